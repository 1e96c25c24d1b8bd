"""data.cache: the images of a split made on the host (fractal, imagefolder) made once, into memory.

Made on demand, an image is made again every epoch and every held-out pass. Cached, each split is made
once per process, before training, by one front-to-back pass of the loader workers into one uint8
tensor [N, C, S, S]; `ImageSet.prepare` reads from it and applies the same seeded shift, so every batch
is the one the uncached path makes. `choose` is the one rule that train and plan both call (auto, true,
false); the modes and the measurements behind them: docs/performance.md, "The data cache".
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dscluster.core import loader
from dscluster.core.data import load
from dscluster.errors import UsageError

SHARE_OF_AVAILABLE = 0.25
MAX_BYTES_PER_RANK = 16 * 2**30
FILL_CHUNK = 64
"""Images per loader item of the fill (the fractal renderer draws 32 at a time)."""
MEMINFO = "/proc/meminfo"


def mem_available(path: str = MEMINFO) -> int | None:
    """The node's MemAvailable in bytes (None where the kernel does not say)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def split_bytes(images) -> int:
    """What caching a split holds: its uint8 images and int64 labels."""
    n = len(images)
    return n * images.in_chans * images.img_size ** 2 + 8 * n


def gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


@dataclass(frozen=True, slots=True)
class CacheChoice:
    """What one rank caches, and why a split is not cached ('' when nothing is left out)."""

    training: bool
    holdout: bool
    reason: str = ""


def budget(available: int | None, local_ranks: int) -> int:
    """auto's budget of one rank, in bytes (0 where the node's available memory is unknown)."""
    if not available:
        return 0
    return min(MAX_BYTES_PER_RANK, int(SHARE_OF_AVAILABLE * available / max(1, local_ranks)))


def choose(setting: str, train_bytes: int, holdout_bytes: int, *, primary: bool, local_ranks: int,
           available: int | None) -> CacheChoice:
    """The data.cache rule for one rank (module docstring). `holdout_bytes` 0: no held-out split to cache."""
    hold = holdout_bytes if primary else 0
    if setting == "false":
        return CacheChoice(False, False, "data.cache=false")
    if setting == "true":
        limit = available // max(1, local_ranks) if available else None
        if limit is not None and train_bytes + hold > limit:
            raise UsageError(f"data.cache=true: this rank's splits need {gb(train_bytes + hold)} in memory, more "
                             f"than the node's {gb(available or 0)} available shared by its {local_ranks} rank(s) "
                             f"({gb(limit)} each); set data.cache=auto (caches what fits) or false, or lower "
                             "data.img_size or the number of images")
        return CacheChoice(True, hold > 0)
    room = budget(available, local_ranks)
    training = train_bytes <= room
    holdout = hold > 0 and hold + (train_bytes if training else 0) <= room
    why = "" if training and (holdout or not hold) else (
        f"over this rank's budget of {gb(room)} (data.cache=auto: {SHARE_OF_AVAILABLE:.0%} of the node's "
        f"{gb(available or 0)} available memory shared by {local_ranks} rank(s), at most "
        f"{MAX_BYTES_PER_RANK // 2**30} GiB; data.cache=true caches anyway)")
    return CacheChoice(training, holdout, why)


def fill(images, workers: int, prefetch: int, *, chunk: int = FILL_CHUNK,
         arrived: Callable[[int, float], None] | None = None) -> float:
    """Make every image of `images` once, front to back, by `workers` loader workers, `chunk` images an
    item, into its cache; the seconds it took. `arrived(images, seconds)` after each item (plan's fill probe)."""
    n = len(images)
    channels = images.in_chans
    size = images.img_size
    # [N, C, S, S] in channels-last memory
    x = torch.empty((n, size, size, channels), dtype=torch.uint8).permute(0, 3, 1, 2)
    y = torch.empty(n, dtype=torch.long)
    items = [(tuple(range(lo, min(n, lo + chunk))), None) for lo in range(0, n, chunk)]
    images.cached = None
    t0 = time.perf_counter()
    made = loader.make_loader(images, items, workers, prefetch, False, persistent=False)
    for idx, xb, yb in loader.start_workers(made):
        lo, hi = int(idx[0]), int(idx[-1]) + 1
        x[lo:hi], y[lo:hi] = xb, yb
        if arrived is not None:
            arrived(hi, time.perf_counter() - t0)
    images.cached = (x, y)
    return time.perf_counter() - t0


def cache_splits(splits, cfg, *, local_ranks: int, primary: bool, notes: list[str]) -> list[dict]:
    """Cache this rank's splits as data.cache (`cfg`: the data config) decides; one record per split
    considered (the run's `data_cache` records) and a line in `notes`."""
    train, hold = splits.train, splits.holdout
    if not train.cacheable:
        return []
    hold = hold if primary and hold is not None and hold.cacheable else None
    choice = choose(cfg.cache, split_bytes(train), split_bytes(hold) if hold is not None else 0, primary=primary,
                    local_ranks=local_ranks, available=mem_available())
    workers = loader.workers_for(cfg, local_ranks)
    records = []
    for label, images, on in (("training", train, choice.training), ("held-out", hold, choice.holdout)):
        if images is None:
            continue
        rec = {"split": label, "dataset": images.name, "images": len(images), "bytes": split_bytes(images),
               "cached": on, "workers": workers, "seconds": None, "reason": None if on else choice.reason}
        if on:
            rec["seconds"] = round(fill(images, workers, cfg.prefetch), 3)
        records.append(rec)
    notes.append(note(records))
    return records


def note(records: list[dict]) -> str:
    """The run note of the cache records: what was made once, in how long, or why not."""
    parts = []
    for i, r in enumerate(records):
        what = f"{'' if i else r['dataset'] + ' '}{r['split']} set ({r['images']:,} images, {gb(r['bytes'])})"
        if r["cached"]:
            parts.append(f"{what} made once into memory in {r['seconds']:.1f} s by {r['workers']} worker(s)")
        else:
            parts.append(f"{what} made again every pass: not cached, {r['reason']}")
    return "data: " + "; ".join(parts)


def refuse_unfit(cfg, *, local_ranks: int, primary: bool) -> None:
    """data.cache=true that cannot fit this node: UsageError (exit 2) before the run writes anything."""
    if cfg.cache != "true":
        return
    splits = load(cfg, "cpu")
    hold = splits.holdout if splits.holdout is not None and splits.holdout.cacheable else None
    if splits.train.cacheable:
        choose("true", split_bytes(splits.train), split_bytes(hold) if hold is not None else 0, primary=primary,
               local_ranks=local_ranks, available=mem_available())
