"""What the data set costs the whole run (runmodel/phases.py): its size as training splits it and, for a
set made on the host (fractal, imagefolder, cifar10 resized), how fast the rank's loader workers make
its images and what data.cache makes once.

The fill probe runs train's own fill over the first images of the training split, in plan's process,
and reads when each item arrives: the first wave holds the workers' start, the waves after it give the
wall-clock seconds per image with the workers in parallel. Measured, not one core's rendering divided by
the workers: that division predicted fills about half as long as measured (docs/plan.md, "The whole
run"). The one-core figure (`render_seconds`) only sizes the sample to about PROBE_SECONDS.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from dscluster import core
from dscluster.errors import UsageError
from dscluster.runmodel import phases

RENDER_PROBE_IMAGES = 64
PROBE_SECONDS = 0.3
"""What the fill probe aims to spend making images, after its workers start (sized by one core's rate)."""
PROBE_MAX_IMAGES = 4096
PROBE_WAVES = 3
"""Items per worker, at least: the first holds the start, the rest the rate."""
PROBE_MIN_CHUNK = 16
"""Images per item, at least, where the sample is too small for the fill's own FILL_CHUNK (many workers
on few CPUs)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DataFacts:
    train_n: int
    holdout_n: int
    name: str = ""
    s_per_image: float | None = None
    """Wall-clock seconds per image with the rank's `workers` in parallel (the fill probe); None: not
    made on the host."""
    start_s: float = 0.0
    """Starting the workers of a pass and their first calls (the fill probe)."""
    probe_images: int = 0
    one_core_s: float | None = None
    """One core's seconds per image in plan's process (`render_seconds`)."""
    workers: int = 0
    cached_train: bool = False
    cached_holdout: bool = False
    cache_reason: str = ""
    measured_fill_s: float | None = None
    """The cache's fill as an earlier run of these ranks measured it (runmodel/predicted.py `startup`)."""
    image_bytes: int = 0
    """One uint8 image as the loader and the cache hold it (channels × side²); 0: not made on the host."""
    prefetch: int = 0
    """data.prefetch: micro-batches each loader worker makes ahead."""
    save_gbps: float | None = None
    """The checkpoints' folder's write rate as plan measured it (plan/saveprobe.py); None: not measured, a
    save is priced at phases.CHECKPOINT_WRITE_GBps."""

    @property
    def cached_images(self) -> int:
        return self.train_n * self.cached_train + self.holdout_n * self.cached_holdout

    def fill_s(self) -> float:
        if self.measured_fill_s is not None and self.cached_images:
            return self.measured_fill_s
        return phases.fill_seconds(self.cached_images, self.s_per_image or 0.0, self.start_s,
                                   passes=self.cached_train + self.cached_holdout)

    def feed_step_s(self, images_per_rank: int) -> float:
        """The least a training step takes for its loader workers to make a rank's images (0: cached)."""
        return 0.0 if self.cached_train else phases.feed_step_seconds(images_per_rank, self.s_per_image)

    def eval_s(self, forward_s: float, on_gpu: bool = False, ranks: int = 1) -> float:
        """One held-out pass: `forward_s` of the model over the busiest rank's share (the whole set where
        `ranks` is 1), on a GPU with that share's copy there where cached (its batches are views of
        pageable memory), or the making of the share's images where not."""
        images = phases.evaluation_share(self.holdout_n, ranks)
        copy = phases.evaluation_copy_seconds(images, self.image_bytes) if on_gpu and self.cached_holdout else 0
        return phases.evaluation_seconds(forward_s + copy, images,
                                         None if self.cached_holdout else self.s_per_image, self.start_s)

    def restart_s(self, micro_batch: int, grad_accum: int, steps_per_epoch: int) -> float:
        """The loader's restart at an epoch end: its workers refill their prefetch, workers × data.prefetch
        micro-batches (fewer where the epoch has fewer); 0 without loader workers (data.workers=0, or a set
        not made on the host)."""
        items = min(self.workers * self.prefetch, steps_per_epoch * grad_accum)
        return phases.loader_restart_seconds(items, micro_batch, self.image_bytes) if self.workers else 0.0

    def loader_start_s(self) -> float:
        """What the first step waits for the loader workers' start (the fill probe's start of them)."""
        return self.start_s if self.workers and self.image_bytes else 0.0


@dataclass(frozen=True, slots=True)
class FillRate:
    """What the fill probe measured: seconds per image with `workers` in parallel, and the start."""

    s_per_image: float
    start_s: float
    images: int
    workers: int


def render_seconds(images, count: int = RENDER_PROBE_IMAGES) -> float:
    """Seconds of one core to make one un-augmented image of `images` (sizes the fill probe)."""
    n = min(count, len(images))
    warm = range(n, min(len(images), n + 8)) or range(min(8, n))
    images.prepare(warm, None)  # first-call costs (imports, allocations) are not the steady rate
    t0 = time.perf_counter()
    images.prepare(range(n), None)
    return (time.perf_counter() - t0) / max(1, n)


def probe_sample(size: int, workers: int, one_core_s: float, cpus: int) -> tuple[int, int]:
    """(images, images per item) of the fill probe: whole waves of one item per worker, at least
    PROBE_WAVES of them, about PROBE_SECONDS of making at one core's rate shared by the CPUs the
    workers can use, at most PROBE_MAX_IMAGES and the split."""

    w = max(1, workers)
    per_image = one_core_s / (min(w, cpus) if workers else 1)
    want = min(PROBE_MAX_IMAGES, int(PROBE_SECONDS / max(per_image, 1e-7)))
    chunk = min(core.FILL_CHUNK, max(PROBE_MIN_CHUNK, want // (PROBE_WAVES * w)), size // (PROBE_WAVES * w))
    if chunk < 1:  # fewer images than PROBE_WAVES waves of one image a worker: the split, one item a worker
        return size, max(1, -(-size // w))
    waves = max(PROBE_WAVES, min(want, size) // (w * chunk))
    return min(waves, size // (w * chunk)) * w * chunk, chunk


class _Sample:
    """The first `n` images of a split, made by the split's own `prepare`: the cache train's fill leaves
    is this object's, dropped with it."""

    cached = None

    def __init__(self, images, n: int):
        self.images, self.n = images, n
        self.in_chans, self.img_size = images.in_chans, images.img_size

    def __len__(self) -> int:
        return self.n

    def prepare(self, indices, seed):
        return self.images.prepare(indices, seed)


def fill_rate(images, workers: int, prefetch: int, one_core_s: float, cpus: int | None = None) -> FillRate:
    """Train's fill (datacache.fill) of a sample of `images` by `workers` loader workers: the wall-clock
    seconds per image after the first wave (no fewer than one core's spread over the CPUs the workers
    share: where they outnumber the CPUs, the early ones make their items while the last start), and
    the start, the rest of the sample's fill."""

    cpus = cpus or os.cpu_count() or 1
    n, chunk = probe_sample(len(images), workers, one_core_s, cpus)
    arrivals: list[tuple[int, float]] = []
    total = core.fill_cache(_Sample(images, n), workers, prefetch, chunk=chunk,
                           arrived=lambda made, t: arrivals.append((made, t)))
    first = max(1, workers)
    rate = total / max(1, n)
    if len(arrivals) > first:
        made, at = arrivals[first - 1]
        rate = (arrivals[-1][1] - at) / (n - made)
    rate = max(rate, one_core_s / min(first, cpus))
    return FillRate(rate, max(0.0, total - n * rate), n, workers)


def data_facts(cfg, local_ranks: int) -> DataFacts | str:
    """The data set's facts for the whole run (training's split, the fill probe, data.cache's rule for
    rank 0 of a node with `local_ranks` ranks), or why they are unknown."""

    d = cfg.data
    if d.dataset == "synthetic":
        return DataFacts(train_n=d.synthetic_samples, holdout_n=0, name="synthetic")
    try:

        splits = core.load_data(d, "cpu", cfg.seed)
    except (UsageError, OSError, ImportError) as e:
        return f"data set {d.dataset!r} not readable here ({e})"
    train, hold = splits.train, splits.holdout
    facts = DataFacts(train_n=len(train), holdout_n=len(hold) if hold is not None else 0, name=train.name)
    if not train.host_prepared:
        return facts
    workers = core.workers_for(d, local_ranks)
    try:
        one_core = render_seconds(train)
        rate = fill_rate(train, workers, d.prefetch, one_core)
    except UsageError as e:
        return f"data set {d.dataset!r} not readable here ({e})"
    choice = core.CacheChoice(False, False, "")
    if train.cacheable:
        hold_bytes = core.cache_split_bytes(hold) if hold is not None and hold.cacheable else 0
        choice = core.choose_cache(d.cache, core.cache_split_bytes(train), hold_bytes, primary=True,
                                  local_ranks=local_ranks, available=core.memory_available())
    return DataFacts(train_n=facts.train_n, holdout_n=facts.holdout_n, name=train.name, s_per_image=rate.s_per_image,
                     start_s=rate.start_s, probe_images=rate.images, one_core_s=one_core, workers=workers,
                     cached_train=choice.training, cached_holdout=choice.holdout, cache_reason=choice.reason,
                     image_bytes=train.in_chans * train.img_size ** 2, prefetch=d.prefetch)


def notes(facts: DataFacts | str, images_per_rank: int, gpu_step_s: float) -> list[str]:
    """What the reader should know about the data set's share of the run."""
    if isinstance(facts, str) or facts.s_per_image is None:
        return []
    one = f"; one core alone: {facts.one_core_s * 1e3:.2f} ms an image" if facts.one_core_s else ""
    by = (f"by {facts.workers} loader worker(s) a rank (train's fill): {facts.s_per_image * 1e3:.3f} ms per image "
          f"after {facts.start_s:.2f} s to start them" if facts.workers else
          f"in-process (train's fill, data.workers=0): {facts.s_per_image * 1e3:.3f} ms per image")
    out = [f"data: {facts.probe_images:,} {facts.name} images made here {by}{one}"
           + (f"; {facts.cached_images:,} made once into memory in about {facts.fill_s():.1f} s (data.cache)"
              if facts.cached_images else "")]
    if facts.cache_reason and facts.cache_reason != "data.cache=false":
        out.append(f"data: not every split is cached: {facts.cache_reason}")
    feed = facts.feed_step_s(images_per_rank)
    if feed > gpu_step_s:
        out.append(f"data: the feed, not the GPU, bounds the step: the loader workers make a rank's {images_per_rank} "
                   f"images of a step in {feed:.3f} s, the step's compute and communication take {gpu_step_s:.3f} s "
                   "(more data.workers, or data.cache where memory allows)")
    return out
