"""The training loop every rank runs: one readable path from process group to summary.

Rank detection → what the config cannot apply here (exit 2 before anything is written) → run
directory → process group (bounded timeout) → the Trainer's components (setup_engine, Checkpointer)
→ resume → epochs of steps, held-out evaluation and checkpoints → summary and plan's prediction
beside the measured images/s. Any exception still writes the `end` record and, where this rank knows
the story, a failed summary.json; the process group is destroyed in `finally`. Stacks and the flight
recorder of a failing rank: docs/run-directory.md. Test-only faults: faults.FaultHook."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dscluster import console
from dscluster.core import datacache, dist, evaluation, faults, guards, localsgd, setup_engine, startgc, syncmode
from dscluster.core.comm import powersgd_start
from dscluster.core.config import TrainConfig, to_yaml
from dscluster.core.config_checks import ConfigValueError, compression_conflict, sync_conflict
from dscluster.core.losscale import CALIBRATION_START_POWER
from dscluster.core.optstep import StepBoundary
from dscluster.core.precision import PrecisionDecision, decide_here
from dscluster.core.step import TrainStep
from dscluster.core.timing import WARMUP_STEPS, ends_warmup, process_started, warmup_left_out
from dscluster.errors import DsclusterError, UsageError
from dscluster.files.fsutil import atomic_write_json, atomic_write_text
from dscluster.node import cpus, liveness
from dscluster.rundir import agree, layout
from dscluster.rundir.writer import RunLog, RunRecord
from dscluster.train import records
from dscluster.train.checkpoint import Checkpointer, Position
from dscluster.train.logwindow import LogWindow
from dscluster.train.memory import note_peaks
from dscluster.train.progress import ProgressBar
from dscluster.train.stopped import OnTerminate, record_stop
from dscluster.train.syncwatch import SyncWatch
from dscluster.train.traces import StackTraces


@dataclass
class Outcome:
    """What a run produced; the CLI turns it into an exit code and a line of text."""

    status: str
    accuracy: float | None = None
    steps: int = 0
    images_per_s: float | None = None
    """Steady: after the warm-up steps, to the last step (core/timing.py)."""
    run_images_per_s: float | None = None
    """The whole run: images ÷ wall-clock from the first step's start to the end, final evaluation in."""
    run_dir: Path | None = None
    steps_this_run: int = 0
    """Steps this process trained (a resumed run's, not the run's total): at most WARMUP_STEPS leave none out."""
    scale_history: list[tuple[float, bool]] = field(default_factory=list)  # calibration runs only


