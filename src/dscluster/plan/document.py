"""The plan document: the scenario the model predicts from `PlanInputs` and the calibration, the
recommendation, the notes, and the entries saved for `train` to compare with (runmodel/predicted.py).

The `--json` document (schema version `SCHEMA_VERSION`) is described in docs/schemas.md.
"""

from __future__ import annotations

from dataclasses import replace

from dscluster import core
from dscluster.plan import advice, datafeed, evidence, model, paste, recommend, weigh, wholerun
from dscluster.plan import calibrate as calibration_run
from dscluster.plan import nodes as node_probe
from dscluster.plan.inputs import PlanInputs, PlanOptions, figure_of
from dscluster.runmodel import accuracy, phases, predicted

SCHEMA_VERSION = 1


def saved_entries(doc: dict, cfg, a: advice.Advice, opts: PlanOptions) -> dict[str, dict]:
    """What `train` looks up at the end of a run (runmodel/predicted.py): the config as given, the advice and each
    untested setting (its measuring run compares too), keyed by what decides its figure, with its run costs."""
    settings = [("now", core.sync_label(cfg), doc["prediction"], [], doc["runs"]["now"])]
    for name, j in [("choice", a.choice), *(("untested", u) for u in a.untested)]:
        if j is not None and j is not a.now:
            settings.append((name, j.option.compression, j.option.to_dict()["prediction"], list(j.overrides), j.run))
    out = {}
    tta = doc.get("time_to_accuracy") or {}
    for name, comp, p, ovr, run in settings:
        k = run_key(doc, cfg, p["global_batch"] if any(o.startswith("global_batch=") for o in ovr) else None, comp)
        entry = saved_entry(doc, opts, name, p, ovr, run)
        if (tta.get("runs") or {}).get(name, {}).get("seconds"):  # runmodel/accuracy.py's, for train to compare with
            entry.update(time_to_accuracy_s=tta["runs"][name]["seconds"], target_accuracy=tta["target"])
        out.setdefault(k, entry)
    return out


def saved_entry(doc: dict, opts: PlanOptions, setting: str, p: dict, ovr: list[str], run: dict | None = None) -> dict:
    """One plans.json entry (runmodel/predicted.py): a setting's predicted figures and what they came from;
    with its whole-run prediction, the run costs train's comparison predicts the timed steps from."""
    entry = {"images_per_s": p["images_per_s"], "step_s": p["step_s"], "model_step_s": p["model_step_s"],
             "setting": setting, "config": opts.config, "hostfile": doc["hostfile"], "busbw_GBps": doc["busbw_GBps"],
             "compute_s": doc["compute"]["seconds"], "overrides": ovr, "compute": figure_of(doc["compute"])}
    if run is not None:
        entry.update(costs=run["costs"], model_costs=run["model_costs"])
    return entry


def run_key(doc: dict, cfg, global_batch: int | None, compression: str) -> str:
    """train's key (runmodel/predicted.py) for a run of this plan: `global_batch` where the overrides
    set it, else the config's own, which train keeps when the ranks cannot split it evenly (64 on 3
    ranks: micro-batches 22, 21, 21)."""
    return predicted.key(model=doc["model"], micro_batch=doc["micro_batch"],
                         global_batch=global_batch or cfg.global_batch or doc["global_batch"],
                         precision=doc["precision"], compression=compression, ranks=doc["world_size"])


def scenario_of(inputs: PlanInputs, calibration: dict[str, dict]) -> model.Scenario:
    cfg = inputs.cfg
    full = inputs.micro * inputs.accum * inputs.world
    nodes = tuple(model.Node(name=h.name, ranks=h.slots, compute_s=inputs.compute[h.name],
                             **node_probe.alone_of(inputs.how, h.name)) for h in inputs.hostfile.hosts)
    return model.Scenario(nodes=nodes, micro_batch=inputs.micro, grad_accum=inputs.accum,
                          grad_bytes=model.gradient_bytes(inputs.params, model.FORMAT_BYTES[inputs.grad_format]),
                          grad_format=inputs.grad_format, compression=core.sync_label(cfg),
                          powersgd_rank=cfg.comm.powersgd_rank, matrices=inputs.matrices,
                          busbw_GBps=inputs.busbw, bucket_bytes=cfg.ddp_bucket_mb * 2**20,
                          latency_s=inputs.latency, powersgd_s=inputs.powersgd_s or 0.0,
                          calibration=tuple((c, v["extra_s"]) for c, v in calibration.items()),
                          samples_per_step=inputs.global_batch if inputs.global_batch < full else None,
                          balanced=node_probe.uses_balanced(cfg))


