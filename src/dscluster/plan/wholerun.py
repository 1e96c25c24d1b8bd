"""What plan's whole-run prediction (runmodel/phases.py) is made from for one setting: the data set's
facts (plan/datafeed.py: its size as training splits it, the fill probe, data.cache), the step
times of the setting with and without its compression (at least what the loader workers need to make
an uncached step's images), PowerSGD's start step, the warm-up's first-step costs, an evaluation pass
(train's own evaluation as the probe measured it, the cached held-out set's copy to the GPU, and the
making of an uncached held-out set), the loader's restart at an epoch end, the cache's fill and a
checkpoint save. The warm-up and the evaluation pass come from the newest run of the same setting where
one measured them (`from_runs`), else from the model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dscluster import core
from dscluster.plan import datafeed, model
from dscluster.runmodel import phases


def powersgd_start(cfg) -> int:

    return core.powersgd_start(cfg)


def start_for(cfg, compression: str, world: int, *, recommended: bool) -> int | None:
    """PowerSGD's start step in a run of this setting (None: nothing starts late). A recommendation
    that compresses with PowerSGD pastes phases.POWERSGD_START_STEP where the config's start is later."""
    if world <= 1:
        return None
    if core.parse_sync_label(compression)[1] > 1:  # local SGD: its warm-up steps all-reduce every step
        return cfg.sync.warmup_steps or None
    if compression != "powersgd":
        return None
    own = powersgd_start(cfg)
    return (phases.recommended_start(own) or own) if recommended else own


@dataclass(frozen=True, slots=True)
class FromRuns:
    """What a setting's whole run takes from the newest run of the same setting (its plan key), or models
    without one: the warm-up's first-step costs and the held-out pass of an epoch end (`from_runs`)."""

    warmup_extra_s: float
    warmup_source: str
    """"measured in run X" (the newest run of the setting), "measured in run X of another setting", or
    "modelled: ..."."""
    run_id: str | None = None
    eval_s: float | None = None
    """The held-out pass as that run measured it (the median of its passes; the loader's refill for the next
    epoch runs under it); None: modelled."""
    notes: tuple[str, ...] = ()
    """Lines for the plan's notes where a run's figures are used."""
    startup_s: float | None = None
    """That run's start to its first step, less the data cache's fill (the interpreter, imports, process group,
    engine); None: no run of the setting measured it. Shown beside the whole run, not in it."""
    save_s: float | None = None
    """A checkpoint save as that run measured it (the median of its saves); None: modelled."""

    @property
    def epoch_end_source(self) -> str:
        return f"measured in run {self.run_id}" if self.eval_s is not None or self.save_s is not None else "modelled"


def from_runs(probe_extra_s: float, facts: datafeed.DataFacts | str, measured: dict | None) -> FromRuns:
    """A setting's warm-up: the newest run of the same plan key as it measured it (its first step's start
    to the end of the fifth, less five steady steps: compilation with the compile cache as that run found
    it, the loader's start, the first kernels), else modelled: the probe's first step less its next
    (compilation) and the loader workers' start (the fill probe's), or where a run of another batch,
    compression or rank count of this model and precision measured more, that (`predicted.startup`). Its
    epoch end: that same run's held-out pass where it measured one, else modelled (`costs`)."""
    loader = facts.loader_start_s() if not isinstance(facts, str) else 0.0
    modelled = probe_extra_s + loader
    what = f"modelled: the probe's first step {probe_extra_s:.1f} s" + (
        f" and the loader workers' start {loader:.1f} s" if loader else "")
    if measured and measured.get("same_key"):
        run, held_out = measured["run_id"], measured.get("eval_s")
        notes = [f"whole run: warm-up as run {run} of this setting measured it, {measured['warmup_extra_s']:.1f} s "
                 f"beyond its first five steps ({what} would give {modelled:.1f} s): the newest run of the setting"]
        if held_out is not None:
            notes.append(f"whole run: each epoch end's held-out pass as run {run} measured it, {held_out:.2f} s "
                         "(the loader's refill for the next epoch under it)")
        saved = measured.get("save_s")
        if saved is not None:
            notes.append(f"whole run: each checkpoint save as run {run} measured it, {saved:.2f} s")
        return FromRuns(measured["warmup_extra_s"], f"measured in run {run}", run, held_out, tuple(notes),
                        measured.get("startup_s"), saved)
    if measured and measured["warmup_extra_s"] > modelled:
        run = measured["run_id"]
        return FromRuns(measured["warmup_extra_s"], f"measured in run {run} of another setting", run, notes=(
            f"whole run: warm-up as run {run} on {measured['ranks']} rank(s) measured it, "
            f"{measured['warmup_extra_s']:.1f} s beyond its first five steps ({what}); no run of this setting yet",))
    return FromRuns(modelled, what)


