"""data.dataset: fractal — random IFS classes rendered from a seed; and target_accuracy (time to accuracy)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dscluster.analysis.report import summary_table_rows
from dscluster.core import data
from dscluster.core.config import DataConfig, load_config
from dscluster.core.fractal import FractalRenderer
from dscluster.errors import UsageError
from dscluster.files.fsutil import read_jsonl

ROOT = Path(__file__).resolve().parents[2]


def test_an_image_depends_on_its_seed_class_and_index_alone():
    r = FractalRenderer(7, 6, 32)
    batch = r.render([0, 3, 5, 3], [0, 1, 2, 9])
    assert batch.shape == (4, 3, 32, 32) and batch.dtype == torch.uint8
    alone = r.render([5], [2])  # another batch, another node: the same picture
    assert torch.equal(batch[2], alone[0])
    again = FractalRenderer(7, 6, 32).render([3], [9])
    assert torch.equal(batch[3], again[0])
    assert not torch.equal(batch[1], batch[3])  # same class, other index: jittered
    other_seed = FractalRenderer(8, 6, 32).render([5], [2])
    assert not torch.equal(alone, other_seed)
    many = FractalRenderer(0, 40, 24)  # classes of 2, 3 and 4 maps in one batch, across render chunks
    labels = [k % 40 for k in range(70)]
    together = many.render(labels, list(range(70)))
    assert all(torch.equal(together[j], many.render([labels[j]], [j])[0]) for j in range(70))


def test_every_image_shows_a_shape_not_an_empty_or_filled_square():
    r = FractalRenderer(0, 20, 64)
    x = r.render(list(range(20)), [0] * 20).float()
    background = x[:, :, 0, 0]  # a corner: the attractor never fills the whole square
    ink = (x - background[:, :, None, None]).abs().sum(1) > 30
    share = ink.flatten(1).float().mean(1)
    assert (share > 0.01).all() and (share < 0.6).all(), share


def test_train_and_held_out_are_other_images_of_the_same_classes():
    cfg = DataConfig(dataset="fractal", img_size=16, num_classes=4, images_per_class=10, holdout_fraction=0.2)
    splits = data.load(cfg, torch.device("cpu"))
    assert (len(splits.train), len(splits.holdout)) == (32, 8)
    x, y = splits.train.prepare(range(8), None)
    hx, hy = splits.holdout.prepare(range(8), None)
    assert y.tolist() == hy.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert not any(torch.equal(a, b) for a in x for b in hx)
    assert len(data.load(DataConfig(dataset="fractal", img_size=16, num_classes=4, images_per_class=10, limit=6),
                         torch.device("cpu")).train) == 6


@pytest.mark.parametrize("override, key", [
    ("target_accuracy=1.5", "target_accuracy"),
    ("data.images_per_class=2", "data.images_per_class"),
    ("data.fractal_points=10", "data.fractal_points"),
    ("data.cache=maybe", "data.cache"),
])
def test_bad_fractal_and_target_values_name_the_key(override, key):
    with pytest.raises(UsageError, match=key.replace(".", r"\.")):
        load_config(ROOT / "configs" / "fractal_cpu.yaml", [override])


def test_a_target_without_a_held_out_set_is_refused():
    with pytest.raises(UsageError, match="target_accuracy needs a held-out set"):
        load_config(ROOT / "configs" / "vit_small.yaml", ["target_accuracy=0.5"])


def _train(tmp_path: Path, run_id: str, config: str, *overrides: str) -> Path:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "RANK", "DSCLUSTER_"))}
    env.update(DSCLUSTER_RUNS=str(tmp_path), DSCLUSTER_RUN_ID=run_id, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-m", "dscluster", "train", "--config", str(ROOT / "configs" / config),
                          "progress=false", "checkpoint.every_epochs=0", *overrides],
                         env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]
    return tmp_path / run_id


@pytest.mark.slow
def test_a_tiny_vit_learns_fractal_classes_on_one_cpu(tmp_path):
    # 5 classes (chance 20%), 32 px, 0.2 M parameters: 58% after 6 epochs, about 20 s on one core
    run = _train(tmp_path, "fractal", "fractal_cpu.yaml", "data.num_classes=5", "data.images_per_class=250",
                 "epochs=6", "data.workers=0", "target_accuracy=null")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["dataset"] == "fractal" and summary["status"] == "complete"
    assert summary["accuracy"] >= 0.4, summary["accuracy"]
    assert "time_to_accuracy" not in summary  # no target: nothing about it
    # data.cache auto: both splits made once before training, the fill's time in the run's records
    records = [json.loads(line) for line in (run / "metrics" / "rank-0.jsonl").read_text().splitlines()]
    fills = [r for r in records if r["kind"] == "data_cache"]
    assert [(r["split"], r["images"], r["cached"]) for r in fills] == [("training", 1000, True),
                                                                      ("held-out", 250, True)]
    assert all(r["seconds"] > 0 for r in fills)


@pytest.mark.slow
def test_time_to_accuracy_is_the_first_evaluation_at_the_target(tmp_path):
    target = 0.3
    run = _train(tmp_path, "digits", "digits.yaml", "epochs=3", f"target_accuracy={target}")
    summary = json.loads((run / "summary.json").read_text())
    records = read_jsonl(run / "metrics" / "rank-0.jsonl")
    evals = [r for r in records if r["kind"] == "eval"]
    start = next(r for r in records if r["kind"] == "start")
    first = next(e for e in evals if e["accuracy"] >= target)  # the preset gets past 30% in 3 epochs
    tta = summary["time_to_accuracy"]
    assert summary["target_accuracy"] == target
    assert (tta["step"], tta["epoch"], tta["accuracy"], tta["t"]) == (first["step"], first["epoch"],
                                                                       first["accuracy"], first["t"])
    assert tta["images"] == first["step"] * summary["global_batch"]
    # seconds from the run's start: more than from the first record, within the whole run
    assert first["t"] - start["t"] < tta["seconds"] <= summary["wall_s"]
    assert [r for r in records if r["kind"] == "target"] == [{**tta, "kind": "target", "t": tta["t"],
                                                              "rank": 0, "host": start["host"]}]
    rows = dict(summary_table_rows({**_row(), **summary}))
    assert rows["time to 30.0% held-out accuracy (s)"].startswith(f"{tta['seconds']:.1f} (step {first['step']}")


def _row() -> dict:
    return {"status": "complete", "precision": "fp32", "world_size": 1, "hosts": ["a"], "steps": 1,
            "images_per_s": 1.0, "accuracy": 0.5, "stragglers": [], "overflow_steps": 0, "overflow_rate": 0.0,
            "wall_s": 1.0}


def test_report_shows_time_to_accuracy_only_with_a_target():
    assert not any(label.startswith("time to") for label, _ in summary_table_rows(_row()))
    rows = dict(summary_table_rows({**_row(), "target_accuracy": 0.9, "time_to_accuracy": None}))
    assert rows["time to 90.0% held-out accuracy (s)"] == "not reached"
    got = {"seconds": 12.34, "step": 40, "epoch": 1, "images": 2560}
    rows = dict(summary_table_rows({**_row(), "target_accuracy": 0.9, "time_to_accuracy": got}))
    assert rows["time to 90.0% held-out accuracy (s)"] == "12.3 (step 40, epoch 2, 2,560 images)"
