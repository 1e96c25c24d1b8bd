"""Synchronising less often: post-local SGD and DiLoCo on DeepSpeed's ZeRO-0 path (`sync.mode`).

On Ethernet an every-step all-reduce of the gradients costs more than the step's compute; averaging the
models every H steps (sync.period) moves the same bytes H times less often. Each node steps on its own
gradients (its own GPUs still average theirs every step); every H steps the period's change, weighted by
the rank's share of the global batch, is averaged across all ranks (diloco: as the outer gradient of a
Nesterov step), at once or streamed τ steps behind (sync.delay_steps). Sync points are global step numbers,
the same on every rank; a checkpoint keeps each rank's own state (sync/rank-R.pt), so a resume is exact
with shared or node-local checkpoints. The modes, their costs and measurements: docs/ethernet-labs.md.
"""

from __future__ import annotations

import functools
import io
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as tdist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from dscluster.core.guards import TrainingAborted
from dscluster.core.syncmode import is_sync_point, node_groups, weights
from dscluster.files.fsutil import atomic_write_bytes

SYNC_DIR = "sync"
"""Per-rank averager state inside a checkpoint tag: sync/rank-R.pt."""
WIRE = {"none": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
"""sync.compression: the dtype the period's change crosses the network in."""


def local(cfg) -> bool:
    """Whether the run synchronises less often than every step."""
    return cfg.sync.mode != "every_step"


def averager(cfg, rank, built, boundary) -> ModelAverager:
    """The averager of a run that synchronises less often on several ranks (`rank`: loop.Rank). No DDP
    wraps the model then: the engine's module is the model itself."""
    return ModelAverager(built.engine.module, cfg, rank.info.rank, rank.nodes, built.shares, hosts=rank.hosts,
                         steps_per_epoch=built.sampler.steps_per_epoch, total=built.total_steps, split=built.split,
                         scaler=boundary.scaler, optimizer=built.engine.optimizer)


@dataclass
class InFlight:
    """An average started at a sync point and not yet applied."""

    apply_at: int
    change: torch.Tensor
    """Every rank's weighted change of the period, summed in place by the all-reduce."""
    values: torch.Tensor
    """Weighted buffers, then one non-finite flag per rank (fp32, summed in place)."""
    scale: torch.Tensor | None
    """[loss scale, growth count], reduced to the smallest."""
    scale_sent: torch.Tensor | None
    """This rank's own [loss scale, growth count] as it sent them (a checkpoint keeps it)."""
    snapshot: torch.Tensor | None
    """This rank's parameters then buffers when it started; None when applied at once (τ = 0)."""
    works: list


@dataclass
class FiniteFlags:
    """An applied average's non-finite flags, on their way to the host: read one step later (or before a
    save, or at the run's end), so that the check never waits for the GPU's queue to drain."""

    step: int
    flags: torch.Tensor
    """One flag per rank, on the host (pinned memory on a GPU)."""
    arrived: torch.cuda.Event | None
    """Recorded after the copy on a GPU; None on the CPU, where the copy is done."""


class ModelAverager:
    """One rank's part: `reduce_gradients(step)` after the boundary backward, `after_step(...)` after
    `engine.step()`. Collective: every rank makes the same groups in the same order. `nodes` are the ranks'
    node identities (dist.node_identity), `hosts` their host names, for messages."""

    def __init__(self, model: torch.nn.Module, cfg, rank: int, nodes: list[str], shares: list[int], *,
                 hosts: list[str], steps_per_epoch: int, total: int, split=None, scaler=None, optimizer=None):
        self.mode = cfg.sync.mode
        self.period = int(cfg.sync.period)
        self.warmup = int(cfg.sync.warmup_steps)
        self.delay = int(cfg.sync.delay_steps)
        self.wire = WIRE[cfg.sync.compression]
        self.outer_lr = float(cfg.sync.outer_lr)
        self.outer_momentum = float(cfg.sync.outer_momentum)
        self.every_steps = int(cfg.checkpoint.every_steps)
        self.steps_per_epoch = steps_per_epoch
        self.total = total
        self.rank = rank
        self.world = len(nodes)
        self.hosts = hosts
        self.split = split
        self.scaler = scaler
        self.optimizer = optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buffers = [b for b in model.buffers() if b.is_floating_point()]
        self.node_ranks: list[int] = []
        self.node_group = None
        for ranks in node_groups(nodes):  # every rank creates every group (torch's rule), keeps its own
            # a one-rank node reduces nothing: no group (each costs every rank a rendezvous)
            group = tdist.new_group(ranks) if self.world > 1 and len(ranks) > 1 else None
            if rank in ranks:
                self.node_ranks = ranks
                self.node_group = group
        # streamed: the average travels on a group of its own, so that the collectives made meanwhile
        # (evaluation's barriers, a save's) do not queue behind it
        self.stream_group = tdist.new_group(list(range(self.world))) if self.delay and self.world > 1 else None
        inside, whole = weights(shares, nodes)
        self.node_weight = inside[rank]
        self.world_weight = whole[rank]
        # the node's gradient buckets: parameters in reverse order (roughly backward's), at most ddp_bucket_mb
        self.buckets = _buckets(self.params, int(cfg.ddp_bucket_mb) * 2**20)
        self.bucket_of = {i: b for b, bucket in enumerate(self.buckets) for i in bucket}
        self.waiting: list[int] = []
        self.sent: list[tuple] = []
        self.armed = False
        if self.node_group is not None:
            for i, p in enumerate(self.params):
                p.register_post_accumulate_grad_hook(functools.partial(self._ready, i))
        self.start: torch.Tensor | None = None   # the parameters the period started from, equal on every rank
        self.momentum: torch.Tensor | None = None
        self.in_flight: InFlight | None = None
        self.unchecked: FiniteFlags | None = None
        self.averages = 0

    # --- per step ---------------------------------------------------------------------------------

    def arm(self, step: int) -> None:
        """Before the boundary micro-step's backward: past the warm-up, a node of several ranks sends its
        gradients bucket by bucket as backward makes them (`_ready`), as DDP's buckets do."""
        self.armed = step > self.warmup and self.node_group is not None
        self.sent = []
        self.waiting = [len(bucket) for bucket in self.buckets]

    def _ready(self, index: int, _param) -> None:
        """A parameter's gradient is complete: send every bucket, in order, whose gradients all are. The
        same order on every rank: a bucket waits for the ones before it."""
        if not self.armed:
            return
        self.waiting[self.bucket_of[index]] -= 1
        while len(self.sent) < len(self.buckets) and self.waiting[len(self.sent)] == 0:
            self._send_bucket(self.buckets[len(self.sent)], self.node_group, self.node_weight)

    def reduce_gradients(self, step: int) -> None:
        """After the boundary backward, before engine.step(): across every rank during the warm-up (all at
        once), else the node's buckets that backward did not send, then every bucket's result. The first
        local step notes the weights the period starts from (equal on every rank: DeepSpeed broadcast
        them, or the warm-up's steps made them so)."""
        if self.world <= 1:
            return
        if self.start is None and step > self.warmup:
            self.start = self._flat_params().clone()
        if step <= self.warmup:
            self.sent = []
            self._send_bucket(list(range(len(self.params))), None, self.world_weight)
        elif self.node_group is not None:
            if not self.armed:  # no hooks ran (a caller without `arm`): every bucket now
                self.sent = []
            while len(self.sent) < len(self.buckets):  # and a bucket with a parameter this rank had no gradient for
                self._send_bucket(self.buckets[len(self.sent)], self.node_group, self.node_weight)
        else:
            return
        self._receive_buckets()
        if self.split is not None:
            self.split.reductions_done()

    @torch.no_grad()
    def _send_bucket(self, indices: list[int], group, weight: float) -> None:
        """Every rank sends the same tensors: a parameter this rank has no gradient for (unused in its
        forward) counts as zero, as in DDP, and gets the reduced gradient wherever any rank had one."""
        params = [self.params[i] for i in indices]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        present = torch.tensor([float(p.grad is not None) for p in params], device=grads[0].device)
        flat = _flatten_dense_tensors([*grads, present]).mul_(weight)
        if self.split is not None:
            self.split.bucket_handed()
        self.sent.append((params, grads, present, flat, tdist.all_reduce(flat, group=group, async_op=True)))

    @torch.no_grad()
    def _receive_buckets(self) -> None:
        for params, grads, present, flat, work in self.sent:
            work.wait()
            *reduced, anyone = _unflatten_dense_tensors(flat, [*grads, present])
            for p, g, r in zip(params, grads, reduced, strict=True):
                if p.grad is not None:
                    g.copy_(r)
            missing = [i for i, p in enumerate(params) if p.grad is None]
            if missing:  # rare (a layer this rank did not use): only then read on the host who had one
                had = anyone.tolist()
                for i in missing:
                    if had[i] > 0:
                        params[i].grad = reduced[i].to(params[i].dtype)
        self.sent = []
        self.armed = False

    def after_step(self, step: int, *, step_in_epoch: int) -> bool:
        """After engine.step(): apply an average that is due, start one where `step` is a sync point (and
        apply it at once when not streamed or at the run's end). True when this step did either."""
        if self.world <= 1 or step <= self.warmup:
            return False
        self.check_finite()  # the last average's flags, copied a step ago: no wait
        last = step >= self.total
        due = self.in_flight is not None and (step >= self.in_flight.apply_at or last)
        starts = is_sync_point(step, period=self.period, step_in_epoch=step_in_epoch,
                               steps_per_epoch=self.steps_per_epoch, total=self.total,
                               every_steps=self.every_steps, delay=self.delay)
        if not (due or starts):
            return False
        if self.split is not None:
            self.split.average_started()
        if due:
            self.apply(step)
        if starts:
            at_once = self.delay == 0 or last
            self.launch(step + (0 if at_once else self.delay), at_once=at_once)
            if at_once:
                self.apply(step)
        if last:
            self.check_finite()
        if self.split is not None:
            self.split.average_done()
        return True

    # --- the average --------------------------------------------------------------------------------

    def _flat_params(self) -> torch.Tensor:
        return _flatten_dense_tensors([p.data for p in self.params]).float()

    def _flat_buffers(self) -> torch.Tensor:
        if not self.buffers:
            return torch.zeros(0, device=self.params[0].device)
        return _flatten_dense_tensors([b.data for b in self.buffers]).float()

    @torch.no_grad()
    def launch(self, apply_at: int, *, at_once: bool = False) -> None:
        """Collective: start the all-reduce of this rank's weighted change, buffers, non-finite flag (and
        loss scale), asynchronously."""
        scale = self._scale_state()
        self._send(self._flight(self._flat_params(), self._flat_buffers(), scale, apply_at, keep=not at_once))

    def _flight(self, params, buffers, scale, apply_at: int, *, keep: bool) -> InFlight:
        """What this rank sends, from its parameters and buffers at the sync point (a resume rebuilds the
        same from the snapshot a checkpoint kept)."""
        assert self.start is not None
        finite = torch.isfinite(params).all() & torch.isfinite(buffers).all()
        change = (self.start - params).mul_(self.world_weight).to(self.wire)
        flags = torch.zeros(self.world, device=params.device)
        flags[self.rank] = (~finite).float()
        values = torch.cat([buffers * self.world_weight, flags])
        return InFlight(apply_at=apply_at, change=change, values=values,
                        scale=None if scale is None else scale.clone(), scale_sent=scale,
                        snapshot=torch.cat([params, buffers]) if keep else None, works=[])

    def _send(self, flight: InFlight) -> None:
        group = self.stream_group
        flight.works = [tdist.all_reduce(flight.change, group=group, async_op=True),
                        tdist.all_reduce(flight.values, group=group, async_op=True)]
        if flight.scale is not None:
            flight.works.append(tdist.all_reduce(flight.scale, op=tdist.ReduceOp.MIN, group=group, async_op=True))
        self.in_flight = flight

    @torch.no_grad()
    def apply(self, step: int) -> None:
        """Wait for the average in flight, then the new start, each rank keeping what it trained since it
        sent. If any rank sent non-finite weights, nothing changes on any rank, and the next step's
        `check_finite` stops the run: every rank decides on the device, with no host sync."""
        flight = self.in_flight
        assert flight is not None and self.start is not None
        for work in flight.works:
            work.wait()
        self.in_flight = None
        n_buffers = flight.values.numel() - self.world
        flags = flight.values[n_buffers:]
        finite = flags.sum() == 0
        change = flight.change.float()
        if self.mode == "diloco":  # the outer Nesterov step, the period's change as its gradient
            before = self.momentum if self.momentum is not None else torch.zeros_like(change)
            momentum = before * self.outer_momentum + change
            self.momentum = torch.where(finite, momentum, before)
            change = (change + momentum * self.outer_momentum) * self.outer_lr
        self.start = torch.where(finite, self.start - change, self.start)
        merged = torch.cat([self.start, flight.values[:n_buffers]])
        current = torch.cat([self._flat_params(), self._flat_buffers()])
        if flight.snapshot is not None:  # streamed: what this rank trained since it sent stays its own
            merged = current + merged - flight.snapshot
        merged = torch.where(finite, merged, current)
        tensors = [p.data for p in self.params] + [b.data for b in self.buffers]
        for t, value in zip(tensors, _unflatten_dense_tensors(merged, tensors), strict=True):
            t.copy_(value)
        if flight.scale is not None:
            kept = self._scale_state()
            scale = torch.where(finite, flight.scale, kept)
            self.scaler._scale.copy_(scale[0].reshape(self.scaler._scale.shape))
            self.scaler._growth_tracker.copy_(scale[1].reshape(self.scaler._growth_tracker.shape))
        self.unchecked = _to_host(flags, step)
        self.averages += 1

    def check_finite(self) -> None:
        """Stop the run if the last applied average came from non-finite weights (its flags have reached
        the host by now: they were copied a step ago, before a save, or at the run's end)."""
        pending, self.unchecked = self.unchecked, None
        if pending is None:
            return
        if pending.arrived is not None:
            pending.arrived.synchronize()
        self._stop_if_not_finite(pending.flags, f"the average of step {pending.step}")

    def _stop_if_not_finite(self, flags: torch.Tensor, when: str) -> None:
        bad = [r for r, flag in enumerate(flags.tolist()) if flag != 0]
        if not bad:
            return
        where = ", ".join(f"rank {r} on {self.hosts[r]}" for r in bad)
        raise TrainingAborted(
            f"non-finite weights on {where} at {when}: nothing was averaged, on any rank, "
            "and the last checkpoint is intact. Lower optim.lr (or raise optim.warmup_steps), or train that "
            "node in fp32, and run the same command to resume", failed_ranks=bad,
            failed_hosts=[self.hosts[r] for r in bad])

    def _scale_state(self) -> torch.Tensor | None:
        """fp16 (amp): [scale, growth count], which every rank takes the smallest of at each average."""
        s = self.scaler
        if s is None or getattr(s, "_scale", None) is None:
            return None
        return torch.stack([s._scale.reshape(()).float(), s._growth_tracker.reshape(()).float()])

    def before_save(self) -> None:
        """Collective, before a streamed run's checkpoint (not a sync point): a non-finite rank stops the
        run here too, so that no checkpoint ever holds its weights."""
        self.check_finite()
        if self.world <= 1 or self.delay == 0:
            return
        flags = torch.zeros(self.world, device=self.params[0].device)
        finite = torch.isfinite(self._flat_params()).all() & torch.isfinite(self._flat_buffers()).all()
        flags[self.rank] = (~finite).float()
        tdist.all_reduce(flags)
        self._stop_if_not_finite(flags, "a checkpoint")

    # --- checkpoints (the Checkpointer calls these as it calls comm.CommHook's) -----------------------

    def save(self, tag_dir: Path, rank: int, world_size: int) -> None:
        """This rank's own state into TAG/sync/rank-R.pt, atomically."""
        flight = self.in_flight
        state = {"world_size": world_size, "mode": self.mode, "period": self.period, "delay": self.delay,
                 "averages": self.averages, "momentum": _cpu(self.momentum), "start": _cpu(self.start),
                 "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
                 "grad_scaler": None if self.scaler is None else self.scaler.state_dict(),
                 "weights": _cpu(torch.cat([self._flat_params(), self._flat_buffers()])) if self.delay else None,
                 "in_flight": None if flight is None else self._unsent(flight)}
        buf = io.BytesIO()
        torch.save(state, buf)
        atomic_write_bytes(Path(tag_dir) / SYNC_DIR / f"rank-{rank}.pt", buf.getvalue())

    def _unsent(self, flight: InFlight) -> dict:
        """An average in flight as this rank sent it, which a resume sends again: waiting for it here would
        stall the save, and the weights it was made from have moved on since."""
        assert flight.snapshot is not None  # only a streamed average is still in flight between steps
        return {"apply_at": flight.apply_at, "snapshot": flight.snapshot.cpu(), "scale": _cpu(flight.scale_sent)}

    def restore(self, tag_dir: Path, rank: int, world_size: int, device, agree) -> str | None:
        """Collective: this rank's own saved state, used where every rank has one that fits; else every
        rank goes on from rank 0's weights with fresh outer state (and says so)."""
        saved, why = _read(Path(tag_dir) / SYNC_DIR / f"rank-{rank}.pt", device)
        if saved is not None and (saved.get("world_size") != world_size or saved.get("mode") != self.mode
                                  or saved.get("delay", 0) != self.delay):
            why = (f"it was saved by {saved.get('world_size')} ranks with sync.mode={saved.get('mode')} and "
                   f"sync.delay_steps={saved.get('delay', 0)}, this run has {world_size} with {self.mode} and "
                   f"{self.delay}")
        reasons = [v for v in agree(why) if v]
        self.in_flight = None
        if reasons:
            self._start_from_rank0()
            return f"sync state starts fresh from rank 0's weights: {reasons[0]}"
        assert saved is not None
        self._load_own(saved, device)
        flight = saved.get("in_flight")
        if flight is not None:  # every rank saved at the same step: the same average goes out again
            snapshot = flight["snapshot"].to(device)
            assert self.start is not None  # a period had started: its start was saved with it
            n = self.start.numel()
            self._send(self._flight(snapshot[:n], snapshot[n:], _to(flight["scale"], device), flight["apply_at"],
                                    keep=True))
        return f"sync state restored ({self.mode}, {self.averages} averages so far, each rank its own)"

    @torch.no_grad()
    def _load_own(self, saved: dict, device) -> None:
        """This rank's optimizer moments, loss scaler, outer state and (streamed) weights, over the ones
        DeepSpeed loaded from rank 0's (or its node's) files."""
        self.averages = int(saved.get("averages", 0))
        self.momentum = _to(saved.get("momentum"), device)
        self.start = _to(saved.get("start"), device)
        if self.optimizer is not None and saved.get("optimizer") is not None:
            self.optimizer.load_state_dict(saved["optimizer"])
        if self.scaler is not None and saved.get("grad_scaler"):
            self.scaler.load_state_dict(saved["grad_scaler"])
        if saved.get("weights") is not None:
            tensors = [p.data for p in self.params] + [b.data for b in self.buffers]
            for t, value in zip(tensors, _unflatten_dense_tensors(saved["weights"].to(device), tensors),
                                strict=True):
                t.copy_(value)

    @torch.no_grad()
    def _start_from_rank0(self) -> None:
        """No usable state on some rank: every rank takes rank 0's weights and buffers, and the next local
        step starts a period from them."""
        self.momentum = None
        self.start = None
        tensors = [p.data for p in self.params] + [b.data for b in self.buffers]
        flat = torch.cat([self._flat_params(), self._flat_buffers()])
        tdist.broadcast(flat, src=0)
        for t, value in zip(tensors, _unflatten_dense_tensors(flat, tensors), strict=True):
            t.copy_(value)


def _buckets(params: list, limit_bytes: int) -> list[list[int]]:
    """Parameter indices in buckets of at most `limit_bytes` (one parameter may exceed it alone), last first."""
    buckets: list[list[int]] = [[]]
    size = 0
    for i in reversed(range(len(params))):
        nbytes = params[i].numel() * params[i].element_size()
        if buckets[-1] and size + nbytes > limit_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += nbytes
    return buckets if buckets[0] else []


def _read(path: Path, device) -> tuple[dict | None, str]:
    """(the saved state, "") or (None, why not)."""
    try:
        return torch.load(path, map_location=device, weights_only=True), ""
    except FileNotFoundError:
        return None, "the checkpoint holds no sync state (saved with another sync.mode)"
    except Exception as e:  # a truncated or foreign file: training goes on without it, and says so
        return None, f"its sync state could not be read ({type(e).__name__}: {e})"


def _to_host(flags: torch.Tensor, step: int) -> FiniteFlags:
    """Start copying `flags` to the host; a GPU's copy runs behind the queued work, read once it arrived."""
    if not flags.is_cuda:
        return FiniteFlags(step=step, flags=flags.clone(), arrived=None)
    host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
    host.copy_(flags, non_blocking=True)
    arrived = torch.cuda.Event()
    arrived.record()
    return FiniteFlags(step=step, flags=host, arrived=arrived)


def _cpu(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().cpu()


def _to(t: torch.Tensor | None, device) -> torch.Tensor | None:
    return None if t is None else t.to(device)
