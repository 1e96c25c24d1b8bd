"""plan's model: predict a data-parallel step before the run, and what would make it scale.

Pure arithmetic, no torch: `dscluster plan` measures the inputs (plan/inputs.py), this module turns
them into a step-time split (compute, PowerSGD's hook, the ring all-reduce less what the last backward
hides, a calibration), images/s, the speed-up over the fastest node alone, a verdict in plain words
and the smallest change that scales. A model at all, because a lab over 1 GbE can train slower than
one of its GPUs alone, and the user should hear that before the run, with the remedy. The formulas,
their assumptions and what is not modelled: docs/plan.md, "The model".
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from dscluster import core
from dscluster.errors import UsageError

BACKWARD_SHARE = 2 / 3
"""Backward is about two thirds of a forward+backward (twice the forward's matmul FLOPs)."""
COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")
"""comm.compression's values (core/comm.py)."""
SYNC_LADDER = tuple(f"local_sgd:{h}" for h in core.SYNC_PERIODS)
LADDER = ("none", "fp16", "powersgd", *SYNC_LADDER)
"""Settings the recommendation tries at each accumulation, the smallest change first (bf16 sends
what fp16 sends: it is tried in fp16's place when the config asks for it); then local SGD every H
steps (sync.mode, syncmode.py: docs/ethernet-labs.md), the shortest period first, on several nodes only."""
FORMAT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
POWERSGD_MIN_COMPRESSION_RATE = 2
"""torch's powerSGD_hook compresses an n×m matrix only when r(n+m) × this < nm (core/comm.py)."""
ACCUM_CHOICES = (1, 2, 4, 8, 16, 32)
"""Gradient accumulation steps the recommendation tries, smallest first."""
TARGET_EFFICIENCY = 0.8
"""Scaling efficiency (img/s ÷ the nodes' summed single-node img/s) a recommendation aims for."""
MAX_GLOBAL_BATCH = 4096
"""Largest global batch recommended: DeiT/ViT recipes train at 1024–4096."""
DDP_BUCKET_BYTES = 100 * 2**20
"""torch DDP bucket_cap_mb=100 (the training config's ddp_bucket_mb default)."""
SLOWER = "adding nodes makes training SLOWER"
POWERSGD_ALLREDUCES_PER_BUCKET = 3
"""torch's powerSGD_hook: the bucket's uncompressed tensors, then every P, then every Q, each waiting
for the one before."""


def powersgd_elements(matrices, rank: int) -> int:
    """Numbers PowerSGD sends per step: torch views each gradient as shape[0] × the rest; a matrix
    it compresses goes as P (n×r) and Q (m×r), any other tensor (biases, norms, a 1×k embedding)
    whole."""
    total = 0
    for n, m in matrices:
        r = min(n, m, rank)
        compressed = (n + m) * r * POWERSGD_MIN_COMPRESSION_RATE < n * m
        total += (n + m) * r if compressed else n * m
    return total


def gradient_bytes(params: int, bytes_per_grad: int = 4) -> int:
    """What DDP all-reduces per optimizer step before any compression: fp32 gradients (amp keeps
    fp32 weights, so the gradients are fp32 too) → 4 bytes a parameter."""
    return params * bytes_per_grad


def startup_latency_s(rows: list[dict], ranks: int) -> float:
    """Start-up time of one all-reduce, from a measurement of several sizes (check's rows: bytes,
    time_us, busbw_GBps): the smallest message's time less what its bytes take at the largest
    message's bus bandwidth, the link's steady rate. 0 with one rank or fewer than two sizes, and 0
    where the small message came through faster than that rate (a shaper's token bucket lets a
    burst pass: 64 KiB in 0.49 ms on a 1 Gbit tbf link, whose rate alone takes 0.83 ms)."""
    rows = sorted((r for r in rows if r.get("time_us", 0) > 0 and r.get("busbw_GBps", 0) > 0), key=lambda r: r["bytes"])
    if ranks <= 1 or len(rows) < 2:
        return 0.0
    peak = rows[-1]["busbw_GBps"]
    small = rows[0]
    return max(0.0, small["time_us"] / 1e6 - ring_allreduce_s(small["bytes"], ranks, peak))


def ring_allreduce_s(nbytes: float, ranks: int, busbw_GBps: float) -> float:
    """nccl-tests: busbw = algbw × 2(N−1)/N and algbw = bytes ÷ time, so
    time = bytes × 2(N−1)/N ÷ busbw. One rank communicates nothing."""
    if ranks <= 1:
        return 0.0
    return nbytes * 2 * (ranks - 1) / ranks / (busbw_GBps * 1e9)


@dataclass(frozen=True, kw_only=True, slots=True)
class Node:
    name: str
    """Hostfile name."""
    ranks: int = 1
    """Ranks (GPUs) on this node: the hostfile's slots."""
    compute_s: float
    """Measured seconds of one forward+backward of one micro-batch on one of its ranks."""
    alone_micro: int | None = None
    """The micro-batch this node trains at alone (micro_batch auto splits the global batch over its ranks
    only); None: priced at the lab's."""
    alone_compute_s: float | None = None
    """Measured seconds of one micro-batch of alone_micro on one of its ranks; None: not measured."""

    def images_per_s(self, micro_batch: int, step_overhead_s: float = 0.0) -> float:
        """This node alone, its ranks' own communication left out (NVLink/PCIe is fast): at its own
        micro-batch where measured there (a GPU is faster per image at a larger batch; accumulation
        keeps the rate per image), else at the lab's `micro_batch`; `step_overhead_s` added to each
        micro-batch's seconds (what runs of one rank measured beyond the model: `predict`) unless that
        would leave nothing, as `predict` leaves the compute alone then."""
        micro, seconds = ((self.alone_micro, self.alone_compute_s) if self.alone_micro and self.alone_compute_s
                          else (micro_batch, self.compute_s))
        return self.ranks * micro / (seconds + step_overhead_s if seconds + step_overhead_s > 0 else seconds)


@dataclass(frozen=True, kw_only=True, slots=True)
class Scenario:
    nodes: tuple[Node, ...]
    """Every node of the job, as the hostfile lists them."""
    micro_batch: int
    """Samples per rank per micro-step."""
    grad_accum: int = 1
    """Micro-steps per optimizer step."""
    grad_bytes: float
    """Gradient bytes DDP all-reduces per optimizer step, uncompressed (`gradient_bytes`)."""
    compression: str = "none"
    """Gradients on the wire (comm.compression): none, fp16 or bf16 (half the bytes of fp32 gradients),
    powersgd (low-rank factors; needs `matrices`)."""
    grad_format: str = "fp32"
    """What the gradients are: fp32 (amp, fp32 training) or fp16/bf16 (half weights, amp=false)."""
    powersgd_rank: int = 4
    """comm.powersgd_rank."""
    matrices: tuple[tuple[int, int], ...] = ()
    """Each gradient tensor as PowerSGD views it: (shape[0], numel ÷ shape[0])."""
    busbw_GBps: float
    """Measured all-reduce bus bandwidth across these nodes (`dscluster check`), GB/s."""
    overlap_fraction: float = 1.0
    """Share of the last backward during which the all-reduce may run; 0 = none overlaps."""
    bucket_bytes: float = DDP_BUCKET_BYTES
    """DDP bucket size: the last bucket is reduced after backward, never hidden."""
    latency_s: float = 0.0
    """Start-up time of one all-reduce across these nodes (`startup_latency_s`)."""
    powersgd_s: float = 0.0
    """PowerSGD's own work per optimizer step on the slowest node (its products, orthogonalisation and
    error feedback; `plan` measures it with training's hook)."""
    calibration: tuple[tuple[str, float], ...] = ()
    """(compression, measured − modelled step in seconds) from earlier runs of the same model, precision
    and ranks."""
    balanced: bool = False
    """Balanced batching (core/balanced.py): each rank's share of the global micro-batch is proportional to
    its speed, so a micro-step lasts about as long on every rank (`micro_step_s`)."""
    samples_per_step: int | None = None
    """Images an optimizer step trains where that is not micro_batch × grad_accum × ranks: a global
    batch the ranks split unevenly (64 on 3 ranks: 22, 21, 21), whose step lasts as long as the
    largest share's. None: micro_batch × grad_accum × ranks."""

    def __post_init__(self):
        if not self.nodes:
            raise UsageError("the plan needs at least one node")
        for n in self.nodes:
            if n.ranks < 1:
                raise UsageError(f"node {n.name}: ranks must be at least 1, got {n.ranks}")
            if not n.compute_s > 0:
                raise UsageError(f"node {n.name}: compute time per micro-batch must be > 0 s, got {n.compute_s}")
            if not (n.alone_compute_s is None or n.alone_compute_s > 0) or (n.alone_micro or 1) < 1:
                raise UsageError(f"node {n.name}: alone micro-batch {n.alone_micro} in {n.alone_compute_s} s is "
                                 "out of range")
        checks = [("micro_batch", self.micro_batch >= 1), ("grad_accum", self.grad_accum >= 1),
                  ("grad_bytes", self.grad_bytes > 0), ("busbw_GBps", self.busbw_GBps > 0),
                  ("overlap_fraction", 0 <= self.overlap_fraction <= 1), ("bucket_bytes", self.bucket_bytes > 0),
                  ("latency_s", self.latency_s >= 0), ("powersgd_s", self.powersgd_s >= 0),
                  ("calibration", all(math.isfinite(x) for _, x in self.calibration)),
                  ("samples_per_step", self.samples_per_step is None or
                   0 < self.samples_per_step <= self.micro_batch * self.grad_accum * self.world)]
        for name, good in checks:
            if not good:
                raise UsageError(f"{name}={getattr(self, name)!r} is out of range")
        if self.compression not in COMPRESSIONS and self.sync_period == 1:
            raise UsageError(f"compression {self.compression!r}: expected one of {', '.join(COMPRESSIONS)}")
        if self.grad_format not in FORMAT_BYTES:
            raise UsageError(f"grad_format {self.grad_format!r}: expected one of {', '.join(FORMAT_BYTES)}")
        if self.compression == "powersgd" and not (self.matrices and self.powersgd_rank >= 1):
            raise UsageError("compression powersgd needs the gradient matrices' shapes and a rank of at least 1")

    @property
    def world(self) -> int:
        return sum(n.ranks for n in self.nodes)

    @property
    def sync_period(self) -> int:
        """H where `compression` is a MODE:H label (sync.mode local_sgd, diloco); 1: every step."""
        return core.parse_sync_label(self.compression)[1]

    @property
    def sync_stream(self) -> tuple[int, str]:
        """(τ, wire) where `compression` is a streamed MODE:H:τ[:WIRE] label (sync.delay_steps,
        sync.compression); (0, "none") for a blocking fp32 average or every step."""
        return core.parse_sync_stream(self.compression)

    @property
    def global_batch(self) -> int:
        return self.samples_per_step or self.micro_batch * self.grad_accum * self.world

    @property
    def allreduces(self) -> int:
        """All-reduces per optimizer step: one per DDP bucket, three with PowerSGD; none on one rank."""
        if self.world <= 1 or self.sync_period > 1:
            return 0
        buckets = max(1, math.ceil(self.grad_bytes / self.bucket_bytes))
        return buckets * (POWERSGD_ALLREDUCES_PER_BUCKET if self.compression == "powersgd" else 1)

    @property
    def hook_s(self) -> float:
        """Compression work per step that no communication hides (PowerSGD's; training installs no
        hook on one rank)."""
        return self.powersgd_s if self.compression == "powersgd" and self.world > 1 else 0.0

    @property
    def wire_bytes(self) -> float:
        """Bytes all-reduced per optimizer step, in the gradients' own format where not compressed; local SGD:
        the fp32 weights (as many numbers as the gradients) once every H steps, 16-bit with sync.compression."""
        if self.sync_period > 1:
            wire_bytes = FORMAT_BYTES.get(self.sync_stream[1], FORMAT_BYTES["fp32"])
            return self.grad_bytes / FORMAT_BYTES[self.grad_format] * wire_bytes / self.sync_period
        if self.compression == "powersgd":
            return powersgd_elements(self.matrices, self.powersgd_rank) * FORMAT_BYTES[self.grad_format]
        if self.compression in ("fp16", "bf16") and self.grad_format == "fp32":
            return self.grad_bytes / 2
        return self.grad_bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class Prediction:
    compute_s: float
    """grad_accum forward+backward passes of the slowest node."""
    hook_s: float
    """PowerSGD's own work (0 for the other compressions)."""
    comm_s: float
    """The whole all-reduce of one optimizer step, start-up latencies included."""
    hidden_s: float
    """Part of comm_s that runs during the last backward."""
    exposed_s: float
    """Part of comm_s the step waits for: comm_s − hidden_s."""
    step_s: float
    """model_step_s + calibration_s (compute_s where that would be 0 or less)."""
    model_step_s: float
    """compute_s + hook_s + exposed_s: the model's step before any calibration."""
    calibration_s: float
    """Measured − modelled step of earlier runs with this compression (0 without any)."""
    images_per_s: float
    global_batch: int
    node_images_per_s: dict[str, float]
    """Each node alone (no communication)."""
    fastest_node: str
    speedup: float
    """images_per_s ÷ the fastest node alone: below 1 the extra nodes cost time."""
    efficiency: float
    """images_per_s ÷ the sum of every node alone."""
    slower: bool
    """Several nodes and speedup < 1."""
    verdict: str

    def to_dict(self) -> dict:
        return asdict(self)


def micro_step_s(s: Scenario) -> float:
    """One micro-step's compute: the slowest rank's with uniform batches; with balanced batching the
    longest share × that rank's seconds per sample, the shares as training plans them (`plan_shares`)."""
    if not s.balanced:
        return max(n.compute_s for n in s.nodes)

    per_rank = [n.compute_s for n in s.nodes for _ in range(n.ranks)]
    shares = core.plan_shares([s.micro_batch / c for c in per_rank], s.micro_batch * s.world)
    return max(b * c / s.micro_batch for b, c in zip(shares, per_rank, strict=True))


def predict(s: Scenario) -> Prediction:
    slowest = micro_step_s(s)
    compute = s.grad_accum * slowest
    comm = ring_allreduce_s(s.wire_bytes, s.world, s.busbw_GBps) + s.allreduces * s.latency_s
    last_share = min(1.0, s.bucket_bytes / s.grad_bytes)
    hidden = min(s.overlap_fraction * BACKWARD_SHARE * slowest, comm * (1 - last_share))
    if s.sync_period > 1:  # blocking, the average stalls its step; streamed, the next τ steps' compute hide it
        comm = comm + s.latency_s / s.sync_period
        hidden = min(comm, s.sync_stream[0] * (compute + s.hook_s) / s.sync_period)
    model_step = compute + s.hook_s + comm - hidden
    extra = dict(s.calibration).get(s.compression, 0.0)
    step = model_step + extra if model_step + extra > 0 else compute
    rate = s.global_batch / step
    # On one rank there is no communication: a calibration there is the step's own overhead (optimizer, engine),
    # which the node alone pays too; left out of it, one rank reads as less than itself (docs/plan.md).
    alone = {n.name: n.images_per_s(s.micro_batch, extra if s.world == 1 else 0.0) for n in s.nodes}
    fastest = max(alone, key=alone.__getitem__)
    speedup, efficiency = rate / alone[fastest], rate / sum(alone.values())
    slower = len(s.nodes) > 1 and speedup < 1
    comm_share = (comm - hidden) / step
    if len(s.nodes) == 1:
        verdict = (f"one node: {efficiency:.0%} of its ranks' summed speed"
                   + (f"; communication takes {comm_share:.0%} of each step" if comm_share >= 0.05 else ""))
    elif slower:
        verdict = (f"{SLOWER}: {s.world} ranks {rate:,.0f} img/s against {alone[fastest]:,.0f} for {fastest} "
                   f"alone; each step waits {comm - hidden:.2f} s for the gradients against {compute:.2f} s "
                   "of compute")
    elif efficiency >= TARGET_EFFICIENCY:
        verdict = f"scales well: {speedup:.1f}× {fastest} alone, {efficiency:.0%} of the nodes' summed speed"
    else:
        verdict = (f"faster than {fastest} alone ({speedup:.1f}×), but communication takes {comm_share:.0%} "
                   f"of each step: {efficiency:.0%} of the nodes' summed speed")
    return Prediction(compute_s=compute, hook_s=s.hook_s, comm_s=comm, hidden_s=hidden, exposed_s=comm - hidden,
                      step_s=step, model_step_s=model_step, calibration_s=extra,
                      images_per_s=rate, global_batch=s.global_batch, node_images_per_s=alone, fastest_node=fastest,
                      speedup=speedup, efficiency=efficiency, slower=slower, verdict=verdict)


def streamed(s: Scenario) -> str:
    """The streamed variant of the blocking average at `s`'s period H: the smallest delay τ ≤ H−1 whose steps'
    compute hides the average's transfer, in fp32 where that fits, else in 16 bits (fp16: NCCL reduces it on
    every GPU generation); τ = H−1 in 16 bits where nothing hides it whole."""
    mode, h = core.parse_sync_label(s.compression)
    step = s.grad_accum * micro_step_s(s) + s.hook_s
    for wire in ("none", "fp16"):
        trial = replace(s, compression=core.sync_stream_label(mode, h, 1, wire))
        transfer = ring_allreduce_s(trial.wire_bytes * h, s.world, s.busbw_GBps) + s.latency_s
        delay = max(1, math.ceil(transfer / step))
        if delay <= h - 1:
            return core.sync_stream_label(mode, h, delay, wire)
    return core.sync_stream_label(mode, h, h - 1, "fp16")


def implied_busbw_GBps(s: Scenario, measured_step_s: float) -> float | None:
    """The bus bandwidth that would explain a measured step time (the model inverted): what
    the all-reduce really reached in training. None when compute alone explains the step."""
    slowest = micro_step_s(s)
    exposed = measured_step_s - s.grad_accum * slowest - s.hook_s - s.allreduces * s.latency_s
    if exposed <= 0 or s.world <= 1:
        return None
    # step = compute + comm − min(backward, comm × (1 − share)); on slow links backward is the smaller
    last_share = min(1.0, s.bucket_bytes / s.grad_bytes)
    backward = s.overlap_fraction * BACKWARD_SHARE * slowest
    comm = exposed + backward if backward <= (exposed + backward) * (1 - last_share) else exposed / last_share
    return ring_allreduce_s(s.wire_bytes, s.world, 1.0) / comm
