"""What `dscluster plan` measures on this machine: the compute time of one micro-batch of the
config's model, and PowerSGD's own work per optimizer step with training's hook. The model
(plan/model.py) turns them into a prediction; docs/plan.md says how they are taken."""

from __future__ import annotations

import copy
import os
import socket
import statistics
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from dscluster.core import comm, evaluation, faults, startgc
from dscluster.core.model import build_model
from dscluster.core.precision import decide_here, input_and_autocast, torch_dtype
from dscluster.core.setup_engine import compiles
from dscluster.errors import UsageError

CPU_PROBE_BATCH = 4
"""On CPU the probe runs at most this many samples and scales linearly when the micro-batch is
expensive: ViT-B/16 at 128 would take minutes, and a CPU figure is only a stand-in for the GPUs."""
CPU_FULL_BATCH_S = 1.0
"""On CPU the probe measures the whole micro-batch when 4 samples say a step of it takes at most
this long: 4 samples scaled up read the digits preset 3× slow (236 img/s predicted, 735 measured)."""
CPU_PROBE_BUDGET_S = 10.0
"""After its first 3 timed steps the CPU probe takes more (up to 7) while this many seconds have not
passed: a steadier median on a busy machine."""
GPU_WARMUP_S, GPU_TIMED_S = 0.5, 1.0
"""On a GPU the probe warms up for at least this long (kernel choice, clocks leaving idle) and times
at least 10 steps and this long: ViT-S's 10 steps alone take a third of a second, and read 20 %
slow against training when timed that briefly."""
DISTURBED_SPREAD = 0.5
"""A probe whose slowest sample is more than this share of the median above its fastest was disturbed
(another process took the machine): taken again once, and reported if it still is. Single CPU steps
of the digits ViT spread 77 % on a 2-core machine at load average 7.7."""


def probe_key(cfg, micro: int, precision: str) -> str:
    """What a compute figure measured here depends on: this host, its device, and the config's model,
    micro-batch, precision and input. A figure kept with a calibration is used again while this holds."""
    device = f"cuda ({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else "cpu"
    return (f"host={socket.gethostname()} device={device} model={cfg.model.name} micro_batch={micro} "
            f"precision={precision} dataset={cfg.data.dataset} img_size={cfg.data.img_size} "
            f"channels_last={cfg.channels_last} compile={cfg.compile}")


def compiles_here(cfg) -> bool:
    """Whether training compiles on this machine's first GPU (core/setup_engine.py `compiles`, its
    rule): the probe then times the compiled step, as training runs it. Never on CPU unless forced."""
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    return device.type == "cuda" and compiles(cfg.compile, device)


class Probe:
    """What both measurements share: the device, the precision training would use there, and a
    batch of random inputs shaped like the config's data."""

    def __init__(self, cfg, in_chans: int, num_classes: int, micro: int):
        self.cfg = cfg
        self.in_chans = in_chans
        self.num_classes = num_classes
        self.cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", 0) if self.cuda else torch.device("cpu")
        self.precision = decide_here(cfg.precision).precision if self.cuda else "fp32"
        self.inputs(micro if self.cuda else min(micro, CPU_PROBE_BATCH))

    def inputs(self, batch: int) -> None:
        """Random images and labels of `batch` samples (channels_last as training keeps them)."""
        size = self.cfg.data.img_size
        self.batch = batch
        self.x = torch.randn(batch, self.in_chans, size, size, device=self.device)
        if self.cfg.channels_last:
            self.x = self.x.contiguous(memory_format=torch.channels_last)
        self.y = torch.randint(0, self.num_classes, (batch,), device=self.device)

    def model(self):
        return build_model(self.cfg.model, in_chans=self.in_chans, num_classes=self.num_classes,
                           img_size=self.cfg.data.img_size).to(self.device)

    def step_of(self, model):
        """One forward+backward of `model` in the training's precision; gradients dropped after."""
        amp = self.cuda and self.precision != "fp32"

        def step():
            with torch.autocast(self.device.type, dtype=torch_dtype(self.precision), enabled=amp):
                loss = F.cross_entropy(model(self.x), self.y)
            loss.backward()
            model.zero_grad(set_to_none=True)

        return step

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


