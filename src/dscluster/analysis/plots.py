"""The run's pictures, drawn with matplotlib's object API (Agg, no pyplot global state).

Every plot function returns a `Plot` holding the path it wrote and the series it drew (label → x/y lists),
so tests can check a picture shows what it must without reading pixels, and a panel that has nothing to
show says why in words instead of staying blank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
from matplotlib import colormaps  # noqa: E402
from matplotlib.colors import to_hex, to_rgb  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from dscluster import core
from dscluster.analysis.gpusplit import busy_but_waiting_words, gpu_views  # noqa: E402
from dscluster.analysis.load import RunData  # noqa: E402
from dscluster.analysis.monitor import by_kind  # noqa: E402
from dscluster.analysis.stats import (  # noqa: E402
    COMM_BOUND_SHARE,
    SPLIT_PARTS,
    comm_share,
    find_stragglers,
    rank_stats,
    step_split,
    summary_row,
    time_to_accuracy,
)
from dscluster.telemetry.backends import SLOWDOWN_REASONS  # noqa: E402

DPI = 80
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf", "#d62728"]
STRAGGLER_COLOUR = "#d62728"
HOST_FAMILIES = ["Blues", "Oranges", "Greens", "Purples", "Greys", "YlOrBr", "PuRd", "BuGn", "RdPu", "GnBu"]
"""One colour family per node; its ranks (or GPUs) take distinct shades of it. No reds: red marks stragglers."""


@dataclass
class Plot:
    name: str
    path: Path
    title: str
    series: dict[str, dict[str, list[Any]]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    """What the picture says in words: 'not fp16', 'no GPU data', 'run did not complete'."""


def host_colours(run: RunData) -> dict[str, str]:
    """Each node's colour family (a matplotlib colormap name), stable across all of a run's plots."""
    hosts = sorted({h for h in (r.host for r in run.ranks.values()) if h} | set(run.telemetry))
    return {h: HOST_FAMILIES[i % len(HOST_FAMILIES)] for i, h in enumerate(hosts)}


def shade(family: str | None, k: int, n: int) -> str:
    """The k-th of n distinct shades of a node's family, dark to light (hex)."""
    if family is None:
        return "#333333"
    level = 0.8 if n <= 1 else 0.9 - 0.5 * k / (n - 1)
    return to_hex(colormaps[family](level))


def _rank_style(run: RunData, rank: int, colours: dict[str, str]) -> tuple[str, str, str]:
    """(the rank's own shade of its node's colour family, line style, legend label)."""
    host = run.ranks[rank].host
    same_node = sorted(r for r in run.ranks if run.ranks[r].host == host)
    return shade(colours.get(host), same_node.index(rank), len(same_node)), "-", f"rank {rank} ({host or '?'})"


def _title(run: RunData, what: str) -> str:
    suffix = "" if run.completed else " — run did not complete"
    return f"{run.name}: {what}{suffix}"


def _new(ncols: int = 1, width: float = 10.0, height: float = 3.8) -> tuple[Figure, list]:
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, list(axes)


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=11, wrap=True)
    ax.set(xticks=[], yticks=[])


def _save(fig: Figure, plot: Plot, incomplete: bool) -> Plot:
    if incomplete:
        plot.notes.append("run did not complete: showing what was recorded")
    fig.suptitle(plot.title, fontsize=11)
    plot.path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(plot.path, dpi=DPI)
    return plot


