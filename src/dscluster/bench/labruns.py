"""What bench/gpu_lab.py reads and records, run by run: its RUN arguments, plan's recommendation over a
run's overrides, and the record of each run (summary.json's figures, rank 0's median step split,
plan's prediction and whole run) as the results file keeps it. No lab here: the script builds it.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from dscluster import core
from dscluster.files.fsutil import read_jsonl

SPLIT_KEYS = ("compute_s", "comm_s", "data_s", "other_s")


def parse_run(text: str) -> tuple[str, int, str]:
    name, nodes, overrides = (text.split(":", 2) + ["", ""])[:3]
    if not name.isidentifier() or not nodes.isdigit() or int(nodes) < 1 or "--config" not in overrides.split():
        raise SystemExit(f"run {text!r}: expected NAME:NODES:--config FILE [KEY=VALUE ...], e.g. "
                         "'b2:2:--config configs/vit_base.yaml max_steps=12'")
    return name, int(nodes), overrides


def config_of(overrides: str) -> str:
    words = overrides.split()
    return words[words.index("--config") + 1]


def with_recommendation(overrides: str, recommended: list[str]) -> list[str]:
    """The KEY=VALUE words of a run's overrides with plan's recommendation over them: plan states
    what to change from the overrides it was given, so the run keeps the others (a compression the
    run already had is not repeated in the recommendation)."""
    words = overrides.split()
    if "--config" in words:
        i = words.index("--config")
        del words[i:i + 2]
    merged = {w.split("=", 1)[0]: w for w in words if "=" in w}
    merged.update({w.split("=", 1)[0]: w for w in recommended})
    return list(merged.values())


def median_split(run_dir: Path) -> dict | None:
    try:
        steps = [r for r in read_jsonl(run_dir / "metrics" / "rank-0.jsonl") if r.get("kind") == "step"]
    except OSError:
        return None
    steps = steps[core.WARMUP_STEPS:]
    out = {}
    for k in SPLIT_KEYS:
        vals = [r[k] for r in steps if isinstance(r.get(k), (int, float))]
        out[k] = round(statistics.median(vals), 4) if vals else None
    return out


def whole_run(plan: dict, which: str = "now") -> dict | None:
    """plan's whole-run prediction: `now` for the settings the plan was given, `choice` for them with
    its recommendation pasted (the lab's run in --tta)."""
    runs = plan.get("runs") if isinstance(plan.get("runs"), dict) else {}
    got = runs.get(which) or (runs.get("now") if which == "choice" else None)
    if not got:
        return None
    return {k: got.get(k) for k in ("seconds", "images_per_s", "steady_images_per_s", "total_steps", "phases")}


def accuracy_by_compression(runs: list[dict]) -> dict:
    """Held-out accuracy per comm.compression (the run's override; "none" without one): each run's,
    their mean, and the mean's difference from none's in points."""
    groups: dict[str, list[float]] = {}
    for r in runs:
        if isinstance(r.get("accuracy"), (int, float)):
            words = dict(w.split("=", 1) for w in r["overrides"].split() if "=" in w)
            groups.setdefault(words.get("comm.compression", "none"), []).append(r["accuracy"])
    out = {k: {"accuracies": v, "accuracy": round(statistics.mean(v), 4)} for k, v in groups.items()}
    for v in out.values():
        if "none" in out:
            v["points_vs_none"] = round(100 * (v["accuracy"] - out["none"]["accuracy"]), 2)
    return out


def run_entry(name: str, nodes, ranks: int, overrides: str, rc: int, wall_s: float, run_dir: Path,
              summary: dict, plan: dict | None) -> dict:
    """One run as the results file keeps it: summary.json's figures (the steady img/s and the whole
    run's), the held-out accuracy, rank 0's median split, plan's prediction and the deviation."""
    pred = (plan or {}).get("prediction") or {}
    return {
        "name": name, "nodes": nodes, "ranks": ranks, "overrides": overrides, "rc": rc, "wall_s": round(wall_s, 1),
        "images_per_s": summary.get("images_per_s"), "run_images_per_s": summary.get("run_images_per_s"),
        "global_batch": summary.get("global_batch"), "timed_steps": summary.get("timed_steps"),
        "accuracy": summary.get("accuracy"), "median_split_rank0": median_split(run_dir),
        "plan": None if not pred or plan is None else {
            "predicted_images_per_s": pred.get("images_per_s"), "predicted_step_s": pred.get("step_s"),
            "split": {k: pred.get(k) for k in ("compute_s", "hook_s", "comm_s", "hidden_s")},
            "compute_s_per_micro": plan["compute"]["seconds"], "powersgd_s": plan.get("powersgd_s"),
            "latency_s": plan.get("latency_s"), "busbw_GBps": plan.get("busbw_GBps"),
            "calibration": plan.get("calibration"), "calibration_runs": plan.get("calibration_runs"),
            "recommended": plan["recommendation"].get("overrides"), "whole_run": whole_run(plan),
            "time_to_accuracy": plan.get("time_to_accuracy")},
        "deviation_percent": (summary.get("plan") or {}).get("deviation_percent")}
