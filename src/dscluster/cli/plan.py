"""`dscluster plan`: predict the scaling of a training config on the hostfile's nodes, before the run.

Inputs: the all-reduce bus bandwidth `dscluster check` measured (<state>/check.json; --busbw wins),
the model's parameter count (built from the config on the meta device: no memory, no GPU), and the
compute time of one micro-batch (--compute-s, else a few forward+backward passes measured here).
The model and its assumptions: dscluster.advisor and docs/advisor.md.

The `--json` document (schema version `SCHEMA_VERSION`) is described in docs/schemas.md.
--calibrate: PowerSGD's cost across ranks is more than the one-rank probe shows, so where it is in
play and uncalibrated on these ranks, plan first runs a few PowerSGD steps of the config on the
hostfile's nodes (the README's mpirun of entry_cn.sh), which `train` records like any run,
and predicts again with that outcome (`calibrate`).

Exit status: 0 the prediction was made (whatever it says), 1 a --calibrate run failed (the plan is
printed uncalibrated), 2 bad input (config, hostfile, no bandwidth: run `dscluster check` or pass
--busbw).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import replace
from pathlib import Path

from dscluster import advisor, plan_calibrate, state
from dscluster.check import checkfile
from dscluster.check.checkfile import CheckFileError
from dscluster.errors import UsageError
from dscluster.plan_probe import measure_compute, measure_powersgd

SCHEMA_VERSION = 1
COMPRESSION_KEY = "comm.compression"
"""The training config key that compresses gradients on the wire (train/comm.py)."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="predict step time, img/s and speed-up on the hostfile's nodes before the run, and what scales",
        description="Predict one optimizer step of data-parallel training (compute, all-reduce, overlap), the "
        "images/s, the speed-up over the fastest node alone and a verdict; recommend the smallest gradient "
        "accumulation and compression that reach 80% scaling efficiency. Needs the all-reduce bandwidth of "
        "`dscluster check` (or --busbw). Exit 0 predicted, 1 a --calibrate run failed, 2 bad input.",
        epilog="examples:\n"
        "  dscluster plan --config configs/vit_base.yaml\n"
        "  dscluster plan --config configs/vit_base.yaml --busbw 0.119 --compute-s 0.043 micro_batch=128\n"
        "  dscluster plan --config configs/vit_base.yaml --compute-s node1=0.2,node2=0.2,node3=0.45 --json\n"
        "  dscluster plan --config configs/vit_base.yaml --calibrate comm.compression=powersgd",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", metavar="YAML", required=True, help="training preset (configs/*.yaml)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, as for `dscluster train`")
    p.add_argument("--hostfile", default="hosts.txt", help="OpenMPI hostfile (default: hosts.txt)")
    p.add_argument("--busbw", type=float, metavar="GBps",
                   help="all-reduce bus bandwidth in GB/s (default: what `dscluster check` measured)")
    p.add_argument("--compute-s", metavar="S|NODE=S,...",
                   help="seconds of one forward+backward of one micro-batch on one rank, for every node or "
                   "per node (default: measured here)")
    p.add_argument("--powersgd-s", type=float, metavar="S",
                   help="PowerSGD's own work per optimizer step on one rank, seconds (default: measured here "
                   "when compute is)")
    p.add_argument("--calibrate", action="store_true",
                   help=f"where PowerSGD is in play and no run on these ranks has measured it, first run "
                   f"{plan_calibrate.STEPS} PowerSGD steps of this config on the hostfile's nodes (the README's mpirun "
                   "of entry_cn.sh, about a minute) and correct the plan by what they measure")
    p.add_argument("--no-calibration", action="store_true",
                   help="ignore what earlier runs measured against their plans (<state>/plans.json outcomes)")
    p.add_argument("--max-global-batch", type=int, default=advisor.MAX_GLOBAL_BATCH, metavar="N",
                   help=f"largest global batch to recommend (default: {advisor.MAX_GLOBAL_BATCH})")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (schema in the module docstring)")
    p.set_defaults(func=plan_command)


def busbw_from_check(path: Path) -> tuple[float, int | None, float]:
    """(bus bandwidth of check's largest all-reduce, closest to DDP's 100 MB buckets; its rank count;
    the start-up latency of one all-reduce, from its smallest message)."""
    fix = "run `dscluster check` (without --skip-active) on this hostfile, or pass --busbw GBps"
    try:
        result = checkfile.load(path).allreduce_result()
    except FileNotFoundError:
        raise UsageError(f"{path}: no all-reduce measurement yet: {fix}") from None
    except CheckFileError as e:
        raise UsageError(f"{e}; or pass --busbw GBps") from None
    rows = [r for r in (result or {}).get("results") or [] if r.get("busbw_GBps", 0) > 0]
    if not rows:
        raise UsageError(f"{path}: holds no all-reduce result (skipped or failed): {fix}")
    world = result.get("world_size")
    return (float(max(rows, key=lambda r: r.get("bytes") or 0)["busbw_GBps"]), world,
            advisor.startup_latency_s(rows, world or 1))


def parse_compute(text: str, names: list[str]) -> dict[str, float]:
    """`0.05` for every node, or `node1=0.05,node2=0.2` naming every hostfile node."""
    def seconds(value: str, where: str) -> float:
        try:
            s = float(value)
        except ValueError:
            s = math.nan
        if not (s > 0 and math.isfinite(s)):
            raise UsageError(f"--compute-s {where}: expected seconds > 0, e.g. --compute-s 0.05")
        return s

    if "=" not in text:
        return dict.fromkeys(names, seconds(text, repr(text)))
    out: dict[str, float] = {}
    for part in text.split(","):
        name, _, value = part.strip().partition("=")
        if name not in names:
            raise UsageError(f"--compute-s: {name!r} is not a host of the hostfile ({', '.join(names)})")
        if name in out:
            raise UsageError(f"--compute-s: {name!r} given twice; give each node once, e.g. --compute-s "
                             + ",".join(f"{n}=0.05" for n in names))
        out[name] = seconds(value, repr(part))
    missing = [n for n in names if n not in out]
    if missing:
        raise UsageError(f"--compute-s: no time for {', '.join(missing)}; give NODE=S for every node, or one number")
    return out


def data_shape(cfg) -> tuple[int, int]:
    """(in_chans, num_classes) as train/data.py builds each data set, without loading it."""
    d = cfg.data
    if d.dataset == "digits":
        return 1, 10
    if d.dataset == "cifar10":
        return 3, 10
    if d.dataset == "imagefolder" and d.path:
        root = Path(d.path) / "train" if (Path(d.path) / "train").is_dir() else Path(d.path)
        classes = [p for p in root.iterdir() if p.is_dir()] if root.is_dir() else []
        if classes:
            return 3, len(classes)
    return 3, d.num_classes


def batch_shape(cfg, world: int) -> tuple[int, int, str | None]:
    """(micro_batch, grad_accum, note) the training would use on `world` ranks."""
    g, accum = cfg.global_batch, cfg.grad_accum
    if cfg.micro_batch != "auto":
        micro = int(cfg.micro_batch)
        return micro, accum or (max(1, g // (micro * world)) if g else 1), None
    if g is None:
        return 32, accum or 1, "micro_batch auto without global_batch: assumed 32 (pass micro_batch=N)"
    micro = max(1, math.ceil(g / (world * (accum or 1))))
    return micro, accum or 1, (f"micro_batch auto: assumed global_batch {g} ÷ {world} ranks = {micro} (auto-fit "
                               "may take less on small GPUs and accumulate: pass micro_batch=N)")


def gradient_shapes(cfg, in_chans: int, num_classes: int) -> tuple[int, tuple[tuple[int, int], ...]]:
    """(parameters, each gradient as PowerSGD views it: shape[0] × the rest), built on the meta
    device: shapes only, no memory, so ViT-B costs nothing to count."""
    import torch

    from dscluster.train.model import build_model, count_params as count

    with torch.device("meta"):
        model = build_model(cfg.model, in_chans=in_chans, num_classes=num_classes, img_size=cfg.data.img_size)
    matrices = tuple((p.shape[0], p.numel() // p.shape[0]) if p.dim() else (1, 1)
                     for p in model.parameters() if p.requires_grad)
    return count(model), matrices


def planned_precision(cfg) -> tuple[str, str | None]:
    """(the precision training will use, a note when guessed): the config's, else `dscluster check`'s
    (DSCLUSTER_PRECISION, <state>/cluster.env), else this machine's GPU's, else fp32 with a note."""
    import os

    from dscluster.train.precision import FORMATS, decide_here

    if cfg.precision != "auto":
        return cfg.precision, None
    cluster = os.environ.get("DSCLUSTER_PRECISION")
    if not cluster and state.cluster_env_path().exists():
        # a damaged cluster.env is bad input (exit 2, as launch says), not a reason to plan for fp32
        cluster = state.read_env_file(state.cluster_env_path()).get("DSCLUSTER_PRECISION")
    if cluster and cluster.strip().lower() in FORMATS:
        return cluster.strip().lower(), None
    decided = decide_here("auto").precision
    return decided, (None if decided != "fp32" else "precision auto and no `dscluster check` result here: planned "
                     "for fp32 (pass precision=... for the GPUs' format)")


def allowed_compressions(cfg, precision: str) -> tuple[dict[str, bool], list[str]]:
    """Which comm.compression values training accepts for this config, by training's own rule, and
    why not where it refuses one."""
    import copy

    from dscluster.train.config_checks import ConfigValueError, compression_conflict

    ok, why = {}, {}
    for comp in advisor.COMPRESSIONS:
        trial = copy.deepcopy(cfg)
        trial.comm.compression = comp
        try:
            compression_conflict(trial, precision)
            ok[comp] = True
        except ConfigValueError as e:
            ok[comp] = False
            if comp in advisor.LADDER:
                why.setdefault(e.also, str(e))  # one line per cause (ZeRO refuses every compression alike)
    return ok, list(why.values())


def overrides(cfg, current_global: int, option: advisor.Option | None, micro: int) -> list[str]:
    """key=value for `./entry_cn.sh` / `dscluster train`: all three batch keys, so the trainer's
    check micro × accum × world = global holds whatever the preset says, and the compression."""
    out = []
    if option is not None and option.prediction.global_batch != current_global:
        out = [f"micro_batch={micro}", f"grad_accum={option.grad_accum}",
               f"global_batch={option.prediction.global_batch}"]
        if cfg.optim.lr_reference_batch is None:
            out.append(f"optim.lr_reference_batch={current_global}")  # linear LR scaling, as DeiT's recipe
    if option is not None and option.compression != cfg.comm.compression:
        out.append(f"{COMPRESSION_KEY}={option.compression}")
    return out


def saved_entries(doc: dict, cfg, rec: advisor.Recommendation, args) -> dict[str, dict]:
    """What `train` looks up at the end of a run (train/predicted.py): the config as given and each
    recommended setting, keyed by what decides its figure."""
    settings = [("now", doc["grad_accum"], cfg.comm.compression, doc["prediction"], [])]
    for name in ("choice", "without_compression"):
        o = getattr(rec, name)
        if o is not None:
            settings.append((name, o.grad_accum, o.compression, o.to_dict()["prediction"],
                             overrides(cfg, doc["global_batch"], o, doc["micro_batch"])))
    out = {}
    for name, _accum, comp, p, ovr in settings:
        k = run_key(doc, cfg, p["global_batch"] if any(o.startswith("global_batch=") for o in ovr) else None, comp)
        out.setdefault(k, saved_entry(doc, args, name, p, ovr))
    return out


def saved_entry(doc: dict, args, setting: str, p: dict, ovr: list[str]) -> dict:
    """One plans.json entry (train/predicted.py): a setting's predicted figures and what they came from."""
    return {"images_per_s": p["images_per_s"], "step_s": p["step_s"], "model_step_s": p["model_step_s"],
            "setting": setting, "config": args.config, "hostfile": doc["hostfile"], "busbw_GBps": doc["busbw_GBps"],
            "compute_s": doc["compute"]["seconds"], "overrides": ovr}


def run_key(doc: dict, cfg, global_batch: int | None, compression: str) -> str:
    """train's key (train/predicted.py) for a run of this plan: `global_batch` where the overrides
    set it, else the config's own, which train keeps when the ranks cannot split it evenly (64 on 3
    ranks: micro-batches 22, 21, 21)."""
    from dscluster.train import predicted

    return predicted.key(model=doc["model"], micro_batch=doc["micro_batch"],
                         global_batch=global_batch or cfg.global_batch or doc["global_batch"],
                         precision=doc["precision"], compression=compression, ranks=doc["world_size"])


def plan(args: argparse.Namespace) -> dict:
    if args.calibrate and args.no_calibration:
        raise UsageError("--calibrate measures a run to correct the plan, --no-calibration ignores such runs: "
                         "pass one of them")
    inputs = measure_inputs(args)
    doc, rec = build(args, inputs, calibration_of(args, inputs))
    if args.calibrate:
        doc, rec = calibrate(args, inputs, doc, rec)
    return doc


def measure_inputs(args: argparse.Namespace) -> dict:
    """Everything the prediction is made from that costs a measurement or a model build, once: a
    calibration run rebuilds the plan from the same inputs."""
    from dscluster.hosts import parse_hostfile
    from dscluster.train.config import load_config

    if args.busbw is not None and not (args.busbw > 0 and math.isfinite(args.busbw)):
        raise UsageError(f"--busbw {args.busbw}: expected the all-reduce bus bandwidth in GB/s, > 0")
    if args.max_global_batch < 1:
        raise UsageError(f"--max-global-batch {args.max_global_batch}: expected at least 1")
    cfg = load_config(args.config, args.overrides)
    hostfile = parse_hostfile(args.hostfile)
    names = hostfile.names
    compute = parse_compute(args.compute_s, names) if args.compute_s is not None else None
    # cheap inputs first: a missing bandwidth says so before any model is built or measured
    source = "--busbw" if args.busbw is not None else str(state.check_json_path())
    busbw, check_world, latency = ((args.busbw, None, 0.0) if args.busbw is not None
                                   else busbw_from_check(state.check_json_path()))
    world = hostfile.total_slots
    micro, accum, batch_note = batch_shape(cfg, world)
    in_chans, num_classes = data_shape(cfg)
    params, matrices = gradient_shapes(cfg, in_chans, num_classes)
    precision, precision_note = planned_precision(cfg)
    from dscluster.train.precision import gradient_format

    grad_format = gradient_format(cfg, precision)
    allowed, refused = allowed_compressions(cfg, precision)
    if compute is None:
        seconds, device, note = measure_compute(cfg, in_chans, num_classes, micro)
        compute, how = dict.fromkeys(names, seconds), {"seconds": seconds, "source": "measured", "device": device,
                                                       "note": note}
    else:
        how = {"seconds": max(compute.values()), "source": "--compute-s", "device": None, "note": None}
    powersgd_s = args.powersgd_s
    if powersgd_s is not None and not (powersgd_s >= 0 and math.isfinite(powersgd_s)):
        raise UsageError(f"--powersgd-s {powersgd_s}: expected seconds >= 0, e.g. --powersgd-s 0.02")
    if powersgd_s is None and allowed.get("powersgd") and world > 1 and how["source"] == "measured":
        powersgd_s = measure_powersgd(cfg, in_chans, num_classes, micro)
    return dict(cfg=cfg, hostfile=hostfile, compute=compute, how=how, source=source, busbw=busbw,
                check_world=check_world, latency=latency, world=world, micro=micro, accum=accum,
                batch_note=batch_note, params=params, matrices=matrices, precision=precision,
                precision_note=precision_note, grad_format=grad_format, allowed=allowed, refused=refused,
                powersgd_s=powersgd_s)


def calibration_of(args: argparse.Namespace, inputs: dict) -> dict[str, dict]:
    from dscluster.train import predicted

    return {} if args.no_calibration else predicted.calibration(model=inputs["cfg"].model.name,
                                                                 precision=inputs["precision"], ranks=inputs["world"])


def scenario_of(inputs: dict, calibration: dict[str, dict]) -> advisor.Scenario:
    cfg = inputs["cfg"]
    even = inputs["micro"] * inputs["accum"] * inputs["world"]
    nodes = tuple(advisor.Node(name=h.name, ranks=h.slots, compute_s=inputs["compute"][h.name])
                  for h in inputs["hostfile"].hosts)
    return advisor.Scenario(nodes=nodes, micro_batch=inputs["micro"], grad_accum=inputs["accum"],
                            grad_bytes=advisor.gradient_bytes(inputs["params"], advisor.FORMAT_BYTES[inputs["grad_format"]]),
                            grad_format=inputs["grad_format"], compression=cfg.comm.compression,
                            powersgd_rank=cfg.comm.powersgd_rank, matrices=inputs["matrices"],
                            busbw_GBps=inputs["busbw"], bucket_bytes=cfg.ddp_bucket_mb * 2**20,
                            latency_s=inputs["latency"], powersgd_s=inputs["powersgd_s"] or 0.0,
                            calibration=tuple((c, v["extra_s"]) for c, v in calibration.items()),
                            samples_per_step=cfg.global_batch if cfg.global_batch and cfg.global_batch < even else None)


def build(args: argparse.Namespace, inputs: dict, calibration: dict[str, dict],
          runs: list[dict] | None = None) -> tuple[dict, advisor.Recommendation]:
    """The plan document from measured inputs and the calibration, saved for `train` to compare with."""
    cfg, hostfile, world, powersgd_s = inputs["cfg"], inputs["hostfile"], inputs["world"], inputs["powersgd_s"]
    scenario = scenario_of(inputs, calibration)
    prediction = advisor.predict(scenario)
    rec = advisor.recommend(scenario, max_global_batch=args.max_global_batch,
                            compressions=advisor.ladder(cfg.comm.compression, allowed=inputs["allowed"].get))
    notes = [n for n in (inputs["batch_note"], inputs["how"]["note"], inputs["precision_note"]) if n]
    check_world = inputs["check_world"]
    if check_world and check_world != world:
        notes.append(f"check measured the all-reduce over {check_world} ranks, this plan has {world}: if the "
                     f"hostfile changed, run `dscluster check --hostfile {args.hostfile}` again")
    if cfg.zero_stage:
        notes.append(f"zero_stage {cfg.zero_stage}: reduce-scatter + all-gather move about what ZeRO-0's "
                     "all-reduce moves; the estimate is the same")
    for comp, c in calibration.items():
        more, act = ("more", "add") if c["extra_s"] >= 0 else ("less", "take off")
        notes.append(f"calibrated by {c['runs']} earlier run(s) of this model on {world} rank(s): {comp} steps took "
                     f"{abs(c['extra_s']) * 1e3:.1f} ms {more} than the model gives, so its step times {act} that "
                     "(--no-calibration ignores them)")
    if uses_powersgd(cfg, rec, world):
        notes.append((f"PowerSGD: its own work {powersgd_s * 1e3:.1f} ms a step"
                      + (" (--powersgd-s)" if args.powersgd_s is not None else ", measured here")
                      if powersgd_s is not None else
                      "PowerSGD: its own work is not measured with --compute-s (pass --powersgd-s), so its step "
                      "time is a lower bound")
                     + "; it sends plain all-reduces for the first comm.powersgd_start_step steps")
        if "powersgd" not in calibration:
            notes.append(f"PowerSGD is not calibrated on {world} ranks yet: its hook costs more across ranks than "
                         "the one-rank probe shows (first runs on GPU labs measured 23 % below to 6 % above this "
                         "prediction). "
                         f"`dscluster plan --calibrate` measures it first with a {plan_calibrate.STEPS}-step run on "
                         "these nodes; any PowerSGD run here does the same for the next plan")
    doc = {
        "schema": SCHEMA_VERSION, "config": args.config, "model": cfg.model.name, "params": inputs["params"],
        "hostfile": hostfile.path, "world_size": world,
        "nodes": [{"name": n.name, "ranks": n.ranks, "compute_s": n.compute_s,
                   "images_per_s": n.images_per_s(inputs["micro"])} for n in scenario.nodes],
        "micro_batch": inputs["micro"], "grad_accum": inputs["accum"], "global_batch": scenario.global_batch,
        "precision": inputs["precision"], "compression": cfg.comm.compression, "grad_format": inputs["grad_format"],
        "grad_bytes": int(scenario.grad_bytes), "wire_bytes": int(scenario.wire_bytes),
        "busbw_GBps": inputs["busbw"], "busbw_source": inputs["source"], "compute": inputs["how"],
        "latency_s": inputs["latency"], "powersgd_s": powersgd_s, "calibration": calibration,
        "calibration_runs": runs or [],
        "assumptions": {"backward_share": advisor.BACKWARD_SHARE, "overlap_fraction": scenario.overlap_fraction,
                        "bucket_bytes": int(scenario.bucket_bytes)},
        "prediction": prediction.to_dict(),
        "recommendation": {**rec.to_dict(), "overrides": overrides(cfg, scenario.global_batch, rec.choice,
                                                                   inputs["micro"]),
                           "pending": inputs["refused"]},
        "saved_to": None,
        "notes": notes,
    }
    save(doc, saved_entries(doc, cfg, rec, args))
    return doc, rec


def save(doc: dict, entries: dict[str, dict]) -> None:
    from dscluster.train import predicted

    try:
        doc["saved_to"] = str(predicted.save(entries))
    except OSError as e:  # a read-only state directory costs the comparison at the end of the run, not the plan
        doc["notes"].append(f"could not save the prediction for `train` to compare with ({e})")


def uses_powersgd(cfg, rec: advisor.Recommendation, world: int) -> bool:
    """The config or the recommendation sends PowerSGD factors across several ranks."""
    return world > 1 and (cfg.comm.compression == "powersgd"
                          or (rec.choice is not None and rec.choice.compression == "powersgd"))


def calibrate(args: argparse.Namespace, inputs: dict, doc: dict,
              rec: advisor.Recommendation) -> tuple[dict, advisor.Recommendation]:
    """--calibrate: where PowerSGD is in play on several ranks and no run here has measured it yet,
    one short PowerSGD run of this config on the hostfile's nodes (the README's mpirun of
    entry_cn.sh); `train` records it against the model's step like any run,
    and the plan is made again with that outcome. Its output goes to stderr."""
    cfg, world = inputs["cfg"], inputs["world"]
    if not uses_powersgd(cfg, rec, world) or "powersgd" in doc["calibration"]:
        why = ("PowerSGD is already calibrated on these ranks" if "powersgd" in doc["calibration"] else
               "neither the config nor the recommendation uses PowerSGD across several ranks")
        doc["notes"].append(f"--calibrate: nothing to measure ({why}); the model alone is within about 7 % for "
                            "the other settings")
        return doc, rec
    # the PowerSGD setting at the config's own batch, saved so that train finds its model step
    scenario = replace(scenario_of(inputs, {}), compression="powersgd")
    p = advisor.predict(scenario)
    save(doc, {run_key(doc, cfg, None, "powersgd"):
               saved_entry(doc, args, "calibration", p.to_dict(), plan_calibrate.overrides())})
    run = plan_calibrate.run(args.hostfile, args.config, args.overrides, world)
    run.update(global_batch=p.global_batch, model_images_per_s=p.images_per_s)
    calibration = calibration_of(args, inputs)
    rc, run_dir = run["exit_code"], run["run_dir"]
    if rc != 0 or "powersgd" not in calibration:
        doc["calibration_runs"] = [run]
        doc["notes"].append(f"--calibrate: the PowerSGD run {run_dir} " + (f"exited {rc}" if rc else
                            "recorded no outcome") + ": the plan above is not calibrated; its output is above")
        return doc, rec
    doc, rec = build(args, inputs, calibration, [run])
    doc["notes"].append(f"--calibrate: PowerSGD measured {run['images_per_s']:,.0f} img/s at global batch "
                        f"{p.global_batch} in {run_dir} ({run['seconds']:.0f} s), where the model alone gave "
                        f"{p.images_per_s:,.0f}")
    return doc, rec


def plan_command(args: argparse.Namespace) -> int:
    doc = plan(args)
    if args.json:
        print(json.dumps(doc, indent=2, sort_keys=True))
    else:
        from dscluster.cli.plan_render import render

        render(doc)
    return 1 if any(r["exit_code"] for r in doc["calibration_runs"]) else 0
