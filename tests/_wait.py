"""Waiting in tests: on the condition itself, with deadlines that grow with the machine's load.

A deadline is given as what an idle machine needs (with a margin), and stretched by
`slowdown()`: the load per CPU core (1-minute average) when it is above 1, at most
MAX_SLOWDOWN, times DSCLUSTER_TEST_SLOWDOWN where a runner is known to be slow. The load is
read again while waiting, so a load that builds up during a wait extends it. A test that
waits this way fails with what it waited for, instead of hanging or racing a fixed sleep.

    from _wait import Deadline, run_bounded, scaled, wait_until

    wait_until(lambda: (run / "summary.json").exists(), 60, "summary.json written")
    res = run_bounded([...], 120, "the launch")      # a subprocess that must end in time
    assert took < scaled(10)                          # a bound measured on an idle machine
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Any, Callable

import pytest

MAX_SLOWDOWN = 8.0


def slowdown() -> float:
    """How many times longer than on an idle machine things may take now (1 to MAX_SLOWDOWN,
    times DSCLUSTER_TEST_SLOWDOWN)."""
    try:
        per_core = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        per_core = 1.0
    return min(max(1.0, per_core), MAX_SLOWDOWN) * float(os.environ.get("DSCLUSTER_TEST_SLOWDOWN") or 1)


def scaled(seconds: float) -> float:
    """`seconds` on an idle machine, stretched for the load now."""
    return seconds * slowdown()


class Deadline:
    """`seconds` (what an idle machine needs) from now, stretched by the highest load seen
    while it runs."""

    def __init__(self, seconds: float):
        self.start = time.monotonic()
        self.seconds = seconds
        self.factor = slowdown()

    @property
    def allowed(self) -> float:
        self.factor = max(self.factor, slowdown())
        return self.seconds * self.factor

    def left(self) -> float:
        return self.start + self.allowed - time.monotonic()

    def passed(self) -> bool:
        return self.left() <= 0

    def elapsed(self) -> float:
        return time.monotonic() - self.start


def wait_until(condition: Callable[[], Any], seconds: float, what: str, *, interval: float = 0.05,
               explain: Callable[[], str] | None = None) -> Any:
    """Poll `condition` until it returns something true, and return that; fail the test naming
    `what` (and `explain()`, if given) once the load-scaled deadline has passed."""
    deadline = Deadline(seconds)
    while True:
        value = condition()
        if value:
            return value
        if deadline.passed():
            detail = f"\n{explain()}" if explain else ""
            pytest.fail(f"waited {deadline.elapsed():.1f} s (deadline {deadline.allowed:.0f} s, load-scaled from "
                        f"{seconds:.0f} s) for: {what}{detail}", pytrace=False)
        time.sleep(interval)


def run_bounded(argv: list[str], seconds: float, what: str, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(argv, capture_output, text) that must end within a load-scaled deadline;
    past it, the command and everything in its process group are killed and the test fails
    with their output, instead of hanging the test run."""
    deadline = Deadline(seconds)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kwargs)
    while True:
        try:
            out, err = proc.communicate(timeout=max(deadline.left(), 0.1))
            return subprocess.CompletedProcess(argv, proc.returncode, out, err)
        except subprocess.TimeoutExpired:
            if not deadline.passed():
                continue  # the load went up while waiting: so did the deadline
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            try:
                out, err = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:  # something outside its group still holds the pipes
                proc.kill()
                proc.wait()
                out, err = "", "(not collected: a process outside the command's group kept its output open)"
            pytest.fail(f"{what}: still running after {deadline.elapsed():.0f} s (deadline load-scaled from "
                        f"{seconds:.0f} s), killed\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-3000:]}",
                        pytrace=False)