def uses_powersgd(cfg, rec: recommend.Recommendation, world: int) -> bool:
    """The config or the recommendation sends PowerSGD factors across several ranks."""
    return world > 1 and (cfg.comm.compression == "powersgd"
                          or (rec.choice is not None and rec.choice.compression == "powersgd"))


def notes_of(opts: PlanOptions, inputs: PlanInputs, calibration: dict[str, dict], rec: recommend.Recommendation,
             p: model.Prediction) -> list[str]:
    """What the reader should know about the inputs and the model's reach, one line each."""
    cfg = inputs.cfg
    world = inputs.world
    powersgd_s = inputs.powersgd_s
    notes = [n for n in (inputs.batch_note, inputs.how["note"], inputs.precision_note) if n] + inputs.notes
    if inputs.check_world and inputs.check_world != world:
        notes.append(f"check measured the all-reduce over {inputs.check_world} ranks, this plan has {world}: if the "
                     f"hostfile changed, run `dscluster check --hostfile {opts.hostfile}` again")
    if cfg.zero_stage in (1, 2):
        notes.append(f"zero_stage {cfg.zero_stage}: reduce-scatter + all-gather move about what ZeRO-0's "
                     "all-reduce moves; the estimate is the same")
    elif cfg.zero_stage == 3:
        notes.append("zero_stage 3: the weights are all-gathered again for every forward and backward, about 1.5x "
                     "the bytes of ZeRO-0's all-reduce; the estimate counts ZeRO-0's")
    if cfg.offload_optimizer != "none":
        notes.append(f"offload_optimizer={cfg.offload_optimizer}: the optimizer steps on the CPU and its states "
                     "cross PCIe every step; the estimate leaves both out")
    for comp, c in calibration.items():
        more, act = ("more", "add") if c["extra_s"] >= 0 else ("less", "take off")
        notes.append(f"calibrated by {c['runs']} earlier run(s) of this model on {world} rank(s): {comp} steps took "
                     f"{abs(c['extra_s']) * 1e3:.1f} ms {more} than the model gives, so its step times {act} that "
                     "(--no-calibration ignores them)")
    if p.model_step_s + p.calibration_s < p.compute_s:
        notes.append(f"the calibration puts the step at {(p.model_step_s + p.calibration_s) * 1e3:.1f} ms, less than "
                     f"the {p.compute_s * 1e3:.1f} ms of compute the compute figure ({inputs.how['seconds']:.4f} s a "
                     "micro-batch) gives alone: that figure is too slow (a disturbed probe, or eager against compiled "
                     "training), so the steps shown follow what the runs measured; settings far from the measured one "
                     "are uncertain: pass --compute-s from a training run, or plan with --no-calibration when the "
                     "machine is idle")
    if uses_powersgd(cfg, rec, world):
        notes.append((f"PowerSGD: its own work {powersgd_s * 1e3:.1f} ms a step"
                      + (" (--powersgd-s)" if opts.powersgd_s is not None else ", measured here")
                      if powersgd_s is not None else
                      "PowerSGD: its own work is not measured with --compute-s (pass --powersgd-s), so its step "
                      "time is a lower bound")
                     + "; it sends plain all-reduces for the first comm.powersgd_start_step steps")
        if "powersgd" not in calibration:
            notes.append(f"PowerSGD is not calibrated on {world} ranks yet: its hook costs more across ranks than "
                         "the one-rank probe shows (first runs on GPU labs measured 23 % below to 6 % above this "
                         "prediction). "
                         f"`dscluster plan --calibrate` measures it first with a {calibration_run.STEPS}-step run on "
                         "these nodes; any PowerSGD run here does the same for the next plan")
    return notes