def plot_utilisation(run: RunData, out: Path) -> Plot:
    """GPU utilisation and memory per node over time, or CPU/RAM when no node has a GPU. Each GPU's
    legend gives its ranks' measured step split (analysis/gpusplit.py); where NVML says busy and the
    split says waiting for the network, the picture says so in words."""
    gpu = any(h.has_gpu for h in run.telemetry.values())
    what = "GPU utilisation and memory per node" if gpu else "CPU utilisation and RAM per node (no GPU data)"
    plot = Plot("utilisation", out / "utilisation.png", _title(run, what))
    fig, (ax_u, ax_m) = _new(2)
    colours, t0 = host_colours(run), run.t0 or 0.0
    if not run.telemetry:
        plot.notes.append("no telemetry files")
        _empty(ax_u, "no telemetry/*.jsonl in this run")
        _empty(ax_m, "no telemetry/*.jsonl in this run")
        return _save(fig, plot, not run.completed)
    views = {(v.host, v.index): v for v in gpu_views(run)} if gpu else {}
    for host in sorted(run.telemetry):
        samples = run.telemetry[host].samples
        if gpu:
            indices = sorted({g["index"] for s in samples for g in s["gpus"]})
            for k, idx in enumerate(indices):
                pts = [(s["t"] - t0, g) for s in samples for g in s["gpus"] if g["index"] == idx]
                xs = [p[0] for p in pts]
                util = [p[1].get("util_percent") for p in pts]
                mem = [(p[1].get("mem_used_mb") or 0) / 1024 for p in pts]
                split = views[(host, idx)].label() if (host, idx) in views else ""
                label, colour = f"{host} GPU{idx}", shade(colours[host], k, len(indices))
                ax_u.plot(xs, util, color=colour, label=f"{label} ({split})" if split else label)
                ax_m.plot(xs, mem, color=colour, label=label)
                plot.series[f"util {label}"] = {"x": xs, "y": util}
                plot.series[f"mem {label}"] = {"x": xs, "y": mem}
        else:
            xs = [s["t"] - t0 for s in samples]
            cpu = [s.get("cpu_percent") for s in samples]
            ram = [(s.get("ram_used_mb") or 0) / 1024 for s in samples]
            ax_u.plot(xs, cpu, color=shade(colours[host], 0, 1), label=host)
            ax_m.plot(xs, ram, color=shade(colours[host], 0, 1), label=host)
            plot.series[f"cpu {host}"] = {"x": xs, "y": cpu}
            plot.series[f"ram {host}"] = {"x": xs, "y": ram}
    if not gpu:
        plot.notes.append("no GPU data: CPU and RAM shown")
    waiting = busy_but_waiting_words(list(views.values()))
    if waiting:  # NVML's "busy" includes kernels that wait for the network: say what the split measured
        plot.notes.append(waiting)
        ax_u.set_title(waiting.split(":")[0], fontsize=9, color="#b00020")
    ax_u.set_ylabel("GPU utilisation (%)" if gpu else "CPU utilisation (% of all cores)")
    ax_m.set_ylabel("GPU memory used (GiB)" if gpu else "RAM used (GiB)")
    ax_u.set_ylim(0, 105)
    for ax in (ax_u, ax_m):
        ax.set_xlabel("time since run start (s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    return _save(fig, plot, not run.completed)


def plot_throughput(run: RunData, out: Path) -> Plot:
    """Samples/s per rank over steps, and each rank's step-time distribution; the straggler is red."""
    stats = rank_stats(run)
    stragglers = find_stragglers(stats)
    plot = Plot("throughput", out / "throughput.png", _title(run, "throughput and step time per rank"))
    fig, (ax_t, ax_b) = _new(2)
    colours = host_colours(run)
    if not any(r.steps for r in run.ranks.values()):
        plot.notes.append("no step records")
        _empty(ax_t, "no step records in metrics/rank-*.jsonl")
        _empty(ax_b, "no step records")
        return _save(fig, plot, not run.completed)
    box_data = []
    box_labels = []
    box_colours = []
    for rank in sorted(run.ranks):
        steps = run.ranks[rank].steps
        colour, ls, label = _rank_style(run, rank, colours)
        xs = [s["step"] for s in steps if s.get("samples_per_s") is not None]
        ys = [s["samples_per_s"] for s in steps if s.get("samples_per_s") is not None]
        ax_t.plot(xs, ys, color=colour, ls=ls, label=label + (" — straggler" if rank in stragglers else ""),
                  lw=2.2 if rank in stragglers else 1.3)
        plot.series[f"samples_per_s {label}"] = {"x": xs, "y": ys}
        steady = steps[core.WARMUP_STEPS:] or steps
        times = [s["step_time"] for s in steady if isinstance(s.get("step_time"), (int, float))]
        if times:
            box_data.append(times)
            box_labels.append(f"r{rank}\n{run.ranks[rank].host or '?'}")
            box_colours.append(STRAGGLER_COLOUR if rank in stragglers else colour)
            plot.series[f"step_time {label}"] = {"x": list(range(len(times))), "y": times}
    ax_t.set_xlabel("optimizer step")
    ax_t.set_ylabel("samples/s (this rank)")
    ax_t.grid(alpha=0.3)
    ax_t.legend(fontsize=8, loc="best")
    if box_data:
        bp = ax_b.boxplot(box_data, patch_artist=True, showfliers=True)
        ax_b.set_xticks(range(1, len(box_labels) + 1), box_labels, fontsize=8)
        for patch, c in zip(bp["boxes"], box_colours, strict=True):
            patch.set_facecolor(c)
            patch.set_alpha(0.6)
    ax_b.set_ylabel("step time (s)")
    ax_b.set_title(f"wall-clock step time per rank (first {core.WARMUP_STEPS} steps excluded)" + (
        f"; straggler: rank {', '.join(map(str, stragglers))}" if stragglers else "; no straggler"), fontsize=9)
    ax_b.grid(alpha=0.3, axis="y")
    plot.notes.append(f"stragglers: {stragglers}" if stragglers else "no straggler")
    return _save(fig, plot, not run.completed)


def plot_loss(run: RunData, out: Path) -> Plot:
    """Training loss per rank and held-out accuracy over optimizer steps."""
    plot = Plot("loss", out / "loss.png", _title(run, "training loss and held-out accuracy"))
    fig, (ax,) = _new(1, width=8.0)
    colours = host_colours(run)
    for rank in sorted(run.ranks):
        steps = [s for s in run.ranks[rank].steps if isinstance(s.get("loss"), (int, float))]
        if not steps:
            continue
        colour, ls, label = _rank_style(run, rank, colours)
        xs, ys = [s["step"] for s in steps], [s["loss"] for s in steps]
        ax.plot(xs, ys, color=colour, ls=ls, lw=1.1, label=f"loss {label}")
        plot.series[f"loss {label}"] = {"x": xs, "y": ys}
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (cross-entropy)")
    ax.grid(alpha=0.3)
    evals = [e for e in run.evals() if isinstance(e.get("accuracy"), (int, float))]
    ax2 = ax.twinx()
    if evals:
        xs = [e.get("step") for e in evals]
        ys = [100.0 * e["accuracy"] if e["accuracy"] <= 1.0 else e["accuracy"] for e in evals]
        ax2.plot(xs, ys, "o-", color="black", label="held-out accuracy")
        ax2.annotate(f"{ys[-1]:.1f}%", (xs[-1], ys[-1]), textcoords="offset points", xytext=(-10, 6), fontsize=9)
        plot.series["held-out accuracy"] = {"x": xs, "y": ys}
    else:
        plot.notes.append("no held-out evaluation recorded")
    _mark_target(ax2, plot, time_to_accuracy(run))
    ax2.set_ylabel("held-out accuracy (%)")
    ax2.set_ylim(0, 100)
    if not plot.series:
        monitored = "loss" in by_kind(run.monitor)
        plot.notes.append("no step records: the loss DeepSpeed's monitor recorded is in monitor.png"
                          if monitored else "no loss records")
        _empty(ax, "no step records with a loss" + (" (see monitor.png)" if monitored else ""))
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    if lines[0] or lines2[0]:
        ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=8, loc="center right")
    return _save(fig, plot, not run.completed)


