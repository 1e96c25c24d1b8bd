"""Mixed-GPU data parallelism: per-rank batch shares from measured speed, same update as uniform DP.

With equal batches every step waits for the slowest card. Here rank i gets b_i samples of each
global batch, proportional to its measured samples/s and capped by what fits in its memory, with
sum(b_i) = B exactly. Each rank's mean loss is weighted by `loss_weight` = b_i * N / B, which turns
DeepSpeed's average over ranks into the exact mean over the global batch; clipping and fp16
overflow stay one decision for all ranks because DeepSpeed takes both after the all-reduce. The
derivation: docs/training-config.md, "How a run's shape is decided".
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from dscluster.errors import UsageError

__all__ = [
    "plan_shares",
    "loss_weight",
    "BalancedBatchSampler",
    "calibrate",
    "plan_shares_distributed",
    "SharePlan",
]


def _check_inputs(samples_per_s: Sequence[float], global_batch: int, max_micro: Sequence[int] | None) -> list[int]:
    n = len(samples_per_s)
    if n == 0:
        raise UsageError("balanced batching: no ranks given (samples_per_s is empty)")
    for rank, s in enumerate(samples_per_s):
        if not (isinstance(s, (int, float)) and math.isfinite(s) and s > 0):
            raise UsageError(
                f"balanced batching: rank {rank} measured {s!r} samples/s; every rank needs a positive "
                "finite speed (re-run calibration, or use batching: uniform)"
            )
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < n:
        raise UsageError(
            f"balanced batching: global batch {global_batch!r} cannot give each of {n} ranks at least one "
            f"sample; set the global batch to {n} or more"
        )
    if max_micro is None:
        return [global_batch - (n - 1)] * n
    if len(max_micro) != n:
        raise UsageError(f"balanced batching: {len(max_micro)} memory caps for {n} ranks; give one per rank")
    caps = []
    for rank, cap in enumerate(max_micro):
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise UsageError(f"balanced batching: rank {rank} max micro-batch {cap!r}; it must be a whole number ≥ 1")
        caps.append(cap)
    if sum(caps) < global_batch:
        raise UsageError(
            f"balanced batching: the ranks' memory fits sum to {sum(caps)} samples {caps}, less than the global "
            f"batch {global_batch}; lower the global batch or use gradient accumulation"
        )
    return caps


def _water_fill(speeds: Sequence[float], total: int, caps: Sequence[int]) -> list[float]:
    """Continuous shares x_i = clip(lam * s_i, 1, cap_i) with sum(x) = total.

    sum(clip(lam * s_i, 1, cap_i)) grows monotonically from n to sum(caps) as lam grows,
    so bisection on lam finds the one proportional-where-possible split.
    """
    lo, hi = 0.0, max(c / s for c, s in zip(caps, speeds, strict=True)) * 2.0
    for _ in range(200):
        lam = (lo + hi) / 2
        if sum(min(max(lam * s, 1.0), c) for s, c in zip(speeds, caps, strict=True)) < total:
            lo = lam
        else:
            hi = lam
    return [min(max(hi * s, 1.0), c) for s, c in zip(speeds, caps, strict=True)]


def plan_shares(samples_per_s: Sequence[float], global_batch: int, max_micro: Sequence[int] | None = None) -> list[int]:
    """Integer shares b_i ≥ 1, b_i ≤ max_micro[i], sum = global_batch, b_i ∝ samples_per_s[i].

    `global_batch` is the number of samples all ranks together process in one micro-step
    (with gradient accumulation G the optimizer step sees G times as many). Proportional to
    speed means every rank's micro-step takes about b_i / s_i, the same for all. A rank
    whose proportional share would not fit in its memory gets its cap and the rest is
    spread over the others in proportion to their speed; rounding uses largest remainders
    so the sum is exact. Deterministic: every rank computes the same plan from the same inputs.
    """
    caps = _check_inputs(samples_per_s, global_batch, max_micro)
    speeds = [float(s) for s in samples_per_s]
    ideal = _water_fill(speeds, global_batch, caps)
    shares = [min(max(int(math.floor(x + 1e-9)), 1), c) for x, c in zip(ideal, caps, strict=True)]
    # Largest remainder: hand out what floor() cut off to the ranks furthest below their
    # ideal share that still have room; take back (bisection noise) from those furthest above.
    while sum(shares) < global_batch:
        room = [i for i in range(len(shares)) if shares[i] < caps[i]]
        i = max(room, key=lambda r: (ideal[r] - shares[r], -r))
        shares[i] += 1
    while sum(shares) > global_batch:
        spare = [i for i in range(len(shares)) if shares[i] > 1]
        i = min(spare, key=lambda r: (ideal[r] - shares[r], r))
        shares[i] -= 1
    return shares


def loss_weight(b_i: int, world: int, global_batch: int) -> float:
    """Factor for rank i's *mean* loss so DeepSpeed's rank average is the global-batch mean.

    b_i * world / global_batch, with global_batch = sum of all shares in one micro-step.
    Independent of gradient accumulation (DeepSpeed divides by G itself). Equals 1.0 for
    uniform shares, so uniform batching is the special case.
    """
    if b_i < 1 or world < 1 or global_batch < 1:
        raise UsageError(f"loss_weight: share {b_i}, world {world}, global batch {global_batch} must all be ≥ 1")
    return b_i * world / global_batch


class BalancedBatchSampler:
    """Per-rank batch sampler over one shared shuffled order (use as DataLoader(batch_sampler=...)).

    Every rank builds the same permutation from (seed, epoch). Step k takes the k-th block
    of B = sum(shares) indices; rank i gets [offset_i, offset_i + b_i) of that block, so the
    ranks' samples are disjoint and together form exactly one global batch. Every rank
    yields len(self) = dataset_len // B batches: the last partial global batch is dropped,
    because a rank running one step more than the others would hang in the all-reduce.
    """

    def __init__(self, dataset_len: int, shares: Sequence[int], rank: int, seed: int = 0, epoch: int = 0,
                 shuffle: bool = True):
        if not shares or any(int(b) < 1 for b in shares):
            raise UsageError(f"BalancedBatchSampler: shares {list(shares)!r} must be one whole number ≥ 1 per rank")
        if not 0 <= rank < len(shares):
            raise UsageError(f"BalancedBatchSampler: rank {rank} outside 0..{len(shares) - 1}")
        self.shares = [int(b) for b in shares]
        self.global_batch = sum(self.shares)
        if dataset_len < self.global_batch:
            raise UsageError(
                f"BalancedBatchSampler: dataset of {dataset_len} samples is smaller than one global batch "
                f"({self.global_batch}); lower the batch size"
            )
        self.dataset_len = int(dataset_len)
        self.rank = rank
        self.seed = int(seed)
        self.epoch = int(epoch)
        self.shuffle = shuffle
        self.offset = sum(self.shares[:rank])
        self.share = self.shares[rank]

    def set_epoch(self, epoch: int) -> None:
        """New shared order for the next epoch (call with the same epoch on every rank)."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.dataset_len // self.global_batch

    def order_tensor(self):
        """The shared order of this epoch as a tensor (identical on every rank).

        Kept as an int64 tensor and sliced per step: a Python list of a large epoch (a
        synthetic benchmark set of millions of indices) would cost ~36 bytes per index.
        """
        import torch  # the rules here stay torch-free at load: plan and check read them

        if not self.shuffle:
            return torch.arange(self.dataset_len)
        g = torch.Generator()
        g.manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.dataset_len, generator=g)

    def order(self) -> list[int]:
        """The shared order of this epoch as a list (for inspection and tests)."""
        return self.order_tensor().tolist()

    def __iter__(self) -> Iterator[list[int]]:
        order = self.order_tensor()
        for step in range(len(self)):
            start = step * self.global_batch + self.offset
            yield order[start:start + self.share].tolist()


