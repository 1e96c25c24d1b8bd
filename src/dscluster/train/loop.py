"""The training loop every rank runs: one readable path from process group to summary.

Order of events: rank detection and env → what the config cannot apply here (comm.compression
for this rank's precision: exit 2 before anything is written) → run directory (env snapshot) →
process group (gloo on CPU, nccl on GPU, bounded timeout) → data/model/engine (setup_engine) →
resume → per epoch: equal-step check, steps (step.py; records per log window, logwindow.py),
held-out eval on rank 0 between barriers (evaluation.py), checkpoint → summary, and plan's
saved prediction beside the measured images/s (plan/predicted.py). Any exception still writes the
`end` record and, where this rank knows the story, a failed summary.json; the process group is
destroyed in `finally`. Every rank keeps RUN_DIR/traces/rank-R.txt open for Python stack dumps
(traces.py); a failing rank also dumps torch's flight recorder to RUN_DIR/nccl_trace/ before the
group is destroyed, on gloo as on NCCL. Test-only faults: faults.py.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dscluster import console, cpus, liveness, runinfo
from dscluster.errors import DsclusterError, UsageError
from dscluster.fsutil import atomic_write_json, atomic_write_text
from dscluster.plan import predicted
from dscluster.train import checkpoint, dist, evaluation, faults, guards, nodelocal
from dscluster.train.config import TrainConfig, to_yaml
from dscluster.train.config_checks import ConfigValueError, compression_conflict
from dscluster.train.logwindow import LogWindow
from dscluster.train.optstep import StepBoundary
from dscluster.train.precision import PrecisionDecision, decide_here
from dscluster.train.progress import ProgressBar
from dscluster.train.runlog import RunLog, summary_record
from dscluster.train.step import TrainStep
from dscluster.train.syncwatch import SyncWatch
from dscluster.train.timing import WARMUP_STEPS, ends_warmup
from dscluster.train.traces import StackTraces


@dataclass
class Outcome:
    """What a run produced; the CLI turns it into an exit code and a line of text."""

    status: str
    accuracy: float | None = None
    steps: int = 0
    images_per_s: float | None = None
    run_dir: Path | None = None
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
    run_id = runinfo.resolve_run_id()
    rdir = runinfo.run_dir()
    traces = StackTraces(rdir, info.rank)
    dist.default_extensions_dir()  # before the env snapshot, so it shows where JIT ops are cached
    if not has_cuda and not os.environ.get("OMP_NUM_THREADS"):
        # ranks sharing a host share its cores; oversubscribed OpenMP threads spin and crawl
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, info.local_world_size)))
    dist.set_primary(info.rank == 0)
    primary = info.rank == 0
    dist.export_env(info, run_id)
    dist.enable_nccl_diagnostics(rdir / "nccl_trace")
    host = dist.hostname()
    my_fault = faults.for_rank(info.rank)
    log = RunLog(rdir, info.rank, host)
    log.write_env(cpus=cpus.cpu_list(os.sched_getaffinity(0)), cpus_note=cpu_note)
    if cpu_note and primary:
        console.err.print(f"[dim]dscluster train: {cpu_note}[/dim]")
    out = Outcome(status="failed", run_dir=rdir)
    facts: dict = {"run_id": run_id, "world_size": info.world_size, "hosts": [host], "model": cfg.model.name,
                   "dataset": cfg.data.dataset, "epochs": cfg.epochs, "steps": 0, "overflow_steps": 0}
    has_cuda_device = False
    try:
        device = torch.device("cpu")
        if has_cuda:
            device = torch.device("cuda", dist.device_for(info.local_rank, torch.cuda.device_count()))
            torch.cuda.set_device(device)
            has_cuda_device = True
        backend = cfg.dist.backend if cfg.dist.backend != "auto" else ("nccl" if has_cuda else "gloo")
        dist.init_process_group(info, backend, cfg.dist.timeout_s, device)
        hosts = dist.all_gather_strings(host)
        facts["hosts"] = sorted(set(hosts))
        if has_cuda_device:
            gpu = str(torch.cuda.get_device_properties(device).uuid)  # unique per card, across hosts too
            for ranks in dist.shared_gpus(dist.all_gather_strings(gpu)):
                if primary:
                    console.err.print(f"[yellow]warning:[/yellow] ranks {', '.join(map(str, ranks))} share one GPU "
                                      f"on {hosts[ranks[0]]}: start at most one rank per GPU (slots= in the hostfile, "
                                      "or CUDA_VISIBLE_DEVICES listing as many GPUs as the node has ranks)")
        precision = decision.precision
        if calibrate:
            if precision != "fp16" and not has_cuda:
                raise UsageError("loss-scale calibration needs fp16, which needs a GPU; this rank has none")
            precision = "fp16"
        facts["precision"] = precision
        decisions = dist.all_gather_strings(precision)
        if len(set(decisions)) > 1:
            odd = [r for r, p in enumerate(decisions) if p != decisions[0]]
            raise guards.TrainingAborted(
                f"ranks chose different precisions ({', '.join(f'rank {r} on {hosts[r]}: {p}' for r, p in enumerate(decisions))}); "
                "run `dscluster check` so every node gets the cluster-wide DSCLUSTER_PRECISION, or set precision=",
                failed_ranks=odd, failed_hosts=[hosts[r] for r in odd])
        out = _run(cfg, info, device, precision, hosts, log, rdir, facts, my_fault, calibrate, primary, started=t0)
        facts["peak_mem_mb"] = peak_mem_mb(has_cuda_device)
        log.record("end", status="complete", error=None, peak_mem_mb=facts["peak_mem_mb"])
        if primary and not calibrate:
            log.write_summary(summary_record(status="complete", wall_s=round(time.time() - t0, 3), **facts))
        return out
    except guards.TrainingAborted as e:
        facts["peak_mem_mb"] = peak_mem_mb(has_cuda_device)
        log.record("end", status="failed", error=str(e), peak_mem_mb=facts["peak_mem_mb"])
        if primary:
            log.write_summary(summary_record(
                status="failed", wall_s=round(time.time() - t0, 3), failed_rank=e.failed_ranks[0],
                failed_host=e.failed_hosts[0], error=str(e), failed_ranks=e.failed_ranks, **facts))
        raise
    except BaseException as e:
        # Before anything else touches the broken group: what every rank's collectives were.
        dist.dump_flight_recorder(rdir / "nccl_trace", info.rank)
        traces.exception()
        msg = f"{type(e).__name__}: {e}" if not isinstance(e, DsclusterError) else str(e)
        failed_rank, failed_host = info.rank, host
        if dist.is_peer_failure(e):
            # This rank is the survivor: the collective failed because a peer is gone. Which one
            # shows in the run directory (its metrics stop without an end record, the traces);
            # a whole node that vanished does not answer any more: ask now, while it is still gone.
            failed_rank = failed_host = None
            facts["vanished_hosts"] = liveness.vanished_hosts(host, facts["hosts"])
            if len(facts["vanished_hosts"]) == 1:
                failed_host = facts["vanished_hosts"][0]
            msg = (f"a collective failed: another rank died or never joined (`dscluster diagnose {rdir}` "
                   f"names it){liveness.vanished_text(facts['vanished_hosts'], host)}: {msg}")
        facts["peak_mem_mb"] = peak_mem_mb(has_cuda_device)
        log.record("end", status="failed", error=msg, peak_mem_mb=facts["peak_mem_mb"])
        log.write_summary(summary_record(status="failed", wall_s=round(time.time() - t0, 3), failed_rank=failed_rank,
                                         failed_host=failed_host, error=msg, **facts),
                          only_if_absent_or_not_failed=not primary)
        raise
    finally:
        ProgressBar.stop_all()
        log.close()
        # The engine (and a DDP reducer in it) sits in reference cycles: free it while its
        # process group still exists, not at interpreter exit (a rank then aborted in teardown,
        # "terminate called without an active exception").
        gc.collect()
        dist.destroy()
        traces.close()


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
    """comm.compression against the precision this rank trains in: load_config could only check an
    explicit precision, `auto` is decided here (the same on every rank of a job that `check` set up)."""
    if cfg.comm.compression == "none":
        return
    precision = "fp16" if calibrate else decision.precision
    try:
        compression_conflict(cfg, precision)
    except ConfigValueError as e:
        why = "loss-scale calibration" if calibrate else decision.reason
        raise UsageError(f"precision {precision} on this rank ({why}): {e}") from None


def peak_mem_mb(on_cuda: bool) -> float | None:
    """Peak GPU memory this process allocated (MiB); None on CPU, where there is no device pool."""
    if not on_cuda:
        return None
    try:
        return round(torch.cuda.max_memory_allocated() / 2**20, 1)
    except Exception:
        return None


def _run_facts(cfg: TrainConfig, b, pos, last: int) -> dict:
    """What plan's phase-aware comparison needs of this run (plan/predicted.py `timed`)."""
    from dscluster.train.comm import powersgd_start

    powersgd = b.comm is not None and cfg.comm.compression == "powersgd"
    return {"resumed_at": pos.global_step, "last": last, "total": b.total_steps, "epochs": cfg.epochs,
            "steps_per_epoch": b.sampler.steps_per_epoch, "start_step": powersgd_start(cfg) if powersgd else None}


