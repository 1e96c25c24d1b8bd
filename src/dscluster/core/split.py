"""Where each step's time went: compute, waiting for communication, waiting for data. Measured.

On Ethernet a step can spend most of its time waiting for the gradients, and the step time alone does
not say so. So every step is split: data (getting its batches), comm (from the last gradient bucket's
hand-off to the reductions' end: what backward could not hide) and compute (the rest); with the
window's `other` (logging, evaluation, checkpoints) they add up to the step time. On a GPU the marks
are CUDA events read back with the window, so data is what the device waited, not host seconds.
Definitions and clocks: docs/performance.md, "Where a step's time went".
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

FIELDS = ("compute_s", "comm_s", "data_s", "other_s")
"""What a step record gains (docs/run-directory.md)."""


@dataclass
class Marks:
    """One step's clock readings: floats (seconds, CPU) or CUDA events (GPU)."""

    start: object = None
    handed: object = None
    reduced: object = None
    end: object = None
    avg_start: object = None
    avg_end: object = None
    data_s: float = 0.0
    """Host seconds getting batches (CPU)."""
    data_events: list = field(default_factory=list)
    """(before, after) CUDA events around each batch (GPU)."""


class StepSplit:
    """Marks each step; `resolve` turns a window's marks into seconds once the device has finished.

    `comm`: "measured" (a DDP hook calls `bucket_handed`), "none" (one rank), "unmeasured" (several
    ranks reduced by DeepSpeed itself)."""

    def __init__(self, device, comm: str, clock=time.perf_counter, *, averages: bool = False):
        if comm not in ("measured", "none", "unmeasured"):
            raise ValueError(comm)
        self.comm = comm
        self.averages = averages  # sync.mode local_sgd / diloco: records carry average_s
        self.clock = clock
        self.cuda = getattr(device, "type", "cpu") == "cuda"
        self._free: list = []   # CUDA events whose times were read: reused
        self.marks: Marks | None = None

    def _mark(self):
        if not self.cuda:
            return self.clock()
        ev = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        ev.record()  # on the current stream: completes when the device reaches this point
        return ev

    def start(self) -> None:
        self.marks = Marks(start=self._mark())

    @contextmanager
    def data(self):
        """Around the host's work of getting a batch."""
        m = self.marks
        before = self._mark() if self.cuda and m is not None else None
        t0 = self.clock()
        try:
            yield
        finally:
            if m is not None:
                m.data_s += self.clock() - t0
                if before is not None:
                    m.data_events.append((before, self._mark()))

    def bucket_handed(self) -> None:
        """A gradient bucket goes to communication (called by the DDP hook; the last call counts)."""
        m = self.marks
        if m is None:
            return
        if m.handed is not None and self.cuda:
            m.handed.record()  # the same event, re-recorded: no event per bucket
        else:
            m.handed = self._mark()

    def reductions_done(self) -> None:
        """Right after the boundary micro-step's backward, which DDP ends by waiting for the reductions."""
        if self.marks is not None and self.marks.handed is not None:
            self.marks.reduced = self._mark()

    def average_started(self) -> None:
        if self.marks is not None:
            self.marks.avg_start = self._mark()

    def average_done(self) -> None:
        if self.marks is not None and self.marks.avg_start is not None:
            self.marks.avg_end = self._mark()

    def end(self) -> Marks:
        m, self.marks = self.marks, None
        m.end = self._mark()
        return m

    def _seconds(self, a, b) -> float:
        if not self.cuda:
            return b - a
        if not b.query():  # the window's read-back waited for the device: this is only a safety net
            b.synchronize()
        return a.elapsed_time(b) / 1000.0

    def resolve(self, marks: list[Marks], records: list[dict], window_s: float) -> None:
        """Give each record compute_s, comm_s, data_s and other_s (after the window's device sync)."""
        spans = []
        for m, rec in zip(marks, records, strict=True):
            span = max(0.0, self._seconds(m.start, m.end))
            comm: float | None = 0.0
            if self.comm == "unmeasured":
                comm = None
            elif self.comm == "measured":
                comm = max(0.0, self._seconds(m.handed, m.reduced)) if m.reduced is not None else 0.0
            avg = max(0.0, self._seconds(m.avg_start, m.avg_end)) if m.avg_end is not None else 0.0
            if self.averages:
                rec["average_s"] = avg
            if comm is not None:
                comm += avg
            data = m.data_s
            if self.cuda and m.data_events:
                data = sum(max(0.0, self._seconds(a, b)) for a, b in m.data_events)
            rec["data_s"] = data
            rec["comm_s"] = comm
            rec["compute_s"] = max(0.0, span - data - (comm or 0.0))
            spans.append(rec["data_s"] + rec["compute_s"] + (comm or 0.0))
            if self.cuda:
                self._free += [e for e in (m.start, m.handed, m.reduced, m.avg_start, m.avg_end, m.end)
                               if e is not None]
                self._free += [e for pair in m.data_events for e in pair]
        other = max(0.0, window_s - sum(spans)) / len(records) if records else 0.0
        for rec in records:
            rec["other_s"] = other
