"""Where each step's time went: compute, waiting for communication, waiting for data. Measured.

A step of data-parallel training on Ethernet can spend most of its time waiting for the gradients
to cross the network, and the step time alone does not say so. So every step is split:

- data: host seconds spent getting the step's batches (index lookup, decode, copy to the device);
- comm: from the moment the last gradient bucket was handed to communication (the DDP
  communication hook's call, comm.py) until the reductions had finished (DDP's finalize has waited
  for them when `engine.backward()` returns). That is the part of the all-reduce backward could
  not hide; the rest ran during backward and costs nothing. Floored at 0.
- compute: the rest of the step: forward and backward up to the last bucket, the optimizer step
  and anything else the step itself did.

data + compute + comm = the step's own span, from its start to the end of `engine.step()`. The step
time of the run (timing.py) is wall clock per log window, and a window also holds what happens
between steps (logging, held-out evaluation, checkpoint saves): that remainder is `other`, spread
evenly over the window's steps, so that data + compute + comm + other = step_time in every window.

Clocks: on CPU `time.perf_counter()` everywhere. On a GPU the step's marks are CUDA events
recorded on the current stream (no host sync); the window's read-back, which waits for the device
anyway, is where their times are read. There the span is the device's, and so is data: an event
before the host starts getting a batch and one after it has been handed over, and the device time
between them. That is the time the device waited for the batch (and copied it): while the host
gets the next micro-batch the device is still busy with the last one, and that overlap costs
nothing. Host seconds would count it, and took it out of compute: 4 ranks of ViT-S at
grad_accum 4 read 0.099 s of data and 0.003 s of compute a step, where four micro-batches take
the device about 0.11 s.

With sync.mode local_sgd or diloco (localsgd.py) the gradients' all-reduce, where a step has one, is
marked the same way around it, and the average of the models every H steps is timed on its own:
`average_s`, part of comm (these records only).

With one rank there is nothing to wait for: comm = 0. With several ranks but no DDP hook (ZeRO 1-3,
overlap_comm false: DeepSpeed reduces on its own) comm is not measured: null, and compute holds it.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

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
        import torch

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
