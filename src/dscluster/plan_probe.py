"""What `dscluster plan` measures on this machine: the compute time of one micro-batch of the
config's model, and PowerSGD's own work per optimizer step with training's hook. The advisor
(dscluster.advisor) turns them into a prediction; docs/advisor.md says how they are taken."""

from __future__ import annotations

import statistics
import time

from dscluster.errors import UsageError

CPU_PROBE_BATCH = 4
CPU_FULL_BATCH_S = 1.0
"""On CPU the probe measures the whole micro-batch when 4 samples say a step of it takes at most
this long: 4 samples scaled up read the digits preset 3× slow (236 img/s predicted, 735 measured)."""
"""On CPU the probe runs at most this many samples and scales linearly: ViT-B/16 at 128 would
take minutes, and a CPU figure is only a stand-in for the GPUs anyway."""
GPU_WARMUP_S, GPU_TIMED_S = 0.5, 1.0
"""On a GPU the probe warms up for at least this long (kernel choice, clocks leaving idle) and times
at least 10 steps and this long: ViT-S's 10 steps alone take a third of a second, and read 20 %
slow against training when timed that briefly."""
CPU_PROBE_BUDGET_S = 10.0
"""After its first 3 timed steps the CPU probe takes more (up to 7) while this many seconds have not
passed: a steadier median on a busy machine."""


def gpu_seconds_per_step(step, sync, min_steps: int = 10) -> float:
    """Mean seconds of `step` once warm: GPU_WARMUP_S of warm-up (3 steps at least), then at least
    `min_steps` steps and GPU_TIMED_S, the clock read after `sync` (the GPU finished, not queued)."""
    t_end, n = time.perf_counter() + GPU_WARMUP_S, 0
    while n < 3 or time.perf_counter() < t_end:
        step()
        sync()  # each warm-up step finishes before the clock is read
        n += 1
    t0, n = time.perf_counter(), 0
    while n < min_steps or time.perf_counter() - t0 < GPU_TIMED_S:
        for _ in range(min_steps):
            step()
            n += 1
        sync()
    return (time.perf_counter() - t0) / n


def measure_compute(cfg, in_chans: int, num_classes: int, micro: int) -> tuple[float, str, str]:
    """(seconds per micro-batch, device, note): forward+backward passes of the configured model on
    this machine's first GPU (synchronised before the clock is read), else a few on CPU."""
    import torch
    import torch.nn.functional as F

    from dscluster.train.model import build_model
    from dscluster.train.precision import decide_here, torch_dtype

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    precision = decide_here(cfg.precision).precision if cuda else "fp32"
    batch = micro if cuda else min(micro, CPU_PROBE_BATCH)
    warmup, steps = (3, 10) if cuda else (2, 3)
    amp = torch.autocast("cuda", dtype=torch_dtype(precision), enabled=cuda and precision != "fp32")

    def step():
        with amp:
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        model.zero_grad(set_to_none=True)

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    try:  # an OOM can come from the model, the batch or the first backward
        model = build_model(cfg.model, in_chans=in_chans, num_classes=num_classes,
                            img_size=cfg.data.img_size).to(device)
        x = torch.randn(batch, in_chans, cfg.data.img_size, cfg.data.img_size, device=device)
        if cfg.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        y = torch.randint(0, num_classes, (batch,), device=device)
        if cuda:
            per_batch = gpu_seconds_per_step(step, sync)
        else:
            for _ in range(warmup):
                t0 = time.perf_counter()
                step()
            if batch < micro and (time.perf_counter() - t0) * micro / batch <= CPU_FULL_BATCH_S:
                batch = micro  # cheap enough: the real micro-batch, nothing scaled
                x = torch.randn(batch, in_chans, cfg.data.img_size, cfg.data.img_size, device=device)
                y = torch.randint(0, num_classes, (batch,), device=device)
                step()
            # a shared CPU is noisy (other processes): the median of single steps, within a time budget
            times, t_end = [], time.perf_counter() + CPU_PROBE_BUDGET_S
            while len(times) < steps or (time.perf_counter() < t_end and len(times) < 2 * steps + 1):
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            per_batch = statistics.median(times)
            steps = len(times)
    except torch.OutOfMemoryError:
        raise UsageError(f"micro_batch {micro} does not fit this GPU for the measurement: pass --compute-s "
                         "(seconds per micro-batch on your nodes) or a smaller micro_batch=N") from None
    if cuda:
        name = torch.cuda.get_device_name(device)
        return per_batch, f"cuda ({name})", (f"measured here on {name}, {precision}, eager (training compiles on "
                                             "GPUs of capability 7.0+, which is faster)")
    scaled = per_batch * micro / batch
    how = f"{batch}" if batch == micro else f"{batch} scaled to {micro}"
    return scaled, "cpu", (f"measured on CPU (no GPU here), median of {steps} steps of {how}: "
                           "the plan is for CPU ranks; pass --compute-s from your GPU nodes")


def measure_powersgd(cfg, in_chans: int, num_classes: int, micro: int) -> float | None:
    """PowerSGD's own work per optimizer step on this machine: one training step of a one-rank DDP
    with training's PowerSGD hook (train/comm.py) less the same step with its plain all-reduce. On
    one rank the all-reduces cost nothing, so what is left is the hook's products, orthogonalisation
    and error feedback, which no communication hides. None where it cannot be measured here."""
    import copy

    import torch
    import torch.distributed as tdist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from dscluster.train import comm
    from dscluster.train.model import build_model
    from dscluster.train.precision import decide_here, torch_dtype

    if not tdist.is_available() or tdist.is_initialized():
        return None
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    precision = decide_here(cfg.precision).precision if cuda else "fp32"
    batch = micro if cuda else min(micro, CPU_PROBE_BATCH)
    warmup, steps = 5, 3  # on CPU; PowerSGD starts at step 2, after DDP's first backward
    tdist.init_process_group("nccl" if cuda else "gloo", store=tdist.HashStore(), rank=0, world_size=1)
    seconds = {}
    try:
        x = torch.randn(batch, in_chans, cfg.data.img_size, cfg.data.img_size, device=device)
        y = torch.randint(0, num_classes, (batch,), device=device)
        for compression in ("none", "powersgd"):
            trial = copy.deepcopy(cfg)
            trial.comm.compression, trial.comm.powersgd_start_step = compression, 2
            model = build_model(cfg.model, in_chans=in_chans, num_classes=num_classes,
                                img_size=cfg.data.img_size).to(device)
            ddp = DistributedDataParallel(model, device_ids=[device.index] if cuda else None,
                                          bucket_cap_mb=cfg.ddp_bucket_mb)
            comm.install(ddp, trial, split=None)

            def step():
                with torch.autocast(device.type, dtype=torch_dtype(precision), enabled=cuda and precision != "fp32"):
                    loss = F.cross_entropy(ddp(x), y)
                loss.backward()
                ddp.zero_grad(set_to_none=True)

            if cuda:
                seconds[compression] = gpu_seconds_per_step(step, lambda: torch.cuda.synchronize(device))
            else:
                for _ in range(warmup):
                    step()
                t0 = time.perf_counter()
                for _ in range(steps):
                    step()
                seconds[compression] = (time.perf_counter() - t0) / steps
            del ddp, model
    except torch.OutOfMemoryError:
        return None
    finally:
        tdist.destroy_process_group()
    return max(0.0, seconds["powersgd"] - seconds["none"])
