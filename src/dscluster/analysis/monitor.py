"""DeepSpeed's own monitor series (the config's csv_monitor or tensorboard section) in a run directory.

A script that never calls dscluster.userlog can still turn on DeepSpeed's monitor. Pointed into the
run directory (docs/byo-script.md), its series are found here and `plot` draws the loss and learning
rate. csv_monitor writes <output_path>/<job_name>/<Tag_With_Underscores>.csv, a `step,<last part of
the tag>` header and one `step,value` row per event. TensorBoard event files are read through the
tensorboard package only where it is installed.
"""

from __future__ import annotations

import csv
from pathlib import Path

from dscluster.rundir.layout import CHECKPOINT_DIR

Series = list[tuple[float, float]]
EXPORT_DIR = Path("tensorboard") / "dscluster"
"""Where `plot` writes dscluster's own series for TensorBoard (analysis/tbexport.py): not a monitor's."""


def series_kind(name: str) -> str | None:
    """'loss', 'lr' or 'loss_scale' for the tags a user looks for; None for the rest (timers)."""
    last = name.replace("/", "_").lower().rsplit("samples_", 1)[-1]
    if "loss_scale" in last:
        return "loss_scale"
    if last in ("lr", "learning_rate") or last.endswith("_lr"):
        return "lr"
    if "loss" in last:
        return "loss"
    return None


def read_csv_series(path: Path) -> Series:
    """One csv_monitor file: rows after the header whose two cells are numbers (a torn last row is skipped)."""
    out: Series = []
    with path.open(newline="", encoding="utf-8") as f:
        for row in csv.reader(f):
            try:
                out.append((float(row[0]), float(row[1])))
            except (ValueError, IndexError):
                continue
    return out


def read_event_series(path: Path) -> dict[str, Series]:
    """Scalars of one TensorBoard event file, by tag; {} where tensorboard is not installed."""
    try:  # optional: the tensorboard package is installed only where wanted
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        return {}
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(float(e.step), float(e.value)) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _outside_checkpoints(run_dir: Path, path: Path) -> bool:
    """Not in checkpoints/ (large, never a monitor's) nor in our own TensorBoard export."""
    parts = path.relative_to(run_dir).parts
    return CHECKPOINT_DIR not in parts and parts[:2] != EXPORT_DIR.parts


def read_monitor(run_dir: Path, problems: list[str]) -> dict[str, Series]:
    """Every monitor series under the run directory, by its tag (the file's name without .csv, or the
    event file's tag). Unreadable files go to `problems`."""
    run_dir = Path(run_dir)
    found: dict[str, Series] = {}
    for path in sorted(run_dir.rglob("*.csv")):
        if not _outside_checkpoints(run_dir, path):
            continue
        try:
            with path.open(encoding="utf-8") as f:
                header = f.readline().strip().split(",")
            if header[:1] != ["step"] or len(header) != 2:
                continue  # not a csv_monitor file
            found[path.stem] = read_csv_series(path)
        except (OSError, UnicodeDecodeError) as e:
            problems.append(f"{path}: unreadable ({type(e).__name__}: {e}); ignored")
    for path in sorted(run_dir.rglob("events.out.tfevents.*")):
        if not _outside_checkpoints(run_dir, path):
            continue
        try:
            for tag, series in read_event_series(path).items():
                found.setdefault(tag, []).extend(series)
        except Exception as e:  # a torn event file: say so, keep the rest
            problems.append(f"{path}: unreadable ({type(e).__name__}: {e}); ignored")
    return {tag: sorted(s) for tag, s in found.items() if s}


def by_kind(series: dict[str, Series]) -> dict[str, dict[str, Series]]:
    """{'loss': {tag: series}, 'lr': {...}, 'loss_scale': {...}} of the tags a user looks for."""
    out: dict[str, dict[str, Series]] = {}
    for tag, s in series.items():
        kind = series_kind(tag)
        if kind:
            out.setdefault(kind, {})[tag] = s
    return out