def _run(cfg: TrainConfig, info, device, precision, hosts, log: RunLog, rdir: Path, facts: dict,
         my_fault: dict, calibrate: bool, primary: bool, started: float) -> Outcome:
    from dscluster.train.setup_engine import build

    if calibrate:
        from dscluster.train.losscale import CALIBRATION_START_POWER

        cfg.fp16.initial_scale_power = CALIBRATION_START_POWER
        cfg.max_steps = cfg.fp16.calibrate_steps
    shared = nodelocal.run_dir_shared(rdir, info.rank)   # without NFS every node keeps its own checkpoint
    b = build(cfg, info, device, precision, node_local_checkpoints=not shared)
    engine, sampler = b.engine, b.sampler
    boundary = StepBoundary(engine, cfg, precision)
    spe = sampler.steps_per_epoch
    facts.update(global_batch=sum(b.shares) * b.plan.grad_accum)
    tta = evaluation.TimeToAccuracy(None if calibrate else cfg.target_accuracy, started, facts["global_batch"])
    for note in b.notes:
        if primary:
            console.err.print(f"[dim]dscluster train: {note}[/dim]")
    if primary:
        atomic_write_text(rdir / runinfo.CONFIG_FILE, to_yaml(cfg))
        atomic_write_json(rdir / runinfo.DS_CONFIG_FILE, b.ds_config)
        if b.share_plan is not None:
            atomic_write_json(rdir / "shares.json", b.share_plan)

    ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else rdir / runinfo.CHECKPOINT_DIR
    # what a checkpoint keeps per rank beside DeepSpeed's files: PowerSGD's error feedback
    rank_state = None if b.comm is None else (lambda tag_dir: b.comm.save(tag_dir, info.rank, info.world_size))
    pos = checkpoint.Position(0, 0, 0)
    if not calibrate:
        tag = checkpoint.resume_decision(cfg.checkpoint.resume, ckpt_dir)
        tag = nodelocal.resume_agreement(dist.all_gather_strings(tag or ""), hosts, ckpt_dir, shared)
        if tag:
            pos, client = checkpoint.load(engine, ckpt_dir, tag)
            boundary.load_state_dict(client)
            note = b.comm.restore(ckpt_dir / tag, info.rank, info.world_size, device,
                                  dist.all_gather_strings) if b.comm is not None else None
            if primary:
                console.err.print(f"dscluster train: resumed from {ckpt_dir}/{tag} at global step {pos.global_step}")
                if note:
                    console.err.print(f"[dim]dscluster train: {note}[/dim]")
    epoch, start_step, global_step = pos.epoch, pos.step_in_epoch, pos.global_step
    facts["steps"] = global_step
    if start_step >= spe:
        epoch, start_step = epoch + 1, 0

    log.record("start", world_size=info.world_size, local_rank=info.local_rank, device=str(device),
               precision=precision, micro_batch=b.shares[info.rank], grad_accum=b.plan.grad_accum,
               global_batch=facts["global_batch"], pid=os.getpid(), params=b.params, steps_per_epoch=spe,
               shares=b.shares, loss_weight=b.loss_weight, resumed_from_step=global_step,
               launcher=info.source)
    guard = None
    if precision == "fp16" and not calibrate:
        guard = guards.LossScaleGuard(window=cfg.fp16.guard_window, max_overflow_rate=cfg.fp16.guard_max_overflow_rate,
                                      min_scale=cfg.fp16.min_loss_scale, min_scale_steps=cfg.fp16.guard_min_scale_steps,
                                      rank=info.rank, host=log.host)
    total = b.total_steps
    gen = torch.Generator(device=device).manual_seed(cfg.seed * 7919 + info.rank * 104729 + global_step)
    progress = ProgressBar(primary and cfg.progress and not calibrate, total, global_step)
    out = Outcome(status="complete", run_dir=rdir)
    steps_this_run, accuracy = 0, None
    run_length = total - pos.global_step
    window = LogWindow(log, b.split, boundary, guard, facts, run_length,
                       scale_history=out.scale_history if calibrate else None)
    trainer = TrainStep(engine, b, cfg, precision, boundary, device, b.split, gen)
    watch = SyncWatch(cfg.sync_debug if device.type == "cuda" and not calibrate else "off")
    if cfg.sync_debug != "off" and device.type != "cuda" and primary:
        console.err.print("[yellow]warning:[/yellow] sync_debug watches CUDA host syncs; this rank has no GPU, "
                          "so it is off")
    watched = 0

    failed_saves = 0

    def save(pos: checkpoint.Position) -> None:
        nonlocal failed_saves
        f = my_fault.get("disk_full")
        ok, msg = checkpoint.save(engine, ckpt_dir, pos, rank=info.rank, fail_save=f is not None and f.step == pos.global_step,
                                  extra=boundary.state_dict(), rank_state=rank_state,
                                  writes_latest=nodelocal.writes_latest(info.rank, info.local_rank, shared))
        failed_saves, msg = checkpoint.after_save(ok, msg, failed_saves)  # the stated rule: stops at the 2nd
        if not ok or primary:
            (progress.print if primary else console.err.print)(
                f"{'[yellow]warning:[/yellow] ' if not ok else ''}{msg}" + ("" if primary else f" (rank {info.rank})"))

    done = global_step >= total
    while not done and epoch < cfg.epochs:
        counts = dist.all_gather_ints([spe + (1 if "mismatch_steps" in my_fault else 0)], device)
        guards.check_equal_steps([c[0] for c in counts], hosts, epoch)
        step_in_epoch = start_step - 1
        for step_in_epoch, micro in enumerate(sampler.steps(epoch, start_step), start=start_step):
            global_step += 1
            faults.inject(my_fault, global_step, log, cfg.dist.timeout_s)
            armed = steps_this_run >= WARMUP_STEPS
            watched += armed
            with watch.step(global_step, armed):
                r = trainer.run(micro, log_step=global_step % cfg.log_every == 0)
            steps_this_run += 1
            facts["steps"] = global_step  # what a failed run's summary reports as reached
            window.add({"step": global_step, "epoch": epoch, "lr": float(engine.get_lr()[0]), "loss_scale": r.loss_scale,
                        "overflow": r.overflow, "samples": r.samples, "grad_norm": r.grad_norm}, r.values, r.marks)
            progress.advance(epoch)
            done = global_step >= total
            every = cfg.checkpoint.every_steps
            save_now = bool(every and global_step % every == 0 and step_in_epoch + 1 < spe and not calibrate)
            if len(window) >= cfg.log_every or save_now or ends_warmup(steps_this_run, run_length):
                window.flush(steps_this_run)
            if save_now:
                save(checkpoint.Position(epoch, step_in_epoch + 1, global_step))
            if done:
                break
        window.flush(steps_this_run)
        end_of_epoch = not done or step_in_epoch + 1 >= spe
        last = done or epoch + 1 >= cfg.epochs
        if not calibrate and b.splits.holdout is not None and (last or (epoch + 1) % cfg.eval_every_epochs == 0):
            accuracy = evaluation.held_out(engine, b, cfg, device, primary=primary, log=log, progress=progress,
                                           epoch=epoch, step=global_step, tta=tta)
        every_e = cfg.checkpoint.every_epochs
        if not calibrate and end_of_epoch and every_e and ((epoch + 1) % every_e == 0 or last):
            save(checkpoint.Position(epoch, spe, global_step))
        epoch, start_step = epoch + 1, 0
    progress.stop()
    if watch.enabled:
        for rec in watch.records():
            log.record("host_sync", **rec)
        if primary:
            console.err.print(f"dscluster train: {watch.summary(watched)}")
    gb = facts["global_batch"]
    out.accuracy, out.steps = accuracy, global_step
    out.images_per_s = window.images_per_s(gb)
    facts.update(steps=global_step, images_per_s=out.images_per_s, accuracy=accuracy,
                 timed_steps=window.window.timed_steps, timed_s=round(window.window.timed_s, 4), **tta.summary())
    if primary and not calibrate:
        plan_vs_measured(cfg, b, gb, precision, info, out, facts, _run_facts(cfg, b, pos, global_step))
    return out


def plan_vs_measured(cfg: TrainConfig, b, gb: int, precision: str, info, out: Outcome, facts: dict,
                     run: dict) -> None:
    """Rank 0, at the end: the saved prediction against what this run measured (plan/predicted.py),
    for the steps this run timed (`run`: _run_facts). A damaged plans.json costs only the
    comparison, with a warning that names it."""
    try:
        cmp = predicted.compare(predicted.key(model=cfg.model.name, micro_batch=max(b.shares), global_batch=gb,
                                              precision=precision, compression=cfg.comm.compression,
                                              ranks=info.world_size), out.images_per_s, run=run)
    except UsageError as e:
        console.err.print(f"[yellow]warning:[/yellow] no plan comparison: {e}")
        return
    if cmp is not None:
        facts["plan"] = cmp
        console.err.print(f"dscluster train: {predicted.line(cmp)}")
        try:  # the next `plan` corrects itself by what this lab really did
            predicted.record(cmp, model=cfg.model.name, precision=precision, compression=cfg.comm.compression,
                             ranks=info.world_size, global_batch=gb, run_id=facts["run_id"])
        except OSError as e:
            console.err.print(f"[yellow]warning:[/yellow] plan outcome not kept ({e})")
