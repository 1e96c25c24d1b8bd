"""data.cache: a host-made split made once into memory gives the very batches the uncached path makes
(augmented or not, through the loader workers, for evaluation and for the probes), and the auto rule
caches what fits the rank's memory budget."""

from __future__ import annotations

import os

import pytest
import torch

from dscluster.core import data, datacache
from dscluster.core.config import DataConfig
from dscluster.core.loader import with_loader
from dscluster.core.sampler import StepSampler
from dscluster.errors import UsageError

CPU = torch.device("cpu")
GiB = 2**30


def fractal(**kw) -> DataConfig:
    return DataConfig(**{"dataset": "fractal", "img_size": 24, "num_classes": 4, "images_per_class": 20,
                         "fractal_points": 256, "workers": 2, **kw})


def batches(cfg: DataConfig, augment: bool) -> tuple[list, list, list]:
    """(training micro-batches of two epochs through the loader, held-out chunks, probe prefixes)."""
    splits = data.load(cfg, CPU)
    notes: list[str] = []
    datacache.cache_splits(splits, cfg, local_ranks=1, primary=True, notes=notes)
    probes = [splits.train.get_batch(list(range(b)), CPU) for b in (1, 4, 2, 8)]
    train = splits.train
    steps = with_loader(StepSampler(len(train), [6], 2, 0, seed=5), splits, cfg, CPU, 1, notes)
    fed = [(idx, *train.get_batch(idx, CPU, augment=augment)) for e in (0, 1) for micro in steps.steps(e)
           for idx in micro]
    hold = splits.holdout
    chunks = [list(range(lo, min(len(hold), lo + 7))) for lo in range(0, len(hold), 7)]
    held = [hold.get_batch(idx, CPU) for _ in range(2) for idx in chunks]  # two evaluations
    return fed, held, probes


def equal(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(p, q) for x, y in zip(a, b, strict=True)
                                    for p, q in zip(x[-2:], y[-2:], strict=True))


@pytest.mark.parametrize("augment", [False, True])
def test_cached_batches_are_the_uncached_ones(augment):
    fed, held, probes = batches(fractal(cache="true", augment=augment), augment)
    fed0, held0, probes0 = batches(fractal(cache="false", augment=augment), augment)
    assert [f[0] for f in fed] == [f[0] for f in fed0]
    assert equal(fed, fed0), "a cached training batch differs from the uncached one"
    assert equal(held, held0) and equal(probes, probes0)
    if augment:  # the shift still moves pixels: the cache holds the un-augmented images
        plain, _, _ = batches(fractal(cache="true", augment=False), False)
        assert not all(torch.equal(a[1], b[1]) for a, b in zip(fed, plain, strict=True))


def test_a_cached_split_is_made_once_and_evaluation_reads_it_in_process(monkeypatch):
    cfg = fractal(cache="true")
    splits = data.load(cfg, CPU)
    notes: list[str] = []
    records = datacache.cache_splits(splits, cfg, local_ranks=1, primary=True, notes=notes)
    assert [(r["split"], r["cached"], r["images"]) for r in records] == [("training", True, 64),
                                                                       ("held-out", True, 16)]
    assert records[0]["bytes"] == 64 * 3 * 24 * 24 + 64 * 8 and records[0]["seconds"] >= 0
    assert notes[0].startswith("data: fractal training set (64 images") and "made once into memory" in notes[0]
    with_loader(StepSampler(len(splits.train), [4], 1, 0, seed=0), splits, cfg, CPU, 1, notes)
    made = []
    for images in (splits.train, splits.holdout):
        make = images.make
        monkeypatch.setattr(images, "make", lambda idx, m=make: made.append(os.getpid()) or m(idx))
    x, y = splits.holdout.get_batch(list(range(16)), CPU)
    splits.train.get_batch(list(range(8)), CPU)
    assert made == [] and splits.holdout.feed is None, "a cached split was made again"
    assert x.shape == (16, 3, 24, 24) and y.tolist() == [i % 4 for i in range(16)]


