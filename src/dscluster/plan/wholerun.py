"""What plan's whole-run prediction (plan/phases.py) is made from for one setting: the data set's
size (train/data.py loads it, so the steps per epoch are training's), the step times of the
setting with and without its compression, PowerSGD's start step, the probe's first-step cost, an
evaluation pass and a checkpoint save.
"""

from __future__ import annotations

from dataclasses import replace

from dscluster.errors import UsageError
from dscluster.plan import model, phases


def dataset_sizes(cfg) -> tuple[int, int] | str:
    """(training images, held-out images) as training splits them, or why they are unknown."""
    d = cfg.data
    if d.dataset == "synthetic":
        return d.synthetic_samples, 0
    try:
        from dscluster.train.data import load

        splits = load(d, "cpu", cfg.seed)
    except (UsageError, OSError, ImportError) as e:
        return f"data set {d.dataset!r} not readable here ({e})"
    return len(splits.train), len(splits.holdout) if splits.holdout is not None else 0


def powersgd_start(cfg) -> int:
    from dscluster.train.comm import powersgd_start as resolved

    return resolved(cfg)


def start_for(cfg, compression: str, world: int, *, recommended: bool) -> int | None:
    """PowerSGD's start step in a run of this setting (None: nothing starts late). A recommendation
    that compresses with PowerSGD pastes phases.POWERSGD_START_STEP where the config's start is later."""
    if compression != "powersgd" or world <= 1:
        return None
    own = powersgd_start(cfg)
    return (phases.recommended_start(own) or own) if recommended else own


def costs(cfg, s: model.Scenario, p: model.Prediction, *, start: int | None, train_n: int, holdout_n: int,
          warmup_extra_s: float, params: int, uncalibrated: bool = False) -> phases.RunCosts:
    """The run costs of scenario `s` (predicted as `p`), whose steps after `start` are compressed;
    `uncalibrated`: the model's steps before calibration (what train's outcomes are measured against)."""
    plain = model.predict(replace(s, compression="none")) if s.compression == "powersgd" else p
    pick = (lambda q: q.model_step_s) if uncalibrated else (lambda q: q.step_s)
    rank0 = s.nodes[0].compute_s / s.micro_batch  # rank 0 evaluates alone
    every = cfg.checkpoint
    return phases.RunCosts(
        plain_step_s=pick(plain), step_s=pick(p), start_step=start, warmup_extra_s=warmup_extra_s,
        eval_s=holdout_n * rank0 * phases.FORWARD_SHARE,
        save_s=params * phases.CHECKPOINT_BYTES_PER_PARAM / (phases.CHECKPOINT_WRITE_GBps * 1e9),
        steps_per_epoch=max(1, train_n // s.global_batch), eval_every_epochs=cfg.eval_every_epochs,
        checkpoint_every_epochs=every.every_epochs, checkpoint_every_steps=every.every_steps)


def setting_run(cfg, s: model.Scenario, p: model.Prediction, sizes, *, start: int | None, warmup_extra_s: float,
                params: int) -> dict | None:
    """The whole-run prediction of one setting (phases.whole_run) with the model's uncalibrated steps
    beside it (`model_costs`), or None when the data set's size is unknown or smaller than a step."""
    if isinstance(sizes, str) or sizes[0] < s.global_batch:
        return None
    kw = dict(start=start, train_n=sizes[0], holdout_n=sizes[1], warmup_extra_s=warmup_extra_s, params=params)
    c = costs(cfg, s, p, **kw)
    out = phases.whole_run(c, epochs=cfg.epochs, max_steps=cfg.max_steps, global_batch=s.global_batch)
    out["model_costs"] = costs(cfg, s, p, uncalibrated=True, **kw).to_dict()
    return out


def run_note(cfg, sizes, now_start: int | None, choice_start: int | None, world: int) -> list[str]:
    """What the reader should know about the whole-run figures and the start-step rule."""
    notes = []
    if isinstance(sizes, str):
        notes.append(f"no whole-run prediction: {sizes}; the step figures hold for the steady state only")
    elif sizes[0] and world:
        notes.append(f"whole run: {sizes[0]:,} training and {sizes[1]:,} held-out images, {cfg.epochs} epoch(s)"
                     + (f", max_steps {cfg.max_steps}" if cfg.max_steps > 0 else "")
                     + f"; checkpoint saves assumed at {phases.CHECKPOINT_WRITE_GBps} GB/s")
    if now_start is not None and now_start > phases.WARMUP_STEPS:
        notes.append(f"comm.powersgd_start_step resolves to {now_start}: the run's first {now_start} steps send "
                     "uncompressed gradients, and the whole-run figure counts them")
    if choice_start is not None:
        notes.append(f"start-step rule: a recommendation with PowerSGD compresses from step {choice_start} "
                     f"(comm.powersgd_start_step={choice_start}), not after the learning-rate warm-up: "
                     f"{phases.POWERSGD_START_EVIDENCE}")
    return notes
