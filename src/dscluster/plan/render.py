"""`dscluster plan`'s table and notes for a terminal (the document itself: plan/document.py, docs/schemas.md)."""

from __future__ import annotations

import time

from rich import box
from rich.markup import escape
from rich.table import Table

from dscluster import console
from dscluster.plan.advice import clock
from dscluster.runmodel.phases import WARMUP_STEPS

HEADERS = ("setting", "batch", "compute", "comm", "hidden", "step", "img/s", "speed-up", "eff")


def _row(label: str, p: dict, seconds: float | None, style: str = "") -> list[str]:
    cells = [label, f"{p['global_batch']:,}", f"{p['compute_s']:.3f}", f"{p['comm_s']:.3f}", f"{p['hidden_s']:.3f}",
             f"{p['step_s']:.3f}", f"{p['images_per_s']:,.0f}", f"{p['speedup']:.2f}×", f"{p['efficiency']:.0%}",
             clock(seconds) if seconds else "-"]
    return [f"[{style}]{escape(c)}[/]" if style else escape(c) for c in cells]


def _label(what: str, o: dict) -> str:
    return f"{what}: accum {o['grad_accum']}" + (f"+{o['compression']}" if o["compression"] != "none" else "")


def alone_step(doc: dict) -> dict:
    """The fastest node alone as a table row: the config's global batch at its own img/s, nothing to send."""
    p = doc["prediction"]
    rate = p["node_images_per_s"][p["fastest_node"]]
    step = doc["global_batch"] / rate
    return {"global_batch": doc["global_batch"], "compute_s": step, "comm_s": 0.0, "hidden_s": 0.0, "step_s": step,
            "images_per_s": rate, "speedup": 1.0, "efficiency": rate / sum(p["node_images_per_s"].values())}