def calibrate(step_fn: Callable[[int], object], micro_batches: int | Sequence[int], steps: int, *,
              warmup: int = 1, synchronize: Callable[[], object] | None = None,
              clock: Callable[[], float] = time.perf_counter) -> float:
    """Time real steps and return this rank's samples/s.

    step_fn(b) must run the real forward+backward on b samples *locally*: no all-reduce,
    no optimizer step (e.g. plain `loss_fn(model(x[:b]), y[:b]).backward()` followed by
    zeroing the grads). A step with a collective in it makes the fast rank wait for the
    slow one and every rank would measure the same speed. `micro_batches` is the size (or
    sizes) to time at, ideally near the share the rank will get: small batches under-use a
    GPU. `synchronize` (torch.cuda.synchronize on GPU) runs before each clock read, since
    CUDA kernels run asynchronously. The first `warmup` calls per size are not timed
    (allocator, cuDNN autotune, compilation).
    """
    sizes = [micro_batches] if isinstance(micro_batches, int) else list(micro_batches)
    if not sizes or any(b < 1 for b in sizes) or steps < 1:
        raise UsageError(f"calibrate: micro-batches {sizes!r} and steps {steps} must be ≥ 1")
    sync = synchronize or (lambda: None)
    samples = 0
    seconds = 0.0
    for b in sizes:
        for _ in range(warmup):
            step_fn(b)
        sync()
        t0 = clock()
        for _ in range(steps):
            step_fn(b)
        sync()
        seconds += clock() - t0
        samples += b * steps
    if seconds <= 0:
        raise UsageError("calibrate: the timed steps took no measurable time; time more steps")
    return samples / seconds


