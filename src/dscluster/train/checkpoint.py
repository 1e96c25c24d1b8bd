"""DeepSpeed checkpoints whose `latest` pointer only ever names a complete checkpoint.

DeepSpeed's own `latest` is written by rank 0 as soon as rank 0 is done. Here every rank saves, all
ranks agree that every rank succeeded, and only then `latest` is written atomically: a full disk or
an I/O error on any rank leaves the previous `latest` loadable. One failed save trains on with a
warning; a second in a row stops the run (`MAX_FAILED_SAVES`, docs/failure-behaviour.md). The client
state carries the epoch, the step in it and the global step, so a resume skips exactly the batches
already trained on."""

from __future__ import annotations

import errno
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from dscluster import console
from dscluster.core import dist
from dscluster.errors import UsageError
from dscluster.files.filemodel import validate
from dscluster.files.fsutil import StorageFull, atomic_write_text, free_space_text
from dscluster.rundir import layout
from dscluster.rundir.checkpoints import LATEST, find_latest, resume_decision
from dscluster.train import nodelocal

MAX_FAILED_SAVES = 2
"""Consecutive failed saves that stop the run; fewer: training goes on without them."""

# How torch.save reports a full disk: its C++ stream writer raises RuntimeError, not OSError
# ("PytorchStreamWriter failed writing file data/0: file write failed", "unexpected pos 1234
# vs 1200", or the iostream's "basic_ios::clear: iostream error").
_WRITE_FAILURE_MARKERS = ("file write failed", "unexpected pos", "basic_ios::clear", "No space left on device")


def is_write_failure(e: BaseException) -> bool:
    """A storage error while writing a checkpoint (full disk, quota, I/O): training can go on."""
    if isinstance(e, OSError):
        return True
    return isinstance(e, RuntimeError) and any(m in str(e) for m in _WRITE_FAILURE_MARKERS)


@dataclass(frozen=True)
class Position:
    """Where training stands: `epoch` (0-based) with `step_in_epoch` of its steps done."""

    epoch: int
    step_in_epoch: int
    global_step: int

    def to_dict(self) -> dict:
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "global_step": self.global_step}


def tag_for(pos: Position) -> str:
    return f"epoch{pos.epoch:04d}-step{pos.global_step:08d}"


def commit_latest(ckpt_dir: Path, tag: str) -> None:
    atomic_write_text(Path(ckpt_dir) / LATEST, tag + "\n")


def save(engine, ckpt_dir: Path, pos: Position, *, rank: int, fail_save: bool = False,
         extra: dict | None = None, rank_state=None, writes_latest: bool | None = None) -> tuple[bool, str]:
    """Collective: every rank calls it. Returns (committed, message). `extra` goes into the
    client state beside the position (e.g. the amp GradScaler's state); `rank_state(tag_dir)`, if
    given, writes this rank's own files into the tag (PowerSGD's error feedback) before `latest`
    may name it. `writes_latest`: this rank commits `latest` (default: rank 0; without a shared
    filesystem every node's local rank 0, train/nodelocal.py)."""
    import torch
    import torch.distributed as dist

    tag = tag_for(pos)
    error = ""
    if fail_save:  # test-only fault: the storage layer reports a full disk mid-save
        def _full(*_a, **_k):
            raise OSError(errno.ENOSPC, "No space left on device (injected by DSCLUSTER_FAULT)")
        engine.checkpoint_engine.save, original = _full, engine.checkpoint_engine.save
    try:
        engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state={**(extra or {}), "position": pos.to_dict()},
                              save_latest=False)
        ok = 1
    except (OSError, RuntimeError) as e:
        if not is_write_failure(e):
            raise
        ok, error = 0, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if dist.is_initialized():
            dist.barrier()  # pairs with the closing barrier of save_checkpoint on the ranks that succeeded
    finally:
        if fail_save:
            engine.checkpoint_engine.save = original
    if ok and rank_state is not None:
        try:  # after DeepSpeed's closing barrier: a failure here is this rank's alone, told by the flag
            rank_state(Path(ckpt_dir) / tag)
        except (OSError, RuntimeError) as e:
            if not is_write_failure(e):
                raise
            ok, error = 0, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    flag = torch.tensor([ok], dtype=torch.int32, device=engine.device)
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    committed = bool(flag.item())
    writer = (rank == 0) if writes_latest is None else writes_latest  # node-local: one per node
    if writer and committed:
        try:
            commit_latest(ckpt_dir, tag)
        except OSError as e:  # `latest` is written atomically: the old one stands
            committed, error = False, f"{type(e).__name__} writing '{LATEST}': {e.strerror or e}"
    if writer and not committed:
        shutil.rmtree(Path(ckpt_dir) / tag, ignore_errors=True)
    flag.fill_(int(committed))  # every writer's `latest` decides for every rank (and is the closing sync)
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if flag.item():
        return True, f"checkpoint {tag} saved"
    prev = find_latest(ckpt_dir)
    return False, (f"checkpoint {tag} failed{' on this rank: ' + error if error else ' on another rank'}; "
                   f"'{LATEST}' still points to {prev or 'nothing'}; {free_space_text(ckpt_dir)}")


