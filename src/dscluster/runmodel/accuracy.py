"""Time to accuracy in plan: when a run with `target_accuracy` set first reaches it, for the config as
given, for the recommendation, and for the fastest node alone.

A step model cannot say how many steps a model needs to learn; runs can. Every run that evaluates leaves
its held-out curve in <state>/curves.json, keyed by what decides it (`trajectory_key`: model, data,
optimizer and schedule, epochs, global batch; not the seed, not the nodes). plan reads the step where
the curves first reach the target and prices the run up to it with the whole-run model (phases). This
lab's curves come first, then those shipped with the presets (`SHIPPED`). The file's layout and the
rules for compressed and family curves: docs/plan.md, "Time to accuracy".
"""

from __future__ import annotations

import functools
import hashlib
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dscluster import core
from dscluster.errors import UsageError
from dscluster.files import state
from dscluster.files.filemodel import NUMBER, load_state_file
from dscluster.files.fsutil import atomic_write_json
from dscluster.runmodel import phases

CURVES_FILE = "curves.json"
SCHEMA = 1
MAX_CURVES = 200
"""Curves kept (the newest)."""
FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "schema": (int,), "curves": (list,), "curves[]": (dict,), "curves[].key": (str,), "curves[].points": (list,),
    "curves[].points[]": (list,), "curves[].compression": (str,), "curves[].ranks": (int,),
    "curves[].run_id": (str,), "curves[].at": NUMBER, "curves[].family": (str,), "curves[].length": (str,),
}
_DATA_RUN_ONLY = ("workers", "prefetch", "cache")
"""data keys that change how fast images come, not which ones: left out of the key."""


@dataclass(frozen=True)
class Shipped:
    """A curve measured on a GPU and shipped with its preset: `config` with `overrides` resolves to its key."""

    config: str
    overrides: tuple[str, ...]
    points: tuple[tuple[int, float], ...]
    what: str
    source: str
    compression: str = "none"


