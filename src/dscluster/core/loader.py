"""DataLoader workers that make a rank's batches ahead of its steps, on the sampler's own plan.

A data set made on the host (decode, resize, augment) would otherwise be made inside the step, with the
GPU idle; here torch DataLoader workers make it a few batches ahead, into pinned memory. The sampler
still decides everything: the loader is handed the same index lists in the same order, one item per
micro-step, and each batch's augmentation is seeded by its place in the plan, not by its worker, so 0
workers or 8 give the same tensors. `ImageSet.get_batch` takes the prepared batch whose indices match
(`Feed`) and falls back to making it in-process; held-out evaluation reads its set in one pass of
fixed chunks (`pass_feed`) unless it is cached (core/datacache.py).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from dscluster.node import cpus

MAX_DEFAULT_WORKERS = 8


def default_workers(local_ranks: int, cpus: int | None = None) -> int:
    """data.workers=null: this node's CPUs shared among its ranks, at most MAX_DEFAULT_WORKERS each."""
    cpus = cpus or os.cpu_count() or 1
    return max(1, min(MAX_DEFAULT_WORKERS, cpus // max(1, local_ranks)))


def workers_for(cfg, local_ranks: int) -> int:
    """A rank's loader workers: data.workers, or default_workers where it is null."""
    return default_workers(local_ranks) if cfg.workers is None else cfg.workers


def batch_seed(seed: int, epoch: int, step: int, micro: int, rank: int) -> int:
    """The augmentation seed of one micro-batch, from its place in the plan alone."""
    return int(np.random.SeedSequence([seed, epoch, step, micro, rank]).generate_state(1, np.uint64)[0] >> 1)


def _spread_worker(_worker_id: int) -> None:
    """A launcher that bound the rank to one core (OpenMPI does for 1-2 ranks unless --bind-to none)
    would put every worker on that core too: let the workers use the whole node."""
    try:
        if len(os.sched_getaffinity(0)) < (os.cpu_count() or 1):
            cpus.widen()
    except OSError:
        pass  # a cpuset that forbids it: the workers stay where the launcher put the rank


class Prepared(Dataset):
    """What the loader maps: an item (indices, seed or None) -> (indices, uint8 images, labels)."""

    def __init__(self, images):
        self.images = images

    def __getitem__(self, item: tuple[tuple[int, ...], int | None]):
        indices, seed = item
        x, y = self.images.prepare(indices, seed)
        return torch.tensor(indices, dtype=torch.long), x, y


class Plan:
    """The loader's sampler: the items of the epoch being trained, replaced at each epoch."""

    def __init__(self):
        self.items: list[tuple[tuple[int, ...], int | None]] = []

    def __iter__(self):
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)


class Feed:
    """Prepared batches in plan order; `take(indices)` gives the next one when it is the one asked for."""

    def __init__(self, batches: Iterator, count: int, *, one_pass: bool = False):
        self.batches = batches
        self.left = count
        self.one_pass = one_pass
        self.pending = None

    @property
    def done(self) -> bool:
        return self.left == 0 and self.pending is None

    def take(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.pending is None and self.left > 0:
            self.pending = next(self.batches)
            self.left -= 1
        if self.pending is None:
            return None
        got, x, y = self.pending
        if got.numel() != len(indices) or not torch.equal(got, torch.as_tensor(indices, dtype=torch.long)):
            return None  # asked for something else (a probe, a one-off batch): kept for the step that wants it
        self.pending = None
        if self.one_pass and self.left == 0:
            self.finish()
        return x, y

    def finish(self) -> None:
        """Past the last batch: the loader's iterator ends here (a one-pass loader's workers exit now).
        Left to the garbage collector instead, each worker was joined with torch's 5 s timeout and
        then killed: 14 workers held a finished run for 70 s."""
        next(self.batches, None)


@contextlib.contextmanager
def _quiet():
    """Without torch's warning that a rank bound to fewer CPUs than it has workers may "freeze": its
    workers spread over the node (_spread_worker), and the run notes say so."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
        yield


def make_loader(images, sampler, workers: int, prefetch: int, pin: bool, *, persistent: bool) -> DataLoader:
    """The batches' seeds are the plan's; the loader's own seed (drawn at each start of its workers) comes
    from a generator of its own, not the global torch stream: model init, dropout and drop-path draw the
    same numbers whether a split is cached (core/datacache.py) or made again at each pass."""
    with _quiet():
        return DataLoader(Prepared(images), sampler=sampler, batch_size=None, num_workers=workers, pin_memory=pin,
                          prefetch_factor=prefetch if workers else None,
                          persistent_workers=persistent and workers > 0,
                          worker_init_fn=_spread_worker if workers else None, generator=torch.Generator())


def start_workers(loader: DataLoader) -> Iterator:
    with _quiet():
        return iter(loader)


class LoaderSteps:
    """A StepSampler whose micro-batches are made ahead by loader workers; otherwise the sampler itself."""

    def __init__(self, sampler, images, *, workers: int, prefetch: int, pin: bool, augment: bool):
        self.sampler = sampler
        self.images = images
        self.augment = augment
        self.plan = Plan()
        # Persistent: the workers (and what they opened) outlive an epoch instead of starting again.
        self.loader = make_loader(images, self.plan, workers, prefetch, pin, persistent=True)
        self.primed: tuple | None = None
        """(epoch, start_step, plan, feed) started ahead by `prime`."""

    def __getattr__(self, name):  # steps_per_epoch, shares, rank, ...: the sampler's
        return getattr(self.sampler, name)

    def close(self) -> None:
        """Training is over: the persistent workers exit now, in order (torch keeps their iterator on the
        loader; left to the garbage collector at exit, each was joined with a 5 s timeout, then killed)."""
        it = getattr(self.loader, "_iterator", None)
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
        self.loader._iterator = None

    def prime(self, epoch: int, start_step: int = 0) -> None:
        """Set the workers on `epoch` now, while the held-out pass runs (rank 0) and the other ranks wait:
        its first batches are made by the time its first step asks, instead of the epoch's first step
        waiting for the workers' restart (measured: docs/performance.md, "The data cache")."""
        self.primed = (epoch, start_step, *self._start(epoch, start_step))

    def _start(self, epoch: int, start_step: int) -> tuple[list, Feed]:
        """The sampler's steps of `epoch` from `start_step`, and the workers started on them."""
        s = self.sampler
        plan = list(s.steps(epoch, start_step))
        self.plan.items = [(tuple(idx), batch_seed(s.seed, epoch, step, k, s.rank) if self.augment else None)
                           for step, micro in enumerate(plan, start=start_step) for k, idx in enumerate(micro)]
        return plan, Feed(start_workers(self.loader), len(self.plan.items))

    def steps(self, epoch: int, start_step: int = 0) -> Iterator[list[list[int]]]:
        primed, self.primed = self.primed, None
        if primed is not None and primed[:2] == (epoch, start_step):
            plan, feed = primed[2:]
        else:  # not primed, or primed for another place: the workers start again here
            plan, feed = self._start(epoch, start_step)
        self.images.drop_prefix()
        self.images.feed = feed
        try:
            yield from plan
        finally:
            if self.images.feed is feed:
                self.images.feed = None


def pass_feed(images, workers: int, prefetch: int, pin: bool) -> Callable[[Sequence[int]], Feed | None]:
    """For a set read front to back in chunks (evaluation): a chunk [0, B) starts a feed of them all."""

    def start(indices: Sequence[int]) -> Feed | None:
        b = len(indices)
        if b == 0 or list(indices) != list(range(b)) or b >= len(images):
            return None
        items = [(tuple(range(lo, min(len(images), lo + b))), None) for lo in range(0, len(images), b)]
        loader = make_loader(images, items, workers, prefetch, pin, persistent=False)
        return Feed(start_workers(loader), len(items), one_pass=True)

    return start


def with_loader(sampler, splits, cfg, device: torch.device, local_ranks: int, notes: list[str]):
    """The sampler with its batches made by `cfg.workers` loader workers (data.workers, data.prefetch),
    for data sets made on the host; any other data set gets the sampler back unchanged."""
    train = splits.train
    if not train.host_prepared:
        return sampler
    workers = workers_for(cfg, local_ranks)
    pin = device.type == "cuda"
    bound = len(os.sched_getaffinity(0))
    if workers and bound < min(workers + 1, os.cpu_count() or 1):
        notes.append(f"data: the launcher bound this rank to {bound} CPU(s); its {workers} loader workers use all "
                     f"{os.cpu_count()} of the node's (mpirun --bind-to none leaves the rank free too)")
    notes.append(f"data: {train.name} batches made ahead by {workers} loader worker(s)"
                 + (", pinned memory" if pin else "") if workers else
                 f"data: {train.name} batches made in the training process (data.workers=0)")
    if splits.holdout is not None and splits.holdout.host_prepared and splits.holdout.cached is None:
        splits.holdout.pass_feed = pass_feed(splits.holdout, workers, cfg.prefetch, pin)
    return LoaderSteps(sampler, train, workers=workers, prefetch=cfg.prefetch, pin=pin, augment=cfg.augment)
