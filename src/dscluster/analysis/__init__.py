"""Turn run directories into plots, a one-page report and a diagnosis. Reads files only.

Never imports the command line: `dscluster plot` and analysis/plot.py (`dscluster.cli.plot`) call it."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path

from dscluster.analysis.diagnose import diagnose
from dscluster.analysis.load import RunData, load_run
from dscluster.analysis.stats import summary_row
from dscluster.analysis.tbexport import export as export_tensorboard
from dscluster.files import redact
from dscluster.files.fsutil import atomic_write_text
from dscluster.rundir.layout import PLOTS_DIR, REPORT_FILE


def drawing(module: str):
    """plots.py, monitor_plot.py or report.py: they load matplotlib at import, so they load when pictures
    are drawn and `dscluster --help` (which imports this package) stays quick."""
    return importlib.import_module(f"dscluster.analysis.{module}")


@dataclass
class RunOutput:
    run: RunData
    out_dir: Path
    report: Path
    plots: list = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    diagnosis: dict = field(default_factory=dict)


def analyse(run_dirs: list[str | Path], out: str | Path | None = None) -> list[RunOutput]:
    """Plots + report.html for every run; scaling.png too when several runs are given.

    Without --out, each run's pictures go to RUN/plots/ and its report to RUN/report.html.
    With --out and one run: OUT/*.png and OUT/report.html; with several: OUT/<run>/...
    """
    pictures = drawing("plots")
    monitor_pictures = drawing("monitor_plot")
    page = drawing("report")
    runs = [load_run(d) for d in run_dirs]  # all validated before anything is written
    names = [r.name for r in runs]
    results = []
    scaling_plot = None
    if len(runs) > 1:
        scaling_dir = Path(out) if out else runs[0].path / PLOTS_DIR
        scaling_plot = pictures.plot_scaling(runs, scaling_dir)
    for run in runs:
        if out is None:
            out_dir, report = run.path / PLOTS_DIR, run.path / REPORT_FILE
        elif len(runs) == 1:
            out_dir, report = Path(out), Path(out) / REPORT_FILE
        else:
            sub = run.name if names.count(run.name) == 1 else f"{run.name}-{names.index(run.name)}"
            out_dir = Path(out) / sub
            report = out_dir / REPORT_FILE
        plots = pictures.plot_run(run, out_dir)
        monitor = monitor_pictures.plot_monitor(run, out_dir)
        if monitor is not None:
            plots.append(monitor)
        if scaling_plot is not None:
            plots.append(scaling_plot)
        if out is None:  # beside DeepSpeed's own events, where the run turned TensorBoard on
            export_tensorboard(run)
        row = summary_row(run)
        diag = diagnose(run)
        atomic_write_text(report, redact.redact_text(page.render_report(run, row, plots, diag)), mode=0o644)
        results.append(RunOutput(run, out_dir, report, plots, row, diag))
    return results


__all__ = ["RunData", "RunOutput", "analyse", "load_run"]