def batch_limit(opts: PlanOptions, cfg, global_batch: int) -> tuple[int, str | None]:
    """The largest global batch plan may recommend, and why it is the config's own where it is.

    With target_accuracy set the run is judged by time to accuracy: a larger global batch takes
    fewer optimizer steps per epoch under the same learning-rate schedule (a warm-up of
    optim.warmup_steps can outlast the run), so the recommendation keeps the config's batch
    unless --max-global-batch allows more."""
    if opts.max_global_batch is not None:
        return opts.max_global_batch, None
    if getattr(cfg, "target_accuracy", None) is not None:
        return global_batch, (f"target_accuracy is set: the recommendation keeps global_batch {global_batch} "
                              "(a larger batch takes fewer optimizer steps per epoch under the same schedule "
                              "and reached less accuracy in the same epochs); --max-global-batch N lets plan "
                              "raise it")
    return model.MAX_GLOBAL_BATCH, None


def build(opts: PlanOptions, inputs: PlanInputs, calibration: dict[str, dict],
          runs: list[dict] | None = None) -> tuple[dict, recommend.Recommendation]:
    """The plan document from measured inputs and the calibration, saved for `train` to compare with."""
    cfg = inputs.cfg
    world = inputs.world
    scenario = scenario_of(inputs, calibration)
    prediction = model.predict(scenario)
    mixed, balance = node_probe.mixed_notes(scenario, prediction, scenario.balanced)
    rec_scenario = replace(scenario, balanced=True) if balance else scenario
    limit, kept = batch_limit(opts, cfg, scenario.global_batch)
    comps = recommend.ladder(core.sync_label(cfg), allowed=lambda c: (
        inputs.allowed.get(c) and not (opts.every_step and c in model.SYNC_LADDER)))
    searched = recommend.recommend(rec_scenario, max_global_batch=limit, compressions=comps)  # by the step
    tried = recommend.options(rec_scenario, recommend.settings(rec_scenario, comps), model.ACCUM_CHOICES, limit,
                             stream=True)
    pricer = weigh.Pricer(inputs, scenario, prediction)
    judged, whole = weigh.weigh(pricer, rec_scenario, tried, balance)
    rec = recommendation_of(searched, judged)
    choice_start = ((whole.get("choice") or {}).get("costs") or {}).get("start_step")
    run_notes = (wholerun.run_note(cfg, pricer.facts, pricer.now_start,
                                   choice_start if choice_start != wholerun.powersgd_start(cfg) else None, world)
                 + datafeed.notes(pricer.facts, scenario.micro_batch * scenario.grad_accum, prediction.step_s)
                 + pricer.notes)
    doc = {
        "schema": SCHEMA_VERSION, "config": opts.config, "model": cfg.model.name, "params": inputs.params,
        "hostfile": inputs.hostfile.path, "world_size": world,
        "nodes": [{"name": n.name, "ranks": n.ranks, "compute_s": n.compute_s,
                   "images_per_s": n.images_per_s(inputs.micro), "alone_micro": n.alone_micro,
                   "alone_compute_s": n.alone_compute_s} for n in scenario.nodes],
        "micro_batch": inputs.micro, "grad_accum": inputs.accum, "global_batch": scenario.global_batch,
        "precision": inputs.precision, "compression": cfg.comm.compression, "sync": core.sync_label(cfg),
        "grad_format": inputs.grad_format,
        "grad_bytes": int(scenario.grad_bytes), "wire_bytes": int(scenario.wire_bytes),
        "busbw_GBps": inputs.busbw, "busbw_source": inputs.source, "compute": inputs.how,
        "latency_s": inputs.latency, "powersgd_s": inputs.powersgd_s, "calibration": calibration,
        "calibration_runs": runs or [],
        "assumptions": {"backward_share": model.BACKWARD_SHARE, "overlap_fraction": scenario.overlap_fraction,
                        "bucket_bytes": int(scenario.bucket_bytes)},
        "prediction": prediction.to_dict(),
        "runs": whole,
        "recommendation": {**rec.to_dict(), **advice.to_dict(judged), "pending": inputs.refused,
                           "overrides": list(judged.choice.overrides) if judged.choice else []},
        "saved_to": None,
        "notes": (notes_of(opts, inputs, calibration, rec, prediction) + mixed + run_notes + ([kept] if kept else [])
                  + advice_notes(cfg, judged)),
    }
    for entry in doc["recommendation"]["untested"]:
        entry["command"] = paste.lab_command(opts.config, opts.overrides, world, opts.hostfile, entry["overrides"])
    if rec.train_alone:
        node = prediction.fastest_node
        doc["recommendation"]["alone_command"] = paste.alone_command(
            opts.config, opts.overrides, node, next(n.ranks for n in scenario.nodes if n.name == node))
    if cfg.target_accuracy is not None:
        doc["time_to_accuracy"] = time_to_accuracy(cfg, scenario.global_batch, whole, rec, prediction,
                                                   accuracy.curves_for(cfg, scenario.global_batch))
        doc["notes"] += doc["time_to_accuracy"]["notes"]
    save(doc, saved_entries(doc, cfg, judged, opts))
    return doc, rec