def train(cfg: TrainConfig, *, calibrate: bool = False) -> Outcome:
    """Run training (or an fp16 loss-scale calibration) on this rank."""
    t0 = time.time()
    info = dist.detect_ranks()
    cpu_note = cpus.free_launcher_binding()  # before CUDA, NCCL and the loader start their threads
    has_cuda = dist.prepare_accelerator()
    # bad input: exit 2 before anything is written
    decision = decide_precision(cfg, calibrate, info, has_cuda)
    check_comm_here(cfg, calibrate, decision)
    datacache.refuse_unfit(cfg.data, local_ranks=info.local_world_size,
                           primary=evaluation.evaluates(cfg, info.rank == 0))
    agree.require_one_run_dir()  # every rank one run directory, before any writes there
    run_id = layout.resolve_run_id()
    run_dir = layout.run_dir()
    stopped = OnTerminate()  # before StackTraces: faulthandler chains SIGTERM to it (train/stopped.py)
    traces = StackTraces(run_dir, info.rank)
    prepare_rank(info, run_id, run_dir, has_cuda)
    primary, host = info.rank == 0, dist.hostname()
    log = RunLog(run_dir, info.rank, host)
    log.write_env(cpus=cpus.cpu_list(os.sched_getaffinity(0)), cpus_note=cpu_note)
    if cpu_note and primary:
        console.err.print(f"[dim]dscluster train: {cpu_note}[/dim]")
    record = RunRecord(run_id=run_id, world_size=info.world_size, hosts=[host], model=cfg.model.name,
                       dataset=cfg.data.dataset, epochs=cfg.epochs)
    stopped.then = record_stop(log, record, run_dir, t0, summary=primary and not calibrate)
    device = None
    try:
        device = rank_device(info, has_cuda)
        rank = join(cfg, info, device, decision, calibrate, record)
        out = Trainer(cfg, rank, log, run_dir, record, faults.FaultHook(info.rank), calibrate=calibrate,
                      started=t0).fit()
        log.record("end", status="complete", error=None, **note_peaks(record, device))
        if primary and not calibrate:
            log.write_summary(record.summary(status="complete", wall_s=round(time.time() - t0, 3)))
        return out
    except guards.TrainingAborted as e:
        log.record("end", status="failed", error=str(e), **note_peaks(record, device))
        if primary:
            log.write_summary(record.summary(status="failed", wall_s=round(time.time() - t0, 3),
                                             failed_rank=e.failed_ranks[0], failed_host=e.failed_hosts[0],
                                             error=str(e), failed_ranks=e.failed_ranks))
        raise
    except BaseException as e:
        # Before anything else touches the broken group: what every rank's collectives were.
        dist.dump_flight_recorder(run_dir / layout.NCCL_TRACE_DIR, info.rank)
        traces.exception()
        record_crash(e, log, record, run_dir, device, primary=primary, wall_s=round(time.time() - t0, 3))
        raise
    finally:
        ProgressBar.stop_all()
        log.close()
        # The engine (and a DDP reducer in it) sits in reference cycles, frozen with the start-up: free it
        # while its process group still exists, not at interpreter exit (a rank then aborted in teardown,
        # "terminate called without an active exception"; core/startgc.py).
        startgc.release()
        dist.destroy()
        traces.close()
        stopped.close()


def prepare_rank(info, run_id: str, run_dir: Path, has_cuda: bool) -> None:
    """This process's settings before the group forms: threads, env, the primary rank, diagnostics."""
    dist.default_extensions_dir()  # before the env snapshot, so it shows where JIT ops are cached
    if not has_cuda:
        cpus.share_cores(info.local_world_size)  # ranks sharing a host share its cores
    dist.set_primary(info.rank == 0)
    dist.export_env(info, run_id)
    dist.enable_nccl_diagnostics(run_dir / layout.NCCL_TRACE_DIR)


def rank_device(info, has_cuda: bool) -> torch.device:
    """This rank's device, made current (a GPU of its node by local rank, else the CPU)."""
    if not has_cuda:
        return torch.device("cpu")
    device = torch.device("cuda", dist.device_for(info.local_rank, torch.cuda.device_count()))
    torch.cuda.set_device(device)
    return device


@dataclass
class Rank:
    """Who this process is in the run, settled once every rank has joined the group."""

    info: dist.RankInfo
    device: torch.device
    precision: str
    hosts: list[str]  # by rank
    nodes: list[str]
    """Each rank's machine (dist.node_identity), by rank: what local SGD groups into nodes."""

    @property
    def primary(self) -> bool:
        return self.info.rank == 0