def _mark_target(ax, plot: Plot, tta: dict) -> None:
    """target_accuracy as a dashed line, and the step it was first reached (time to accuracy)."""
    if tta["target_accuracy"] is None:
        return
    y = 100.0 * tta["target_accuracy"]
    ax.axhline(y, color="tab:green", ls="--", lw=1, label=f"target {y:.1f}%")
    got = tta["time_to_accuracy"]
    if got:
        ax.axvline(got["step"], color="tab:green", ls=":", lw=1)
        ax.annotate(f"reached after {got['seconds']:.1f} s", (got["step"], y), textcoords="offset points",
                    xytext=(4, -14), fontsize=9, color="tab:green")
        plot.notes.append(f"target {y:.1f}% reached at step {got['step']}, {got['seconds']:.1f} s")
    else:
        plot.notes.append(f"target {y:.1f}% not reached")


def plot_loss_scale(run: RunData, out: Path) -> Plot:
    """fp16 dynamic loss scale over steps with overflow (skipped) steps marked."""
    plot = Plot("loss_scale", out / "loss_scale.png", _title(run, "fp16 loss scale and overflow steps"))
    fig, (ax,) = _new(1, width=8.0)
    rank = next((r for r in sorted(run.ranks) if run.ranks[r].steps), None)
    steps = run.ranks[rank].steps if rank is not None else []
    scaled = [s for s in steps if isinstance(s.get("loss_scale"), (int, float))]
    overflow = [s for s in steps if s.get("overflow")]
    if run.precision != "fp16" or not scaled:
        why = f"not fp16 (precision: {run.precision or 'unknown'}): no dynamic loss scaling"
        if run.precision == "fp16":
            why = "fp16, but no loss_scale values were recorded"
        plot.notes.append(why)
        _empty(ax, f"{why}\noverflow/skipped steps: {len(overflow)} of {len(steps)}")
        return _save(fig, plot, not run.completed)
    xs, ys = [s["step"] for s in scaled], [s["loss_scale"] for s in scaled]
    ax.step(xs, ys, where="post", color=PALETTE[0], label=f"loss scale (rank {rank})")
    plot.series["loss_scale"] = {"x": xs, "y": ys}
    if overflow:
        ox = [s["step"] for s in overflow]
        oy = [s.get("loss_scale") or ys[0] for s in overflow]
        ax.plot(ox, oy, "x", color=STRAGGLER_COLOUR, ms=8, mew=2, label=f"overflow, step skipped ({len(ox)})")
        plot.series["overflow"] = {"x": ox, "y": oy}
    ax.set_yscale("log", base=2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss scale (log2)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    plot.notes.append(f"{len(overflow)} overflow steps of {len(steps)}")
    return _save(fig, plot, not run.completed)


def plot_gpu_health(run: RunData, out: Path) -> Plot:
    """Temperature and power per GPU over time, slowdown (throttle) events marked."""
    plot = Plot("gpu_health", out / "gpu_health.png", _title(run, "GPU temperature, power and throttling"))
    fig, (ax_t, ax_p) = _new(2)
    if not any(h.has_gpu for h in run.telemetry.values()):
        backends = sorted({h.backend for h in run.telemetry.values()}) or ["no telemetry"]
        plot.notes.append("no GPU data")
        for ax in (ax_t, ax_p):
            _empty(ax, f"no GPU data (telemetry backend: {', '.join(backends)})")
        return _save(fig, plot, not run.completed)
    colours, t0 = host_colours(run), run.t0 or 0.0
    events = 0
    reasons: dict[str, int] = {}
    for host in sorted(run.telemetry):
        samples = run.telemetry[host].samples
        indices = sorted({g["index"] for s in samples for g in s["gpus"]})
        for k, idx in enumerate(indices):
            pts = [(s["t"] - t0, g) for s in samples for g in s["gpus"] if g["index"] == idx]
            label, colour = f"{host} GPU{idx}", shade(colours[host], k, len(indices))
            xs = [p[0] for p in pts]
            temp = [p[1].get("temp_c") for p in pts]
            power = [p[1].get("power_w") for p in pts]
            ax_t.plot(xs, temp, color=colour, label=label)
            ax_p.plot(xs, power, color=colour, label=label)
            plot.series[f"temp {label}"] = {"x": xs, "y": temp}
            plot.series[f"power {label}"] = {"x": xs, "y": power}
            thr = [(x, g, sorted(set(g.get("throttle_reasons") or []) & SLOWDOWN_REASONS)) for x, g in pts]
            thr = [(x, g, r) for x, g, r in thr if r]
            for _, _, rs in thr:
                for r in rs:
                    reasons[r] = reasons.get(r, 0) + 1
            if thr:
                events += len(thr)
                ax_t.plot([x for x, _, _ in thr], [g.get("temp_c") or 0 for _, g, _ in thr], "v",
                          color=STRAGGLER_COLOUR, ms=6)
                plot.series[f"throttle {label}"] = {"x": [x for x, _, _ in thr], "y": [r for _, _, r in thr]}
    ax_t.set_ylabel("GPU temperature (°C)")
    ax_p.set_ylabel("GPU power (W)")
    for ax in (ax_t, ax_p):
        ax.set_xlabel("time since run start (s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    counted = ", ".join(f"{r} ×{n}" for r, n in sorted(reasons.items())) or "none"
    ax_t.set_title(f"▼ samples with a slowdown reason: {events} ({counted})", fontsize=9)
    plot.notes.append(f"{events} throttle (slowdown) samples")
    return _save(fig, plot, not run.completed)


SPLIT_STYLE = {"compute_s": ("compute", 0.0, ""), "comm_s": ("waiting for the network", 0.35, "///"),
               "average_s": ("averaging the models (sync.mode)", 0.2, "\\\\"), "data_s": ("waiting for data", 0.6,
               "..."), "other_s": ("between steps (eval, checkpoints, logs)", 0.8, "xx")}
"""Each part of a step: legend label, how much lighter than the rank's own shade, hatch."""
SMOOTH = 10
"""Steps in the running mean of the network share over the run (single CPU steps are noisy)."""


def _lighter(colour: str, amount: float) -> str:
    return to_hex([c + (1 - c) * amount for c in to_rgb(colour)])


def plot_step_split(run: RunData, out: Path) -> Plot:
    """Where each rank's step time went (measured, core/split.py): stacked bars per rank, and the share
    of each step spent waiting for the network over the run. A communication-bound run shows at once."""
    plot = Plot("step_split", out / "step_split.png", _title(run, "step time: compute, network, data per rank"))
    fig, (ax_b, ax_t) = _new(2)
    splits = step_split(run)
    if not splits:
        plot.notes.append("no step split recorded")
        for ax in (ax_b, ax_t):
            _empty(ax, "no compute_s/comm_s/data_s in the step records\n(a run of an older dscluster)")
        return _save(fig, plot, not run.completed)
    colours = host_colours(run)
    xs = list(range(len(splits)))
    bottoms = [0.0] * len(splits)
    averaged = all("average_s" in s.seconds for s in splits)  # sync.mode: drawn apart from the rest of comm
    for part in [*SPLIT_PARTS[:2], "average_s", *SPLIT_PARTS[2:]] if averaged else SPLIT_PARTS:
        label, light, hatch = SPLIT_STYLE[part]
        heights = [(s.seconds.get(part) or 0.0) - (s.seconds["average_s"] if averaged and part == "comm_s" else 0.0)
                   for s in splits]
        faces = [_lighter(_rank_style(run, s.rank, colours)[0], light) for s in splits]
        ax_b.bar(xs, heights, bottom=bottoms, color=faces, hatch=hatch, edgecolor="#444444", linewidth=0.6)
        ax_b.bar([0], [0], color="#dddddd", hatch=hatch, edgecolor="#444444", label=label)  # legend swatch only
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    for s, x, top in zip(splits, xs, bottoms, strict=True):
        share = s.comm_share
        text = "network\nnot measured" if share is None else f"{share:.0%}\nnetwork"
        ax_b.annotate(text, (x, top), textcoords="offset points", xytext=(0, 3), ha="center", fontsize=8,
                      color=STRAGGLER_COLOUR if share is not None and share > COMM_BOUND_SHARE else "black")
        colour, _, label = _rank_style(run, s.rank, colours)
        plot.series[f"split {label}"] = {"x": list(SPLIT_PARTS), "y": [s.seconds.get(p) for p in SPLIT_PARTS],
                                         "colour": [colour], "average_s": s.seconds.get("average_s")}
    ax_b.set_xticks(xs, [f"r{s.rank}\n{s.host or '?'}" for s in splits], fontsize=8)
    ax_b.set(ylabel="seconds per step (mean after warm-up)", ylim=(0, max(bottoms) * 1.25 or 1))
    ax_b.grid(alpha=0.3, axis="y")
    ax_b.legend(fontsize=7, loc="upper left")
    for s in splits:
        steps = [r for r in run.ranks[s.rank].steps if isinstance(r.get("comm_s"), (int, float))
                 and isinstance(r.get("step_time"), (int, float)) and r["step_time"] > 0]
        colour, ls, label = _rank_style(run, s.rank, colours)
        raw = [100.0 * r["comm_s"] / r["step_time"] for r in steps]
        sx = [r["step"] for r in steps]
        sy = [sum(raw[max(0, i - SMOOTH + 1):i + 1]) / len(raw[max(0, i - SMOOTH + 1):i + 1]) for i in range(len(raw))]
        ax_t.plot(sx, sy, color=colour, ls=ls, lw=1.3, label=label)
        plot.series[f"comm_share {label}"] = {"x": sx, "y": sy}
    ax_t.axhline(100 * COMM_BOUND_SHARE, color="#7f7f7f", ls="--", lw=1,
                 label=f"{COMM_BOUND_SHARE:.0%}: cannot scale 80%")
    ax_t.set(xlabel="optimizer step", ylabel=f"waiting for the network (% of step, mean of {SMOOTH})", ylim=(0, 100))
    ax_t.grid(alpha=0.3)
    ax_t.legend(fontsize=7, loc="best")
    share = comm_share(splits)
    if share is None:
        plot.notes.append("communication not measured (one rank, or DeepSpeed reduced without DDP hooks)")
    elif share > COMM_BOUND_SHARE:
        plot.notes.append(f"communication-bound: {share:.0%} of step time waiting for the network")
    else:
        plot.notes.append(f"{share:.0%} of step time waiting for the network")
    return _save(fig, plot, not run.completed)


def plot_scaling(runs: list[RunData], out: Path) -> Plot:
    """Images/s against GPU (rank) count with the ideal line from the smallest run."""
    plot = Plot("scaling", out / "scaling.png", "scaling: images/s against GPU (rank) count")
    fig, (ax,) = _new(1, width=7.0, height=4.2)
    points = []
    for run in runs:
        row = summary_row(run)
        if row["world_size"] and row["images_per_s"]:
            points.append((int(row["world_size"]), float(row["images_per_s"]), run.name))
    if len({p[0] for p in points}) < 2:
        plot.notes.append("needs runs with at least two different world sizes")
        _empty(ax, "scaling needs runs with at least two different GPU/rank counts\n"
                   "(pass several RUN_DIRs: python analysis/plot.py runs/a runs/b)")
        return _save(fig, plot, False)
    points.sort()
    n0, r0 = points[0][0], points[0][1]
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    ideal_x = sorted(set(xs))
    ideal = [r0 * n / n0 for n in ideal_x]
    ax.plot(ideal_x, ideal, "--", color="#7f7f7f", label=f"ideal (linear from {n0} rank{'s' if n0 > 1 else ''})")
    ax.plot(xs, ys, "o-", color=PALETTE[0], label="measured")
    eff = [100.0 * y / (r0 * x / n0) for x, y in zip(xs, ys, strict=True)]
    for x, y, e in zip(xs, ys, eff, strict=True):
        ax.annotate(f"{e:.0f}%", (x, y), textcoords="offset points", xytext=(4, -12), fontsize=9)
    plot.series["measured"] = {"x": xs, "y": ys}
    plot.series["ideal"] = {"x": ideal_x, "y": ideal}
    plot.series["efficiency_percent"] = {"x": xs, "y": eff}
    ax.set_xlabel("GPUs (ranks)")
    ax.set_ylabel("throughput, steady (images/s)")
    ax.set_xticks(ideal_x)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, plot, False)


RUN_PLOTS = (plot_utilisation, plot_throughput, plot_step_split, plot_loss, plot_loss_scale, plot_gpu_health)


def plot_run(run: RunData, out: Path) -> list[Plot]:
    return [fn(run, out) for fn in RUN_PLOTS]
