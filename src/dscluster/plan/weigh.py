"""Each setting recommend.py tried, priced by the whole-run model and weighed for evidence: what
plan/advice.py decides from. `Pricer` reads once what every setting's whole run shares (the data set's
facts, the cache fill and checkpoint saves as runs or the save probe measured them, the evaluation the
compute probe measured); each setting's warm-up and epoch ends come from the newest run of its own plan key
(wholerun.from_runs). The fastest node alone is priced on the same epochs, at its own step.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from dscluster import core
from dscluster.plan import advice, datafeed, evidence, model, paste, recommend, saveprobe, wholerun
from dscluster.plan.inputs import PlanInputs
from dscluster.runmodel import accuracy, phases, predicted


class Pricer:
    """Whole runs of a plan's settings (phases.whole_run's dicts), and the notes on what they are made from."""

    def __init__(self, inputs: PlanInputs, scenario: model.Scenario, prediction: model.Prediction):
        cfg: Any = inputs.cfg
        self.inputs = inputs
        self.scenario = scenario
        self.prediction = prediction
        self.facts = datafeed.data_facts(cfg, max(h.slots for h in inputs.hostfile.hosts))
        self.notes: list[str] = []
        measured = predicted.startup(model=cfg.model.name, precision=inputs.precision, ranks=inputs.world)
        facts = self.facts
        if measured and measured["cache_fill_s"] is not None and not isinstance(facts, str) and facts.cached_images:
            self.facts = replace(facts, measured_fill_s=measured["cache_fill_s"])
            self.notes.append(f"whole run: data cache fill as run {measured['run_id']} measured it, "
                              f"{measured['cache_fill_s']:.1f} s")
        every = cfg.checkpoint
        if not isinstance(self.facts, str) and (every.every_epochs or every.every_steps):
            rate = saveprobe.measure(saveprobe.checkpoint_folder(cfg),
                                     inputs.params * phases.CHECKPOINT_BYTES_PER_PARAM)
            if rate is not None:
                self.facts = replace(self.facts, save_gbps=rate.gbps)
                self.notes.append(rate.note())
        self.now_start = wholerun.start_for(cfg, scenario.compression, inputs.world, recommended=False)

    def runs_of(self, compression: str, global_batch: int | None) -> wholerun.FromRuns:
        inputs = self.inputs
        cfg: Any = inputs.cfg
        key = predicted.key(model=cfg.model.name, micro_batch=inputs.micro,
                            global_batch=global_batch or cfg.global_batch or inputs.global_batch,
                            precision=inputs.precision, compression=compression, ranks=inputs.world)
        found = wholerun.from_runs(float(inputs.how.get("warmup_extra_s") or 0.0), self.facts, predicted.startup(
            model=cfg.model.name, precision=inputs.precision, ranks=inputs.world, plan_key=key))
        self.notes.extend(n for n in found.notes if n not in self.notes)
        return found

    def price(self, s: model.Scenario, p: model.Prediction, start: int | None, global_batch: int | None) -> dict | None:
        inputs = self.inputs
        return wholerun.setting_run(inputs.cfg, s, p, self.facts, start=start,
                                    runs=self.runs_of(s.compression, global_batch), params=inputs.params,
                                    eval_s_per_image=inputs.how.get("eval_s_per_image"),
                                    on_gpu=(inputs.how.get("device") or "cuda") != "cpu")  # --compute-s: GPUs

    def now(self) -> dict | None:
        return self.price(self.scenario, self.prediction, self.now_start, None)

    def option(self, o: recommend.Option, rec_scenario: model.Scenario) -> tuple[dict | None, int | None]:
        """An option's whole run and PowerSGD's start step in it (the recommendation's rule)."""
        start = wholerun.start_for(self.inputs.cfg, o.compression, self.inputs.world, recommended=True)
        s = replace(rec_scenario, grad_accum=o.grad_accum, compression=o.compression, samples_per_step=None)
        gb = o.prediction.global_batch if o.prediction.global_batch != self.scenario.global_batch else None
        return self.price(s, o.prediction, start, gb), start

    def alone(self, now_run: dict | None, node: str) -> dict | None:
        """The fastest node alone on the same epochs at the config's global batch: the config's run, each step
        the node's own (no all-reduce, no sync period, nothing compressed), at least what its loader workers
        take to make its ranks' images where they are not cached."""
        if now_run is None or isinstance(self.facts, str):
            return None
        ranks = next(n.ranks for n in self.scenario.nodes if n.name == node)
        gb = self.scenario.global_batch
        step_s = max(gb / self.prediction.node_images_per_s[node], self.facts.feed_step_s(-(-gb // ranks)))
        costs = replace(phases.RunCosts(**now_run["costs"]), plain_step_s=step_s, step_s=step_s, start_step=None)
        cfg: Any = self.inputs.cfg
        return phases.whole_run(costs, epochs=cfg.epochs, max_steps=cfg.max_steps,
                                global_batch=self.scenario.global_batch,
                                warmup_source=now_run["warmup"]["source"],
                                epoch_end_source=now_run["epoch_ends"]["source"])

    def steps_per_epoch(self, global_batch: int) -> int | None:
        return None if isinstance(self.facts, str) else max(1, self.facts.train_n // global_batch)


def weigh(pricer: Pricer, rec_scenario: model.Scenario, tried: list[recommend.Option],
          balance: bool) -> tuple[advice.Advice, dict[str, dict | None]]:
    """The advice from every option `tried` (recommend's order of preference) and the config as given, and the
    whole runs it shows ("now", "choice", "alone")."""
    inputs = pricer.inputs
    scenario = pricer.scenario
    prediction = pricer.prediction
    cfg: Any = inputs.cfg
    own_label = core.sync_label(cfg)
    own_batch = scenario.global_batch
    at_batch: dict[int, list[dict]] = {}

    def curves_at(global_batch: int) -> list[dict]:
        if global_batch not in at_batch:  # the trajectory the pasted line trains: its batch, its scaled rate
            scaled = cfg if global_batch == own_batch or cfg.optim.lr_reference_batch else replace(
                cfg, optim=replace(cfg.optim, lr_reference_batch=own_batch))
            at_batch[global_batch] = accuracy.curves_for(scaled, global_batch)[0]
        return at_batch[global_batch]

    family = accuracy.family_for(cfg, own_batch)
    target = cfg.target_accuracy
    own_curves = curves_at(own_batch)
    # judged by the time to the target where the node alone's curves (every step, this batch) reach it
    alone_step = accuracy.reach(own_curves, target, "none")["step"] if target and own_curves else None
    judged_by = f"time to {target:.1%}" if alone_step else "whole run"

    def seconds(run: dict | None, label: str, global_batch: int) -> float | None:
        if run is None or alone_step is None:
            return None if run is None else run["seconds"]
        step = accuracy.reach(curves_at(global_batch), target, label)["step"]
        return None if step is None else to_step(run, step)

    def to_step(run: dict, step: int) -> float:  # rounded as runmodel/accuracy.py's time to accuracy is
        return round(accuracy.seconds_to(phases.RunCosts(**run["costs"]), step, epochs=cfg.epochs,
                                         max_steps=cfg.max_steps), 1)

    def judged(o: recommend.Option) -> advice.Judged:
        run, start = pricer.option(o, rec_scenario)
        gb = o.prediction.global_batch
        found = evidence.judge(o.compression, gb, own_label=own_label, own_batch=own_batch,
                               lr_scaled=gb != own_batch, curves_at=curves_at, steps_per_epoch=pricer.steps_per_epoch,
                               family_says=lambda label: evidence.slower_because(cfg, own_curves, family, label))
        pasted = paste.overrides(cfg, own_batch, o, inputs.micro, start) + (["batching=balanced"] if balance else [])
        return advice.Judged(option=o, run=run, seconds=seconds(run, o.compression, gb), evidence=found,
                             overrides=tuple(pasted))

    now_run = pricer.now()
    now = advice.Judged(option=recommend.Option(grad_accum=inputs.accum, compression=own_label, prediction=prediction),
                        run=now_run, seconds=seconds(now_run, own_label, own_batch),
                        evidence=evidence.Evidence(evidence.KEPT))
    fastest = prediction.fastest_node
    alone_run = pricer.alone(now_run, fastest)
    alone_s = None
    if alone_run is not None:
        alone_s = alone_run["seconds"] if alone_step is None else to_step(alone_run, alone_step)
    # a batch larger than the training set trains nothing (steps per epoch = images // global batch)
    trainable = [o for o in tried if isinstance(pricer.facts, str) or o.prediction.global_batch <= pricer.facts.train_n]
    a = advice.advise(now, [judged(o) for o in trainable], alone_node=fastest, alone_s=alone_s,
                      several_nodes=len(scenario.nodes) > 1, target_efficiency=model.TARGET_EFFICIENCY,
                      judged_by=judged_by, warmup_steps=cfg.optim.warmup_steps)
    runs = {"now": now_run, "alone": alone_run if len(scenario.nodes) > 1 else None}
    if a.choice is not None and a.choice is not now:
        runs["choice"] = a.choice.run
    return a, runs