def gpu_seconds_per_step(step, sync, min_steps: int = 10, samples: list[float] | None = None) -> float:
    """Mean seconds of `step` once warm: GPU_WARMUP_S of warm-up (3 steps at least), then at least
    `min_steps` steps and GPU_TIMED_S, the clock read after `sync` (the GPU finished, not queued).
    `samples`, where given, receives the mean of each group of `min_steps` (their spread shows a
    disturbed measurement)."""
    t_end, n = time.perf_counter() + GPU_WARMUP_S, 0
    while n < 3 or time.perf_counter() < t_end:
        step()
        sync()  # each warm-up step finishes before the clock is read
        n += 1
    t0, n = time.perf_counter(), 0
    while n < min_steps or time.perf_counter() - t0 < GPU_TIMED_S:
        t_group = time.perf_counter()
        for _ in range(min_steps):
            step()
            n += 1
        sync()
        if samples is not None:
            samples.append((time.perf_counter() - t_group) / min_steps)
    return (time.perf_counter() - t0) / n


def spread(samples: list[float]) -> float:
    """(slowest − fastest) ÷ median of a probe's samples: 0 for a steady machine."""
    return (max(samples) - min(samples)) / statistics.median(samples) if len(samples) > 1 else 0.0


def host_load() -> str:
    """The 1-minute load average against this machine's cores, in words, for a note."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return "load unknown"
    return f"load average {load:.1f} on {os.cpu_count() or 1} core(s)"


@dataclass(frozen=True, kw_only=True, slots=True)
class ComputeFigure:
    """The compute time of one micro-batch as measured here, and how trustworthy the measurement was."""

    seconds: float
    """Seconds of one forward+backward of one micro-batch on one rank."""
    device: str
    """What it was measured on: `cpu` or `cuda (<GPU name>)`."""
    note: str
    """How it was measured, in words."""
    spread: float
    """(slowest − fastest) ÷ median of its samples (`spread`)."""
    samples: int
    """How many samples it was taken from."""
    tries: int = 1
    """Measurements taken: a disturbed one is taken again once (`measure_steady_compute`)."""
    warmup_extra_s: float = 0.0
    """The first step's time less a steady step's: compilation, allocator, kernel choice (runmodel/phases.py)."""
    compiled: bool = False
    """Timed through torch.compile, as training runs where it compiles (`compiles_here`)."""
    eval_s_per_image: float | None = None
    """Seconds per held-out image of train's own evaluation here (`measure_evaluation`); None: not measured."""

    @property
    def disturbed(self) -> bool:
        return self.spread > DISTURBED_SPREAD


def fault_ms(first_rank: int, ranks: int, env=None) -> int:
    """DSCLUSTER_FAULT's slow_gpu milliseconds for one of these ranks (core/faults.py, test-only), 0
    without: the probe on a node honours the fault training's rank there would have."""
    found = [faults.for_rank(r, env).get("slow_gpu") for r in range(first_rank, first_rank + ranks)]
    return max((f.ms or 0 for f in found if f is not None), default=0)


def slowed(step, ms: int, cuda: bool):
    """`step` made `ms` slower, as training's slow_gpu fault makes a step: the GPU spins (queued), and
    on CPU, where training's fault has no GPU to spin, the probe sleeps, so a CPU lab can test it."""
    if not ms:
        return step

    def slow_step():
        step()
        if cuda:
            torch.cuda._sleep(faults.spin_cycles(ms))
        else:
            time.sleep(ms / 1000)

    return slow_step


