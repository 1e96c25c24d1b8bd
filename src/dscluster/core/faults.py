"""Fault injection, TEST-ONLY: DSCLUSTER_FAULT makes one rank misbehave, so that the fault tests prove
the guards and the timing say the truth. Several faults: separate them with ';'. Nothing else sets it.

    skip_collective:rank=1,step=3   rank 1 skips step 3's all-reduce (peers time out)
    exit:rank=1,step=5              rank 1 exits (code 3) before step 5
    mismatch_steps:rank=1           rank 1 reports one step more per epoch
    disk_full:rank=0,step=20        rank 0's checkpoint save at step 20 hits ENOSPC
    slow_gpu:rank=1,ms=80           rank 1's GPU spins 80 ms more every step, queued (honest timing)
    slow_comm:rank=1,ms=200         rank 1 holds each step's last gradient bucket 200 ms before sending
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from dscluster.errors import UsageError

ENV = "DSCLUSTER_FAULT"
FAULT_KINDS = ("skip_collective", "exit", "mismatch_steps", "disk_full", "slow_gpu", "slow_comm")
_NEEDS_MS = ("slow_gpu", "slow_comm")
_NEEDS_NOTHING_BUT_RANK = ("mismatch_steps",)


@dataclass(frozen=True)
class Fault:
    """A test-only injected fault (see module docstring)."""

    kind: str
    rank: int
    step: int | None = None
    ms: int | None = None


def parse_fault(text: str | None) -> Fault | None:
    """Parse one DSCLUSTER_FAULT entry ("kind:rank=R,step=S"); None when empty."""
    if not text:
        return None
    kind, _, rest = text.partition(":")
    kind = kind.strip()
    if kind not in FAULT_KINDS:
        raise UsageError(f"{ENV}={text!r}: unknown fault {kind!r} (test-only; one of {', '.join(FAULT_KINDS)})")
    params: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        k, _, v = part.partition("=")
        if k not in ("rank", "step", "ms") or not v.strip().isdigit():
            raise UsageError(f"{ENV}={text!r}: expected rank=N[,step=N][,ms=N], got {part!r}")
        params[k] = int(v)
    if "rank" not in params:
        raise UsageError(f"{ENV}={text!r}: needs rank=N")
    if kind in _NEEDS_MS:
        if "ms" not in params:
            raise UsageError(f"{ENV}={text!r}: {kind} needs ms=N")
    elif kind not in _NEEDS_NOTHING_BUT_RANK and "step" not in params:
        raise UsageError(f"{ENV}={text!r}: {kind} needs step=N")
    return Fault(kind, params["rank"], params.get("step"), params.get("ms"))


def for_rank(rank: int, env: dict[str, str] | None = None) -> dict[str, Fault]:
    """This rank's faults by kind, from DSCLUSTER_FAULT (entries separated by ';')."""
    text = (os.environ if env is None else env).get(ENV, "")
    faults = [f for f in (parse_fault(t) for t in text.split(";")) if f]
    return {f.kind: f for f in faults if f.rank == rank}


def inject(my_fault: dict[str, Fault], step: int, log, timeout_s: float) -> None:
    """Before optimizer step `step`: the faults that act at a step (`log` is the rank's RunLog)."""
    import torch  # the parsing above stays torch-free at load: plan reads a node's faults with it

    f = my_fault.get("slow_gpu")
    if f is not None and torch.cuda.is_available():
        torch.cuda._sleep(spin_cycles(f.ms))  # queued: the host runs on, as with any slow kernel
    f = my_fault.get("exit")
    if f is not None and f.step == step:
        log.record("end", status="failed", error=f"injected fault: exit before step {step}")
        log.close()
        os._exit(3)
    f = my_fault.get("skip_collective")
    if f is not None and f.step == step:
        # stay away from this step's all-reduce: the peers must time out, not hang forever
        deadline = time.time() + 2 * timeout_s + 30
        while time.time() < deadline:
            time.sleep(0.5)
        os._exit(4)


class FaultHook:
    """This rank's test-only faults where the loop and the engine ask for them; with none set (every
    real run) each call does nothing and `bool(hook)` is False."""

    def __init__(self, rank: int, env: dict[str, str] | None = None):
        self.faults = for_rank(rank, env)

    def __bool__(self) -> bool:
        return bool(self.faults)

    def before_step(self, step: int, log, timeout_s: float) -> None:
        if self.faults:
            inject(self.faults, step, log, timeout_s)

    def extra_steps_per_epoch(self) -> int:
        """What a mismatch_steps rank adds to the steps per epoch it reports."""
        return 1 if "mismatch_steps" in self.faults else 0

    def fails_save(self, step: int) -> bool:
        """Whether the checkpoint save at `step` meets a full disk (disk_full)."""
        f = self.faults.get("disk_full")
        return f is not None and f.step == step

    def comm_delay_s(self) -> float:
        return comm_delay_s(self.faults)


def comm_delay_s(my_fault: dict[str, Fault]) -> float:
    """Seconds a slow_comm fault holds each gradient bucket before it is sent (0: none)."""
    f = my_fault.get("slow_comm")
    return 0.0 if f is None else f.ms / 1000.0


_CYCLES_PER_MS: list[float] = []


def spin_cycles(ms: int) -> int:
    """GPU clock cycles that torch.cuda._sleep spins for `ms` milliseconds, measured once."""
    import torch  # as in inject

    if not _CYCLES_PER_MS:
        probe = 20_000_000
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(probe)
        stop.record()
        stop.synchronize()
        _CYCLES_PER_MS.append(probe / max(start.elapsed_time(stop), 1e-3))
    return int(ms * _CYCLES_PER_MS[0])
