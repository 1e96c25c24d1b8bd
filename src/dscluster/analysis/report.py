"""report.html: one self-contained page (PNGs base64-embedded) a user can mail or archive.

The summary table comes first because it answers "did it work and how fast" before any
picture; diagnose findings follow so a broken run says why on the same page.
"""

from __future__ import annotations

import base64
import html
import time
from pathlib import Path
from typing import Any

from dscluster.analysis.gpusplit import busy_but_waiting_words, gpu_views
from dscluster.analysis.load import RunData
from dscluster.analysis.plots import Plot
from dscluster.analysis.stats import rank_stats

_CSS = """
body{font-family:system-ui,sans-serif;margin:2em;max-width:1100px;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 10px;text-align:left}
th{background:#f3f3f3}.bad{color:#b00020;font-weight:bold}.ok{color:#1b7f3b;font-weight:bold}
.warn{background:#fff4e5;border-left:4px solid #e69500;padding:8px 12px;margin:1em 0}
img{max-width:100%;border:1px solid #eee;margin:0.5em 0}figcaption{font-size:0.9em;color:#555}
"""


STEADY_LABEL = "throughput, steady (images/s; warm-up steps and final evaluation out)"
SHORT_RUN = " (over every step: the run was too short to leave out its warm-up)"
WHOLE_RUN_LABEL = "throughput, whole run (images/s; first step to end, all in)"

def _fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    if isinstance(v, (list, tuple)):
        return ", ".join(map(str, v)) if v else "none"
    return str(v)