def measure_steady_compute(cfg, in_chans: int, num_classes: int, micro: int, measure=None,
                           slow_ms: int = 0) -> ComputeFigure:
    """`measure_compute`, taken again once where its samples spread more than DISTURBED_SPREAD (another
    process took the machine for a while); the steadier of the two. A figure still disturbed says so
    (`ComputeFigure.disturbed`), and plan reports it: never silently used."""
    if measure is None:
        def measure(cfg, in_chans: int, num_classes: int, micro: int) -> ComputeFigure:
            if slow_ms:
                return measure_compute(cfg, in_chans, num_classes, micro, slow_ms=slow_ms)
            return measure_compute(cfg, in_chans, num_classes, micro)
    first = measure(cfg, in_chans, num_classes, micro)
    if not first.disturbed:
        return first
    second = measure(cfg, in_chans, num_classes, micro)
    # The second measurement reuses this process's compiled graphs: only the first saw what a run's
    # first steps pay (a GPU lab's plan took 0.007 s from it where training paid 29 s).
    return replace(min(first, second, key=lambda f: f.spread), tries=2,
                   warmup_extra_s=max(first.warmup_extra_s, second.warmup_extra_s))


def measure_compute(cfg, in_chans: int, num_classes: int, micro: int, slow_ms: int = 0) -> ComputeFigure:
    """Seconds per micro-batch, with its device, a note and its samples' spread: forward+backward
    passes of the configured model on this machine's first GPU (synchronised before the clock is
    read), else a few on CPU."""
    warmup, steps = 2, 3  # on CPU
    times: list[float] = []
    compiled = compiles_here(cfg)
    try:  # an OOM can come from the batch, the model or the first backward
        probe = Probe(cfg, in_chans, num_classes, micro)
        net = probe.model()
        step = slowed(probe.step_of(torch.compile(net) if compiled else net), slow_ms, probe.cuda)
        first_batch, t0 = probe.batch, time.perf_counter()
        step()  # the first step pays once: compilation where training compiles, allocator, kernels
        probe.sync()
        first = time.perf_counter() - t0
        startgc.settle()  # every import done (core/startgc.py), as training's engine build leaves it
        if probe.cuda:
            per_batch = gpu_seconds_per_step(step, probe.sync, samples=times)
        else:
            for _ in range(warmup - 1):
                t0 = time.perf_counter()
                step()
            if probe.batch < micro and (time.perf_counter() - t0) * micro / probe.batch <= CPU_FULL_BATCH_S:
                probe.inputs(micro)  # cheap enough: the real micro-batch, nothing scaled
                step()
            # a shared CPU is noisy (other processes): the median of single steps, within a time budget
            t_end = time.perf_counter() + CPU_PROBE_BUDGET_S
            while len(times) < steps or (time.perf_counter() < t_end and len(times) < 2 * steps + 1):
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            per_batch = statistics.median(times)
            steps = len(times)
    except torch.OutOfMemoryError:
        raise UsageError(f"micro_batch {micro} does not fit this GPU for the measurement: pass --compute-s "
                         "(seconds per micro-batch on your nodes) or a smaller micro_batch=N") from None
    if probe.cuda:
        name = torch.cuda.get_device_name(probe.device)
        how = ("compiled, as training runs it (compile: " + cfg.compile + ")" if compiled else
               "eager, as training runs it here (compile: " + cfg.compile + ")")
        return ComputeFigure(seconds=per_batch, device=f"cuda ({name})", spread=spread(times), samples=len(times),
                             note=f"measured here on {name}, {probe.precision}, {how}",
                             warmup_extra_s=max(0.0, first - per_batch), compiled=compiled,
                             eval_s_per_image=measure_evaluation(probe, net))
    batch = probe.batch
    how = f"{batch}" if batch == micro else f"{batch} scaled to {micro}"
    fault_s = slow_ms / 1000  # a fault's delay is per step, not per sample: not scaled
    return ComputeFigure(seconds=(per_batch - fault_s) * micro / batch + fault_s, device="cpu", spread=spread(times),
                         samples=len(times),
                         note=f"measured on CPU (no GPU here), median of {steps} steps of {how}: the plan is for "
                         "CPU ranks; pass --compute-s from your GPU nodes",
                         warmup_extra_s=max(0.0, first - per_batch * first_batch / batch),
                         eval_s_per_image=measure_evaluation(probe, net))