def test_other_ranks_cache_the_training_split_only_and_false_caches_nothing():
    cfg = fractal()
    splits = data.load(cfg, CPU)
    records = datacache.cache_splits(splits, cfg, local_ranks=2, primary=False, notes=[])
    assert [r["split"] for r in records] == ["training"] and splits.holdout.cached is None
    off = data.load(fractal(cache="false"), CPU)
    notes: list[str] = []
    records = datacache.cache_splits(off, fractal(cache="false"), local_ranks=1, primary=True, notes=notes)
    assert not any(r["cached"] for r in records) and off.train.cached is None
    assert "not cached, data.cache=false" in notes[0]
    digits = data.load(DataConfig(dataset="digits"), CPU)
    assert datacache.cache_splits(digits, DataConfig(dataset="digits"), local_ranks=1, primary=True,
                                  notes=[]) == []


def test_auto_caches_what_fits_a_quarter_of_available_memory_per_local_rank():
    gb = 10**9
    # 64 GB available, 4 ranks: 4 GB a rank
    both = datacache.choose("auto", 3 * gb, gb // 2, primary=True, local_ranks=4, available=64 * gb)
    assert (both.training, both.holdout, both.reason) == (True, True, "")
    train_only = datacache.choose("auto", 3 * gb, 2 * gb, primary=True, local_ranks=4, available=64 * gb)
    assert (train_only.training, train_only.holdout) == (True, False) and "budget of 4.0 GB" in train_only.reason
    hold_only = datacache.choose("auto", 6 * gb, gb, primary=True, local_ranks=4, available=64 * gb)
    assert (hold_only.training, hold_only.holdout) == (False, True)
    other_rank = datacache.choose("auto", 3 * gb, gb * 2, primary=False, local_ranks=4, available=64 * gb)
    assert (other_rank.training, other_rank.holdout, other_rank.reason) == (True, False, "")
    # at most 16 GiB a rank, however much memory the node has
    assert not datacache.choose("auto", 17 * GiB, 0, primary=True, local_ranks=1, available=2000 * gb).training
    assert datacache.choose("auto", 15 * GiB, 0, primary=True, local_ranks=1, available=2000 * gb).training
    assert not datacache.choose("auto", 1, 0, primary=True, local_ranks=1, available=None).training


def test_true_that_cannot_fit_is_refused_naming_the_key_and_the_bytes():
    gb = 10**9
    assert datacache.choose("true", 9 * gb, gb, primary=True, local_ranks=2, available=21 * gb).holdout
    with pytest.raises(UsageError, match=r"data.cache=true: this rank's splits need 11.0 GB .* 21.0 GB available "
                                         r"shared by its 2 rank\(s\)"):
        datacache.choose("true", 10 * gb, gb, primary=True, local_ranks=2, available=21 * gb)


def test_mem_available_reads_meminfo(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       131072000 kB\nMemFree:         1000 kB\nMemAvailable:   65536000 kB\n")
    assert datacache.mem_available(str(f)) == 65536000 * 1024
    assert datacache.mem_available(str(tmp_path / "absent")) is None


def test_true_is_refused_before_the_run_when_the_node_cannot_hold_it():
    huge = fractal(cache="true", img_size=1024, images_per_class=1_000_000)
    with pytest.raises(UsageError, match="data.cache=true: this rank's splits need"):
        datacache.refuse_unfit(huge, local_ranks=1, primary=True)
    datacache.refuse_unfit(fractal(cache="true"), local_ranks=1, primary=True)  # fits: nothing said


def test_the_fill_leaves_the_global_random_stream_alone():
    """Model init follows the data set's load: a cached run must draw the weights an uncached one draws."""
    cfg = fractal(cache="true")
    splits = data.load(cfg, CPU)
    torch.manual_seed(3)
    datacache.cache_splits(splits, cfg, local_ranks=1, primary=True, notes=[])
    after_fill = torch.rand(4)
    torch.manual_seed(3)
    assert torch.equal(after_fill, torch.rand(4))
