"""The plan document: the scenario the model predicts from `PlanInputs` and the calibration, the
recommendation, the notes, and the entries saved for `train` to compare with (plan/predicted.py).

The `--json` document (schema version `SCHEMA_VERSION`) is described in docs/schemas.md.
"""

from __future__ import annotations

from dataclasses import replace

from dscluster import syncmode
from dscluster.plan import accuracy, datafeed, model, phases, predicted, recommend, saveprobe, wholerun
from dscluster.plan import calibrate as calibration_run
from dscluster.plan import nodes as node_probe
from dscluster.plan.inputs import PlanInputs, PlanOptions, figure_of

SCHEMA_VERSION = 1


def overrides(cfg, current_global: int, option: recommend.Option | None, micro: int,
              start: int | None = None) -> list[str]:
    """key=value for `./entry_cn.sh` / `dscluster train`: all three batch keys, so the trainer's
    check micro × accum × world = global holds whatever the preset says, the compression, and
    PowerSGD's start step where the rule moves it (`wholerun.start_for`)."""
    out = []
    if option is not None and option.prediction.global_batch != current_global:
        out = [f"micro_batch={micro}", f"grad_accum={option.grad_accum}",
               f"global_batch={option.prediction.global_batch}"]
        if cfg.optim.lr_reference_batch is None:
            out.append(f"optim.lr_reference_batch={current_global}")  # linear LR scaling, as DeiT's recipe
    if option is not None and option.compression != syncmode.label(cfg):
        out += syncmode.paste_args(option.compression, syncmode.label(cfg))
    if option is not None and start is not None and start != wholerun.start_for(cfg, option.compression, 2,
                                                                               recommended=False):
        out.append(f"comm.powersgd_start_step={start}")
    return out


def saved_entries(doc: dict, cfg, rec: recommend.Recommendation, opts: PlanOptions) -> dict[str, dict]:
    """What `train` looks up at the end of a run (plan/predicted.py): the config as given and each
    recommended setting, keyed by what decides its figure, with its run costs (plan/phases.py)."""
    settings = [("now", syncmode.label(cfg), doc["prediction"], [])]
    for name in ("choice", "without_compression"):
        o = getattr(rec, name)
        if o is not None:
            start = (doc["runs"].get(name) or {}).get("costs", {}).get("start_step")
            settings.append((name, o.compression, o.to_dict()["prediction"],
                             overrides(cfg, doc["global_batch"], o, doc["micro_batch"], start)))
    out = {}
    tta = doc.get("time_to_accuracy") or {}
    for name, comp, p, ovr in settings:
        k = run_key(doc, cfg, p["global_batch"] if any(o.startswith("global_batch=") for o in ovr) else None, comp)
        entry = saved_entry(doc, opts, name, p, ovr, doc["runs"].get(name))
        if (tta.get("runs") or {}).get(name, {}).get("seconds"):  # plan/accuracy.py's, for train to compare with
            entry.update(time_to_accuracy_s=tta["runs"][name]["seconds"], target_accuracy=tta["target"])
        out.setdefault(k, entry)
    return out


def saved_entry(doc: dict, opts: PlanOptions, setting: str, p: dict, ovr: list[str], run: dict | None = None) -> dict:
    """One plans.json entry (plan/predicted.py): a setting's predicted figures and what they came from;
    with its whole-run prediction, the run costs train's comparison predicts the timed steps from."""
    entry = {"images_per_s": p["images_per_s"], "step_s": p["step_s"], "model_step_s": p["model_step_s"],
             "setting": setting, "config": opts.config, "hostfile": doc["hostfile"], "busbw_GBps": doc["busbw_GBps"],
             "compute_s": doc["compute"]["seconds"], "overrides": ovr, "compute": figure_of(doc["compute"])}
    if run is not None:
        entry.update(costs=run["costs"], model_costs=run["model_costs"])
    return entry


