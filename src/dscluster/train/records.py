"""What a run leaves for the next `dscluster plan`: rank 0's held-out curve, and its measured rate beside
the prediction plan saved for this setting. A damaged curves or plans file costs only that record,
with a warning that names it, never the run."""

from __future__ import annotations

from dscluster import console
from dscluster.core import syncmode
from dscluster.core.config import TrainConfig
from dscluster.core.evaluation import TimeToAccuracy
from dscluster.errors import UsageError
from dscluster.rundir.writer import RunRecord
from dscluster.runmodel import accuracy, predicted


def keep_curve(tta: TimeToAccuracy, cfg: TrainConfig, *, compression: str, ranks: int, run_id: str) -> None:
    """Rank 0, at the end of a run that started at step 0: its held-out curve into plan's curves
    (runmodel/accuracy.py), from which the next plan predicts the time to an accuracy."""
    try:
        accuracy.record_curve(cfg, tta.global_batch, tta.points, compression=compression, ranks=ranks, run_id=run_id)
    except (UsageError, OSError) as e:
        console.err.print(f"[yellow]warning:[/yellow] held-out curve not kept for plan ({e})")


def plan_vs_measured(cfg: TrainConfig, built, global_batch: int, precision: str, info, out, record: RunRecord,
                     run: dict) -> None:
    """Rank 0, at the end: the saved prediction against what this run measured (runmodel/predicted.py),
    for the steps this run timed (`run`: Trainer.timed). A damaged plans.json costs only the
    comparison, with a warning that names it."""
    try:
        setting = predicted.key(model=cfg.model.name, micro_batch=max(built.shares), global_batch=global_batch,
                                precision=precision, compression=syncmode.label(cfg), ranks=info.world_size)
        comparison = predicted.compare(setting, out.images_per_s, run=run)
    except UsageError as e:
        console.err.print(f"[yellow]warning:[/yellow] no plan comparison: {e}")
        return
    if comparison is not None:
        record.plan = comparison
        console.err.print(f"dscluster train: {predicted.line(comparison)}")
        try:  # the next `plan` corrects itself by what this lab really did
            predicted.record(comparison, model=cfg.model.name, precision=precision, compression=syncmode.label(cfg),
                             ranks=info.world_size, global_batch=global_batch, run_id=record.run_id)
        except OSError as e:
            console.err.print(f"[yellow]warning:[/yellow] plan outcome not kept ({e})")
