"""Held-out evaluation: every rank its share (or rank 0 alone), between two barriers, on the bare model;
and time to accuracy.

Where every rank holds the same weights at an epoch end (syncmode.evaluation_sharded), each evaluates its
contiguous share of the held-out split and one all-reduce of (correct, loss sum, samples) gives rank 0 the
whole set's figures; else rank 0 evaluates alone while the others wait at a barrier. A rank runs the model
itself (setup_engine.bare_module), never the DDP wrapper, whose forward may broadcast buffers. Under ZeRO-3
each layer's forward all-gathers its parameters from every rank, so every rank runs as many forwards
(`evaluates`); rank 0 alone records. With `target_accuracy` set, the first evaluation that reaches it is
the run's time to accuracy: the `target` record, `time_to_accuracy` in summary.json.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as tdist
import torch.nn.functional as F

from dscluster.core import dist
from dscluster.core.setup_engine import bare_module
from dscluster.core.syncmode import evaluation_sharded


def share(n: int, rank: int, world: int, batch: int) -> list[range]:
    """This rank's batches of a held-out set of `n`: its contiguous share, n·rank/world up to
    n·(rank+1)/world, in batches of `batch` (one rank: the whole set, as before sharding)."""
    lo = n * rank // world
    hi = n * (rank + 1) // world
    return [range(start, min(hi, start + batch)) for start in range(lo, hi, batch)]


@torch.no_grad()
def evaluate(engine, dataset, dtype, device, channels_last: bool, batch: int = 256,
             autocast: torch.dtype | None = None, *, rank: int = 0, world: int = 1,
             lockstep: bool = False) -> tuple[float, float, int]:
    """(accuracy, mean loss, samples) of the model on `dataset`; under `autocast` (training's autocast dtype
    on a GPU, `Built.autocast`) as training's forward runs, else in the inputs' dtype. Without it an fp16 or
    bf16 amp run evaluated in fp32, bypassing the GPU's half-precision units. `world` > 1 (collective): this
    rank's `share`, summed over the ranks by one all-reduce; `lockstep` (ZeRO-3): as many forwards as the
    largest share, a rank with fewer running one more on a sample it does not count."""
    module = bare_module(engine)
    was_training = module.training
    module.eval()
    correct = 0
    loss_sum = 0.0
    n = len(dataset)
    parts = share(n, rank, world, batch)
    most = max(len(share(n, r, world, batch)) for r in range(world))
    with eager(), torch.autocast(device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
        for part in parts:
            x, y = dataset.get_batch(list(part), device, dtype, channels_last=channels_last)
            out = module(x).float()
            loss_sum += float(F.cross_entropy(out, y, reduction="sum"))
            correct += int((out.argmax(1) == y).sum())
        for _ in range(len(parts), most if lockstep else 0):  # ZeRO-3's forwards gather from every rank
            module(dataset.get_batch([0], device, dtype, channels_last=channels_last)[0])
    module.train(was_training)
    if world > 1:
        totals = torch.tensor([correct, loss_sum, sum(len(p) for p in parts)], dtype=torch.float64, device=device)
        tdist.all_reduce(totals)
        correct = int(totals[0].item())
        loss_sum = float(totals[1].item())
        n = int(totals[2].item())
    return correct / n, loss_sum / n, n


def eager():
    """The evaluation runs the model eagerly even where training compiled it (compile: auto): an eval-mode
    graph of its own, and one more for the last, shorter batch, cost the first held-out pass of a
    compiled run on an H100 about 15 s of compilation, more than its eager passes take in a whole run."""
    stance = getattr(torch.compiler, "set_stance", None)
    return stance("force_eager") if stance is not None else contextlib.nullcontext()


@dataclass
class TimeToAccuracy:
    """When the held-out accuracy first reached `target`: seconds since the run started (`started`,
    time.time()), measured at the end of that evaluation, with its step, epoch and images trained on;
    `training_seconds`: from the data cache's fill and the first step instead, the span of plan's
    prediction (runmodel/accuracy.py), start-up left out."""

    target: float | None
    started: float
    global_batch: int
    reached: dict | None = None
    points: list[tuple[int, float]] = field(default_factory=list)
    """(step, accuracy) of every evaluation: the run's held-out curve (`keep`)."""
    first_step_t: float | None = None
    """time.time() where the first step began (the trainer sets it)."""
    fill_s: float = 0.0
    """The data cache's fill before the first step: with the steps, the span plan's prediction covers."""
    eval_seconds: list[float] = field(default_factory=list)
    """Each held-out pass's seconds (at an epoch end another epoch follows, the loader's refill for it runs
    under the pass): what an epoch end costs, for plan's next prediction (runmodel/predicted.py)."""

    def see(self, rec: dict, log, progress) -> None:
        """An `eval` record: a point of the curve; the first one at or above the target becomes the
        `target` record."""
        self.points.append((rec["step"], rec["accuracy"]))
        self.eval_seconds.append(rec["seconds"])
        if self.target is None or self.reached is not None or rec["accuracy"] < self.target:
            return
        training = None if self.first_step_t is None else round(self.fill_s + rec["t"] - self.first_step_t, 3)
        self.reached = {"target": self.target, "accuracy": rec["accuracy"],
                        "seconds": round(rec["t"] - self.started, 3), "training_seconds": training,
                        "step": rec["step"], "epoch": rec["epoch"], "images": rec["step"] * self.global_batch,
                        "t": rec["t"]}
        log.record("target", **self.reached)
        progress.print(f"reached target accuracy {self.target:.1%} after {self.reached['seconds']:.1f} s "
                       f"(step {rec['step']}, epoch {rec['epoch'] + 1}, {self.reached['images']:,} images)")

    def summary(self) -> dict:
        """summary.json's fields: none without a target; with one, time_to_accuracy (null: not reached)."""
        if self.target is None:
            return {}
        return {"target_accuracy": self.target, "time_to_accuracy": self.reached}