_SHIPPED_DOC = 'docs/advisor.md, "Shipped curves and evidence"'
"""Where each shipped curve's and each evidence line's measurement is named (results files)."""
_FRACTAL8 = ("configs/vit_small_fractal.yaml", ("epochs=8",))
SHIPPED = (
    Shipped(*_FRACTAL8,
            ((78, 0.091), (156, 0.122), (234, 0.268), (312, 0.487), (390, 0.730), (468, 0.876), (546, 0.90),
             (624, 0.9397)),
            "one H100 alone, fp16, compiled, seed 1 (epoch 7's accuracy is the target record's floor, 90 %)",
            _SHIPPED_DOC),
    Shipped(*_FRACTAL8,
            ((78, 0.082), (156, 0.191), (234, 0.247), (312, 0.548), (390, 0.701), (468, 0.857), (546, 0.914),
             (624, 0.933)),
            "one node of two H100s alone, fp16, compiled, seed 1",
            _SHIPPED_DOC),
    Shipped(*_FRACTAL8,
            ((78, 0.089), (156, 0.165), (234, 0.239), (312, 0.405), (390, 0.564), (468, 0.671)),
            "PowerSGD rank 4 from step 30, 1+1+2 H100s at 10 Gbit, seed 1, epochs 1-6 (the run was cut there)",
            _SHIPPED_DOC, "powersgd"),
    Shipped(*_FRACTAL8,
            ((78, 0.086), (156, 0.226), (234, 0.212), (312, 0.357), (390, 0.552), (468, 0.653)),
            "PowerSGD rank 4 from step 30, two 1-GPU H100 nodes at 1 Gbit, seed 1, epochs 1-6 (cut there)",
            _SHIPPED_DOC, "powersgd"),
)
_FRACTAL15 = ("configs/vit_small_fractal.yaml", ())
SHIPPED += (
    Shipped(*_FRACTAL15,
            ((78, 0.0915), (156, 0.1308), (234, 0.186), (312, 0.5078), (390, 0.6359), (468, 0.7596), (546, 0.8532),
             (624, 0.89), (702, 0.9095), (780, 0.9371), (858, 0.9481), (936, 0.9605), (1014, 0.9662), (1092, 0.9676),
             (1170, 0.9672)),
            "one H200 alone, fp16, compiled, seed 1", _SHIPPED_DOC),
    Shipped(*_FRACTAL15,
            ((78, 0.0781), (156, 0.1633), (234, 0.2098), (312, 0.1843), (390, 0.4997), (468, 0.6878), (546, 0.7626),
             (624, 0.8253), (702, 0.8866), (780, 0.9025), (858, 0.9398), (936, 0.9525), (1014, 0.9623),
             (1092, 0.9655), (1170, 0.9655)),
            "one H200 alone, fp16, compiled, seed 2", _SHIPPED_DOC),
    Shipped(*_FRACTAL15,
            ((78, 0.0935), (156, 0.1281), (234, 0.2728), (312, 0.4801), (390, 0.5745), (468, 0.7311), (546, 0.8234),
             (624, 0.8926), (702, 0.9112), (780, 0.9412), (858, 0.9522), (936, 0.9644), (1014, 0.9673),
             (1092, 0.9683), (1170, 0.9687)),
            "two 1-GPU H200 nodes at 10 Gbit, every step, seed 1", _SHIPPED_DOC),
    Shipped(*_FRACTAL15,
            ((78, 0.1036), (156, 0.2164), (234, 0.3353), (312, 0.5427), (390, 0.717), (468, 0.8215), (546, 0.8778),
             (624, 0.9156), (702, 0.9232), (780, 0.9454), (858, 0.9513), (936, 0.964), (1014, 0.9651),
             (1092, 0.9657), (1170, 0.9658)),
            "local SGD every 8 steps, two 1-GPU H200 nodes at 10 Gbit, seed 1", _SHIPPED_DOC, "local_sgd:8"),
    Shipped(*_FRACTAL15,
            ((78, 0.0963), (156, 0.1249), (234, 0.267), (312, 0.4714), (390, 0.6327), (468, 0.7719), (546, 0.8665),
             (624, 0.8834), (702, 0.9209), (780, 0.9321), (858, 0.9488), (936, 0.9559), (1014, 0.9632),
             (1092, 0.9656), (1170, 0.9658)),
            "local SGD every 8 steps, two 1-GPU H200 nodes at 10 Gbit, seed 2", _SHIPPED_DOC, "local_sgd:8"),
    Shipped(*_FRACTAL15,
            ((78, 0.0726), (156, 0.1691), (234, 0.2491), (312, 0.4516), (390, 0.6486), (468, 0.768), (546, 0.8358),
             (624, 0.8816), (702, 0.9097), (780, 0.9309), (858, 0.9404), (936, 0.9541), (1014, 0.9612),
             (1092, 0.9619), (1170, 0.9621)),
            "local SGD every 64 steps, two 1-GPU H200 nodes at 1 Gbit, seed 1", _SHIPPED_DOC, "local_sgd:64"),
)
POWERSGD_EVIDENCE = ("PowerSGD rank 4 from step 30 reached 65.3 and 67.1 % after 6 epochs of fractal ViT-S (two 1-GPU "
                     "nodes at 1 Gbit; 1+1+2 H100s at 10 Gbit), where uncompressed runs reached 87.6 and 85.7 % "
                     f"({_SHIPPED_DOC})")
FP16_EVIDENCE = ("fp16 and bf16 gradients ended within 1 point of uncompressed ones on digits, 4-rank GPU lab, 4 "
                 f"seeds ({_SHIPPED_DOC})")
SYNC_EVIDENCE = ("local SGD every 8 and every 64 steps reached 90 % at the step every-step training did (702) or "
                 "sooner, fractal ViT-S on two H200 nodes; "
                 "on digits, every 4 and 8 steps ended 0.7 and 0.8 points below every-step training, 5 seeds "
                 f"({_SHIPPED_DOC})")
TRAIL_POINTS = 0.01
"""A compression whose recorded curves end more than this below uncompressed ones at the same step
(1 point) is left out of a recommendation made for time to accuracy."""


def path(env=None) -> Path:
    return state.state_dir(env) / CURVES_FILE


def _facts(cfg, global_batch: int) -> dict:
    data = {k: v for k, v in asdict(cfg.data).items() if k not in _DATA_RUN_ONLY}
    optim = {k: v for k, v in asdict(cfg.optim).items() if k != "fused"}
    return {"model": asdict(cfg.model), "data": data, "optim": optim, "epochs": cfg.epochs,
            "max_steps": cfg.max_steps, "global_batch": global_batch}


def _digest(facts: dict) -> str:
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:12]