def recommendation_of(searched: recommend.Recommendation, a: advice.Advice) -> recommend.Recommendation:
    """The step search's result with the advice's choice: the setting to paste, or none (train alone)."""
    choice = a.choice.option if a.choice is not None else None
    reached = choice is not None and choice.prediction.efficiency >= searched.target_efficiency
    return replace(searched, choice=choice, without_compression=None, reached=reached, train_alone=a.train_alone,
                   needed=None if reached else searched.needed, summary=advice.summary(a))


def advice_notes(cfg, a: advice.Advice) -> list[str]:
    """Why a setting is left out (its recorded curves trail), and what an untested one's measuring run is held
    against."""
    own = core.sync_label(cfg)
    notes = []
    for j in a.left_out:
        batch = j.option.prediction.global_batch
        what = f"global_batch={batch}"
        if j.option.compression != own:
            what = " ".join(core.sync_paste_args(j.option.compression, own)) + (
                f" at global batch {batch:,}" if batch != a.now.option.prediction.global_batch else "")
        notes.append(f"{what} is left out of the recommendation: {j.evidence.why}")
    if a.untested:
        notes.append(f"an untested setting's run records its held-out curve; the next plan holds it against "
                     f"every-step training at global batch {a.now.option.prediction.global_batch:,} at equal "
                     f"epochs, within {evidence.TOLERANCE * 100:g} point (the config as it is records that, "
                     f"on the lab or on {a.alone_node} alone)")
    return notes


def time_to_accuracy(cfg, global_batch: int, whole: dict, rec: recommend.Recommendation, p: model.Prediction,
                     curves: tuple[list[dict], str]) -> dict:
    """runmodel/accuracy.py's prediction for the config as given, the recommendation (where it keeps the
    global batch the recorded curves were made at) and the fastest node alone, from `curves`
    (accuracy.curves_for's answer)."""
    runs, compressions = {"now": whole.get("now")}, {"now": core.sync_label(cfg)}
    choice = rec.choice
    if choice is not None and choice.prediction.global_batch == global_batch:
        runs["choice"], compressions["choice"] = whole.get("choice"), choice.compression
    fastest = p.fastest_node
    alone_run = whole.get("alone")  # plan/weigh.py's, as the advice judges it
    alone = (fastest, phases.RunCosts(**alone_run["costs"])) if alone_run and whole.get("now") else None
    out = accuracy.predict(cfg, cfg.target_accuracy, global_batch, runs, alone, compressions, curves=curves)
    if choice is not None and "choice" not in runs:
        out["notes"].append(f"no time to accuracy for the recommendation: it changes the global batch to "
                            f"{choice.prediction.global_batch}, and the recorded curves are at {global_batch}")
    return out


def save(doc: dict, entries: dict[str, dict]) -> None:
    try:
        doc["saved_to"] = str(predicted.save(entries))
    except OSError as e:  # a read-only state directory costs the comparison at the end of the run, not the plan
        doc["notes"].append(f"could not save the prediction for `train` to compare with ({e})")
