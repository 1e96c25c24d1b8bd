"""Synchronising less often: post-local SGD and DiLoCo on DeepSpeed's ZeRO-0 path (`sync.mode`).

On Ethernet an every-step all-reduce of the gradients costs more than the step's compute (ViT-S,
87 MB of fp32 gradients: 0.073 s at 10 Gbit against 0.028 s of compute on an H200). Averaging the
models every H steps moves the same bytes H times less often:

- local_sgd (post-local SGD, Lin et al. 2020; torch's `PeriodicModelAverager` and
  `HierarchicalModelAverager`): the first sync.warmup_steps steps all-reduce the gradients across
  every rank; after that each node steps on its own gradients, its own GPUs averaging theirs every
  step (the hierarchical part: NVLink or PCIe is fast), and every H steps the models are averaged
  across all ranks.
- diloco (Douillard et al. 2023): the same inner steps; at each average the change of the period,
  averaged over the ranks, is the outer gradient of a Nesterov step (outer_lr, outer_momentum) on the
  weights the period started from. local_sgd is diloco with outer_lr 1 and momentum 0.

What is averaged is what the optimizer steps: with amp (the default) the model's own fp32 weights,
which DeepSpeed's engine steps with torch's AdamW. The inner optimizer state (AdamW's moments) stays
each rank's own, as in both papers. Rank weights follow the data: a rank's share of the global batch
(balanced batching gives a slow node less), for the gradients within a node as for the models.

Sync points (syncmode.is_sync_point) are global step numbers, the same on every rank whatever each rank's
fp16 loss scaler did: a step an overflow made one rank skip is still a step of the period. At each
average the loss scalers agree too (the smallest scale and growth count of any rank), so a rank that
overflowed alone does not train on at another scale. Epoch ends are sync points as well (rank 0
evaluates and checkpoints the average), as are checkpoint.every_steps saves and the run's last step.
A checkpoint keeps the period's outer state (DiLoCo's momentum) per rank beside DeepSpeed's files.

Every all-reduce here is timed as communication in the step split (split.py): the gradients' as the
usual comm, the models' average as `average_s` (inside comm_s, never in compute).
"""

from __future__ import annotations

import io
from pathlib import Path

import torch
import torch.distributed as tdist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from dscluster.fsutil import atomic_write_bytes
from dscluster.syncmode import is_sync_point, node_groups, weights

SYNC_DIR = "sync"
"""Per-rank averager state inside a checkpoint tag: sync/rank-R.pt."""


def local(cfg) -> bool:
    """Whether the run synchronises less often than every step."""
    return cfg.sync.mode != "every_step"