def trajectory_key(cfg, global_batch: int) -> str:
    """What decides a run's held-out curve: model, data (not how fast it comes), optimizer and schedule,
    epochs, max_steps and the global batch; the seed and the nodes are not in it."""
    return (f"model={cfg.model.name} dataset={cfg.data.dataset} img_size={cfg.data.img_size} "
            f"global_batch={global_batch} epochs={cfg.epochs} digest={_digest(_facts(cfg, global_batch))}")


def family_key(cfg, global_batch: int) -> str:
    """The trajectory's family: its key but for the run length (epochs, max_steps), so the same optimizer
    and schedule kind, cut or stretched."""
    facts = {k: v for k, v in _facts(cfg, global_batch).items() if k not in ("epochs", "max_steps")}
    return (f"model={cfg.model.name} dataset={cfg.data.dataset} img_size={cfg.data.img_size} "
            f"global_batch={global_batch} digest={_digest(facts)}")


def run_length(cfg) -> str:
    """What sets a run's length, as a user writes it: "epochs=8", "epochs=8 max_steps=300"."""
    return f"epochs={cfg.epochs}" + (f" max_steps={cfg.max_steps}" if cfg.max_steps else "")


def _read(p: Path) -> list[dict]:
    fix = f"delete {p} (it only keeps the held-out curves of earlier runs) and train again"
    curves = (load_state_file(p, FIELD_TYPES, fix, UsageError) or {}).get("curves") or []
    for i, c in enumerate(curves):
        for j, point in enumerate(c.get("points") or []):
            if len(point) != 2 or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in point):
                raise UsageError(f"{p}: damaged: field curves[{i}].points[{j}] is {json.dumps(point)[:60]}, "
                                 f"expected [step, accuracy]; {fix}")
    return curves


def check_file(env=None) -> None:
    """Read curves.json once before anything is measured: a damaged file is bad input (exit 2), named with its fix."""
    _read(path(env))


def record_curve(cfg, global_batch: int, points: list[tuple[int, float]], *, compression: str, ranks: int,
                 run_id: str, env=None) -> None:
    """Keep a run's held-out curve (train's rank 0, at the end of a run that evaluated), atomically."""
    if not points:
        return
    p = path(env)
    curves = _read(p)
    curves.append({"key": trajectory_key(cfg, global_batch), "points": [[int(s), float(a)] for s, a in points],
                   "compression": compression, "ranks": ranks, "run_id": run_id, "at": time.time(),
                   "family": family_key(cfg, global_batch), "length": run_length(cfg)})
    atomic_write_json(p, {"schema": SCHEMA, "curves": curves[-MAX_CURVES:]})


def first_reach(points, target: float) -> int | None:
    """The step of the first evaluation at or above `target`, None where the curve never got there."""
    return next((int(s) for s, a in points if a >= target), None)


@functools.lru_cache(maxsize=None)
def _shipped_config(config, overrides: tuple[str, ...]):
    """A shipped curve's preset with its overrides, loaded once a process (a plan reads every one of
    them for each key it prices); None where it no longer loads."""

    try:
        return core.load_config(config, list(overrides))
    except (UsageError, OSError):
        return None


def _shipped(global_batch: int) -> list[tuple[Shipped, dict]]:
    """The shipped curves as stored ones, each with the key, family and length its preset and overrides
    resolve to (at `global_batch` where the preset leaves it open)."""
    out = []
    for s in SHIPPED:
        ref = _shipped_config(s.config, tuple(s.overrides))
        if ref is None:
            continue
        resolved_batch = ref.global_batch or global_batch
        out.append((s, {"key": trajectory_key(ref, resolved_batch), "family": family_key(ref, resolved_batch),
                        "length": run_length(ref),
                        "points": [list(p) for p in s.points], "compression": s.compression, "ranks": 1}))
    return out


def _with_shipped(own: list[dict], shipped: list[tuple[Shipped, dict]], env=None) -> tuple[list[dict], str]:
    """One key's curves: this lab's, and the shipped ones of the compressions none of them had; and
    where they come from."""
    mine = {c.get("compression", "none") for c in own}
    shipped = [(s, c) for s, c in shipped if s.compression not in mine]
    where = [f"{len(own)} run(s) of this lab ({path(env)})"] if own else []
    if shipped:
        files = ", ".join(dict.fromkeys(s.source for s, _ in shipped))
        where.append(f"{len(shipped)} run(s) shipped with the preset: " + "; ".join(s.what for s, _ in shipped)
                     + f" ({files})")
    return own + [c for _, c in shipped], "; ".join(where)


