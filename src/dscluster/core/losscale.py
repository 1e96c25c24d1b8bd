"""fp16 loss-scale calibration: how high can the dynamic scale start without overflowing?

DeepSpeed's default start (2^16) overflowed on every step in the field; each overflow skips
an optimizer step and halves the scale, so a bad start costs steps and, with hysteresis,
can reach the minimum. Calibration runs a short fp16 training from 2^16, records (scale,
overflow) per step and recommends the power of two at which steps stopped overflowing;
`write_initial_scale_power` puts it into the preset (atomically, keeping comments).
"""

from __future__ import annotations

import math
from pathlib import Path

import yaml

from dscluster.core.dist import ensure_single_process_group
from dscluster.errors import JobFailed, UsageError
from dscluster.files import paths
from dscluster.files.fsutil import atomic_write_text

CALIBRATION_START_POWER = 16


def recommend_initial_scale_power(points: list[tuple[float, bool]]) -> int:
    """log2 of the lowest scale any successful step used after the first success.

    The first non-overflowing step marks where the halving stopped; later overflows that
    pushed the scale lower still count, so the recommendation is a start that the run
    actually sustained.
    """
    first_ok = next((i for i, (_, ov) in enumerate(points) if not ov), None)
    if first_ok is None:
        raise JobFailed(
            f"loss-scale calibration: all {len(points)} steps overflowed "
            f"(last scale {points[-1][0] if points else '?'}); "
            "fp16 does not work for this model/lr: use precision=bf16 or fp32, or lower optim.lr"
        )
    ok_scales = [s for s, ov in points[first_ok:] if not ov]
    return max(0, int(math.floor(math.log2(min(ok_scales)))))


def replay_dynamic_scaler(overflows: list[bool], *, init_power: int = CALIBRATION_START_POWER,
                          window: int = 1000, hysteresis: int = 2, min_scale: float = 1.0) -> list[float]:
    """The scale DeepSpeed's own DynamicLossScaler uses at each step for a given overflow sequence."""
    scaler = make_dynamic_scaler(init_power=init_power, window=window, hysteresis=hysteresis, min_scale=min_scale)
    scales = []
    for ov in overflows:
        scales.append(float(scaler.cur_scale))
        scaler.update_scale(ov)
    return scales


def make_dynamic_scaler(*, init_power: int, window: int, hysteresis: int, min_scale: float):
    """DeepSpeed's DynamicLossScaler as its fp16 optimizer builds it (it logs through deepspeed.comm,
    so a one-process group is brought up when none exists)."""
    # deepspeed chooses its accelerator when imported (core/dist.py): a light caller never pays for it
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    ensure_single_process_group()
    return DynamicLossScaler(init_scale=2.0**init_power, scale_window=window, min_scale=min_scale,
                             delayed_shift=hysteresis, consecutive_hysteresis=False, raise_error_at_min_scale=False)


def write_initial_scale_power(config_path: str | Path, power: int) -> None:
    """Set fp16.initial_scale_power in a YAML preset in place, keeping its comments and layout."""
    path = paths.config_path(str(config_path))  # the file load_config read
    text = path.read_text(encoding="utf-8")
    root = yaml.compose(text)
    if root is not None and not isinstance(root, yaml.MappingNode):
        raise UsageError(f"{path}: top level is not a mapping")
    fp16 = next((v for k, v in (root.value if root else []) if k.value == "fp16"), None)
    if fp16 is None:
        sep = "" if not text or text.endswith("\n") else "\n"
        new = f"{text}{sep}fp16:\n  initial_scale_power: {power}\n"
    elif not isinstance(fp16, yaml.MappingNode) or fp16.flow_style:
        raise UsageError(f"{path}:{fp16.start_mark.line + 1}: fp16 must be a block mapping to be edited")
    else:
        val = next((v for k, v in fp16.value if k.value == "initial_scale_power"), None)
        if val is not None:
            new = text[:val.start_mark.index] + str(power) + text[val.end_mark.index:]
        else:
            first_key = fp16.value[0][0] if fp16.value else None
            indent = " " * (first_key.start_mark.column if first_key else 2)
            lines = text.splitlines(keepends=True)
            at = fp16.start_mark.line  # insert as the section's first line
            lines.insert(at, f"{indent}initial_scale_power: {power}\n")
            new = "".join(lines)
    atomic_write_text(path, new)
