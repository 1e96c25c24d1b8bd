"""The series `plot` writes for TensorBoard beside DeepSpeed's (analysis/tbexport.py): which ones, from
which files, and that a written export reads back. The real training run: tests/cluster/test_train_local.py
(its reference run)."""

from __future__ import annotations

import json

import pytest
from _analysis_runs import make_run
from test_step_split_plot import with_split

from dscluster.analysis import analyse, load_run
from dscluster.analysis.monitor import read_monitor
from dscluster.analysis.tbexport import export, scalars, wanted


def tb_run(tmp_path, enabled: bool = True):
    run = with_split(make_run(tmp_path, world=2, steps=12, gpus=True), comm_s=0.3)
    (run / "ds_config.json").write_text(json.dumps({"tensorboard": {"enabled": enabled}}))
    return run


def test_loss_accuracy_throughput_split_and_gpu_series(tmp_path):
    tags = {}
    for tag, step, _, value in scalars(load_run(tb_run(tmp_path))):
        tags.setdefault(tag, []).append((step, value))
    assert len(tags["loss/rank_0"]) == 12 and len(tags["loss/rank_1"]) == 12
    assert tags["accuracy/held_out"] == [(6, pytest.approx(68.0)), (12, pytest.approx(86.0))]
    job = dict(tags["throughput/images_per_s"])
    assert job[1] == pytest.approx(sum(v for s, v in tags["throughput/rank_0"] + tags["throughput/rank_1"] if s == 1))
    assert [v for _, v in tags["step_split/comm_s/rank_1"]] == [0.3] * 12
    assert {"gpu/node1/gpu0/util_percent", "gpu/node2/gpu0/temp_c", "gpu/node1/gpu0/mem_used_gib",
            "node/node2/cpu_percent"} <= set(tags)


def test_written_only_where_the_run_turned_tensorboard_on(tmp_path):
    assert wanted(load_run(tb_run(tmp_path / "on")))
    assert not wanted(load_run(tb_run(tmp_path / "off", enabled=False)))
    assert export(load_run(tb_run(tmp_path / "off2", enabled=False))) is None


def test_plot_writes_the_export_and_does_not_read_it_back_as_a_monitor(tmp_path):
    pytest.importorskip("tensorboard")
    path = tb_run(tmp_path)
    analyse([path])
    analyse([path])
    files = list((path / "tensorboard" / "dscluster").glob("events.out.tfevents.*"))
    assert len(files) == 1  # replaced, not appended
    problems = []
    assert read_monitor(path, problems) == {} and problems == []
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(files[0].parent), size_guidance={"scalars": 0})
    acc.Reload()
    assert len(acc.Scalars("accuracy/held_out")) == 2 and len(acc.Scalars("throughput/images_per_s")) == 12


def test_deepspeeds_monitors_write_into_the_run_directory_unless_the_user_said_where(tmp_path):
    from dscluster.core.ds_config import merged, monitor_defaults

    theirs = {"tensorboard": {"enabled": True}, "csv_monitor": {"enabled": False}}
    ds = merged(merged({}, monitor_defaults(theirs, tmp_path / "runs" / "r1")), theirs)
    assert ds["tensorboard"] == {"enabled": True, "output_path": str((tmp_path / "runs" / "r1" / "monitor").absolute()),
                                 "job_name": "deepspeed"}
    assert ds["csv_monitor"] == {"enabled": False}
    mine = {"tensorboard": {"enabled": True, "output_path": "/data/tb"}}
    assert merged(merged({}, monitor_defaults(mine, tmp_path)), mine)["tensorboard"]["output_path"] == "/data/tb"
    assert monitor_defaults(None, tmp_path) == {}