def summary_table_rows(row: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) pairs of the summary table; also what tests check."""
    acc = row["accuracy"]
    if isinstance(acc, float) and acc <= 1.0:
        acc = 100.0 * acc
    rate = row["overflow_rate"]
    return [
        ("status", _fmt(row["status"])),
        ("precision", _fmt(row["precision"])),
        ("world size (ranks)", _fmt(row["world_size"])),
        ("hosts", _fmt(row["hosts"])),
        ("optimizer steps", _fmt(row["steps"])),
        (STEADY_LABEL, _fmt(row["images_per_s"]) + (SHORT_RUN if row.get("warmup_steps") == 0 else "")),
        (WHOLE_RUN_LABEL, _fmt(row.get("run_images_per_s"))),
        ("held-out accuracy (%)", _fmt(acc)),
        ("stragglers (ranks)", _fmt(row["stragglers"])),
        ("overflow steps", f"{row['overflow_steps']} ({_fmt(None if rate is None else 100.0 * rate)}%)"),
        ("wall time (s)", _fmt(row["wall_s"])),
        *_time_to_accuracy_rows(row),
    ]


def _time_to_accuracy_rows(row: dict[str, Any]) -> list[tuple[str, str]]:
    """The headline figure of a run with a target_accuracy: when it first got there."""
    target = row.get("target_accuracy")
    if target is None:
        return []
    tta = row.get("time_to_accuracy")
    label = f"time to {100.0 * target:.1f}% held-out accuracy (s)"
    if not tta:
        return [(label, "not reached")]
    return [(label, f"{_fmt(float(tta['seconds']))} (step {tta['step']}, epoch {tta['epoch'] + 1}, "
                    f"{tta['images']:,} images)")]


def _img(plot: Plot) -> str:
    data = base64.b64encode(Path(plot.path).read_bytes()).decode("ascii")
    notes = "; ".join(plot.notes)
    return (f'<figure><img alt="{html.escape(plot.title)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{html.escape(plot.title)}{(' — ' + html.escape(notes)) if notes else ''}"
            "</figcaption></figure>")


def _pct(share: float | None) -> str:
    return "—" if share is None else f"{100 * share:.0f}"


def _gpu_table(run: RunData) -> list[str]:
    """Per GPU: NVML's utilisation beside the share of the step its ranks spent computing, waiting for
    the network and for data (analysis/gpusplit.py), and the sentence where the two disagree."""
    views = gpu_views(run)
    if not views:
        return []
    out = ["<h2>GPUs: NVML utilisation and where the step went</h2>"]
    words = busy_but_waiting_words(views)
    if words:
        out.append(f"<div class='warn' id='gpu-waiting'><b>{html.escape(words)}</b></div>")
    out.append("<table id='gpus'><tr><th>host</th><th>GPU</th><th>ranks</th><th>NVML utilisation (%)</th>"
               "<th>compute (% of step)</th><th>network wait (%)</th><th>data wait (%)</th></tr>")
    for v in views:
        out.append(f"<tr{' class=bad' if v.busy_but_waiting else ''}><td>{html.escape(v.host)}</td><td>{v.index}</td>"
                   f"<td>{_fmt(v.ranks)}</td><td>{_fmt(v.util_percent, 0)}</td><td>{_pct(v.shares.get('compute'))}</td>"
                   f"<td>{_pct(v.shares.get('comm'))}</td><td>{_pct(v.shares.get('data'))}</td></tr>")
    out.append("</table>")
    return out


def _incomplete_banner(run: RunData, row: dict[str, Any]) -> str:
    """Why the pictures stop: a cancelled run (summary.json) says at which step and how to resume."""
    e = html.escape
    summary = run.summary or {}
    if summary.get("status") == "cancelled":
        resume = summary.get("resume")
        return (f"<div class='warn'><b>This run was cancelled</b> at step {e(_fmt(summary.get('steps')))}"
                + (f"; to resume: <code>{e(resume)}</code>" if isinstance(resume, str) else "")
                + ". The pictures show what was recorded before it stopped.</div>")
    return (f"<div class='warn'><b>This run did not complete</b> ({e(row['status'])}). "
            "The pictures show what was recorded before it stopped.</div>")


def render_report(run: RunData, row: dict[str, Any], plots: list[Plot], diagnosis: dict[str, Any]) -> str:
    e = html.escape
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>dscluster run {e(run.name)}</title>"
             f"<style>{_CSS}</style></head><body>",
             f"<h1>Run {e(run.name)}</h1>",
             f"<p>Run directory: <code>{e(str(run.path))}</code> · report written "
             f"{e(time.strftime('%Y-%m-%d %H:%M:%S'))}</p>"]
    if not run.completed:
        parts.append(_incomplete_banner(run, row))
    parts.append("<h2>Summary</h2><table id='summary'>")
    for label, value in summary_table_rows(row):
        cls = ""
        if label == "status":
            cls = " class='ok'" if row["completed"] else " class='bad'"
        parts.append(f"<tr><th>{e(label)}</th><td{cls}>{e(value)}</td></tr>")
    parts.append("</table>")
    stats = rank_stats(run)
    if stats:
        parts.append("<h2>Ranks</h2><table id='ranks'><tr><th>rank</th><th>host</th><th>steps</th>"
                     "<th>last step</th><th>median step time (s)</th><th>p90 step time (s)</th>"
                     "<th>samples/s</th><th>status</th></tr>")
        for s in stats:
            straggler = s.rank in row["stragglers"]
            parts.append(
                f"<tr{' class=bad' if straggler else ''}><td>{s.rank}{' (straggler)' if straggler else ''}</td>"
                f"<td>{e(_fmt(s.host))}</td><td>{s.steps}</td><td>{_fmt(s.last_step)}</td>"
                f"<td>{_fmt(s.median_step_time, 3)}</td><td>{_fmt(s.p90_step_time, 3)}</td>"
                f"<td>{_fmt(s.samples_per_s)}</td><td>{e(s.status)}</td></tr>")
        parts.append("</table>")
    parts.extend(_gpu_table(run))
    findings = diagnosis.get("findings", [])
    parts.append("<h2>Diagnosis</h2>")
    if findings:
        parts.append("<ul id='findings'>")
        for f in findings:
            parts.append(f"<li class='{'bad' if f['severity'] == 'error' else ''}'>{e(f['severity'])}: "
                         f"{e(f['message'])}</li>")
        parts.append("</ul>")
    else:
        parts.append("<p class='ok'>No problems found: every rank finished, same step, same environment.</p>")
    if run.problems:
        parts.append("<h3>Unreadable files</h3><ul>" + "".join(f"<li>{e(p)}</li>" for p in run.problems) + "</ul>")
    parts.append("<h2>Pictures</h2>")
    parts.extend(_img(p) for p in plots if Path(p.path).exists())
    parts.append("</body></html>\n")
    return "\n".join(parts)