@dataclass(frozen=True)
class SharePlan:
    """What every rank agreed on, logged to the run directory (config / metrics)."""

    samples_per_s: list[float]
    max_micro: list[int] | None
    global_batch: int
    shares: list[int]

    def weight(self, rank: int) -> float:
        return loss_weight(self.shares[rank], len(self.shares), self.global_batch)

    def predicted_step_s(self) -> list[float]:
        """Each rank's expected compute time per micro-step: b_i / s_i (ideally all equal)."""
        return [b / s for b, s in zip(self.shares, self.samples_per_s, strict=True)]

    def to_dict(self) -> dict:
        return {
            "samples_per_s": self.samples_per_s,
            "max_micro": self.max_micro,
            "global_batch": self.global_batch,
            "shares": self.shares,
            "loss_weights": [self.weight(r) for r in range(len(self.shares))],
            "predicted_step_s": self.predicted_step_s(),
        }


def plan_shares_distributed(samples_per_s: float, global_batch: int, max_micro: int | None = None) -> SharePlan:
    """All-gather each rank's speed (and memory fit) and plan on every rank.

    Needs an initialised torch.distributed process group. plan_shares is deterministic, so
    every rank computes the same shares without a second broadcast.
    """
    import torch.distributed as dist  # as in order_tensor: only a training rank pays for torch

    world = dist.get_world_size()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (float(samples_per_s), None if max_micro is None else int(max_micro)))
    speeds = [g[0] for g in gathered]
    caps = [g[1] for g in gathered]
    cap_list = None if all(c is None for c in caps) else [global_batch if c is None else c for c in caps]
    shares = plan_shares(speeds, global_batch, cap_list)
    return SharePlan(samples_per_s=speeds, max_micro=cap_list, global_batch=global_batch, shares=shares)


def resolve_batching(requested: str, environ: dict[str, str] | None = None) -> str:
    """The batching mode a run uses: the config's, or for `auto` the cluster's DSCLUSTER_BATCHING
    (written by `dscluster check`: balanced when GPUs differ), else uniform."""
    if requested != "auto":
        return requested
    value = (os.environ if environ is None else environ).get("DSCLUSTER_BATCHING", "").strip().lower()
    if not value:
        return "uniform"
    if value not in ("uniform", "balanced"):
        raise UsageError(f"environment: DSCLUSTER_BATCHING={value!r} is not uniform or balanced "
                         "(re-run `dscluster check`, or set batching= in the config)")
    return value
