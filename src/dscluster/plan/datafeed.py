"""What the data set costs the whole run (plan/phases.py): its size as training splits it and, for a
set made on the host (fractal, imagefolder, cifar10 resized), how fast one core makes an image and
what data.cache makes once.

The render probe times `prepare` of RENDER_PROBE_IMAGES training images in plan's own process on the
head (after one small warm call): seconds of one core per image. With the rank's loader workers
(data.workers, or the node's CPUs shared among its ranks) that gives the cache's fill, an uncached
evaluation and the least an uncached training step takes. Whether a split is cached is train's own
rule (train/datacache.choose) with the head's available memory.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from dscluster.errors import UsageError
from dscluster.plan import phases

RENDER_PROBE_IMAGES = 64


@dataclass(frozen=True, kw_only=True, slots=True)
class DataFacts:
    train_n: int
    holdout_n: int
    name: str = ""
    s_per_image: float | None = None
    """One core's seconds per image made on the host (the render probe); None: not made on the host."""
    workers: int = 0
    cached_train: bool = False
    cached_holdout: bool = False
    cache_reason: str = ""
    measured_fill_s: float | None = None
    """The cache's fill as an earlier run of these ranks measured it (plan/predicted.py `startup`)."""

    @property
    def cached_images(self) -> int:
        return self.train_n * self.cached_train + self.holdout_n * self.cached_holdout

    def fill_s(self) -> float:
        if self.measured_fill_s is not None and self.cached_images:
            return self.measured_fill_s
        return phases.fill_seconds(self.cached_images, self.s_per_image or 0.0, self.workers,
                                   passes=self.cached_train + self.cached_holdout)

    def feed_step_s(self, images_per_rank: int) -> float:
        """The least a training step takes for its loader workers to make a rank's images (0: cached)."""
        return 0.0 if self.cached_train else phases.feed_step_seconds(images_per_rank, self.s_per_image, self.workers)

    def eval_s(self, forward_s: float) -> float:
        return phases.evaluation_seconds(forward_s, self.holdout_n,
                                         None if self.cached_holdout else self.s_per_image, self.workers)


def render_seconds(images, count: int = RENDER_PROBE_IMAGES) -> float:
    """Seconds of one core to make one un-augmented image of `images` (plan's render probe)."""
    n = min(count, len(images))
    warm = range(n, min(len(images), n + 8)) or range(min(8, n))
    images.prepare(warm, None)  # first-call costs (imports, allocations) are not the steady rate
    t0 = time.perf_counter()
    images.prepare(range(n), None)
    return (time.perf_counter() - t0) / max(1, n)


def data_facts(cfg, local_ranks: int) -> DataFacts | str:
    """The data set's facts for the whole run (training's split, the render probe, data.cache's rule for
    rank 0 of a node with `local_ranks` ranks), or why they are unknown."""
    from dscluster.train import datacache, loader

    d = cfg.data
    if d.dataset == "synthetic":
        return DataFacts(train_n=d.synthetic_samples, holdout_n=0, name="synthetic")
    try:
        from dscluster.train.data import load

        splits = load(d, "cpu", cfg.seed)
    except (UsageError, OSError, ImportError) as e:
        return f"data set {d.dataset!r} not readable here ({e})"
    train, hold = splits.train, splits.holdout
    facts = DataFacts(train_n=len(train), holdout_n=len(hold) if hold is not None else 0, name=train.name)
    if not train.host_prepared:
        return facts
    try:
        s_img = render_seconds(train)
    except UsageError as e:
        return f"data set {d.dataset!r} not readable here ({e})"
    choice = datacache.CacheChoice(False, False, "")
    if train.cacheable:
        hold_bytes = datacache.split_bytes(hold) if hold is not None and hold.cacheable else 0
        choice = datacache.choose(d.cache, datacache.split_bytes(train), hold_bytes, primary=True,
                                  local_ranks=local_ranks, available=datacache.mem_available())
    return DataFacts(train_n=facts.train_n, holdout_n=facts.holdout_n, name=train.name, s_per_image=s_img,
                     workers=loader.workers_for(d, local_ranks), cached_train=choice.training,
                     cached_holdout=choice.holdout, cache_reason=choice.reason)


def notes(facts: DataFacts | str, images_per_rank: int, gpu_step_s: float) -> list[str]:
    """What the reader should know about the data set's share of the run."""
    if isinstance(facts, str) or facts.s_per_image is None:
        return []
    out = [f"data: {facts.name} images take {facts.s_per_image * 1e3:.2f} ms of one core each here (render probe, "
           f"{RENDER_PROBE_IMAGES} images); {facts.workers} loader worker(s) a rank"
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
