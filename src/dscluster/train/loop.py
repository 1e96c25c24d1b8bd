"""The training loop every rank runs: one readable path from process group to summary.

Order of events: rank detection and env → run directory (env snapshot) → process group
(gloo on CPU, nccl on GPU, bounded timeout) → data/model/engine (setup_engine) → resume →
per epoch: equal-step check, steps (metrics per step, loss scale guard), held-out eval on
rank 0 between barriers, checkpoint → summary. Any exception still writes the `end`
record and, where this rank knows the story, a failed summary.json; the process group is
destroyed in `finally`. Every rank keeps RUN_DIR/traces/rank-R.txt open for Python stack
dumps (SIGUSR1, SIGTERM, exceptions); a failing rank also dumps torch's flight recorder to
RUN_DIR/nccl_trace/ before the group is destroyed, on gloo as on NCCL.

Host syncs: loss, gradient norm and (amp fp16) loss scale stay on the device and are read
back in one go every `log_every` steps; the fp16 guard judges them then. Only DeepSpeed's own
fp16 optimizer (amp=false or ZeRO 1/2) has host-side scale and overflow: it syncs for them.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import math
import os
import signal
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from dscluster import console, liveness, runinfo
from dscluster.errors import DsclusterError, UsageError
from dscluster.fsutil import atomic_write_json, atomic_write_text
from dscluster.train import checkpoint, dist, guards, optstep
from dscluster.train.config import TrainConfig, to_yaml
from dscluster.train.optstep import StepBoundary
from dscluster.train.precision import decide_here
from dscluster.train.runlog import RunLog, summary_record
from dscluster.train.syncwatch import SyncWatch
from dscluster.train.timing import WARMUP_STEPS, StepWindow, ends_warmup, is_timed


@dataclass
class Outcome:
    """What a run produced; the CLI turns it into an exit code and a line of text."""

    status: str
    accuracy: float | None = None
    steps: int = 0
    images_per_s: float | None = None
    run_dir: Path | None = None
    scale_history: list[tuple[float, bool]] = field(default_factory=list)  # calibration runs only


def loss_scale_of(engine) -> float | None:
    opt = engine.optimizer
    for obj in (opt, getattr(opt, "loss_scaler", None)):
        if obj is not None and hasattr(obj, "cur_scale"):
            return float(obj.cur_scale)
    return None


@torch.no_grad()
def evaluate(engine, dataset, dtype, device, channels_last: bool, batch: int = 256) -> tuple[float, float, int]:
    from dscluster.train.setup_engine import bare_module

    module = bare_module(engine)  # rank 0 alone: never through a DDP wrapper
    was_training = module.training
    module.eval()
    correct, loss_sum, n = 0, 0.0, len(dataset)
    for lo in range(0, n, batch):
        x, y = dataset.get_batch(list(range(lo, min(n, lo + batch))), device, dtype, channels_last=channels_last)
        out = module(x).float()
        loss_sum += float(F.cross_entropy(out, y, reduction="sum"))
        correct += int((out.argmax(1) == y).sum())
    module.train(was_training)
    return correct / n, loss_sum / n, n


def train(cfg: TrainConfig, *, calibrate: bool = False) -> Outcome:
    """Run training (or an fp16 loss-scale calibration) on this rank."""
    t0 = time.time()
    info = dist.detect_ranks()
    run_id = runinfo.resolve_run_id()
    rdir = runinfo.run_dir()
    traces = _Traces(rdir, info.rank)
    has_cuda = dist.prepare_accelerator()
    dist.default_extensions_dir()  # before the env snapshot, so it shows where JIT ops are cached
    if not has_cuda and not os.environ.get("OMP_NUM_THREADS"):
        # ranks sharing a host share its cores; oversubscribed OpenMP threads spin and crawl
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, info.local_world_size)))
    dist.set_primary(info.rank == 0)
    primary = info.rank == 0
    dist.export_env(info, run_id)
    dist.enable_nccl_diagnostics(rdir / "nccl_trace")
    host = dist.hostname()
    fault = [f for f in (guards.parse_fault(t) for t in os.environ.get("DSCLUSTER_FAULT", "").split(";")) if f]
    my_fault = {f.kind: f for f in fault if f.rank == info.rank}
    log = RunLog(rdir, info.rank, host)
    log.write_env()
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
        precision = decide_here(cfg.precision).precision
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
        out = _run(cfg, info, device, precision, hosts, log, rdir, facts, my_fault, calibrate, primary)
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
        _Progress.stop_all()
        log.close()
        # The engine (and a DDP reducer in it) sits in reference cycles: free it while its
        # process group still exists, not at interpreter exit (a rank then aborted in teardown,
        # "terminate called without an active exception").
        gc.collect()
        dist.destroy()
        traces.close()


def peak_mem_mb(on_cuda: bool) -> float | None:
    """Peak GPU memory this process allocated (MiB); None on CPU, where there is no device pool."""
    if not on_cuda:
        return None
    try:
        return round(torch.cuda.max_memory_allocated() / 2**20, 1)
    except Exception:
        return None


class _Traces:
    """RUN_DIR/traces/rank-R.txt: Python stacks of every thread when the rank is stuck or dies.

    `kill -USR1 <pid>` writes them without stopping the rank (where does a hang wait?); a
    SIGTERM (mpirun tearing the job down) writes them and then terminates as before; an
    exception writes them plus its traceback. `dscluster diagnose` lists the files. Works on
    any backend (the flight recorder in nccl_trace/ covers the collectives themselves).
    """

    def __init__(self, run_dir: Path, rank: int):
        self.path = Path(run_dir) / "traces" / f"rank-{rank}.txt"
        self.file = None
        self.signals: list[int] = []
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(self.path, "a", encoding="utf-8")
        except OSError:
            return
        if hasattr(faulthandler, "register"):
            faulthandler.register(signal.SIGUSR1, file=self.file, all_threads=True)
            faulthandler.register(signal.SIGTERM, file=self.file, all_threads=True, chain=True)
            self.signals = [signal.SIGUSR1, signal.SIGTERM]

    def exception(self) -> None:
        if self.file is None:
            return
        try:
            self.file.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}: exception, all threads\n")
            self.file.flush()
            faulthandler.dump_traceback(file=self.file, all_threads=True)
            traceback.print_exc(file=self.file)
            self.file.flush()
        except (OSError, ValueError):
            pass

    def close(self) -> None:
        for sig in self.signals:
            faulthandler.unregister(sig)
        self.signals = []
        if self.file is not None:
            self.file.close()
            self.file = None
            try:
                if self.path.stat().st_size == 0:  # nothing happened: no empty files in a healthy run
                    self.path.unlink()
                    self.path.parent.rmdir()
            except OSError:
                pass


def _run(cfg: TrainConfig, info, device, precision, hosts, log: RunLog, rdir: Path, facts: dict,
         my_fault: dict, calibrate: bool, primary: bool) -> Outcome:
    from dscluster.train.setup_engine import build

    if calibrate:
        from dscluster.train.losscale import CALIBRATION_START_POWER

        cfg.fp16.initial_scale_power = CALIBRATION_START_POWER
        cfg.max_steps = cfg.fp16.calibrate_steps
    b = build(cfg, info, device, precision)
    engine, sampler = b.engine, b.sampler
    boundary = StepBoundary(engine, cfg, precision)
    spe = sampler.steps_per_epoch
    facts.update(global_batch=sum(b.shares) * b.plan.grad_accum)
    for note in b.notes:
        if primary:
            console.err.print(f"[dim]dscluster train: {note}[/dim]")
    if primary:
        atomic_write_text(rdir / runinfo.CONFIG_FILE, to_yaml(cfg))
        atomic_write_json(rdir / runinfo.DS_CONFIG_FILE, b.ds_config)
        if b.share_plan is not None:
            atomic_write_json(rdir / "shares.json", b.share_plan)

    ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else rdir / runinfo.CHECKPOINT_DIR
    pos = checkpoint.Position(0, 0, 0)
    if not calibrate:
        tag = checkpoint.resume_decision(cfg.checkpoint.resume, ckpt_dir)
        tags = dist.all_gather_strings(tag or "")
        if len(set(tags)) > 1:
            raise UsageError(f"ranks see different checkpoints in {ckpt_dir} ({tags}); checkpoint.dir must be shared "
                             "storage (same path on every node, like NFS)")
        if tag:
            pos, client = checkpoint.load(engine, ckpt_dir, tag)
            boundary.load_state_dict(client)
            if primary:
                console.err.print(f"dscluster train: resumed from {ckpt_dir}/{tag} at global step {pos.global_step}")
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
    progress = _Progress(primary and cfg.progress and not calibrate, total, global_step)
    out = Outcome(status="complete", run_dir=rdir)
    steps_this_run, accuracy = 0, None
    run_length = total - pos.global_step
    window = StepWindow()
    pending: list[dict] = []
    pending_dev: list[torch.Tensor] = []  # per step on the device: [loss, grad_norm, scale_tried, scale_after]
    watch = SyncWatch(cfg.sync_debug if device.type == "cuda" and not calibrate else "off")
    if cfg.sync_debug != "off" and device.type != "cuda" and primary:
        console.err.print("[yellow]warning:[/yellow] sync_debug watches CUDA host syncs; this rank has no GPU, "
                          "so it is off")
    watched = 0

    def flush():
        if not pending:
            return
        values = torch.stack(pending_dev).float().tolist()  # the one host sync per log window
        # Only now has the device finished the window's steps: time them (timing.py says why).
        window.close(pending, timed=is_timed(steps_this_run - len(pending) + 1, run_length))
        for rec, (loss_v, *stats) in zip(pending, values):
            norm, scale, overflow = optstep.decode(stats)
            rec["loss"] = loss_v
            if boundary.device_scale:
                rec["loss_scale"], rec["overflow"] = scale, overflow
            if norm is not None:
                rec["grad_norm"] = norm
            facts["overflow_steps"] += rec["overflow"]
            if calibrate:
                out.scale_history.append((rec["loss_scale"], rec["overflow"]))
            log.record("step", **rec)
            if guard is not None:
                guard.observe(rec["step"], rec["loss_scale"], rec["overflow"])
        pending.clear()
        pending_dev.clear()

    done = global_step >= total
    while not done and epoch < cfg.epochs:
        counts = dist.all_gather_ints([spe + (1 if "mismatch_steps" in my_fault else 0)], device)
        guards.check_equal_steps([c[0] for c in counts], hosts, epoch)
        step_in_epoch = start_step - 1
        for step_in_epoch, micro in enumerate(sampler.steps(epoch, start_step), start=start_step):
            global_step += 1
            _inject(my_fault, global_step, log, cfg)
            step_loss = torch.zeros((), device=device)
            scale = None
            samples = 0
            norm = None
            log_step = global_step % cfg.log_every == 0
            armed = steps_this_run >= WARMUP_STEPS
            watched += armed
            with watch.step(global_step, armed):
                for k, idx in enumerate(micro):
                    x, y = b.splits.train.get_batch(idx, device, b.dtype, augment=cfg.data.augment, generator=gen,
                                                    channels_last=cfg.channels_last)
                    # DDP-synchronised engines reduce only at the accumulation boundary
                    with b.ddp.no_sync() if b.ddp is not None and k < len(micro) - 1 else contextlib.nullcontext():
                        loss = F.cross_entropy(engine(x).float(), y)
                        engine.backward(loss * b.loss_weight if b.loss_weight != 1.0 else loss)
                    if k == len(micro) - 1:
                        boundary.before_step(want_norm=log_step)  # gradients are all-reduced by now
                        if precision == "fp16" and not boundary.device_scale:
                            scale = loss_scale_of(engine)  # the scale this step is attempted at (a host float)
                    engine.step()
                    step_loss += loss.detach() / len(micro)
                    samples += len(idx)
                overflow = False
                if precision == "fp16" and not boundary.device_scale:
                    overflow = bool(getattr(engine.optimizer, "overflow", False))
                if log_step and not boundary.own_clip:
                    norm = engine.get_global_grad_norm()  # DeepSpeed clipped (ZeRO, half-weight optimizers)
                    norm = None if norm is None or (isinstance(norm, float) and math.isnan(norm)) else float(norm)
                pending_dev.append(torch.cat([step_loss.reshape(1).float(), boundary.after_step()]))
            steps_this_run += 1
            facts["steps"] = global_step  # what a failed run's summary reports as reached
            pending.append({"step": global_step, "epoch": epoch, "lr": float(engine.get_lr()[0]),
                            "loss_scale": scale, "overflow": overflow, "samples": samples, "grad_norm": norm})
            progress.advance(epoch)
            done = global_step >= total
            every = cfg.checkpoint.every_steps
            save_now = bool(every and global_step % every == 0 and step_in_epoch + 1 < spe and not calibrate)
            if len(pending) >= cfg.log_every or save_now or ends_warmup(steps_this_run, run_length):
                flush()
            if save_now:
                _save(engine, ckpt_dir, checkpoint.Position(epoch, step_in_epoch + 1, global_step), info.rank,
                      my_fault, progress, boundary)
            if done:
                break
        flush()
        end_of_epoch = not done or step_in_epoch + 1 >= spe
        last = done or epoch + 1 >= cfg.epochs
        if not calibrate and b.splits.holdout is not None and (last or (epoch + 1) % cfg.eval_every_epochs == 0):
            dist.barrier()
            if primary:  # rank-0-only work between barriers: the others wait instead of racing ahead
                acc, eloss, n = evaluate(engine, b.splits.holdout, b.dtype, device, cfg.channels_last)
                accuracy = acc
                log.record("eval", epoch=epoch, step=global_step, accuracy=acc, loss=eloss, samples=n)
                progress.print(f"epoch {epoch + 1}/{cfg.epochs} step {global_step}: held-out accuracy {acc:.1%} "
                               f"loss {eloss:.3f}")
            dist.barrier()
        every_e = cfg.checkpoint.every_epochs
        if not calibrate and end_of_epoch and every_e and ((epoch + 1) % every_e == 0 or last):
            _save(engine, ckpt_dir, checkpoint.Position(epoch, spe, global_step), info.rank, my_fault, progress,
                  boundary)
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
                 timed_steps=window.timed_steps, timed_s=round(window.timed_s, 4))
    return out


def _save(engine, ckpt_dir, pos, rank, my_fault, progress, boundary: StepBoundary) -> None:
    f = my_fault.get("disk_full")
    ok, msg = checkpoint.save(engine, ckpt_dir, pos, rank=rank,
                              fail_save=f is not None and f.step == pos.global_step, extra=boundary.state_dict())
    if not ok or rank == 0:
        (progress.print if rank == 0 else console.err.print)(
            f"{'[yellow]warning:[/yellow] ' if not ok else ''}{msg}" + ("" if rank == 0 else f" (rank {rank})"))


def _inject(my_fault: dict, step: int, log: RunLog, cfg: TrainConfig) -> None:
    """Test-only faults (guards.py documents DSCLUSTER_FAULT)."""
    f = my_fault.get("slow_gpu")
    if f is not None and torch.cuda.is_available():
        torch.cuda._sleep(_spin_cycles(f.ms))  # queued: the host runs on, as with any slow kernel
    f = my_fault.get("exit")
    if f is not None and f.step == step:
        log.record("end", status="failed", error=f"injected fault: exit before step {step}")
        log.close()
        os._exit(3)
    f = my_fault.get("skip_collective")
    if f is not None and f.step == step:
        # stay away from this step's all-reduce: the peers must time out, not hang forever
        deadline = time.time() + 2 * cfg.dist.timeout_s + 30
        while time.time() < deadline:
            time.sleep(0.5)
        os._exit(4)


_CYCLES_PER_MS: list[float] = []


def _spin_cycles(ms: int) -> int:
    """GPU clock cycles that torch.cuda._sleep spins for `ms` milliseconds, measured once."""
    if not _CYCLES_PER_MS:
        probe = 20_000_000
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(probe)
        stop.record()
        stop.synchronize()
        _CYCLES_PER_MS.append(probe / max(start.elapsed_time(stop), 1e-3))
    return int(ms * _CYCLES_PER_MS[0])


class _Progress:
    """rich progress bar with ETA on rank 0 (nothing elsewhere)."""

    _live: list["_Progress"] = []

    @classmethod
    def stop_all(cls) -> None:
        for p in list(cls._live):
            p.stop()

    def __init__(self, enabled: bool, total: int, done: int):
        self.bar = None
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("[bold]train[/bold] {task.description}"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("ETA"), TimeRemainingColumn(), console=console.err, transient=False)
            self.task = self.bar.add_task("epoch 1", total=total, completed=done)
            self.bar.start()
            _Progress._live.append(self)

    def advance(self, epoch: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, advance=1, description=f"epoch {epoch + 1}")

    def print(self, text: str) -> None:
        (self.bar.console if self.bar is not None else console.err).print(text)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
            if self in _Progress._live:
                _Progress._live.remove(self)