def run_key(doc: dict, cfg, global_batch: int | None, compression: str) -> str:
    """train's key (plan/predicted.py) for a run of this plan: `global_batch` where the overrides
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
                          grad_format=inputs.grad_format, compression=syncmode.label(cfg),
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
    cfg, world, powersgd_s = inputs.cfg, inputs.world, inputs.powersgd_s
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


def setting_runs(inputs: PlanInputs, scenario: model.Scenario, prediction: model.Prediction,
                 rec: recommend.Recommendation,
                 rec_scenario: model.Scenario) -> tuple[dict[str, dict | None], list[str]]:
    """The whole-run prediction of the config as given ("now") and of each recommended setting (made
    from `rec_scenario`), and the notes on them (`wholerun`): each setting's warm-up and epoch ends from
    the newest run of its own plan key where one measured them (`wholerun.from_runs`)."""
    cfg, world = inputs.cfg, inputs.world
    facts = datafeed.data_facts(cfg, max(h.slots for h in inputs.hostfile.hosts))
    probe_extra = float(inputs.how.get("warmup_extra_s") or 0.0)
    on_gpu = (inputs.how.get("device") or "cuda") != "cpu"  # --compute-s: the nodes' own GPUs
    notes: list[str] = []

    def runs_of(compression: str, global_batch: int | None) -> wholerun.FromRuns:
        key = predicted.key(model=cfg.model.name, micro_batch=inputs.micro,
                            global_batch=global_batch or cfg.global_batch or inputs.global_batch,
                            precision=inputs.precision, compression=compression, ranks=world)
        found = wholerun.from_runs(probe_extra, facts, predicted.startup(
            model=cfg.model.name, precision=inputs.precision, ranks=world, plan_key=key))
        notes.extend(n for n in found.notes if n not in notes)
        return found

    measured = predicted.startup(model=cfg.model.name, precision=inputs.precision, ranks=world)
    if measured and measured["cache_fill_s"] is not None and not isinstance(facts, str) and facts.cached_images:
        facts = replace(facts, measured_fill_s=measured["cache_fill_s"])
        notes.append(f"whole run: data cache fill as run {measured['run_id']} measured it, "
                     f"{measured['cache_fill_s']:.1f} s")
    every = cfg.checkpoint
    if not isinstance(facts, str) and (every.every_epochs or every.every_steps):
        rate = saveprobe.measure(saveprobe.checkpoint_folder(cfg), inputs.params * phases.CHECKPOINT_BYTES_PER_PARAM)
        if rate is not None:
            facts = replace(facts, save_gbps=rate.gbps)
            notes.append(rate.note())
    evaluation = inputs.how.get("eval_s_per_image")  # measured with train's own evaluation, where the probe ran
    now_start = wholerun.start_for(cfg, scenario.compression, world, recommended=False)
    runs = {"now": wholerun.setting_run(cfg, scenario, prediction, facts, start=now_start,
                                        runs=runs_of(scenario.compression, None), params=inputs.params,
                                        eval_s_per_image=evaluation, on_gpu=on_gpu)}
    choice_start = None
    for name in ("choice", "without_compression"):
        o = getattr(rec, name)
        if o is None:
            continue
        start = wholerun.start_for(cfg, o.compression, world, recommended=True)
        if name == "choice" and start is not None and start != wholerun.powersgd_start(cfg):
            choice_start = start  # the rule moved it: say why
        s = replace(rec_scenario, grad_accum=o.grad_accum, compression=o.compression, samples_per_step=None)
        gb = o.prediction.global_batch if o.prediction.global_batch != scenario.global_batch else None
        runs[name] = wholerun.setting_run(cfg, s, o.prediction, facts, start=start, runs=runs_of(o.compression, gb),
                                          params=inputs.params, eval_s_per_image=evaluation, on_gpu=on_gpu)
    feed = datafeed.notes(facts, scenario.micro_batch * scenario.grad_accum, prediction.step_s)
    return runs, wholerun.run_note(cfg, facts, now_start, choice_start, world) + feed + notes


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
    cfg, world = inputs.cfg, inputs.world
    scenario = scenario_of(inputs, calibration)
    prediction = model.predict(scenario)
    mixed, balance = node_probe.mixed_notes(scenario, prediction, scenario.balanced)
    rec_scenario = replace(scenario, balanced=True) if balance else scenario
    limit, kept = batch_limit(opts, cfg, scenario.global_batch)
    curves, source = accuracy.curves_for(cfg, scenario.global_batch)  # read once for the whole plan
    family = accuracy.family_for(cfg, scenario.global_batch)
    slow_learners = learning_too_slowly(cfg, curves, family)
    rec = recommend.recommend(rec_scenario, max_global_batch=limit,
                          compressions=recommend.ladder(syncmode.label(cfg), allowed=lambda c: (
                              inputs.allowed.get(c) and c not in slow_learners
                              and not (opts.every_step and c in model.SYNC_LADDER))))
    whole, run_notes = setting_runs(inputs, scenario, prediction, rec, rec_scenario)
    choice_start = ((whole.get("choice") or {}).get("costs") or {}).get("start_step")
    doc = {
        "schema": SCHEMA_VERSION, "config": opts.config, "model": cfg.model.name, "params": inputs.params,
        "hostfile": inputs.hostfile.path, "world_size": world,
        "nodes": [{"name": n.name, "ranks": n.ranks, "compute_s": n.compute_s,
                   "images_per_s": n.images_per_s(inputs.micro), "alone_micro": n.alone_micro,
                   "alone_compute_s": n.alone_compute_s} for n in scenario.nodes],
        "micro_batch": inputs.micro, "grad_accum": inputs.accum, "global_batch": scenario.global_batch,
        "precision": inputs.precision, "compression": cfg.comm.compression, "sync": syncmode.label(cfg),
        "grad_format": inputs.grad_format,
        "grad_bytes": int(scenario.grad_bytes), "wire_bytes": int(scenario.wire_bytes),
        "busbw_GBps": inputs.busbw, "busbw_source": inputs.source, "compute": inputs.how,
        "latency_s": inputs.latency, "powersgd_s": inputs.powersgd_s, "calibration": calibration,
        "calibration_runs": runs or [],
        "assumptions": {"backward_share": model.BACKWARD_SHARE, "overlap_fraction": scenario.overlap_fraction,
                        "bucket_bytes": int(scenario.bucket_bytes)},
        "prediction": prediction.to_dict(),
        "runs": whole,
        "recommendation": {**rec.to_dict(), "overrides": overrides(cfg, scenario.global_batch, rec.choice,
                                                                   inputs.micro, choice_start),
                           "pending": inputs.refused},
        "saved_to": None,
        "notes": (notes_of(opts, inputs, calibration, rec, prediction) + mixed + run_notes + ([kept] if kept else [])
                  + list(slow_learners.values())),
    }
    if balance:
        doc["recommendation"]["overrides"].append("batching=balanced")
    if rec.train_alone:
        doc["recommendation"]["alone_command"] = alone_command(opts, scenario, prediction.fastest_node)
    if cfg.target_accuracy is not None:
        doc["time_to_accuracy"] = time_to_accuracy(cfg, scenario.global_batch, whole, rec, prediction,
                                                   (curves, source))
        doc["notes"] += doc["time_to_accuracy"]["notes"]
    elif rec.choice is not None and rec.choice.compression != "none":
        why = slower_because(cfg, curves, family, rec.choice.compression)
        gb = rec.choice.prediction.global_batch
        if why and gb != scenario.global_batch:  # the curves are at the config's batch, not the recommendation's
            why += (f" (recorded at global batch {scenario.global_batch}; the recommendation trains at {gb}, "
                    "which no recorded run measured)")
        if why:  # recommended for speed: say what the recorded runs gave up, and how to weigh it
            doc["notes"].append(f"comm.compression={rec.choice.compression} is recommended for images/s, but {why}; "
                                "set target_accuracy=<held-out accuracy> and plan weighs it")
    save(doc, saved_entries(doc, cfg, rec, opts))
    return doc, rec


def alone_command(opts: PlanOptions, s: model.Scenario, node: str) -> str:
    """The README command for `node` alone, as a user pastes it: its one-line hostfile, then mpirun."""
    import shlex

    from dscluster.hosts import format_hostfile
    from dscluster.launch.builders import display
    from dscluster.launch.mpirun import App, mpirun_argv

    ranks = next(n.ranks for n in s.nodes if n.name == node)
    hosts = f"hosts-{node}.txt"
    argv = mpirun_argv("mpirun", [App(ranks, ["./entry_cn.sh", "--config", opts.config, *opts.overrides])],
                       hostfile=hosts)
    return (f"printf '%s\\n' {shlex.quote(format_hostfile([(node, ranks)]).strip())} > {shlex.quote(hosts)} && "
            + display(argv))


def slower_because(cfg, curves: list[dict], family: list[tuple[str, list[dict]]], compression: str) -> str | None:
    """Why `compression` learns too slowly (accuracy.slower's evidence), in words, saying at which run
    length where it comes from the family's curves; None where the recorded curves do not say so."""
    found = accuracy.slower(curves, family, compression)
    if found is None:
        return None
    why, length = found
    if length is None:
        return why
    own = accuracy.run_length(cfg)
    return f"at {length}, not this config's {own} (no recorded run at {own} compares it with uncompressed ones), {why}"


def learning_too_slowly(cfg, curves: list[dict], family: list[tuple[str, list[dict]]]) -> dict[str, str]:
    """{compression: why it is not recommended}: with target_accuracy set, the compressions whose
    recorded held-out `curves` trail uncompressed ones, or where those hold no comparison, the curves of
    another run length of the same `family` (plan/accuracy.py's rule); none without it."""
    if cfg.target_accuracy is None:
        return {}
    why = {c: slower_because(cfg, curves, family, c) for c in model.LADDER if c != "none"}
    return {c: (f"comm.compression={c} is left out of the recommendation: target_accuracy is set, and {w}")
            for c, w in why.items() if w}


def time_to_accuracy(cfg, global_batch: int, whole: dict, rec: recommend.Recommendation, p: model.Prediction,
                     curves: tuple[list[dict], str]) -> dict:
    """plan/accuracy.py's prediction for the config as given, the recommendation (where it keeps the
    global batch the recorded curves were made at) and the fastest node alone, from `curves`
    (accuracy.curves_for's answer)."""
    runs, compressions = {"now": whole.get("now")}, {"now": syncmode.label(cfg)}
    choice = rec.choice
    if choice is not None and choice.prediction.global_batch == global_batch:
        runs["choice"], compressions["choice"] = whole.get("choice"), choice.compression
    fastest = p.fastest_node
    alone = (fastest, p.node_images_per_s[fastest]) if len(p.node_images_per_s) > 1 else None
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