def step_table(doc: dict) -> Table:
    """The steps of the config as given, the advice, the faster untested settings and the node alone, each
    with what it is judged by (its whole run, or its time to the target)."""
    rec = doc["recommendation"]
    judged = rec.get("judged_by") or "whole run"
    table = Table(title=f"one optimizer step, predicted (s; speed-up over the fastest node alone), and the {judged}",
                  box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for col in (*HEADERS, judged):  # fold, never cut: print_whole widens a piped table to fit
        table.add_column(col, justify="left" if col == "setting" else "right", overflow="fold")
    table.add_row(*_row(f"now: accum {doc['grad_accum']}", doc["prediction"], rec.get("now_s")))
    if rec["choice"] and rec["overrides"]:
        table.add_row(*_row(_label("advised", rec["choice"]), rec["choice"]["prediction"], rec.get("choice_s"),
                            "green"))
    for u in rec.get("untested") or []:
        table.add_row(*_row(_label("untested", u), u["prediction"], u["seconds"], "yellow"))
    if len(doc["nodes"]) > 1:
        table.add_row(*_row(f"{doc['prediction']['fastest_node']} alone", alone_step(doc), rec.get("alone_s")))
    return table


def whole_run_line(label: str, r: dict) -> str:
    """`whole run as configured (30 epochs, 660 steps): 41 s to finish, mean 1,610 img/s, steady 1,952 img/s
    as train reports it (…); warm-up 5 steps 9.1 s (measured in run a1), …`."""
    warm = r.get("warmup") or {}

    def part(p: dict) -> str:
        text = f"{p['name']} {p['steps']:,} steps {p['seconds']:,.1f} s" if p["steps"] else \
            f"{p['name']} {p['seconds']:,.1f} s"
        return text + (f" ({warm['source']})" if p["name"] == "warm-up" and warm.get("source") else "")

    # train's end line names its figure "images/s steady (after 5 warm-up steps)": the same words, the same figure
    steady = f"{r['steady_images_per_s']:,.0f} images/s steady (after {WARMUP_STEPS} warm-up steps, as train reports it"
    if r.get("step_images_per_s") and round(r["step_images_per_s"]) != round(r["steady_images_per_s"]):
        steady += f": the epoch ends among its steps; the step alone {r['step_images_per_s']:,.0f}"
    start = r.get("startup") or {}
    before = (f"; before them, start-up {start['seconds']:,.1f} s (the process's start to its first step less the "
              f"data cache: interpreter, imports, process group, engine; {start['source']})"
              if start.get("seconds") is not None else "")
    return (f"whole run {label} ({r['epochs']} epochs, {r['total_steps']:,} steps): {clock(r['seconds'])} to finish, "
            f"mean {r['images_per_s']:,.0f} img/s from the data cache on, {steady}); "
            + ", ".join(part(p) for p in r["phases"] if p["steps"] or round(p["seconds"], 1) or p["name"] == "warm-up")
            + before)


def epoch_ends_line(r: dict) -> str | None:
    """`epoch ends: 15, each up to 1.20 s (held-out pass 0.81 s, loader restart 0.39 s; modelled), 17.6 s in the
    run; 14 of them, 16.8 s, inside the steady figure`; None where they cost nothing."""
    e = r.get("epoch_ends")
    if not e or not e["seconds"]:
        return None
    kinds = (("held-out pass", "evaluation_s"), ("checkpoint save", "save_s"), ("loader restart", "loader_restart_s"))
    parts = [f"{what} {e[k]:.2f} s" for what, k in kinds if round(e[k], 2)]
    return (f"epoch ends: {e['count']:,}, each up to {sum(e[k] for _, k in kinds):.2f} s "
            f"({', '.join(parts)}; {e.get('source') or 'modelled'}), {e['seconds']:,.1f} s in the run; "
            f"{e['in_steady']:,} of them, {e['steady_seconds']:,.1f} s, inside the steady figure")


def time_to_accuracy_line(t: dict) -> str:
    """`time to 90.0% held-out (recorded: …): with the recommendation 26.1 s (step 546), …; the lab gets there
    1.42× sooner (…)`."""
    labels = {"choice": "with the recommendation", "now": "as configured"}
    parts = []
    for key, r in sorted(t["runs"].items(), key=lambda kv: ("choice", "now", "alone").index(kv[0])):
        if r["seconds"] is not None:
            label = f"{r['node']} alone" if key == "alone" else labels[key]
            parts.append(f"{label} {clock(r['seconds'])} (step {r['step']:,})")
    verdict = ""
    if t["speedup"]:
        verdict = (f"; the lab gets there {t['speedup']:.2f}× sooner" if t["speedup"] >= 1 else
                   f"; the lab gets there later than its fastest node alone ({t['speedup']:.2f}×)")
    return (f"time to {t['target']:.1%} held-out, where the recorded runs first reached it ({t['source']}): "
            + ", ".join(parts) + verdict + " (from the data cache and the first step; start-up before them "
            "not counted)")


def render(doc: dict) -> None:
    out = console.out
    p, rec = doc["prediction"], doc["recommendation"]
    wire = (f", {doc['wire_bytes'] / 1e6:.1f} MB on the wire with {doc['compression']}"
            if doc["compression"] != "none" else "")
    out.print(escape(f"dscluster plan: {doc['model']} ({doc['params'] / 1e6:.1f} M parameters, "
                     f"{doc['grad_bytes'] / 1e6:.0f} MB of {doc['grad_format']} gradients a step{wire}) on "
                     f"{len(doc['nodes'])} node(s), {doc['world_size']} rank(s) from {doc['hostfile']}, "
                     f"{doc['precision']}"))
    c = doc["compute"]
    when = (f", {time.strftime('%Y-%m-%d %H:%M', time.localtime(c['measured_at']))}"
            if c.get("measured_at") else "")
    out.print(escape(f"inputs: all-reduce busbw {doc['busbw_GBps']:.3f} GB/s, {doc['latency_s'] * 1e3:.2f} ms "
                     f"start-up ({doc['busbw_source']}); "
                     f"{c['seconds']:.4f} s per micro-batch of {doc['micro_batch']} "
                     f"({c['source']}{', ' + c['device'] if c['device'] else ''}{when})"), style="dim")
    console.print_whole(step_table(doc))
    micro = {n["name"]: n.get("alone_micro") or doc["micro_batch"] for n in doc["nodes"]}  # what each is priced at
    alone = ", ".join(f"{k} {v:,.0f} (micro {micro[k]})" for k, v in p["node_images_per_s"].items())
    out.print(escape(f"each node alone, img/s: {alone}"), style="dim")
    colour = "red" if p["slower"] else ("green" if p["efficiency"] >= rec["target_efficiency"] else "yellow")
    out.print(f"[{colour}]verdict[/]: {escape(p['verdict'])}")
    out.print(f"recommendation: {escape(rec['summary'])}")
    alone_label = f"on {p['fastest_node']} alone"
    for key, label in (("now", "as configured"), ("choice", "with the recommendation"), ("alone", alone_label)):
        r = (doc.get("runs") or {}).get(key)
        if r and (key != "choice" or rec["overrides"]):
            out.print(escape(whole_run_line(label, r)))
            ends = epoch_ends_line(r) if key == "now" else None
            if ends:
                out.print(escape(ends))
    if doc.get("time_to_accuracy") and any(r["seconds"] for r in doc["time_to_accuracy"]["runs"].values()):
        out.print(escape(time_to_accuracy_line(doc["time_to_accuracy"])))
    if rec.get("alone_command"):
        out.print(f"train on {escape(p['fastest_node'])} alone, its README command:")
        out.print("    " + rec["alone_command"], markup=False)
    if rec["overrides"]:
        out.print("paste after ./entry_cn.sh (or dscluster train):")
        out.print("    " + " ".join(rec["overrides"]), markup=False)
    elif rec["choice"] and not rec["train_alone"]:
        out.print("nothing to change: the config as it is " + ("beats the node alone" if len(doc["nodes"]) > 1
                                                               else "is the advice"))
    for u in rec.get("untested") or []:
        out.print(escape(u["summary"]) + "; to measure it:", style="yellow")
        out.print("    " + u["command"], markup=False)
    for line in rec["pending"] + doc["notes"]:
        out.print(escape(f"note: {line}"), style="dim")
    if doc["saved_to"]:
        out.print(escape(f"saved for `dscluster train` to compare with what it measures: {doc['saved_to']}"),
                  style="dim")
    a = doc["assumptions"]
    out.print(escape(f"model: all-reduce = bytes × 2(N−1)/N ÷ busbw + start-up per bucket (3 with PowerSGD), "
                     f"once per optimizer step; up to "
                     f"{a['overlap_fraction']:.0%} of the last backward (≈{a['backward_share']:.2f} of compute) hides "
                     f"it, never the last {a['bucket_bytes'] >> 20} MiB bucket. See docs/plan.md."), style="dim")
