"""plan's saved predictions: `dscluster plan` writes them, `dscluster train` measures against them.

<state>/plans.json, written atomically: one entry per setting, keyed by what decides its figure
(`key`: model, micro-batch, global batch, precision, compression, ranks); the outcomes runs measured
against them; the compute figures plan measured (`figures`, by core's `probe_key`). Its layout and
why it is so: docs/plan.md, "plans.json".

`calibration` turns outcomes into seconds added per optimizer step, never a factor: what the model
misses is paid once a step, whatever the accumulation. Each outcome keeps the compute figure its
model step was made with, and corrections apply to the model's own step, so they never compound.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

from dscluster.errors import UsageError
from dscluster.files import state
from dscluster.files.filemodel import NUMBER, load_state_file
from dscluster.files.fsutil import atomic_write_json
from dscluster.runmodel import phases

PLANS_FILE = "plans.json"
SCHEMA = 1
MAX_OUTCOMES = 50
FEW_PLAIN = 0.1
"""A run whose timed steps were at most this share plain (PowerSGD not yet started) calibrates its
compression with the whole difference, spread over its compressed steps."""


def key(*, model: str, micro_batch: int, global_batch: int, precision: str, compression: str, ranks: int) -> str:
    return (f"model={model} micro_batch={micro_batch} global_batch={global_batch} precision={precision} "
            f"compression={compression} ranks={ranks}")


def path(env=None) -> Path:
    return state.state_dir(env) / PLANS_FILE


# plans.json's fields and their types (dscluster.files.filemodel: absent or null is "not known").
FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "schema": (int,), "plans": (dict,), "plans{}": (dict,), "plans{}.images_per_s": NUMBER, "plans{}.step_s": NUMBER,
    "plans{}.setting": (str,), "plans{}.model_step_s": NUMBER, "plans{}.created": NUMBER, "plans{}.config": (str,),
    "plans{}.hostfile": (str,), "plans{}.busbw_GBps": NUMBER, "plans{}.compute_s": NUMBER,
    "plans{}.overrides": (list,), "plans{}.overrides[]": (str,), "outcomes": (list,), "outcomes[]": (dict,),
    "outcomes[].key": (str,), "outcomes[].model": (str,), "outcomes[].precision": (str,),
    "outcomes[].compression": (str,), "outcomes[].ranks": (int,), "outcomes[].model_step_s": NUMBER,
    "outcomes[].measured_step_s": NUMBER, "outcomes[].run_id": (str,), "outcomes[].at": NUMBER,
    "plans{}.time_to_accuracy_s": NUMBER, "plans{}.target_accuracy": NUMBER,
}


class PlansFileError(UsageError):
    """plans.json exists but is damaged (the message names the file, the field and the fix)."""


def _read_doc(p: Path) -> tuple[dict, list]:
    """(plans, outcomes) of plans.json, validated like user input: none yet is ({}, []), a damaged
    file raises PlansFileError (never replaced silently: it holds the lab's calibration)."""
    fix = f"delete {p} (it only caches predictions and their outcomes) and re-run `dscluster plan`"
    doc = load_state_file(p, FIELD_TYPES, fix, PlansFileError) or {}
    return doc.get("plans") or {}, list(doc.get("outcomes") or [])


def _read(p: Path) -> dict:
    return _read_doc(p)[0]


def save(entries: dict[str, dict], env=None) -> Path:
    """Merge `entries` (KEY → entry) into plans.json, atomically; a damaged file raises PlansFileError."""
    p = path(env)
    plans, outcomes = _read_doc(p)
    now = time.time()
    plans.update({k: {**v, "created": v.get("created", now)} for k, v in entries.items()})
    return atomic_write_json(p, {"schema": SCHEMA, "plans": plans, "outcomes": outcomes, "figures": _figures(p)})


def record(cmp: dict, *, model: str, precision: str, compression: str, ranks: int, global_batch: int,
           run_id: str, env=None) -> None:
    """Keep a run's comparison (`compare`) as an outcome, atomically."""
    model_step = cmp.get("model_step_s")
    if not isinstance(model_step, (int, float)) or model_step <= 0:
        return
    plain, steps = cmp.get("timed_plain_steps", 0), cmp.get("timed_steps", 0)
    # plain and compressed steps mixed: the step difference belongs to neither alone, unless the plain
    # ones are few (PowerSGD from step 30 of hundreds): then the compressed steps own it
    mixed = 0 < plain < steps and plain > FEW_PLAIN * steps
    if plain and plain == steps:
        compression = "none"  # PowerSGD had not started: these were plain all-reduces
    p = path(env)
    plans, outcomes = _read_doc(p)
    entry = plans.get(cmp["key"])
    figure = entry.get("compute") if isinstance(entry, dict) else None
    measured_step = global_batch / float(cmp["measured_images_per_s"])
    if 0 < plain < steps and not mixed:
        measured_step = model_step + (measured_step - model_step) * steps / (steps - plain)
    startup = startup_of(cmp, measured_step)
    if mixed and not startup:
        return
    outcomes.append({"key": cmp["key"], "model": model, "precision": precision, "compression": compression,
                     "ranks": ranks, **({} if mixed else {"model_step_s": float(model_step),
                                                          "measured_step_s": measured_step}),
                     **startup, "run_id": run_id, "at": time.time(),
                     "compute": figure if isinstance(figure, dict) else None})
    atomic_write_json(p, {"schema": SCHEMA, "plans": plans, "outcomes": outcomes[-MAX_OUTCOMES:],
                          "figures": _figures(p)})


def startup_of(cmp: dict, measured_step_s: float) -> dict:
    """What a run measured of its whole run's first costs (compare's `measured_warmup_s` and
    `measured_cache_fill_s`): its warm-up beyond WARMUP_STEPS steady steps, its data cache's fill."""
    out = {}
    warm = cmp.get("measured_warmup_s")
    if isinstance(warm, (int, float)) and warm > 0:
        out["warmup_extra_s"] = round(max(0.0, warm - phases.WARMUP_STEPS * measured_step_s), 3)
    fill = cmp.get("measured_cache_fill_s")
    if isinstance(fill, (int, float)) and fill > 0:
        out["cache_fill_s"] = round(float(fill), 3)
    held_out = cmp.get("measured_eval_s")
    if isinstance(held_out, (int, float)) and held_out > 0:
        out["eval_s"] = round(float(held_out), 4)
    saved = cmp.get("measured_save_s")
    if isinstance(saved, (int, float)) and saved > 0:
        out["save_s"] = round(float(saved), 4)
    started = cmp.get("measured_startup_s")
    if isinstance(started, (int, float)) and started >= 0:
        out["startup_s"] = round(float(started), 3)
    return out


def startup(*, model: str, precision: str, ranks: int, plan_key: str | None = None, env=None) -> dict | None:
    """The newest run's measured first costs for this model and precision (`startup_of`): of the same
    plan key first (`same_key`: its warm-up is the setting's own), else of these ranks, else any, with
    its run id and ranks; the data cache's fill only from these ranks."""
    found = [o for o in _read_doc(path(env))[1] if (o.get("model"), o.get("precision")) == (model, precision)
             and isinstance(o.get("warmup_extra_s"), (int, float))]
    if not found:
        return None
    same = [o for o in found if o.get("ranks") == ranks]
    mine = [o for o in same if plan_key is not None and o.get("key") == plan_key]
    o = (mine or same or found)[-1]
    held_out, started, saved = ((o.get(k) if mine and isinstance(o.get(k), (int, float)) else None)
                                for k in ("eval_s", "startup_s", "save_s"))
    return {"warmup_extra_s": float(o["warmup_extra_s"]), "run_id": o.get("run_id"), "ranks": o.get("ranks"),
            "same_key": bool(mine), "eval_s": held_out, "startup_s": started, "save_s": saved,
            "cache_fill_s": o.get("cache_fill_s") if same and isinstance(o.get("cache_fill_s"), (int, float)) else None}


def calibration(*, model: str, precision: str, ranks: int, env=None) -> dict[str, dict]:
    """{compression: {"extra_s": median measured − modelled step, "runs": n, "compute": figure}} from
    the outcomes of this model, precision and rank count: those made against the compute figure of
    the newest one (a difference holds only with the figure it was taken against)."""
    by: dict[str, list[tuple[float, dict | None]]] = {}
    for o in _read_doc(path(env))[1]:
        if (o.get("model"), o.get("precision"), o.get("ranks")) != (model, precision, ranks):
            continue
        try:
            measured, model_step = float(o["measured_step_s"]), float(o["model_step_s"])
        except (KeyError, TypeError, ValueError):
            continue
        figure = o.get("compute") if isinstance(o.get("compute"), dict) else None
        if measured > 0 and model_step > 0 and math.isfinite(measured) and math.isfinite(model_step):
            by.setdefault(str(o.get("compression")), []).append((measured - model_step, figure))
    out = {}
    for c, rows in sorted(by.items()):
        newest = rows[-1][1]
        extra = [x for x, figure in rows if figure == newest]
        out[c] = {"extra_s": statistics.median(extra), "runs": len(extra), "compute": newest}
    return out


def _figures(p: Path) -> dict[str, dict]:
    try:
        figures = json.loads(p.read_text(encoding="utf-8")).get("figures")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return {}
    return {k: v for k, v in figures.items() if isinstance(v, dict)} if isinstance(figures, dict) else {}


def figure(probe_key: str, env=None) -> dict | None:
    """The compute figure measured before for this probe key (host, device, config: core/probe.py
    `probe_key`), or None."""
    found = _figures(path(env)).get(probe_key)
    return found if isinstance(found, dict) and isinstance(found.get("seconds"), (int, float)) else None


def save_figure(probe_key: str, fig: dict, env=None) -> None:
    """Keep a measured compute figure for the next plan of the same probe key, atomically."""
    p = path(env)
    plans, outcomes = _read_doc(p)
    atomic_write_json(p, {"schema": SCHEMA, "plans": plans, "outcomes": outcomes,
                          "figures": {**_figures(p), probe_key: fig}})


def lookup(plan_key: str, env=None) -> dict | None:
    entry = _read(path(env)).get(plan_key)
    return entry if isinstance(entry, dict) and isinstance(entry.get("images_per_s"), (int, float)) else None


def compare(plan_key: str, measured_images_per_s: float | None, env=None, *, run: dict | None = None) -> dict | None:
    """What summary.json keeps as `plan` when a saved prediction matches this run, else None.

    `run` ({"resumed_at", "last", "total", "epochs", "steps_per_epoch", "start_step"}: train's own
    facts) makes the prediction the one for the steps this run timed (`timed`): its uncompressed and
    compressed steps, evaluations and saves, so a 24-step run and a 3,000-step one are judged alike."""
    entry = lookup(plan_key, env)
    if entry is None or not measured_images_per_s:
        return None
    predicted = float(entry["images_per_s"])
    out: dict[str, Any] = {"predicted_step_s": entry.get("step_s"),
                           # the model's step before calibration (plans older than calibration: their step_s)
                           "model_step_s": entry.get("model_step_s", entry.get("step_s"))}
    phased = timed(entry, run) if run is not None else None
    if phased is not None:
        out.update(phased)
        predicted = out.pop("images_per_s")
    facts = run or {}
    for k in ("warmup_s", "cache_fill_s", "eval_s", "save_s", "startup_s"):
        if isinstance(facts.get(k), (int, float)):
            out[f"measured_{k}"] = round(float(facts[k]), 3)
    tta = time_to_accuracy(entry, run or {})
    return {"key": plan_key, "predicted_images_per_s": predicted, "measured_images_per_s": measured_images_per_s,
            "deviation_percent": round(100.0 * (measured_images_per_s - predicted) / predicted, 1),
            "planned_at": entry.get("created"), **out, "setting": entry.get("setting"), "file": str(path(env)),
            **({"time_to_accuracy": tta} if tta else {})}


def time_to_accuracy(entry: dict, run: dict) -> dict | None:
    """plan's time to the run's target_accuracy against the run's own (both from the data cache and the
    first step), where the saved setting predicted one for the same target."""
    predicted, target = entry.get("time_to_accuracy_s"), run.get("target_accuracy")
    if not isinstance(predicted, (int, float)) or predicted <= 0 or target != entry.get("target_accuracy"):
        return None
    measured = run.get("time_to_accuracy_s")
    return {"target": target, "predicted_s": predicted, "measured_s": measured,
            "deviation_percent": None if measured is None else round(100.0 * (measured - predicted) / predicted, 1)}


def timed(entry: dict, run: dict) -> dict | None:
    """The saved setting's prediction for the steps a run timed (runmodel/phases.py), with train's own
    steps per epoch and PowerSGD start; None for entries saved without run costs."""
    try:
        first, last = phases.timed_steps(int(run["resumed_at"]), int(run["last"]))
        means = []
        for name in ("costs", "model_costs"):
            known = {f.name for f in fields(phases.RunCosts)}
            c = phases.RunCosts(**{**{k: v for k, v in entry[name].items() if k in known},
                                   "steps_per_epoch": int(run["steps_per_epoch"]), "start_step": run.get("start_step")})
            if name == "model_costs":  # the model's step with the epoch ends this run measured: its miss is the step's
                c = phases.measured_epoch_ends(c, run.get("eval_s"), run.get("save_s"))
            means.append(phases.timed_mean_step(c, first, last, total=int(run["total"]), epochs=int(run["epochs"]),
                                                resumed_at=int(run["resumed_at"])))
        global_batch = float(entry["images_per_s"]) * float(entry["step_s"])
    except (KeyError, TypeError, ValueError, UsageError):
        return None
    step_s, model_step_s = means
    if step_s is None or model_step_s is None:
        return None
    plain = phases.plain_steps(first, last, c.start_step)
    return {"images_per_s": global_batch / step_s, "predicted_step_s": step_s, "model_step_s": model_step_s,
            "timed_steps": last - first + 1, "timed_plain_steps": plain, "phase_aware": True}


def line(cmp: dict) -> str:
    out = (f"plan predicted {cmp['predicted_images_per_s']:,.0f} img/s, measured {cmp['measured_images_per_s']:,.0f} "
           f"img/s ({cmp['deviation_percent']:+.0f}%)")
    t = cmp.get("time_to_accuracy")
    if t:
        got = ("not reached" if t["measured_s"] is None else
               f"measured {t['measured_s']:,.1f} s ({t['deviation_percent']:+.0f}%)")
        out += (f"; time to {t['target']:.1%} held-out from the first step: predicted {t['predicted_s']:,.1f} s, "
                + got)
    return out
