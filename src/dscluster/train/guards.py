"""Fail fast and say why, instead of hanging or training on garbage.

- Equal steps per epoch: every rank all-gathers its step count at the start of an epoch;
  a mismatch would otherwise hang in the first all-reduce a rank skips.
- fp16 loss-scale guard: DeepSpeed halves the scale on each overflow and, at the minimum,
  raises a generic error or silently skips steps. The guard watches (scale, overflow) per
  step and stops with the rank, host, step, recent scale history and what to try.
- Fault injection (TEST-ONLY, for the fault tests): DSCLUSTER_FAULT makes one rank misbehave
  on purpose so tests can prove the behaviour above:
      DSCLUSTER_FAULT="skip_collective:rank=1,step=3"  rank 1 skips step 3's all-reduce (peers time out)
      DSCLUSTER_FAULT="exit:rank=1,step=5"             rank 1 exits (code 3) before step 5
      DSCLUSTER_FAULT="mismatch_steps:rank=1"          rank 1 reports one step more per epoch
      DSCLUSTER_FAULT="disk_full:rank=0,step=20"       rank 0's checkpoint save at step 20 hits ENOSPC
      DSCLUSTER_FAULT="slow_gpu:rank=1,ms=80"          rank 1's GPU spins 80 ms more every step, queued
                                                       without the host waiting (honest-timing tests)
  Several faults: separate them with ';'.
  Nothing outside tests should set it.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from dscluster.errors import JobFailed, UsageError


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


@dataclass(frozen=True)
class Fault:
    """A test-only injected fault (see module docstring)."""

    kind: str
    rank: int
    step: int | None = None
    ms: int | None = None


FAULT_KINDS = ("skip_collective", "exit", "mismatch_steps", "disk_full", "slow_gpu")


def parse_fault(text: str | None) -> Fault | None:
    """Parse DSCLUSTER_FAULT ("kind:rank=R,step=S"); None when unset."""
    if not text:
        return None
    kind, _, rest = text.partition(":")
    kind = kind.strip()
    if kind not in FAULT_KINDS:
        raise UsageError(f"DSCLUSTER_FAULT={text!r}: unknown fault {kind!r} (test-only; one of {', '.join(FAULT_KINDS)})")
    params: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        k, _, v = part.partition("=")
        if k not in ("rank", "step", "ms") or not v.strip().isdigit():
            raise UsageError(f"DSCLUSTER_FAULT={text!r}: expected rank=N[,step=N][,ms=N], got {part!r}")
        params[k] = int(v)
    if "rank" not in params:
        raise UsageError(f"DSCLUSTER_FAULT={text!r}: needs rank=N")
    if kind == "slow_gpu":
        if "ms" not in params:
            raise UsageError(f"DSCLUSTER_FAULT={text!r}: slow_gpu needs ms=N")
    elif kind != "mismatch_steps" and "step" not in params:
        raise UsageError(f"DSCLUSTER_FAULT={text!r}: {kind} needs step=N")
    return Fault(kind, params["rank"], params.get("step"), params.get("ms"))
