"""Step times and throughput: the one definition every figure of a run is built on.

A step's time is wall-clock time with the GPU's work and the communication finished: the host queues a
step in milliseconds and runs ahead, so a host clock right after `engine.step()` measures the queueing.
Steps are timed in windows that close after the read-back of their own values; the warm-up windows are
left out, and the later ones follow each other without a gap, so evaluation and checkpoints count too.
Beside that steady figure the run keeps its whole-run one (`StepWindow.whole_run`). Measurements:
docs/performance.md, "A step's time".
"""

from __future__ import annotations

import os
import time
from typing import Callable

WARMUP_STEPS = 5
"""First steps of a run left out of images_per_s (unless the run is not longer than that)."""


def is_timed(steps_done: int, steps_this_run: int) -> bool:
    """Whether the `steps_done`-th step (1-based) of a run of `steps_this_run` steps counts."""
    return steps_done > WARMUP_STEPS or steps_this_run <= WARMUP_STEPS


def warmup_left_out(steps_this_run: int) -> int:
    """How many first steps `is_timed` leaves out of a run of `steps_this_run` steps: WARMUP_STEPS, or none (0)
    when the run is not longer than that (its figure then counts every step, compilation in)."""
    return WARMUP_STEPS if steps_this_run > WARMUP_STEPS else 0


def ends_warmup(steps_done: int, steps_this_run: int) -> bool:
    """A window must close after this step, so that no window mixes warm-up and timed steps."""
    return steps_done == WARMUP_STEPS and steps_this_run > WARMUP_STEPS


def process_started(stat: str = "/proc/self/stat", uptime: str = "/proc/uptime") -> float | None:
    """When this process started (time.time()'s clock): the kernel's start tick of the process against the
    machine's uptime, so the interpreter's start and imports count; None where /proc does not say."""
    try:
        with open(stat, encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the command name may hold spaces
        with open(uptime, encoding="ascii") as f:
            up = float(f.read().split()[0])
        return time.time() - up + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat(5): starttime
    except (OSError, ValueError, IndexError):
        return None


class StepWindow:
    """Times windows of steps by the wall clock; `close` must be called after the device sync."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.t0 = self.started = clock()
        self.timed_s = 0.0
        self.timed_steps = 0
        self.warmup_s: float | None = None
        """First step's start to the end of the warm-up steps (compilation included), once they are over."""

    def close(self, records: list[dict], timed: bool) -> float:
        """Give each step record its share of the window's wall-clock time; returns the window's seconds."""
        elapsed = self.clock() - self.t0
        if records:
            per_step = elapsed / len(records)
            for rec in records:
                rec["step_time"] = per_step
                rec["samples_per_s"] = rec["samples"] / per_step if per_step > 0 else None
            if timed:
                self.timed_s += elapsed
                self.timed_steps += len(records)
            elif self.timed_steps == 0:
                self.warmup_s = self.clock() - self.started
        self.t0 = self.clock()
        return elapsed

    def whole_run(self, images: int) -> tuple[float, float | None]:
        """(seconds from the first step's start to now, `images` ÷ those seconds): the run's figure with
        warm-up, compilation, evaluations and saves all in (module docstring)."""
        seconds = self.clock() - self.started
        return seconds, (images / seconds if seconds > 0 and images else None)

    def images_per_s(self, global_batch: int) -> float | None:
        """The job's steady images/s: every rank's step takes the same wall-clock time in synchronous data
        parallelism."""
        if self.timed_s <= 0 or self.timed_steps == 0:
            return None
        return global_batch * self.timed_steps / self.timed_s
