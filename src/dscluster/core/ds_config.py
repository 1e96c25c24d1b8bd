"""The DeepSpeed config dict, built from the training config, the world and the precision.

DeepSpeed insists that train_batch_size = micro × accumulation × world; a mismatch would
otherwise surface as an assertion deep inside deepspeed.initialize on every rank, so the
arithmetic is checked first and explained (core/shape.py, which plan calls too).
"""

from __future__ import annotations

import copy
from pathlib import Path

from dscluster.core.config import TrainConfig
from dscluster.core.optstep import dscluster_clips
from dscluster.core.precision import amp_dtype
from dscluster.core.shape import BatchPlan
from dscluster.errors import UsageError
from dscluster.rundir import layout


def build_ds_config(cfg: TrainConfig, plan: BatchPlan, precision: str, *, on_gpu: bool,
                    initial_scale_power: int | None = None) -> dict:
    """DeepSpeed JSON config. The optimizer is passed as a client optimizer (fused AdamW on GPU; DeepSpeed's
    CPUAdam with offload_optimizer, core/setup_engine.py).
    The user's `deepspeed:` section is merged last (config_checks refused the keys built here)."""
    bucket = int(cfg.bucket_size_mb) * 1_000_000
    ds: dict = {
        "train_batch_size": plan.global_batch,
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.grad_accum,
        # 0 where dscluster clips itself (core/optstep.py: foreach clip, no host sync)
        "gradient_clipping": 0.0 if dscluster_clips(cfg, precision) else float(cfg.optim.grad_clip),
        "steps_per_print": 10**9,          # we log ourselves; DeepSpeed's prints sync the host
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer synchronises the device at every forward and step
        "timers": {"throughput": {"enabled": False}},
        "zero_optimization": {"stage": int(cfg.zero_stage)},
        "zero_allow_untested_optimizer": True,
    }
    if cfg.zero_stage > 0:
        ds["zero_optimization"].update({
            "overlap_comm": bool(cfg.overlap_comm) and on_gpu,
            "contiguous_gradients": True,
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
            "reduce_scatter": True,
        })
    if cfg.offload_optimizer != "none":
        # DeepSpeed recommends page-locked host memory for the offloaded states (faster copies both ways);
        # a CPU rank has no device to copy to, and pinning needs CUDA.
        ds["zero_optimization"]["offload_optimizer"] = {"device": cfg.offload_optimizer, "pin_memory": on_gpu}
    amp = amp_dtype(cfg, precision)
    if amp is not None:
        # fp32 parameters and optimizer; the engine runs forward under torch.autocast(amp). fp16 gets
        # torch's GradScaler (core/optstep.py sets it up from the fp16 section).
        ds["torch_autocast"] = {"enabled": True, "dtype": amp}
    elif precision == "fp16":
        ds["fp16"] = {
            "enabled": True,
            "loss_scale": 0,  # 0 = dynamic
            "initial_scale_power": int(cfg.fp16.initial_scale_power if initial_scale_power is None
                                       else initial_scale_power),
            "loss_scale_window": int(cfg.fp16.loss_scale_window),
            "hysteresis": int(cfg.fp16.hysteresis),
            "min_loss_scale": float(cfg.fp16.min_loss_scale),
        }
    elif precision == "bf16":
        ds["bf16"] = {"enabled": True}
    elif precision != "fp32":
        raise UsageError(f"unknown precision {precision!r}")
    return merged(merged(ds, monitor_defaults(cfg.deepspeed)), cfg.deepspeed)


MONITORS = ("tensorboard", "csv_monitor")


def monitor_defaults(theirs: dict | None, run_dir: Path | None = None) -> dict:
    """A DeepSpeed monitor the user turned on writes into the run directory (RUN_DIR/monitor/deepspeed/)
    unless they gave its output_path or job_name: DeepSpeed's own default is the working directory,
    where `plot` would not find it and every run would append to the same files."""
    run_dir = layout.run_dir() if run_dir is None else run_dir
    return {key: {"output_path": str(Path(run_dir).absolute() / "monitor"), "job_name": "deepspeed"}
            for key in MONITORS if isinstance((theirs or {}).get(key), dict) and theirs[key].get("enabled")}


def merged(ours: dict, theirs: dict | None) -> dict:
    """`ours` with `theirs` laid over it: mappings merge key by key, any other value of theirs
    replaces ours. Neither input is changed (the user's section is written to config.yaml as given)."""
    out = dict(ours)
    for key, value in (theirs or {}).items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