def sharded(cfg) -> bool:
    """Whether the held-out pass is shared by every rank of this job (syncmode.evaluation_sharded)."""
    world = tdist.get_world_size() if tdist.is_initialized() else 1
    return world > 1 and evaluation_sharded(cfg.sync.mode, cfg.sync.delay_steps)


def evaluates(cfg, primary: bool) -> bool:
    """Whether this rank runs held-out forwards: every rank where the pass is shared (`sharded`; any rank
    count), else rank 0 (`primary`), and under ZeRO-3 every rank (module docstring). The data cache holds
    the held-out split where this is true (core/datacache.py): with sharding, on every rank."""
    return primary or cfg.zero_stage == 3 or evaluation_sharded(cfg.sync.mode, cfg.sync.delay_steps)


def held_out(engine, built, cfg, device, *, primary: bool, log, progress, epoch: int, step: int,
             tta: TimeToAccuracy | None = None) -> float | None:
    """Collective: every rank calls it; every rank its share (`sharded`), else rank 0 (with every rank under
    ZeRO-3), evaluates; rank 0 records it and returns the accuracy."""
    accuracy = None
    # a streamed average (sync.delay_steps > 0) leaves the ranks' weights apart here: rank 0 alone then
    spread = sharded(cfg)
    dist.barrier()
    if evaluates(cfg, primary):
        t0 = time.perf_counter()
        acc, eloss, n = evaluate(engine, built.splits.holdout, built.dtype, device, cfg.channels_last,
                                 autocast=built.autocast, rank=tdist.get_rank() if spread else 0,
                                 world=tdist.get_world_size() if spread else 1, lockstep=cfg.zero_stage == 3)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    if primary:
        accuracy = acc
        rec = log.record("eval", epoch=epoch, step=step, accuracy=acc, loss=eloss, samples=n,
                         seconds=round(time.perf_counter() - t0, 3))
        progress.print(f"epoch {epoch + 1}/{cfg.epochs} step {step}: held-out accuracy {acc:.1%} loss {eloss:.3f}")
        if tta is not None:
            tta.see(rec, log, progress)
    dist.barrier()
    return accuracy
