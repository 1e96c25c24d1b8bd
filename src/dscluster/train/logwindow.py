"""The log window: steps whose values are still on the device, read back and written in one go.

Every `log_every` steps (and before a checkpoint, and where the warm-up ends) the window is
flushed: one host sync reads back the window's losses, norms and loss scales; only then has the
device finished those steps, so only then are they timed (timing.py) and split into compute,
communication and data (split.py); then each step's record is written and the fp16 guard judges
them.
"""

from __future__ import annotations

import torch

from dscluster.core import optstep
from dscluster.core.timing import StepWindow, is_timed


class LogWindow:
    def __init__(self, log, split, boundary, guard, run_record, run_length: int, *, scale_history=None):
        """`run_record`: the run's RunRecord (rundir/writer.py), whose overflow_steps the window counts."""
        self.log = log
        self.split = split
        self.boundary = boundary
        self.guard = guard
        self.run_record = run_record
        self.run_length = run_length
        self.scale_history = scale_history  # a list to append (scale, overflow) to: calibration runs
        self.window = StepWindow()
        self.records: list[dict] = []
        self.values: list[torch.Tensor] = []
        self.marks: list = []

    def __len__(self) -> int:
        return len(self.records)

    def add(self, record: dict, values: torch.Tensor, marks) -> None:
        self.records.append(record)
        self.values.append(values)
        self.marks.append(marks)

    def flush(self, steps_this_run: int) -> None:
        """`steps_this_run`: steps done in this process so far, the window's last included."""
        if not self.records:
            return
        values = torch.stack(self.values).float().tolist()  # the one host sync per log window
        # Only now has the device finished the window's steps: time them (timing.py says why).
        elapsed = self.window.close(self.records, timed=is_timed(steps_this_run - len(self.records) + 1,
                                                                 self.run_length))
        self.split.resolve(self.marks, self.records, elapsed)
        for rec, (loss_v, *stats) in zip(self.records, values, strict=True):
            norm, scale, overflow = optstep.decode(stats)
            rec["loss"] = loss_v
            if self.boundary.device_scale:
                rec["loss_scale"], rec["overflow"] = scale, overflow
            if norm is not None:
                rec["grad_norm"] = norm
            self.run_record.overflow_steps += rec["overflow"]
            if self.scale_history is not None:
                self.scale_history.append((rec["loss_scale"], rec["overflow"]))
            self.log.record("step", **rec)
            if self.guard is not None:
                self.guard.observe(rec["step"], rec["loss_scale"], rec["overflow"])
        self.records.clear()
        self.values.clear()
        self.marks.clear()

    def images_per_s(self, global_batch: int) -> float | None:
        return self.window.images_per_s(global_batch)
