"""Honest GPU pictures: NVML's utilisation beside each GPU's measured step split, and the sentence
the utilisation picture, the report and diagnose say when NVML says busy but the step waits."""

from __future__ import annotations

import json

from _analysis_runs import make_run
from test_step_split_plot import with_split

from dscluster.analysis import analyse, load_run
from dscluster.analysis.diagnose import diagnose
from dscluster.analysis.gpusplit import gpu_views


def gpu_run(tmp_path, comm_s: float, util: float | None = None):
    """Two ranks on two nodes with one GPU each, a measured split, NVML at `util` % (default ~89 %)."""
    run = with_split(make_run(tmp_path, world=2, steps=20, gpus=True), comm_s=comm_s)
    if util is not None:
        for path in (run / "telemetry").glob("*.jsonl"):
            recs = [json.loads(line) for line in path.read_text().splitlines()]
            for r in recs:
                for g in r.get("gpus", []):
                    g["util_percent"] = util
            path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return run


def test_busy_gpus_that_wait_for_the_network_are_named_in_picture_report_and_diagnose(tmp_path):
    path = gpu_run(tmp_path, comm_s=1.9, util=100.0)
    run = load_run(path)
    views = gpu_views(run)
    assert [(v.host, v.index, v.ranks) for v in views] == [("node1", 0, [0]), ("node2", 0, [1])]
    assert all(v.busy_but_waiting and round(v.shares["comm"], 2) == 0.96 for v in views)
    sentence = "GPUs look 100 % busy, but 96 % of each step waits for the network"

    finding = [f for f in diagnose(run)["findings"] if f["kind"] == "gpu_busy_waiting"]
    assert len(finding) == 1 and finding[0]["message"].startswith(sentence)

    out = analyse([path])[0]
    util = next(p for p in out.plots if p.name == "utilisation")
    assert any(n.startswith(sentence) for n in util.notes)
    html = out.report.read_text()
    assert sentence in html and "<table id='gpus'>" in html
    assert "<td>node1</td><td>0</td><td>0</td><td>100</td><td>4</td><td>96</td><td>0</td>" in html


def test_a_compute_bound_run_or_idle_gpus_are_not_called_waiting(tmp_path):
    for name, comm_s, util in (("compute", 0.005, 100.0), ("idle", 1.9, 30.0)):
        run = load_run(gpu_run(tmp_path / name, comm_s=comm_s, util=util))
        assert not any(v.busy_but_waiting for v in gpu_views(run))
        assert not [f for f in diagnose(run)["findings"] if f["kind"] == "gpu_busy_waiting"]


def test_the_split_in_each_gpus_legend_label(tmp_path):
    run = load_run(gpu_run(tmp_path, comm_s=0.4))
    assert gpu_views(run)[0].label() == "compute 17% · network 83% · data 0%"
