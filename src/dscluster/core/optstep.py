"""The optimizer-step boundary: who clips, who scales the loss, and what is read back.

DeepSpeed's own clipping and throughput timer cost host syncs every step, so where the parameters are
plain fp32 (ZeRO-0 with autocast, or fp32) dscluster clips itself after the all-reduce, with torch's
foreach clip (and, with a fused optimizer, through its `grad_scale`); the norm stays on the device until
the log window. fp16 on ZeRO-0 runs autocast with torch's GradScaler, read back once per window; fp16
with amp=false or ZeRO 1-3 keeps DeepSpeed's fp16 optimizer. Why, measured: docs/performance.md,
"The optimizer-step boundary".
"""

from __future__ import annotations

import math

import torch

from dscluster.core.config import TrainConfig
from dscluster.core.precision import amp_dtype

NAN = float("nan")


def dscluster_clips(cfg: TrainConfig, precision: str) -> bool:
    """True where the parameters DeepSpeed steps are the model's own fp32 tensors (no ZeRO, no half
    optimizer wrapper): there dscluster clips, and DeepSpeed's gradient_clipping is 0."""
    if cfg.zero_stage != 0:
        return False
    return precision == "fp32" or amp_dtype(cfg, precision) is not None


class StepBoundary:
    """Per optimizer step: `before_step()` after the last backward, `after_step()` after engine.step().

    `after_step()` returns a small device tensor [grad_norm, scale_tried, scale_after] (NaN where
    not known) that the loop stacks with the loss and reads once per log window.
    """

    def __init__(self, engine, cfg: TrainConfig, precision: str):
        self.engine = engine
        self.clip = float(cfg.optim.grad_clip)
        self.own_clip = dscluster_clips(cfg, precision)
        self.scaler = None
        if precision == "fp16" and amp_dtype(cfg, precision) == "float16":
            if not hasattr(engine, "torch_autocast_z0_gradscaler"):
                raise RuntimeError("this DeepSpeed has no torch_autocast GradScaler; set amp=false for fp16")
            self.scaler = torch.amp.GradScaler(
                engine.device.type, init_scale=2.0 ** cfg.fp16.initial_scale_power,
                growth_interval=max(1, int(cfg.fp16.loss_scale_window)))
            engine.torch_autocast_z0_gradscaler = self.scaler
        self.params = [p for p in engine.module.parameters() if p.requires_grad]
        # fused torch optimizers take a device `grad_scale` to divide gradients by inside their kernel
        self.fused_clip = (self.own_clip and self.scaler is None
                           and bool(getattr(engine.optimizer, "_step_supports_amp_scaling", False)))
        self._nan = torch.full((), NAN, device=engine.device)  # "not known", made once
        self._norm: torch.Tensor | None = None
        self._scale_tried: torch.Tensor | None = None

    def state_dict(self) -> dict:
        """What a checkpoint keeps of this boundary: the amp GradScaler (scale, growth tracker)."""
        return {"grad_scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, client: dict) -> None:
        if self.scaler is not None and client.get("grad_scaler"):
            self.scaler.load_state_dict(client["grad_scaler"])

    @property
    def device_scale(self) -> bool:
        """Scale and overflow come back from the device (GradScaler), not from DeepSpeed's host floats."""
        return self.scaler is not None

    def before_step(self, want_norm: bool) -> None:
        """After the boundary backward (gradients all-reduced), before engine.step()."""
        self._norm = self._scale_tried = None
        if self.scaler is not None:
            self._scale_tried = self.scaler._scale.detach().clone()
        if not self.own_clip:
            return
        if self.scaler is not None and (self.clip > 0 or want_norm):
            self.scaler.unscale_(self.engine.optimizer)  # clip and log the true gradients
        if self.clip > 0 and not self.fused_clip:
            self._norm = torch.nn.utils.clip_grad_norm_(self.params, self.clip, foreach=True)
        elif want_norm or self.clip > 0:
            grads = [p.grad for p in self.params if p.grad is not None]
            self._norm = torch.nn.utils.get_total_norm(grads, foreach=True) if grads else None
            if self._norm is not None and self.clip > 0:
                # = 1 / clip_grad_norm_'s clamped coefficient max_norm / (norm + 1e-6)
                self.engine.optimizer.grad_scale = torch.clamp((self._norm + 1e-6) / self.clip, min=1.0)

    def after_step(self) -> torch.Tensor:
        if self.fused_clip and hasattr(self.engine.optimizer, "grad_scale"):
            del self.engine.optimizer.grad_scale  # only for the step it was computed for
        norm = self._norm.float().reshape(()) if self._norm is not None else self._nan
        if self.scaler is not None:
            tried, after = self._scale_tried.reshape(()), self.scaler._scale.detach().reshape(())
        else:
            tried = after = self._nan
        return torch.stack([norm, tried, after])  # a new tensor: later steps do not change it


def decode(values: list[float]) -> tuple[float | None, float | None, bool]:
    """[grad_norm, scale_tried, scale_after] read back → (norm, scale, overflow). GradScaler only
    ever lowers the scale after an overflow (it skipped that step)."""
    norm, tried, after = values
    norm = None if math.isnan(norm) else norm
    if math.isnan(tried):
        return norm, None, False
    return norm, tried, after < tried
