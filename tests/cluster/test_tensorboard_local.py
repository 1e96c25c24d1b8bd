"""TensorBoard that shows what matters: `dscluster train ... deepspeed.tensorboard.enabled=true` under real
mpirun on localhost (2 CPU ranks, DeepSpeed on gloo), then `plot`; the event files are read back through
the tensorboard package. Marked slow, like test_train_local (no simulated lab)."""

from __future__ import annotations

import subprocess

import pytest
from _local_mpirun import ROOT, require_mpirun, train_command

from dscluster.analysis import analyse

pytestmark = pytest.mark.slow
require_mpirun()
tensorboard = pytest.importorskip("tensorboard", reason="tensorboard is pinned in requirements.txt")


def scalar_tags(folder) -> dict[str, list]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: acc.Scalars(tag) for tag in acc.Tags()["scalars"]}


def test_deepspeeds_events_and_dsclusters_series_are_read_back(tmp_path):
    runs = tmp_path / "runs"
    cmd, env = train_command(runs, "tb", ["--config", "configs/digits.yaml", "progress=false", "epochs=1",
                                          "deepspeed.tensorboard.enabled=true"])
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    run = runs / "tb"
    # DeepSpeed's own monitor, pointed into the run directory by dscluster (not the working directory)
    deepspeed = scalar_tags(run / "monitor" / "deepspeed")
    assert "Train/Samples/lr" in deepspeed, sorted(deepspeed)
    analyse([run])
    ours = scalar_tags(run / "tensorboard" / "dscluster")
    steps = 1437 // 64
    assert len(ours["loss/rank_0"]) == len(ours["loss/rank_1"]) == steps
    assert len(ours["throughput/images_per_s"]) == steps and all(e.value > 0 for e in ours["throughput/images_per_s"])
    accuracy = ours["accuracy/held_out"]
    assert len(accuracy) == 1 and 10 < accuracy[0].value <= 100 and accuracy[0].step == steps
    for part in ("compute_s", "comm_s", "data_s", "other_s"):
        assert len(ours[f"step_split/{part}/rank_1"]) == steps
    analyse([run])  # a second plot replaces the export rather than doubling every series
    assert len(scalar_tags(run / "tensorboard" / "dscluster")["loss/rank_0"]) == steps