class ModelAverager:
    """One rank's part: `reduce_gradients(step)` after the boundary backward, `after_step(...)` after
    `engine.step()`. Collective: every rank makes the same groups in the same order."""

    def __init__(self, model: torch.nn.Module, cfg, rank: int, hosts: list[str], shares: list[int], *,
                 steps_per_epoch: int, total: int, split=None, scaler=None):
        self.mode, self.period, self.warmup = cfg.sync.mode, int(cfg.sync.period), int(cfg.sync.warmup_steps)
        self.outer_lr, self.outer_momentum = float(cfg.sync.outer_lr), float(cfg.sync.outer_momentum)
        self.every_steps = int(cfg.checkpoint.every_steps)
        self.steps_per_epoch, self.total = steps_per_epoch, total
        self.rank, self.world = rank, len(hosts)
        self.split, self.scaler = split, scaler
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.node_ranks: list[int] = []
        self.node_group = None
        for ranks in node_groups(hosts):  # every rank creates every group (torch's rule), keeps its own
            group = tdist.new_group(ranks) if self.world > 1 else None
            if rank in ranks:
                self.node_ranks, self.node_group = ranks, group
        node_w, world_w = weights(shares, hosts)
        self.node_weight, self.world_weight = node_w[rank], world_w[rank]
        self.start: torch.Tensor | None = None   # diloco: the weights the period started from
        self.momentum: torch.Tensor | None = None
        self.averages = 0

    # --- per step ---------------------------------------------------------------------------------

    def reduce_gradients(self, step: int) -> None:
        """After the boundary backward, before engine.step(): across every rank during the warm-up, else
        across this node's ranks. DiLoCo notes the weights a period starts from (the same on every rank:
        DeepSpeed broadcast them, or the warm-up's steps, the last average or a checkpoint made them so)."""
        if self.world <= 1:
            return
        if self.mode == "diloco" and self.start is None and step > self.warmup:
            with torch.no_grad():
                self.start = _flatten_dense_tensors([p.data for p in self.params]).float().clone()  # one tensor: a view
        if step <= self.warmup:
            group, w = None, self.world_weight
        elif len(self.node_ranks) > 1:
            group, w = self.node_group, self.node_weight
        else:
            return
        grads = [p.grad for p in self.params if p.grad is not None]
        if self.split is not None:
            self.split.bucket_handed()
        flat = _flatten_dense_tensors(grads)
        flat.mul_(w)
        tdist.all_reduce(flat, group=group)
        for g, r in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
            g.copy_(r)
        if self.split is not None:
            self.split.reductions_done()

    def after_step(self, step: int, *, step_in_epoch: int) -> bool:
        """After engine.step(): average across ranks where `step` is a sync point. True when it did."""
        if self.world <= 1 or step <= self.warmup:
            return False
        if not is_sync_point(step, period=self.period, step_in_epoch=step_in_epoch,
                             steps_per_epoch=self.steps_per_epoch, total=self.total, every_steps=self.every_steps):
            return False
        if self.split is not None:
            self.split.average_started()
        self.average()
        if self.split is not None:
            self.split.average_done()
        return True

    @torch.no_grad()
    def average(self) -> None:
        """Collective: the weighted mean of every rank's weights (local_sgd), or DiLoCo's outer step on it."""
        data = [p.data for p in self.params]
        flat = _flatten_dense_tensors(data).float().clone()  # not a view of a lone parameter
        flat.mul_(self.world_weight)
        tdist.all_reduce(flat)
        if self.mode == "diloco":
            assert self.start is not None
            delta = self.start - flat  # the outer gradient: how far the average moved, negated
            if self.momentum is None:
                self.momentum = torch.zeros_like(delta)
            self.momentum.mul_(self.outer_momentum).add_(delta)
            self.start.sub_(delta.add_(self.momentum, alpha=self.outer_momentum), alpha=self.outer_lr)
            flat = self.start
        for p, r in zip(data, _unflatten_dense_tensors(flat, data), strict=True):
            p.copy_(r)
        self._agree_on_scale()
        self.averages += 1

    def _agree_on_scale(self) -> None:
        """fp16 (amp): every rank goes on at the smallest loss scale and growth count of any rank."""
        s = self.scaler
        if s is None or getattr(s, "_scale", None) is None:
            return
        both = torch.stack([s._scale.reshape(()).float(), s._growth_tracker.reshape(()).float()])
        tdist.all_reduce(both, op=tdist.ReduceOp.MIN)
        s._scale.fill_(both[0])
        s._growth_tracker.fill_(both[1].to(s._growth_tracker.dtype))

    # --- checkpoints (the Checkpointer calls these as it calls comm.CommHook's) -----------------------

    def save(self, tag_dir: Path, rank: int, world_size: int) -> None:
        """This rank's outer state into TAG/sync/rank-R.pt, atomically."""
        buf = io.BytesIO()
        torch.save({"world_size": world_size, "mode": self.mode, "period": self.period, "averages": self.averages,
                    "momentum": None if self.momentum is None else self.momentum.cpu()}, buf)
        atomic_write_bytes(Path(tag_dir) / SYNC_DIR / f"rank-{rank}.pt", buf.getvalue())

    def restore(self, tag_dir: Path, rank: int, world_size: int, device, agree) -> str | None:
        """Collective: the saved outer state, used only where every rank has one that fits. A checkpoint
        is a sync point: the weights DeepSpeed loaded are the period's start on every rank."""
        path = Path(tag_dir) / SYNC_DIR / f"rank-{rank}.pt"
        saved, why = None, ""
        try:
            saved = torch.load(path, map_location=device, weights_only=True)
        except FileNotFoundError:
            why = "the checkpoint holds no sync state (saved with another sync.mode)"
        except Exception as e:  # a truncated or foreign file: training goes on without the old momentum
            why = f"its sync state could not be read ({type(e).__name__}: {e})"
        if saved is not None and (saved.get("world_size") != world_size or saved.get("mode") != self.mode):
            why = (f"it was saved by {saved.get('world_size')} ranks with sync.mode={saved.get('mode')}, this run "
                   f"has {world_size} with {self.mode}")
        reasons = [v for v in agree(why) if v]
        self.start = None  # the next step notes the loaded weights as the period's start
        if reasons:
            self.momentum = None
            return f"sync state starts fresh: {reasons[0]}" if self.mode == "diloco" else None
        assert saved is not None
        self.averages = int(saved.get("averages", 0))
        self.momentum = None if saved.get("momentum") is None else saved["momentum"].to(device)
        return f"sync state restored ({self.mode}, {self.averages} averages so far)"
