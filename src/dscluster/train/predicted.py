"""The advisor's saved predictions: `dscluster plan` writes them, `dscluster train` measures against them.

<state>/plans.json (the state directory of state.py), written atomically, one entry per config:

    {"schema": 1,
     "plans": {KEY: {"images_per_s": float, "step_s": float, "setting": "now"|"choice"|"without_compression",
                     "created": unix time, "config": str, "hostfile": str, "busbw_GBps": float,
                     "compute_s": float, "overrides": [str]}}}

KEY names what decides the figure (`key`): model, per-rank micro-batch, global batch, precision,
gradient compression, ranks. `plan` saves its prediction for the config as given and for each
setting it recommends, so a run with the pasted overrides finds its own. At the end of a run rank 0
looks its config up and prints "plan predicted X img/s, measured Y img/s (±Z%)"; summary.json
keeps both (`plan`). A later `plan` for the same key replaces the entry.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from dscluster import state
from dscluster.fsutil import atomic_write_json

PLANS_FILE = "plans.json"
SCHEMA = 1


def key(*, model: str, micro_batch: int, global_batch: int, precision: str, compression: str, ranks: int) -> str:
    return (f"model={model} micro_batch={micro_batch} global_batch={global_batch} precision={precision} "
            f"compression={compression} ranks={ranks}")


def path(env=None) -> Path:
    return state.state_dir(env) / PLANS_FILE


def _read(p: Path) -> dict:
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    plans = doc.get("plans") if isinstance(doc, dict) else None
    return plans if isinstance(plans, dict) else {}


def save(entries: dict[str, dict], env=None) -> Path:
    """Merge `entries` (KEY → entry) into plans.json, atomically; an unreadable file is replaced."""
    p = path(env)
    plans = _read(p)
    now = time.time()
    plans.update({k: {**v, "created": v.get("created", now)} for k, v in entries.items()})
    return atomic_write_json(p, {"schema": SCHEMA, "plans": plans})


def lookup(plan_key: str, env=None) -> dict | None:
    entry = _read(path(env)).get(plan_key)
    return entry if isinstance(entry, dict) and isinstance(entry.get("images_per_s"), (int, float)) else None


def compare(plan_key: str, measured_images_per_s: float | None, env=None) -> dict | None:
    """What summary.json keeps as `plan` when a saved prediction matches this run, else None."""
    entry = lookup(plan_key, env)
    if entry is None or not measured_images_per_s:
        return None
    predicted = float(entry["images_per_s"])
    return {"key": plan_key, "predicted_images_per_s": predicted, "measured_images_per_s": measured_images_per_s,
            "deviation_percent": round(100.0 * (measured_images_per_s - predicted) / predicted, 1),
            "predicted_step_s": entry.get("step_s"), "planned_at": entry.get("created"),
            "setting": entry.get("setting"), "file": str(path(env))}


def line(cmp: dict) -> str:
    return (f"plan predicted {cmp['predicted_images_per_s']:,.0f} img/s, measured {cmp['measured_images_per_s']:,.0f} "
            f"img/s ({cmp['deviation_percent']:+.0f}%)")
