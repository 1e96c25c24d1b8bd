"""One optimizer step: its micro-steps, the boundary where gradients are reduced, `engine.step()`.

Kept on the device: the step's loss and the boundary's values (grad norm, amp loss scale) come
back as one small tensor that the log window reads with all the others of the window (no host
sync per step). Only DeepSpeed's own fp16 optimizer (amp=false or ZeRO 1-3) has host-side scale
and overflow: it syncs for them. The step's time split (split.py) is marked here: its start, the
host's work on the batches, the end of the boundary backward (DDP has waited for the reductions)
and the end of the step.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dscluster.core.optstep import StepBoundary


def loss_scale_of(engine) -> float | None:
    opt = engine.optimizer
    for obj in (opt, getattr(opt, "loss_scaler", None)):
        if obj is not None and hasattr(obj, "cur_scale"):
            return float(obj.cur_scale)
    return None


@dataclass
class StepResult:
    values: torch.Tensor
    """On the device: [loss, grad_norm, scale_tried, scale_after] (optstep.decode reads the last three)."""
    samples: int
    loss_scale: float | None
    """DeepSpeed's host-side fp16 scale this step was tried at (None elsewhere)."""
    overflow: bool
    grad_norm: float | None
    """DeepSpeed's own norm where it clips (read on log steps only); dscluster's is in `values`."""
    marks: object = None
    """The step's split.Marks, turned into seconds when its log window is read back."""


class TrainStep:
    """Runs optimizer steps of one run; `run(micro, log_step)` is one of them."""

    def __init__(self, engine, built, cfg, precision: str, boundary: StepBoundary, device, split, generator):
        self.engine = engine
        self.built = built
        self.cfg = cfg
        self.precision = precision
        self.boundary = boundary
        self.device = device
        self.split = split
        self.generator = generator
        self.ddp = built.ddp
        self.averager = None
        """sync.mode local_sgd / diloco on several ranks: localsgd.ModelAverager (set by the Trainer)."""

    def run(self, micro: list[list[int]], log_step: bool, step: int = 0, step_in_epoch: int = 0) -> StepResult:
        """One optimizer step; `step` (global, 1-based) and `step_in_epoch` (0-based) place it in the
        averager's period."""
        engine = self.engine
        built = self.built
        cfg = self.cfg
        boundary = self.boundary
        split = self.split
        split.start()
        step_loss = torch.zeros((), device=self.device)
        scale = None
        samples = 0
        norm = None
        for k, idx in enumerate(micro):
            boundary_step = k == len(micro) - 1
            with split.data():
                x, y = built.splits.train.get_batch(idx, self.device, built.dtype, augment=cfg.data.augment,
                                                    generator=self.generator, channels_last=cfg.channels_last)
            if self.averager is not None and boundary_step:
                self.averager.arm(step)  # a node's ranks reduce their gradients while this backward runs
            # DDP-synchronised engines reduce only at the accumulation boundary
            with self.ddp.no_sync() if self.ddp is not None and not boundary_step else contextlib.nullcontext():
                loss = F.cross_entropy(engine(x).float(), y)
                engine.backward(loss * built.loss_weight if built.loss_weight != 1.0 else loss)
            if boundary_step:
                if self.averager is not None:
                    self.averager.reduce_gradients(step)
                split.reductions_done()  # DDP's finalize waited for the buckets' reductions
                boundary.before_step(want_norm=log_step)  # gradients are all-reduced by now
                if self.precision == "fp16" and not boundary.device_scale:
                    scale = loss_scale_of(engine)  # the scale this step is attempted at (a host float)
            engine.step()
            step_loss += loss.detach() / len(micro)
            samples += len(idx)
        if self.averager is not None:
            self.averager.after_step(step, step_in_epoch=step_in_epoch)
        overflow = False
        if self.precision == "fp16" and not boundary.device_scale:
            overflow = bool(getattr(engine.optimizer, "overflow", False))
        if log_step and not boundary.own_clip:
            norm = engine.get_global_grad_norm()  # DeepSpeed clipped (ZeRO, half-weight optimizers)
            norm = None if norm is None or (isinstance(norm, float) and math.isnan(norm)) else float(norm)
        values = torch.cat([step_loss.reshape(1).float(), boundary.after_step()])
        return StepResult(values=values, samples=samples, loss_scale=scale, overflow=overflow, grad_norm=norm,
                          marks=split.end())