def join(cfg: TrainConfig, info, device, decision: PrecisionDecision, calibrate: bool, record: RunRecord) -> Rank:
    """Collective: the process group, every rank's host and GPU (two ranks on one GPU: a warning) and
    one precision for all (ranks that decided differently: the run stops, naming them)."""
    backend = cfg.dist.backend if cfg.dist.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    dist.init_process_group(info, backend, cfg.dist.timeout_s, device)
    hosts = dist.all_gather_strings(record.hosts[0])
    record.hosts = sorted(set(hosts))
    nodes = dist.all_gather_strings(dist.node_identity())
    if device.type == "cuda":
        gpu = str(torch.cuda.get_device_properties(device).uuid)  # unique per card, across hosts too
        for ranks in dist.shared_gpus(dist.all_gather_strings(gpu)):
            if info.rank == 0:
                console.err.print(f"[yellow]warning:[/yellow] ranks {', '.join(map(str, ranks))} share one GPU "
                                  f"on {hosts[ranks[0]]}: start at most one rank per GPU (slots= in the hostfile, "
                                  "or CUDA_VISIBLE_DEVICES listing as many GPUs as the node has ranks)")
    precision = decision.precision
    if calibrate:
        if precision != "fp16" and device.type != "cuda":
            raise UsageError("loss-scale calibration needs fp16, which needs a GPU; this rank has none")
        precision = "fp16"
    record.precision = precision
    decisions = dist.all_gather_strings(precision)
    if len(set(decisions)) > 1:
        odd = [r for r, p in enumerate(decisions) if p != decisions[0]]
        chose = ", ".join(f"rank {r} on {hosts[r]}: {p}" for r, p in enumerate(decisions))
        raise guards.TrainingAborted(
            f"ranks chose different precisions ({chose}); run `dscluster check` so every node gets the "
            "cluster-wide DSCLUSTER_PRECISION, or set precision=", failed_ranks=odd,
            failed_hosts=[hosts[r] for r in odd])
    return Rank(info, device, precision, hosts, nodes)


def record_crash(e: BaseException, log: RunLog, record: RunRecord, run_dir: Path, device: torch.device | None, *,
                 primary: bool, wall_s: float) -> None:
    """The `end` record and, where this rank knows the story, a failed summary.json."""
    msg = f"{type(e).__name__}: {e}" if not isinstance(e, DsclusterError) else str(e)
    host = log.host
    failed_rank, failed_host = log.rank, host
    if dist.is_peer_failure(e):
        # This rank is the survivor: the collective failed because a peer is gone. Which one
        # shows in the run directory (its metrics stop without an end record, the traces);
        # a whole node that vanished does not answer any more: ask now, while it is still gone.
        failed_rank = failed_host = None
        record.vanished_hosts = liveness.vanished_hosts(host, record.hosts)
        if len(record.vanished_hosts) == 1:
            failed_host = record.vanished_hosts[0]
        msg = (f"{dist.PEER_FAILURE} or never joined (`dscluster diagnose {run_dir}` "
               f"names it){liveness.vanished_text(record.vanished_hosts, host)}: {msg}")
    log.record("end", status="failed", error=msg, **note_peaks(record, device))
    log.write_summary(record.summary(status="failed", wall_s=wall_s, failed_rank=failed_rank, failed_host=failed_host,
                                     error=msg), only_if_absent_or_not_failed=not primary)


def decide_precision(cfg: TrainConfig, calibrate: bool, info, has_cuda: bool) -> PrecisionDecision:
    """`decide_here`, once per training start, on this rank's own GPU. A refusal (precision=fp16 or
    bf16 on a CPU rank, bf16 on a pre-Ampere GPU, a bad DSCLUSTER_PRECISION) and loss-scale
    calibration without a GPU are bad input: exit 2 before the run directory exists."""
    if calibrate and not has_cuda:
        raise UsageError("--calibrate-loss-scale runs fp16, which needs a GPU; this rank has none "
                         "(calibrate on a GPU node, or drop --calibrate-loss-scale / calibrate_loss_scale)")
    return decide_here(cfg.precision, dist.device_for(info.local_rank, torch.cuda.device_count())
                       if has_cuda else None)


def check_comm_here(cfg: TrainConfig, calibrate: bool, decision: PrecisionDecision) -> None:
    """comm.compression and sync.mode against the precision this rank trains in: load_config could only
    check an explicit precision, `auto` is decided here (the same on every rank of a job that `check` set up)."""
    if cfg.comm.compression == "none" and cfg.sync.mode == "every_step":
        return
    precision = "fp16" if calibrate else decision.precision
    try:
        compression_conflict(cfg, precision)
        sync_conflict(cfg, precision)
    except ConfigValueError as e:
        why = "loss-scale calibration" if calibrate else decision.reason
        raise UsageError(f"precision {precision} on this rank ({why}): {e}") from None