def after_save(ok: bool, message: str, failed_in_a_row: int) -> tuple[int, str]:
    """The rule of the module docstring: (failed saves in a row now, the message to show). Raises
    StorageFull (the run stops, exit 1) at MAX_FAILED_SAVES; every rank decides alike (`save`'s flag)."""
    if ok:
        return 0, message
    failed_in_a_row += 1
    if failed_in_a_row >= MAX_FAILED_SAVES:
        raise StorageFull(f"{message}; {failed_in_a_row} checkpoint saves failed in a row: stopping. Free space "
                          "there (or point checkpoint.dir elsewhere) and run the same command: it resumes from "
                          f"'{LATEST}'")
    return failed_in_a_row, (f"{message}; training goes on without this checkpoint (it stops if the next save "
                             "fails too)")


# DeepSpeed's ZeRO files, one per data-parallel rank (stage 1-2: optimizer state; stage 3: weights as well).
_ZERO_SHARD = re.compile(r"zero_pp_rank_(\d+)_mp_rank_\d+_(?:optim|model)_states\.pt$")
# DeepSpeed's refusal to load them at another rank count (ZeRORuntimeException).
_ZERO_WORLD = re.compile(r"world size of (\d+) but the current world size is (\d+)")


def zero_shards(tag_dir: Path) -> set[int]:
    """The ranks whose ZeRO shards this node holds in a checkpoint (none: ZeRO stage 0, whose state any
    rank count loads)."""
    try:
        names = [p.name for p in Path(tag_dir).iterdir()]
    except OSError:
        return set()
    return {int(m.group(1)) for n in names if (m := _ZERO_SHARD.search(n))}


def deepspeed_rank_counts(e: BaseException) -> tuple[int, int] | None:
    """(saved, now) when `e` is DeepSpeed's refusal of a ZeRO checkpoint at another rank count."""
    counts = _ZERO_WORLD.search(str(e))
    if type(e).__name__ != "ZeRORuntimeException" or counts is None:
        return None
    return int(counts.group(1)), int(counts.group(2))


def load(engine, ckpt_dir: Path, tag: str) -> tuple[Position, dict]:
    """(where training stopped, the rest of the client state save() was given)."""
    path, client = engine.load_checkpoint(str(ckpt_dir), tag=tag)
    if path is None or not client or "position" not in client:
        raise UsageError(f"{ckpt_dir}/{tag}: not a dscluster checkpoint (no position in its client state)")
    return position_of(client, f"{ckpt_dir}/{tag}"), client


# The client state's position (`save`), checked by dscluster.files.filemodel; all three are required.
POSITION_TYPES = {"position": (dict,), "position.epoch": (int,), "position.step_in_epoch": (int,),
                  "position.global_step": (int,)}


