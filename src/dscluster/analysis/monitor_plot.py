"""monitor.png: the loss and learning rate DeepSpeed's own monitor recorded (analysis/monitor.py),
for a script whose steps dscluster did not record itself. Drawn only where such series exist."""

from __future__ import annotations

from pathlib import Path

from dscluster.analysis.load import RunData
from dscluster.analysis.monitor import by_kind
from dscluster.analysis.plots import Plot, _new, _save, _title


def plot_monitor(run: RunData, out: Path) -> Plot | None:
    kinds = by_kind(run.monitor)
    if not kinds.get("loss") and not kinds.get("lr"):
        return None
    plot = Plot("monitor", out / "monitor.png", _title(run, "DeepSpeed monitor: loss and learning rate"))
    fig, (ax_l, ax_r) = _new(2)
    for ax, kind, label in ((ax_l, "loss", "loss"), (ax_r, "lr", "learning rate")):
        for tag, series in sorted(kinds.get(kind, {}).items()):
            xs, ys = [p[0] for p in series], [p[1] for p in series]
            ax.plot(xs, ys, lw=1.1, label=tag)
            plot.series[tag] = {"x": xs, "y": ys}
        if not kinds.get(kind):
            ax.text(0.5, 0.5, f"no {label} series", ha="center", va="center", transform=ax.transAxes)
            plot.notes.append(f"no {label} series in the monitor output")
        ax.set_xlabel("step (as the monitor logged it: DeepSpeed's engine counts samples)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if kinds.get(kind):
            ax.legend(fontsize=8)
    return _save(fig, plot, not run.completed)