def curves_for(cfg, global_batch: int, env=None) -> tuple[list[dict], str]:
    """The curves of this trajectory and where they come from: this lab's runs, and for a compression
    none of them had, the shipped ones whose preset and overrides resolve to the same key."""
    k = trajectory_key(cfg, global_batch)
    own = [c for c in _read(path(env)) if c.get("key") == k and c.get("points")]
    shipped = [(s, c) for s, c in _shipped(global_batch) if c["key"] == k]
    if not (own or shipped):
        return [], "no recorded run of this model, data, schedule, epochs and global batch"
    return _with_shipped(own, shipped, env)


def family_for(cfg, global_batch: int, env=None) -> list[tuple[str, list[dict]]]:
    """The curves of this trajectory's family at other run lengths, one entry per key: (its run length,
    its curves as `curves_for` gathers them), this lab's keys first. Only to say whether a compression
    learns more slowly (`slower`), never to price a time to accuracy: the schedule differs."""
    k, fam = trajectory_key(cfg, global_batch), family_key(cfg, global_batch)
    own: dict[str, list[dict]] = {}
    for c in _read(path(env)):
        if c.get("family") == fam and c.get("key") != k and c.get("points"):
            own.setdefault(c["key"], []).append(c)
    shipped: dict[str, list] = {}
    for s, c in _shipped(global_batch):
        if c["family"] == fam and c["key"] != k:
            shipped.setdefault(c["key"], []).append((s, c))
    out = []
    for key in dict.fromkeys([*own, *shipped]):
        curves, _ = _with_shipped(own.get(key, []), shipped.get(key, []), env)
        out.append((curves[0].get("length") or "another run length", curves))
    return out


def _gaps(curves: list[dict], compression: str) -> list[tuple[float, int, float, float]]:
    """Each of `compression`'s curves against the uncompressed ones among `curves` (one key: the same
    schedule): (its accuracy less their median, the step, its accuracy, their median) at the last step
    it evaluated that every uncompressed one did too; none where nothing compares."""
    plain = [dict((int(s), a) for s, a in c["points"]) for c in curves if c.get("compression", "none") == "none"]
    gaps = []
    for c in (c for c in curves if c.get("compression") == compression):
        common = [(int(s), a) for s, a in c["points"] if all(int(s) in q for q in plain)]
        if plain and common:
            step, acc = common[-1]
            plain_at = statistics.median(q[step] for q in plain)
            gaps.append((acc - plain_at, step, acc, plain_at))
    return gaps


def trailing(curves: list[dict], compression: str) -> str | None:
    """How `compression`'s recorded curves learned more slowly than uncompressed ones, in words, or None:
    at the last step each evaluated that uncompressed ones did too, more than TRAIL_POINTS below the
    uncompressed median there (the median over its curves). `curves` are one key's (`curves_for`, or
    one run length of `family_for`)."""
    gaps = _gaps(curves, compression)
    if not gaps or statistics.median(g[0] for g in gaps) >= -TRAIL_POINTS:
        return None
    said = ", ".join(f"{a:.1%} at step {s} against {b:.1%}" for _, s, a, b in gaps)
    return (f"its {len(gaps)} recorded run(s) of this model, data, optimizer and global batch learned more slowly "
            f"than uncompressed ones of the same run length ({said}), more than {TRAIL_POINTS * 100:g} point below")


def slower(curves: list[dict], family: list[tuple[str, list[dict]]], compression: str) -> tuple[str, str | None] | None:
    """Whether `compression` learns more slowly: (trailing's words, None) where this trajectory's `curves`
    compare it with uncompressed ones; else (trailing's words, that run length) from the run length of
    `family` (`family_for`) whose curves compare it most, this lab's own runs of it first. None where
    the curves that decide keep up, or none compare it."""
    if _gaps(curves, compression):
        why = trailing(curves, compression)
        return (why, None) if why else None
    compared = [(length, cs) for length, cs in family if _gaps(cs, compression)]
    if not compared:
        return None
    length, cs = max(compared, key=lambda g: (any(c.get("run_id") and c.get("compression") == compression
                                                  for c in g[1]), len(_gaps(g[1], compression))))
    why = trailing(cs, compression)
    return (why, length) if why else None