def position_of(client: dict, where: str) -> Position:
    """The position a checkpoint's client state records, validated like user input: a damaged one is
    exit 2 naming the checkpoint and the field, not a KeyError in the middle of resuming."""
    fix = (f"resume from an earlier checkpoint (write its tag into {LATEST}) or start fresh with "
           "checkpoint.resume=false")
    try:
        validate({"position": client.get("position")}, POSITION_TYPES)
        p = client["position"]
        missing = [k for k in ("epoch", "step_in_epoch", "global_step") if not isinstance(p.get(k), int)]
        if missing or min(p[k] for k in ("epoch", "step_in_epoch", "global_step")) < 0:
            raise ValueError(f"field position.{(missing or ['epoch'])[0]} is missing or negative ({p})")
    except (ValueError, AttributeError) as e:
        raise UsageError(f"{where}: damaged checkpoint metadata: {e}; {fix}") from None
    return Position(int(p["epoch"]), int(p["step_in_epoch"]), int(p["global_step"]))


class Checkpointer:
    """The run's save and resume rules in one place: where checkpoints go (checkpoint.dir, else the
    run directory's), whether the nodes share it (nodelocal.py), which checkpoint a start resumes
    from (`resume`: the flag, `latest`, and every node naming the same tag), when a save is due
    (`maybe_save`: checkpoint.every_steps inside an epoch; checkpoint.every_epochs and the run's last
    epoch at an epoch's end) and what a failed save does (`after_save`). A calibration run neither
    resumes nor saves."""

    def __init__(self, cfg, rdir: Path, info, *, hosts: list[str], device, primary: bool, calibrate: bool,
                 faults):
        """Collective (every rank finds out whether it shares rank 0's run directory)."""
        self.dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(rdir) / layout.CHECKPOINT_DIR
        self.own_dir = bool(cfg.checkpoint.dir)  # a folder of the user's, not the run directory's
        self.resume_mode = None if calibrate else cfg.checkpoint.resume
        self.every_steps = 0 if calibrate else cfg.checkpoint.every_steps
        self.every_epochs = 0 if calibrate else cfg.checkpoint.every_epochs
        self.info = info
        self.hosts = hosts
        self.device = device
        self.primary = primary
        self.faults = faults
        self.shared = nodelocal.run_dir_shared(rdir, info.rank)
        self.node_local = not self.shared  # without NFS every node keeps its own checkpoint
        self.engine = self.comm = self.boundary = None
        self.steps_per_epoch = 0
        self.failed_in_a_row = 0
        self.save_seconds: list[float] = []   # each save's wall clock, the collectives in it included
        self.say = console.err.print  # rank 0 points it at the progress bar once there is one

    def attach(self, built, boundary) -> None:
        """What a checkpoint holds: the engine, PowerSGD's state (built.comm) and the step boundary's."""
        self.engine = built.engine
        self.comm = built.comm
        self.boundary = boundary
        self.steps_per_epoch = built.sampler.steps_per_epoch

    def resume(self) -> Position:
        """Collective: where this run starts (0 unless a checkpoint every rank agrees on is loaded)."""
        if self.resume_mode is None:
            return Position(0, 0, 0)
        tag = resume_decision(self.resume_mode, self.dir)
        tags = self._settle_interrupted_commit(dist.all_gather_strings(tag or ""))
        tag = nodelocal.resume_agreement(tags, self.hosts, self.dir, self.shared)
        if not tag:
            return Position(0, 0, 0)
        # DeepSpeed refuses ZeRO state saved at another rank count (caught below), but only on a rank that has a
        # shard of its own to load: one without (a job with more ranks, or on the other node) finds nothing. So
        # every rank says what it holds, and all refuse alike when one has no shard.
        shards = zero_shards(self.dir / tag)
        mine = f"{max(shards, default=-1) + 1} {int(self.info.rank in shards)}"  # ranks it saw saved, own shard
        held = [s.split() for s in dist.all_gather_strings(mine)]
        saved = max(int(count) for count, _ in held)
        if saved and saved != self.info.world_size and any(own == "0" for _, own in held):
            raise self.other_rank_count(tag, saved, self.info.world_size)
        try:
            pos, client = load(self.engine, self.dir, tag)
        except Exception as e:
            counts = deepspeed_rank_counts(e)
            if counts is None:
                raise
            raise self.other_rank_count(tag, *counts) from None
        self.boundary.load_state_dict(client)
        note = None if self.comm is None else self.comm.restore(
            self.dir / tag, self.info.rank, self.info.world_size, self.device, dist.all_gather_strings)
        if self.primary:
            console.err.print(f"dscluster train: resumed from {self.dir}/{tag} at global step {pos.global_step}")
            if note:
                console.err.print(f"[dim]dscluster train: {note}[/dim]")
        return pos

    def other_rank_count(self, tag: str, saved: int, ranks: int) -> UsageError:
        """A ZeRO checkpoint resumed at another rank count: what to run instead. Training afresh needs a
        checkpoint folder of its own: in this one, its tags would land among the old run's shards."""
        fresh = ("checkpoint.dir pointing at another folder" if self.own_dir
                 else "another DSCLUSTER_RUN_ID (a run directory of its own)")
        return UsageError(
            f"{self.dir}/{tag} holds ZeRO state partitioned over {saved} ranks and this job has {ranks}: DeepSpeed "
            f"cannot load it at another rank count. Resume it with {saved} ranks (mpirun -np {saved} on the hosts it "
            f"was saved on), or train afresh with {fresh}")

    def _settle_interrupted_commit(self, tags: list[str]) -> list[str]:
        """Collective (every rank takes the same branch: `tags` is gathered). Without a shared
        filesystem, nodes naming two checkpoints resume from the newer one every node holds."""
        pair = None if self.shared else nodelocal.interrupted_commit(tags)
        if pair is None:
            return tags
        mine = "".join("1" if (self.dir / t).is_dir() else "0" for t in pair)
        choice = nodelocal.newest_held(pair, dist.all_gather_strings(mine))
        if choice is None:
            return tags
        if self.primary:
            console.err.print(f"dscluster train: the nodes' '{LATEST}' named {pair[1]} and {pair[0]} (the last run "
                              f"stopped while they committed it); every node holds {choice}: resuming from it")
        return [choice] * len(tags)

    def maybe_save(self, pos: Position, *, epoch_end: bool = False, last: bool = False, before=None) -> None:
        """Collective: save at `pos` when the rules above ask for one (`before()` first: the log window
        is flushed, so the checkpoint's steps are on record). Inside an epoch never on its last step:
        the epoch's own save follows."""
        if epoch_end:
            due = bool(self.every_epochs and ((pos.epoch + 1) % self.every_epochs == 0 or last))
        else:
            due = bool(self.every_steps and pos.global_step % self.every_steps == 0
                       and pos.step_in_epoch < self.steps_per_epoch)
        if not due:
            return
        if before is not None:
            before()
        self.save(pos)

    def save(self, pos: Position) -> None:
        """Collective: save now; a failure warns, or stops the run at MAX_FAILED_SAVES (`after_save`)."""
        info = self.info
        comm = self.comm
        rank_state = None if comm is None else (lambda tag_dir: comm.save(tag_dir, info.rank, info.world_size))
        before_save = getattr(comm, "before_save", None)
        if before_save is not None:
            before_save()  # local SGD: a non-finite rank stops the run before any checkpoint holds it
        t0 = time.monotonic()
        ok, msg = save(self.engine, self.dir, pos, rank=info.rank, fail_save=self.faults.fails_save(pos.global_step),
                       extra=self.boundary.state_dict(), rank_state=rank_state,
                       writes_latest=nodelocal.writes_latest(info.rank, info.local_rank, self.shared))
        if ok:
            self.save_seconds.append(time.monotonic() - t0)
        self.failed_in_a_row, msg = after_save(ok, msg, self.failed_in_a_row)
        if ok and not self.primary:
            return
        text = f"{'[yellow]warning:[/yellow] ' if not ok else ''}{msg}"
        (self.say if self.primary else console.err.print)(text + ("" if self.primary else f" (rank {info.rank})"))