class Trainer:
    """One rank's run: its components built once (engine, Checkpointer, step, log window), then
    `fit` drives them: resume, epochs of steps, held-out evaluation, checkpoints, the end."""

    def __init__(self, cfg: TrainConfig, rank: Rank, log: RunLog, run_dir: Path, record: RunRecord,
                 fault_hook: faults.FaultHook, *, calibrate: bool, started: float):
        if calibrate:
            cfg.fp16.initial_scale_power = CALIBRATION_START_POWER
            cfg.max_steps = cfg.fp16.calibrate_steps
        self.cfg = cfg
        self.rank = rank
        self.log = log
        self.run_dir = run_dir
        self.record = record
        self.faults = fault_hook
        self.calibrate = calibrate
        self.primary = rank.primary
        self.ckpt = Checkpointer(cfg, run_dir, rank.info, hosts=rank.hosts, device=rank.device, primary=rank.primary,
                                 calibrate=calibrate, faults=fault_hook)
        # through the module: a test follows the engine's life by patching setup_engine.build
        self.built = setup_engine.build(cfg, rank.info, rank.device, rank.precision,
                           evaluates=evaluation.evaluates(cfg, rank.primary),
                           node_local_checkpoints=self.ckpt.node_local, faults=fault_hook)
        startgc.settle()  # every import done, the engine built: the collector back, past all of it
        self.boundary = StepBoundary(self.built.engine, cfg, rank.precision)
        self.steps_per_epoch = self.built.sampler.steps_per_epoch
        self.total = self.built.total_steps
        if localsgd.local(cfg) and rank.info.world_size > 1:
            self.built.comm = localsgd.averager(cfg, rank, self.built, self.boundary)
        self.ckpt.attach(self.built, self.boundary)
        record.global_batch = sum(self.built.shares) * self.built.plan.grad_accum
        self.tta = evaluation.TimeToAccuracy(None if calibrate else cfg.target_accuracy, started, record.global_batch)
        self.write_run_files()

    def write_run_files(self) -> None:
        """The data cache's records, the engine's notes, and on rank 0 the config as resolved (config.yaml,
        ds_config.json, shares)."""
        for rec in self.built.data_cache:
            self.log.record("data_cache", **rec)
        if not self.primary:
            return
        for note in self.built.notes:
            console.err.print(f"[dim]dscluster train: {note}[/dim]")
        atomic_write_text(self.run_dir / layout.CONFIG_FILE, to_yaml(self.cfg))
        atomic_write_json(self.run_dir / layout.DS_CONFIG_FILE, self.built.ds_config)
        if self.built.share_plan is not None:
            atomic_write_json(self.run_dir / layout.SHARES_FILE, self.built.share_plan)

    def fit(self) -> Outcome:
        self.start = self.ckpt.resume()
        self.global_step = self.record.steps = self.start.global_step
        self.start_components()
        epoch, start_step = self.start.epoch, self.start.step_in_epoch
        if start_step >= self.steps_per_epoch:
            epoch, start_step = epoch + 1, 0
        done = self.global_step >= self.total
        if not done:
            self.check_equal_steps(epoch)
        while not done and epoch < self.cfg.epochs:
            done = self.run_epoch(epoch, start_step)
            epoch, start_step = epoch + 1, 0
        return self.finish()

    def start_components(self) -> None:
        """The `start` record, then what the steps need: the fp16 guard, the step, the log window,
        the progress bar and the host-sync watch."""
        cfg = self.cfg
        rank = self.rank
        built = self.built
        calibrate = self.calibrate
        info = rank.info
        device = rank.device
        self.log.record("start", world_size=info.world_size, local_rank=info.local_rank, device=str(device),
                        precision=rank.precision, micro_batch=built.shares[info.rank], grad_accum=built.plan.grad_accum,
                        global_batch=self.record.global_batch, pid=os.getpid(), params=built.params,
                        steps_per_epoch=self.steps_per_epoch, shares=built.shares, loss_weight=built.loss_weight,
                        resumed_from_step=self.global_step, launcher=info.source)
        guard = None
        if rank.precision == "fp16" and not calibrate:
            fp16 = cfg.fp16
            guard = guards.LossScaleGuard(window=fp16.guard_window, max_overflow_rate=fp16.guard_max_overflow_rate,
                                          min_scale=fp16.min_loss_scale, min_scale_steps=fp16.guard_min_scale_steps,
                                          rank=info.rank, host=self.log.host)
        generator = torch.Generator(device=device).manual_seed(cfg.seed * 7919 + info.rank * 104729 + self.global_step)
        self.progress = ProgressBar(self.primary and cfg.progress and not calibrate, self.total, self.global_step)
        self.ckpt.say = self.progress.print
        self.steps_this_run = 0
        self.accuracy = None
        self.watched = 0
        self.tta.first_step_t = time.time()
        self.tta.fill_s = sum(r["seconds"] or 0 for r in built.data_cache)
        self.run_length = self.total - self.global_step
        self.scale_history: list[tuple[float, bool]] = []
        self.window = LogWindow(self.log, built.split, self.boundary, guard, self.record, self.run_length,
                                scale_history=self.scale_history if calibrate else None)
        self.step = TrainStep(built.engine, built, cfg, rank.precision, self.boundary, device, built.split, generator)
        if isinstance(built.comm, localsgd.ModelAverager):
            self.step.averager = built.comm
        self.watch = SyncWatch(cfg.sync_debug if device.type == "cuda" and not calibrate else "off")
        if cfg.sync_debug != "off" and device.type != "cuda" and self.primary:
            console.err.print("[yellow]warning:[/yellow] sync_debug watches CUDA host syncs; this rank has no GPU, "
                              "so it is off")

    def check_equal_steps(self, epoch: int) -> None:
        """Collective, once a run: every rank runs as many steps per epoch. Not at each epoch's start, where
        the few bytes would queue on the link behind a streamed average in flight: the count never changes."""
        mine = self.steps_per_epoch + self.faults.extra_steps_per_epoch()
        counts = dist.all_gather_ints([mine], self.rank.device)
        guards.check_equal_steps([c[0] for c in counts], self.rank.hosts, epoch)

    def run_epoch(self, epoch: int, start_step: int) -> bool:
        """Collective: one epoch from `start_step`, its evaluation and its checkpoint; True when the run is done."""
        cfg = self.cfg
        steps_per_epoch = self.steps_per_epoch
        done, step_in_epoch = False, start_step - 1
        for step_in_epoch, micro in enumerate(self.built.sampler.steps(epoch, start_step), start=start_step):
            done = self.run_step(epoch, step_in_epoch, micro)
            if done:
                break
        self.window.flush(self.steps_this_run)
        last = done or epoch + 1 >= cfg.epochs
        evaluates = last or (epoch + 1) % cfg.eval_every_epochs == 0
        if not last and hasattr(self.built.sampler, "prime"):
            self.built.sampler.prime(epoch + 1)  # loader workers: the next epoch's batches during the evaluation
        if not self.calibrate and self.built.splits.holdout is not None and evaluates:
            self.accuracy = evaluation.held_out(self.built.engine, self.built, cfg, self.rank.device,
                                                primary=self.primary, log=self.log, progress=self.progress,
                                                epoch=epoch, step=self.global_step, tta=self.tta)
        if not done or step_in_epoch + 1 >= steps_per_epoch:  # the epoch ran to its end (not stopped by max_steps)
            self.ckpt.maybe_save(Position(epoch, steps_per_epoch, self.global_step), epoch_end=True, last=last)
        return done

    def run_step(self, epoch: int, step_in_epoch: int, micro) -> bool:
        """One optimizer step; True when it was the run's last."""
        self.global_step += 1
        step, cfg = self.global_step, self.cfg
        self.faults.before_step(step, self.log, cfg.dist.timeout_s)
        armed = self.steps_this_run >= WARMUP_STEPS
        self.watched += armed
        with self.watch.step(step, armed):
            result = self.step.run(micro, log_step=step % cfg.log_every == 0, step=step, step_in_epoch=step_in_epoch)
        self.steps_this_run += 1
        self.record.steps = step  # what a failed run's summary reports as reached
        self.window.add({"step": step, "epoch": epoch, "lr": float(self.built.engine.get_lr()[0]),
                         "loss_scale": result.loss_scale, "overflow": result.overflow, "samples": result.samples,
                         "grad_norm": result.grad_norm}, result.values, result.marks)
        self.progress.advance(epoch)
        if len(self.window) >= cfg.log_every or ends_warmup(self.steps_this_run, self.run_length):
            self.window.flush(self.steps_this_run)
        self.ckpt.maybe_save(Position(epoch, step_in_epoch + 1, step),
                             before=lambda: self.window.flush(self.steps_this_run))
        return step >= self.total

    def finish(self) -> Outcome:
        """The host-sync report, the run's figures into its record, and plan's comparison."""
        self.progress.stop()
        if hasattr(self.built.sampler, "close"):
            self.built.sampler.close()  # loader workers (core/loader.py): they exit now, not at interpreter exit
        if self.watch.enabled:
            for rec in self.watch.records():
                self.log.record("host_sync", **rec)
            if self.primary:
                console.err.print(f"dscluster train: {self.watch.summary(self.watched)}")
        global_batch = self.record.global_batch
        record = self.record
        out = Outcome(status="complete", accuracy=self.accuracy, steps=self.global_step,
                      images_per_s=self.window.images_per_s(global_batch), run_dir=self.run_dir,
                      steps_this_run=self.steps_this_run, scale_history=self.scale_history)
        record.steps = self.global_step
        record.images_per_s = out.images_per_s
        record.accuracy = self.accuracy
        record.timed_steps = self.window.window.timed_steps
        record.timed_s = round(self.window.window.timed_s, 4)
        record.warmup_steps = warmup_left_out(self.steps_this_run)
        run_s, out.run_images_per_s = self.window.window.whole_run(global_batch * self.steps_this_run)
        record.run_s = round(run_s, 3)
        record.run_images_per_s = out.run_images_per_s
        record.time_to_accuracy = self.tta.summary()
        if self.primary and not self.calibrate and self.start.global_step == 0:
            records.keep_curve(self.tta, self.cfg, compression=syncmode.label(self.cfg),
                               ranks=self.rank.info.world_size, run_id=record.run_id)
        if self.primary and not self.calibrate:
            records.plan_vs_measured(self.cfg, self.built, global_batch, self.rank.precision, self.rank.info, out,
                                     record, self.timed())
        return out

    def startup_s(self) -> float | None:
        """The process's start to its first step, less the data cache's fill: the interpreter, the imports,
        the process group, the engine (core/timing.py `process_started`)."""
        started = process_started()
        if started is None or self.tta.first_step_t is None:
            return None
        return max(0.0, self.tta.first_step_t - started - self.tta.fill_s)

    def timed(self) -> dict:
        """What plan's phase-aware comparison needs of this run (runmodel/predicted.py `timed`)."""
        powersgd = self.built.comm is not None and self.cfg.comm.compression == "powersgd"
        reached = self.tta.reached or {}
        return {"resumed_at": self.start.global_step, "last": self.global_step, "total": self.total,
                "epochs": self.cfg.epochs, "steps_per_epoch": self.steps_per_epoch,
                "start_step": powersgd_start(self.cfg) if powersgd else None,
                "target_accuracy": self.tta.target, "time_to_accuracy_s": reached.get("training_seconds"),
                "warmup_s": self.window.window.warmup_s, "cache_fill_s": self.tta.fill_s,
                "startup_s": self.startup_s(),
                # the held-out passes at epoch ends inside the timed windows: the last one comes after them,
                # with no next epoch's loader refill under it
                "eval_s": statistics.median(self.tta.eval_seconds[:-1]) if self.tta.eval_seconds[:-1] else None,
                # its checkpoint saves: modelled from one timed write (plan/saveprobe.py), so a save's miss must
                # not count as the step's
                "save_s": statistics.median(self.ckpt.save_seconds) if self.ckpt.save_seconds else None}