def seconds_to(c: phases.RunCosts, step: int, *, epochs: int, max_steps: int) -> float:
    """plan's whole-run seconds from the data cache to the end of the evaluation after `step`."""
    total = phases.total_steps(c.steps_per_epoch, epochs, max_steps)
    warm = min(phases.WARMUP_STEPS, step)
    head = phases.span(c, 1, warm, total=total, epochs=epochs, events_to=0)
    rest = phases.span(c, warm + 1, step, total=total, epochs=epochs, events_from=1, events_to=step)
    return (c.cache_fill_s + c.warmup_extra_s + head["plain_s"] + head["steady_s"] + rest["plain_s"]
            + rest["steady_s"] + rest["evaluation_s"] + rest["checkpoints_s"] + rest["restart_s"])


def reach(curves: list[dict], target: float, compression: str) -> dict:
    """Where the curves of runs with this compression (all of them where none has it) first reach
    `target`: {"step": the median over those that did, the higher of the middle two (a step a run
    evaluated at; None: none did), "curves", "reached", "same": whether the curves had this compression}."""
    same = [c for c in curves if c.get("compression", "none") == compression]
    use = same or curves
    steps = [s for s in (first_reach(c["points"], target) for c in use) if s is not None]
    return {"step": int(statistics.median_high(steps)) if steps else None, "curves": len(use), "reached": len(steps),
            "same": bool(same)}


def predict(cfg, target: float, global_batch: int, runs: dict, alone: tuple[str, phases.RunCosts] | None,
            compressions: dict[str, str], env=None, *, curves: tuple[list[dict], str] | None = None) -> dict:
    """The document's `time_to_accuracy`: for each whole run in `runs` ({"now"|"choice": phases.whole_run's
    dict}, `compressions` theirs) and for the node alone (`alone`: its name and its run's costs at this global
    batch, as plan/weigh.py prices it), the step its recorded curves reach `target` at and plan's seconds to
    the end of that evaluation; `speedup`: the node alone's seconds over the lab's best. `curves`:
    `curves_for`'s answer where the caller has read it already."""
    curves, source = curves if curves is not None else curves_for(cfg, global_batch, env)
    out: dict = {"target": target, "source": source, "curves": len(curves), "runs": {}, "speedup": None,
                 "notes": []}
    if not curves:
        out["notes"].append(f"no time to {target:.1%}: {source}; train once with target_accuracy={target} (any "
                            "run that evaluates records its curve) and the next plan predicts it")
        return out
    priced = {name: (phases.RunCosts(**run["costs"]), compressions.get(name, "none"))
              for name, run in runs.items() if run is not None}
    if alone is not None:
        priced["alone"] = (alone[1], "none")
    for name, (c, compression) in priced.items():
        r = reach(curves, target, compression)
        seconds = None if r["step"] is None else round(seconds_to(c, r["step"], epochs=cfg.epochs,
                                                                  max_steps=cfg.max_steps), 1)
        out["runs"][name] = {**r, "seconds": seconds, "images": r["step"] and r["step"] * global_batch,
                             "compression": compression, **({"node": alone[0]} if name == "alone" and alone else {})}
        if r["step"] is None:
            out["notes"].append(f"no time to {target:.1%} for {LABELS[name]}: none of its {r['curves']} recorded "
                                "curve(s) reached it")
        elif compression != "none" and not r["same"]:
            evidence = (f"not measured, and two measurements point the other way: {POWERSGD_EVIDENCE}"
                        if compression == "powersgd" else FP16_EVIDENCE)
            what = "the recorded curves did not compress"
            if ":" in compression:  # a sync label (syncmode.py): MODE:H
                evidence, what = SYNC_EVIDENCE, f"no recorded curve averaged every {compression.split(':')[1]} steps"
            out["notes"].append(f"time to accuracy with {compression}: {what}, and "
                                f"{LABELS[name]} is priced as if it reached {target:.1%} at the same step; "
                                + evidence)
    lab = [v["seconds"] for k, v in out["runs"].items() if k != "alone" and v["seconds"]]
    if lab and (out["runs"].get("alone") or {}).get("seconds"):
        out["speedup"] = round(out["runs"]["alone"]["seconds"] / min(lab), 2)
    return out


LABELS = {"now": "the config as given", "choice": "the recommendation", "alone": "the fastest node alone"}