def costs(cfg, s: model.Scenario, p: model.Prediction, *, start: int | None, facts: datafeed.DataFacts,
          warmup_extra_s: float, params: int, uncalibrated: bool = False, eval_s_per_image: float | None = None,
          on_gpu: bool = True, measured_eval_s: float | None = None,
          measured_save_s: float | None = None) -> phases.RunCosts:
    """The run costs of scenario `s` (predicted as `p`), whose steps after `start` are compressed;
    `uncalibrated`: the model's steps before calibration (what train's outcomes are measured against);
    `eval_s_per_image`: train's evaluation measured by the probe, else a third of rank 0's compute;
    `on_gpu`: the ranks train on GPUs (a cached held-out set is copied there at each evaluation);
    `measured_eval_s`: a run's held-out pass, the loader's refill under it (`FromRuns.eval_s`);
    `measured_save_s`: a run's checkpoint save (`FromRuns.save_s`), in place of the folder's write rate
    (`facts.save_gbps`, else assumed)."""
    period = s.sync_period
    plain = model.predict(replace(s, compression="none")) if s.compression == "powersgd" or period > 1 else p
    pick = (lambda q: q.model_step_s) if uncalibrated else (lambda q: q.step_s)
    spe = max(1, facts.train_n // s.global_batch)
    delay = s.sync_stream[0]
    # blocking local SGD also averages at every epoch's end (syncmode.is_sync_point): spread over the epoch's steps
    epoch_average = p.comm_s * period / spe if period > 1 and spe % period and not delay else 0.0
    # streamed, the run's last step still averages, blocking: one whole transfer, paid once like the warm-up
    last_average = p.comm_s * period if delay else 0.0
    feed = facts.feed_step_s(s.micro_batch * s.grad_accum)
    every = cfg.checkpoint
    c = phases.RunCosts(
        plain_step_s=max(pick(plain), feed), step_s=max(pick(p) + epoch_average, feed), start_step=start,
        warmup_extra_s=warmup_extra_s + last_average, eval_s=held_out_s(cfg, s, facts, eval_s_per_image, on_gpu),
        save_s=params * phases.CHECKPOINT_BYTES_PER_PARAM / ((facts.save_gbps or phases.CHECKPOINT_WRITE_GBps) * 1e9),
        restart_s=facts.restart_s(s.micro_batch, s.grad_accum, spe),
        steps_per_epoch=spe, eval_every_epochs=cfg.eval_every_epochs,
        checkpoint_every_epochs=every.every_epochs, checkpoint_every_steps=every.every_steps,
        cache_fill_s=facts.fill_s(), cache_images=facts.cached_images, cache_workers=facts.workers)
    return phases.measured_epoch_ends(c, measured_eval_s if facts.holdout_n else None, measured_save_s)


def held_out_s(cfg, s: model.Scenario, facts: datafeed.DataFacts, eval_s_per_image: float | None,
               on_gpu: bool) -> float:
    """One held-out pass: rank 0's seconds per image (`eval_s_per_image`, else a third of its compute) over
    the whole set; where the ranks share it (core.evaluation_sharded), the slowest node's over the largest
    share, and one small all-reduce of the sums."""
    rank0 = eval_s_per_image or s.nodes[0].compute_s / s.micro_batch * phases.FORWARD_SHARE
    mode = core.parse_sync_label(s.compression)[0]
    # a streamed label is what its pasted line trains; a plain MODE:H keeps the config's own delay
    delay = s.sync_stream[0] or cfg.sync.delay_steps
    if s.world <= 1 or not facts.holdout_n or not core.evaluation_sharded(mode, delay):
        return facts.eval_s(facts.holdout_n * rank0, on_gpu)
    slowest = rank0 * max(n.compute_s for n in s.nodes) / s.nodes[0].compute_s
    share = phases.evaluation_share(facts.holdout_n, s.world)
    return facts.eval_s(share * slowest, on_gpu, ranks=s.world) + s.latency_s


def setting_run(cfg, s: model.Scenario, p: model.Prediction, facts: datafeed.DataFacts | str, *, start: int | None,
                runs: FromRuns, params: int, eval_s_per_image: float | None = None,
                on_gpu: bool = True) -> dict | None:
    """The whole-run prediction of one setting (phases.whole_run) with the model's uncalibrated steps
    beside it (`model_costs`), or None when the data set's size is unknown or smaller than a step."""
    if isinstance(facts, str) or facts.train_n < s.global_batch:
        return None
    def of(uncalibrated: bool) -> phases.RunCosts:
        return costs(cfg, s, p, start=start, facts=facts, warmup_extra_s=runs.warmup_extra_s, params=params,
                     uncalibrated=uncalibrated, eval_s_per_image=eval_s_per_image, on_gpu=on_gpu,
                     measured_eval_s=runs.eval_s, measured_save_s=runs.save_s)

    out = phases.whole_run(of(False), epochs=cfg.epochs, max_steps=cfg.max_steps, global_batch=s.global_batch,
                           warmup_source=runs.warmup_source, epoch_end_source=runs.epoch_end_source)
    out["warmup"]["run_id"] = runs.run_id
    out["startup"] = {"seconds": runs.startup_s, "source": None if runs.startup_s is None else
                      f"measured in run {runs.run_id}"}
    out["model_costs"] = of(True).to_dict()
    return out


def run_note(cfg, facts: datafeed.DataFacts | str, now_start: int | None, choice_start: int | None,
             world: int) -> list[str]:
    """What the reader should know about the whole-run figures and the start-step rule."""
    notes = []
    if isinstance(facts, str):
        notes.append(f"no whole-run prediction: {facts}; the step figures hold for the steady state only")
    elif facts.train_n and world:
        notes.append(f"whole run: {facts.train_n:,} training and {facts.holdout_n:,} held-out images, "
                     f"{cfg.epochs} epoch(s)"
                     + (f", max_steps {cfg.max_steps}" if cfg.max_steps > 0 else "")
                     + ("" if facts.save_gbps else
                        f"; checkpoint saves assumed at {phases.CHECKPOINT_WRITE_GBps} GB/s"))
    if now_start is not None and now_start > phases.WARMUP_STEPS:
        notes.append(f"comm.powersgd_start_step resolves to {now_start}: the run's first {now_start} steps send "
                     "uncompressed gradients, and the whole-run figure counts them")
    if choice_start is not None:
        notes.append(f"start-step rule: a recommendation with PowerSGD compresses from step {choice_start} "
                     f"(comm.powersgd_start_step={choice_start}), not after the learning-rate warm-up: "
                     f"{phases.POWERSGD_START_EVIDENCE}")
    return notes