def measure_evaluation(probe: Probe, net) -> float | None:
    """Seconds per image of a held-out pass as train runs it: core/evaluation.py's own `evaluate` (rank 0,
    the bare model, eager, its batch of 256, training's input dtype and autocast, its host reads of loss
    and accuracy) over the probe's random images, after one warm pass; on CPU over the probe's few
    images. None where it does not fit."""
    cfg = probe.cfg
    dtype, autocast = input_and_autocast(cfg, probe.precision, probe.cuda)  # as training's Built has them
    batch = 256 if probe.cuda else probe.batch
    n = 2 * batch if probe.cuda else batch
    x = torch.randn(batch, probe.in_chans, cfg.data.img_size, cfg.data.img_size, device=probe.device)
    x = (x.contiguous(memory_format=torch.channels_last) if cfg.channels_last else x).to(dtype)
    y = torch.randint(0, probe.num_classes, (batch,), device=probe.device)

    class Held:  # the held-out split's interface that `evaluate` reads: its length and its batches
        def __len__(self) -> int:
            return n

        def get_batch(self, indices, device, dtype, channels_last=False):
            return x[:len(indices)], y[:len(indices)]  # made once: the timed passes are the model's

    class Engine:
        module = net if dtype == torch.float32 else net.to(dtype)

    try:
        # a warm pass first
        evaluation.evaluate(Engine, Held(), dtype, probe.device, cfg.channels_last, batch=batch, autocast=autocast)
        probe.sync()
        t0 = time.perf_counter()
        evaluation.evaluate(Engine, Held(), dtype, probe.device, cfg.channels_last, batch=batch, autocast=autocast)
        probe.sync()
    except torch.OutOfMemoryError:
        return None
    return (time.perf_counter() - t0) / n


def measure_powersgd(cfg, in_chans: int, num_classes: int, micro: int) -> float | None:
    """PowerSGD's own work per optimizer step on this machine: one training step of a one-rank DDP
    with training's PowerSGD hook (core/comm.py) less the same step with its plain all-reduce. On
    one rank the all-reduces cost nothing, so what is left is the hook's products, orthogonalisation
    and error feedback, which no communication hides. None where it cannot be measured here."""
    if not tdist.is_available():
        return None
    # A one-rank group this process already has serves as well (plan called in a process that made
    # one); inside a job of several ranks the step would wait for the others: not measured here.
    own = not tdist.is_initialized()
    if not own and tdist.get_world_size() != 1:
        return None
    warmup, steps = 5, 3  # on CPU; PowerSGD starts at step 2, after DDP's first backward
    cuda = torch.cuda.is_available()
    if own:
        tdist.init_process_group("nccl" if cuda else "gloo", store=tdist.HashStore(), rank=0, world_size=1)
    seconds = {}
    try:
        probe = Probe(cfg, in_chans, num_classes, micro)
        for compression in ("none", "powersgd"):
            trial = copy.deepcopy(cfg)
            trial.comm.compression, trial.comm.powersgd_start_step = compression, 2
            ddp = DistributedDataParallel(probe.model(), device_ids=[probe.device.index] if probe.cuda else None,
                                          bucket_cap_mb=cfg.ddp_bucket_mb)
            comm.install(ddp, trial, split=None)
            step = probe.step_of(ddp)
            if probe.cuda:
                seconds[compression] = gpu_seconds_per_step(step, probe.sync)
            else:
                for _ in range(warmup):
                    step()
                t0 = time.perf_counter()
                for _ in range(steps):
                    step()
                seconds[compression] = (time.perf_counter() - t0) / steps
            del ddp, step
    except torch.OutOfMemoryError:
        return None
    finally:
        if own:
            _RETIRED[:] = [tdist.group.WORLD]  # the previous one's workers are long idle: let it go here
            tdist.destroy_process_group()
    return max(0.0, seconds["powersgd"] - seconds["none"])


# The last one-rank group measure_powersgd made, kept after it was destroyed. gloo's worker threads free a
# step's future callbacks (DDP's comm hooks close over the group) when they next get the GIL, after the step
# has returned; holding the group's last reference, such a callback destroyed the group in its own worker
# thread, which joined itself: "terminate called after throwing an instance of 'std::system_error' what():
# Resource deadlock avoided" (plan on a 2-core lab; 1 process in 6 that probed 4-5 times under load).
_RETIRED: list = []
