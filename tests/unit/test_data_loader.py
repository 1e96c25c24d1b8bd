"""imagefolder batches come from DataLoader workers on the sampler's own plan: the same indices, labels
and (augmented) pixels with 2 workers as with none, the same as making them in-process, resume
mid-epoch included; training from an ImageFolder of JPEGs runs through them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from _wait import wait_until
from dscluster.core import data
from dscluster.core.config import DataConfig
from dscluster.core.loader import LoaderSteps, default_workers, with_loader
from dscluster.core.sampler import BalancedStepSampler, StepSampler
from dscluster.errors import UsageError

ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


def make_imagefolder(root: Path, classes: int = 4, per_class: int = 16, seed: int = 0) -> Path:
    """JPEGs of different sizes (resized on load), each class a colour of its own plus noise."""
    rng = np.random.default_rng(seed)
    for c in range(classes):
        (root / f"class{c}").mkdir(parents=True)
        base = rng.integers(0, 256, 3)
        for i in range(per_class):
            h, w = rng.integers(18, 48, 2)
            pixels = np.clip(base + rng.normal(0, 40, (h, w, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(root / f"class{c}" / f"img{i:03d}.jpg", quality=90)
    return root


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_imagefolder(tmp_path_factory.mktemp("imagefolder"))


def load(folder: Path, **kw) -> tuple[data.Splits, DataConfig]:
    cfg = DataConfig(dataset="imagefolder", path=str(folder), img_size=16, **kw)
    return data.load(cfg, CPU), cfg


def run_steps(steps, images, epochs_from: list[tuple[int, int]], augment: bool):
    """What the training loop sees: per micro-step (indices, x, y)."""
    out = []
    for epoch, start in epochs_from:
        for micro in steps.steps(epoch, start):
            for idx in micro:
                x, y = images.get_batch(idx, CPU, torch.float32, augment=augment)
                out.append((list(idx), x, y))
    return out


def same(a, b) -> bool:
    return len(a) == len(b) and all(ia == ib and torch.equal(xa, xb) and torch.equal(ya, yb)
                                    for (ia, xa, ya), (ib, xb, yb) in zip(a, b, strict=True))


@pytest.mark.parametrize("kind,shares,accum", [("uniform", [4, 4], 2), ("balanced", [3, 5], 1)])
def test_two_workers_give_the_same_batches_as_none_on_the_samplers_plan(folder, kind, shares, accum):
    splits, cfg = load(folder, augment=True)
    train = splits.train
    make = StepSampler if kind == "uniform" else BalancedStepSampler
    # epoch 0 whole, epoch 1 resumed after its first step
    plan = [(0, 0), (1, 1)]
    for rank in range(len(shares)):
        sampler = make(len(train), shares, accum, rank, seed=7)
        seen = {}
        for workers in (0, 2):
            steps = with_loader(sampler, splits, DataConfig(**{**vars(cfg), "workers": workers}), CPU, 1, [])
            assert isinstance(steps, LoaderSteps) and steps.steps_per_epoch == sampler.steps_per_epoch
            seen[workers] = run_steps(steps, train, plan, augment=True)
        assert same(seen[0], seen[2]), f"rank {rank}: 2 workers made other batches than none"
        # The rank's share is the sampler's: its indices, in its order, with the folder's labels.
        expected = [idx for e, s in plan for micro in sampler.steps(e, s) for idx in micro]
        assert [i for i, _, _ in seen[2]] == expected
        for idx, x, y in seen[2]:
            assert y.tolist() == [train.labels[i] for i in idx]
            assert x.shape == (len(idx), 3, 16, 16) and x.dtype == torch.float32


def test_loader_batches_are_the_in_process_ones_and_augmentation_moves_pixels(folder):
    splits, cfg = load(folder, augment=False, workers=2)
    train = splits.train
    sampler = StepSampler(len(train), [8], 1, 0, seed=3)
    fed = run_steps(with_loader(sampler, splits, cfg, CPU, 1, []), train, [(0, 0)], augment=False)
    direct = [(idx, *train.get_batch(idx, CPU)) for idx, _, _ in fed]  # no feed: made here
    assert same(fed, direct)
    aug_splits, aug_cfg = load(folder, augment=True, workers=2)
    shifted = run_steps(with_loader(sampler, aug_splits, aug_cfg, CPU, 1, []), aug_splits.train, [(0, 0)],
                        augment=True)
    assert [i for i, _, _ in shifted] == [i for i, _, _ in fed]
    assert not all(torch.equal(a[1], b[1]) for a, b in zip(fed, shifted, strict=True)), "augment=true changed no pixel"


def test_resume_mid_epoch_continues_with_the_same_batches(folder):
    splits, cfg = load(folder, augment=True, workers=2)
    sampler = StepSampler(len(splits.train), [4], 2, 0, seed=11)
    steps = with_loader(sampler, splits, cfg, CPU, 1, [])
    whole = run_steps(steps, splits.train, [(0, 0)], augment=True)
    resumed = run_steps(steps, splits.train, [(0, 3)], augment=True)
    assert same(resumed, whole[3 * 2:])


def test_the_next_epoch_is_made_during_the_evaluation_with_the_same_batches(folder, tmp_path, monkeypatch):
    # train/loop.py primes epoch e+1 before rank 0's held-out pass: the workers make its first batch
    # while the GPU evaluates, not after the next step has asked for it
    splits, cfg = load(folder, augment=True, workers=2)
    train = splits.train
    sampler = StepSampler(len(train), [4], 2, 0, seed=5)
    unprimed = run_steps(with_loader(sampler, splits, cfg, CPU, 1, []), train, [(0, 0), (1, 0)], augment=True)
    made = tmp_path / "made"
    made.mkdir()
    prepare = train.prepare

    def recording(idx, seed):  # runs in a worker process: leaves a file per batch it made
        (made / "-".join(map(str, idx))).touch()
        return prepare(idx, seed)

    monkeypatch.setattr(train, "prepare", recording)
    steps = with_loader(sampler, splits, cfg, CPU, 1, [])
    primed = run_steps(steps, train, [(0, 0)], augment=True)
    first = "-".join(map(str, next(iter(sampler.steps(1, 0)))[0]))
    assert not (made / first).exists()  # epoch 1's first batch is not made ahead of being asked for...
    steps.prime(1)
    wait_until(lambda: (made / first).exists(), 60, "epoch 1's first batch made by a worker after prime(1)")
    primed += run_steps(steps, train, [(1, 0)], augment=True)  # ...and, primed, epoch 1 is the same
    assert same(primed, unprimed)
    steps.prime(2)  # primed for another place (a resume elsewhere): the workers start again there
    assert same(run_steps(steps, train, [(1, 1)], augment=True), unprimed[len(unprimed) // 2 + 2:])


def test_evaluation_reads_the_holdout_through_the_workers(folder, monkeypatch):
    splits, cfg = load(folder, workers=2)
    holdout = splits.holdout
    plain = data.load(DataConfig(**{**vars(cfg), "workers": 0}), CPU).holdout
    with_loader(StepSampler(len(splits.train), [4], 1, 0, seed=0), splits, cfg, CPU, 1, [])
    here = []  # chunks made in this (the training) process rather than in a worker
    prepare = holdout.prepare
    monkeypatch.setattr(holdout, "prepare", lambda idx, seed: here.append(os.getpid()) or prepare(idx, seed))
    chunks = [list(range(lo, min(len(holdout), lo + 5))) for lo in range(0, len(holdout), 5)]
    for _ in range(2):  # two evaluations, each a pass of its own
        got = [(idx, *holdout.get_batch(idx, CPU)) for idx in chunks]
        assert same(got, [(idx, *plain.get_batch(idx, CPU)) for idx in chunks])
    assert here == [], f"{len(here)} of {2 * len(chunks)} chunks were made in the training process"


def test_memory_probes_make_each_image_once(folder, monkeypatch):
    splits, _ = load(folder)
    made = []
    prepare = splits.train.prepare
    monkeypatch.setattr(splits.train, "prepare", lambda idx, seed: made.extend(idx) or prepare(idx, seed))
    for b in (1, 2, 4, 8, 4):
        x, y = splits.train.get_batch(list(range(b)), CPU)
        assert x.shape[0] == b and y.tolist() == splits.train.labels[:b]
    assert sorted(made) == list(range(8))


def test_an_unreadable_image_is_named_through_the_workers(tmp_path):
    root = make_imagefolder(tmp_path / "bad", classes=2, per_class=4)
    (root / "class1" / "img999.jpg").write_bytes(b"not a jpeg")
    cfg = DataConfig(dataset="imagefolder", path=str(root), img_size=16, workers=2, augment=False)
    splits = data.load(cfg, CPU)
    train = splits.train
    steps = with_loader(StepSampler(len(train), [len(train)], 1, 0, seed=0, shuffle=False), splits, cfg, CPU, 1, [])
    with pytest.raises(UsageError, match="img999.jpg: not a readable image"):
        run_steps(steps, train, [(0, 0)], augment=False)


def test_default_workers_share_the_nodes_cpus_among_its_ranks():
    assert default_workers(1, cpus=16) == 8
    assert default_workers(4, cpus=16) == 4
    assert default_workers(8, cpus=4) == 1


def test_digits_keeps_its_device_path():
    cfg = DataConfig(dataset="digits", workers=2)
    splits = data.load(cfg, CPU)
    sampler = StepSampler(len(splits.train), [8], 1, 0, seed=0)
    assert with_loader(sampler, splits, cfg, CPU, 1, []) is sampler


def test_digits_are_scikit_learns_digits_read_without_importing_it(monkeypatch):
    import importlib.util
    import subprocess as sp

    from sklearn.datasets import load_digits

    images, target = data.digits_arrays()
    d = load_digits()
    assert images.shape == (1797, 8, 8) and (images == d.images).all() and (target == d.target).all()
    with monkeypatch.context() as m:   # scikit-learn's file not where it was: its own loader, the same arrays
        m.setattr(importlib.util, "find_spec", lambda name: None)
        again = data.digits_arrays()
    assert (again[0] == d.images).all() and (again[1] == d.target).all()
    # a rank that trains on digits does not pay scikit-learn's (and SciPy's) import
    probe = "import sys; from dscluster.core import data; data.digits_arrays(); print('sklearn' in sys.modules)"
    out = sp.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


def _train(folder: Path, runs: Path, run_id: str, workers: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "RANK", "DSCLUSTER_"))}
    env.update(DSCLUSTER_RUNS=str(runs), DSCLUSTER_RUN_ID=run_id)
    args = ["--config", str(ROOT / "configs" / "digits.yaml"), "data.dataset=imagefolder", f"data.path={folder}",
            "data.augment=true", f"data.workers={workers}", "global_batch=8", "max_steps=4", "epochs=1",
            "checkpoint.every_epochs=0", "compile=false"]
    res = subprocess.run([sys.executable, "-m", "dscluster", "train", *args], env=env, capture_output=True,
                         text=True, timeout=600, cwd=runs)
    assert res.returncode == 0, res.stderr[-4000:]
    run = runs / run_id
    steps = [json.loads(line) for line in (run / "metrics" / "rank-0.jsonl").read_text().splitlines()]
    return {"loss": [r["loss"] for r in steps if r["kind"] == "step"], "stderr": res.stderr,
            "summary": json.loads((run / "summary.json").read_text())}


@pytest.mark.slow
def test_training_from_jpegs_through_two_workers_learns_the_same_as_in_process(folder, tmp_path):
    with_workers = _train(folder, tmp_path, "workers2", 2)
    in_process = _train(folder, tmp_path, "workers0", 0)
    assert with_workers["summary"]["status"] == "complete" and with_workers["summary"]["dataset"] == "imagefolder"
    assert len(with_workers["loss"]) == 4
    assert with_workers["loss"] == in_process["loss"]  # the same batches, so the same steps
    assert "made ahead by 2 loader worker(s)" in with_workers["stderr"]


class _AffinityImages:
    """A data set whose every 'image' is the number of CPUs the worker that made it may run on."""

    host_prepared = True
    feed = None

    def __len__(self) -> int:
        return 8

    def prepare(self, indices, seed):
        n = len(os.sched_getaffinity(0))
        return torch.full((len(indices), 1, 1, 1), n, dtype=torch.uint8), torch.zeros(len(indices), dtype=torch.long)

    def drop_prefix(self) -> None:
        pass


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPUs to bind the rank to fewer than the node has")
def test_workers_of_a_rank_bound_to_one_core_use_the_whole_node():
    images = _AffinityImages()
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})  # what `mpirun -np 1` does to its rank
    try:
        steps = LoaderSteps(StepSampler(8, [4], 1, 0, seed=0), images, workers=2, prefetch=1, pin=False,
                            augment=False)
        epoch = steps.steps(0)  # held: the feed lives while the epoch's steps are being taken
        micro = next(epoch)[0]
        x, _ = images.feed.take(micro)
    finally:
        os.sched_setaffinity(0, before)
    assert int(x.flatten()[0]) == os.cpu_count()
