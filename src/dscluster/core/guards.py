"""Fail fast and say why, instead of hanging or training on garbage.

- Equal steps per epoch: every rank all-gathers its step count at the start of an epoch;
  a mismatch would otherwise hang in the first all-reduce a rank skips.
- fp16 loss-scale guard: DeepSpeed halves the scale on each overflow and, at the minimum,
  raises a generic error or silently skips steps. The guard watches (scale, overflow) per
  step and stops with the rank, host, step, recent scale history and what to try.

- A peer's failure: which collective error means another rank is gone (`is_peer_failure`), kept
  torch-free so that `dscluster diagnose` reads the same rule.

The test-only faults that prove these (DSCLUSTER_FAULT) live in faults.py.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from dscluster.errors import JobFailed

PEER_FAILURE = "a collective failed: another rank died"
"""How a rank's `end` error begins when a peer's absence failed its collective (loop.record_crash writes
it; diagnose reads it: such a rank failed because of another, not on its own)."""

# What a surviving rank sees when a peer died or never joined: the error is about the peer,
# not about this rank (gloo: connection reset/closed, broken pipe, timed out waiting; NCCL:
# the watchdog aborted the communicator).
PEER_FAILURE_MARKERS = ("Connection reset by peer", "Connection closed by peer", "Timed out waiting", "Broken pipe",
                        "NCCL communicator was aborted")


def is_peer_failure(e: BaseException) -> bool:
    """True when `e` (or what caused it) is a collective failing because another rank is gone."""
    seen = 0
    while e is not None and seen < 5:
        if isinstance(e, RuntimeError) and any(m in str(e) for m in PEER_FAILURE_MARKERS):
            return True
        e = e.__cause__ or e.__context__
        seen += 1
    return False


class TrainingAborted(JobFailed):
    """A guard stopped the run; every rank reaches the same decision, rank 0 writes the summary."""

    def __init__(self, message: str, failed_ranks: list[int], failed_hosts: list[str]):
        super().__init__(message)
        self.failed_ranks = failed_ranks
        self.failed_hosts = failed_hosts


def check_equal_steps(counts: list[int], hosts: list[str], epoch: int) -> None:
    """Raise naming the odd ranks when ranks would run different numbers of steps."""
    if len(set(counts)) <= 1:
        return
    # the odd ones out: ranks that differ from the most common count (ties: from rank 0's)
    tally = collections.Counter(counts)
    top = max(tally.values())
    reference = counts[0] if tally[counts[0]] == top else tally.most_common(1)[0][0]
    odd = [r for r, c in enumerate(counts) if c != reference]
    detail = ", ".join(f"rank {r} on {hosts[r]}: {counts[r]}" for r in range(len(counts)))
    raise TrainingAborted(
        f"epoch {epoch}: ranks disagree on steps per epoch ({detail}); rank(s) {', '.join(map(str, odd))} differ. "
        "Every rank must see the same data set and batch settings (same config, same data.path contents); "
        "otherwise the run would hang in the first all-reduce a rank skips",
        failed_ranks=odd, failed_hosts=[hosts[r] for r in odd],
    )


@dataclass
class ScalePoint:
    step: int
    scale: float
    overflow: bool


class LossScaleGuard:
    """Watch fp16 dynamic loss scaling; `observe` raises TrainingAborted when it has gone wrong."""

    def __init__(self, *, window: int, max_overflow_rate: float, min_scale: float, min_scale_steps: int,
                 rank: int, host: str, history: int = 12):
        self.window = window
        self.max_rate = max_overflow_rate
        self.min_scale = min_scale
        self.min_scale_steps = min_scale_steps
        self.rank, self.host = rank, host
        self.recent: collections.deque[ScalePoint] = collections.deque(maxlen=max(window, history))
        self.history = history
        self.at_min = 0
        self.overflows = 0

    def observe(self, step: int, scale: float | None, overflow: bool) -> None:
        if scale is None:
            return
        self.recent.append(ScalePoint(step, float(scale), bool(overflow)))
        self.overflows += bool(overflow)
        self.at_min = self.at_min + 1 if scale <= self.min_scale else 0
        window = list(self.recent)[-self.window:]
        rate = sum(p.overflow for p in window) / len(window)
        if len(window) >= self.window and rate > self.max_rate:
            self._stop(step, f"{sum(p.overflow for p in window)} of the last {len(window)} steps overflowed "
                             f"({rate:.0%} > fp16.guard_max_overflow_rate {self.max_rate:.0%})")
        if self.at_min >= self.min_scale_steps:
            self._stop(step, f"the loss scale has sat at its minimum {self.min_scale:g} for {self.at_min} steps "
                             "(gradients overflow even unscaled)")

    def _stop(self, step: int, why: str) -> None:
        hist = " ".join(f"{p.scale:g}{'!' if p.overflow else ''}" for p in list(self.recent)[-self.history:])
        raise TrainingAborted(
            f"fp16 loss scale guard on rank {self.rank} ({self.host}) at step {step}: {why}. "
            f"Recent scales (! = overflow, step skipped): {hist}. "
            "Try precision=bf16 if every GPU supports it, a lower optim.lr, or precision=fp32; "
            "`dscluster train --calibrate-loss-scale` measures a stable fp16.initial_scale_power",
            failed_ranks=[self.rank], failed_hosts=[self.host],
        )
