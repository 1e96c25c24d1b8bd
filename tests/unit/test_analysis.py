"""Plots and report from small run directories: the shapes a user must be able to see."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _analysis_runs import make_run

from dscluster.analysis import analyse
from dscluster.analysis.load import load_run
from dscluster.analysis.plots import plot_scaling
from dscluster.analysis.report import STEADY_LABEL, WHOLE_RUN_LABEL, summary_table_rows
from dscluster.analysis.stats import summary_row
from dscluster.errors import UsageError

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _plots(result) -> dict:
    return {p.name: p for p in result.plots}


def test_straggler_is_named_in_the_plot_the_table_and_the_report(tmp_path):
    run = make_run(tmp_path, world=3, slow_rank=2)
    (res,) = analyse([run])
    thr = _plots(res)["throughput"]
    assert thr.path.read_bytes()[:8] == PNG_MAGIC
    assert "stragglers: [2]" in thr.notes
    assert set(thr.series) >= {f"samples_per_s rank {r} (node{r + 1})" for r in range(3)}
    assert res.summary["stragglers"] == [2]
    html = res.report.read_text()
    assert "2 (straggler)" in html


def test_no_straggler_when_ranks_are_even(tmp_path):
    (res,) = analyse([make_run(tmp_path, world=3)])
    assert res.summary["stragglers"] == []
    assert "no straggler" in _plots(res)["throughput"].notes


def test_fp16_loss_scale_plot_marks_every_overflow_step(tmp_path):
    (res,) = analyse([make_run(tmp_path, precision="fp16", overflow_steps=(3, 7, 8))])
    ls = _plots(res)["loss_scale"]
    assert ls.series["overflow"]["x"] == [3, 7, 8]
    assert ls.series["loss_scale"]["y"][0] == 2.0 ** 16
    assert ls.series["loss_scale"]["y"][-1] == 2.0 ** 13  # halved once per overflow
    assert res.summary["overflow_steps"] == 3
    assert dict(summary_table_rows(res.summary))["overflow steps"].startswith("3 (25.0%")


def test_bf16_run_says_not_fp16_instead_of_an_empty_panel(tmp_path):
    (res,) = analyse([make_run(tmp_path, precision="bf16")])
    ls = _plots(res)["loss_scale"]
    assert ls.series == {}
    assert any("not fp16 (precision: bf16)" in n for n in ls.notes)


def test_gpu_run_plots_gpu_utilisation_and_throttle_events(tmp_path):
    (res,) = analyse([make_run(tmp_path, gpus=True, throttle_at=(1, 2))])
    util = _plots(res)["utilisation"]
    assert "GPU utilisation" in util.title
    assert {"util node1 GPU0", "util node2 GPU0", "mem node1 GPU0"} <= set(util.series)
    health = _plots(res)["gpu_health"]
    assert health.series["throttle node1 GPU0"]["y"] == [["sw_power_cap"], ["sw_power_cap"]]
    assert health.series["power node2 GPU0"]["y"][0] == 180.0


def test_cpu_only_run_shows_cpu_and_ram_and_says_no_gpu_data(tmp_path):
    (res,) = analyse([make_run(tmp_path, gpus=False)])
    util = _plots(res)["utilisation"]
    assert "CPU utilisation" in util.title
    assert {"cpu node1", "ram node1", "cpu node2"} <= set(util.series)
    assert "no GPU data" in _plots(res)["gpu_health"].notes


def test_loss_and_accuracy_series_come_from_the_metrics(tmp_path):
    (res,) = analyse([make_run(tmp_path, steps=12)])
    loss = _plots(res)["loss"]
    assert loss.series["loss rank 0 (node1)"]["x"] == list(range(1, 13))
    assert loss.series["held-out accuracy"]["x"] == [6, 12]
    assert loss.series["held-out accuracy"]["y"] == pytest.approx([68.0, 86.0])


def test_scaling_plot_has_ideal_line_and_efficiency(tmp_path):
    runs = [load_run(make_run(tmp_path, f"w{w}", world=w, rate=100.0)) for w in (1, 2, 4)]
    plot = plot_scaling(runs, tmp_path / "out")
    assert plot.series["measured"]["x"] == [1, 2, 4]
    assert plot.series["ideal"]["y"] == [100.0, 200.0, 400.0]
    assert plot.series["efficiency_percent"]["y"] == pytest.approx([100.0, 90.0, 90.0])


def test_scaling_with_one_world_size_says_what_it_needs(tmp_path):
    plot = plot_scaling([load_run(make_run(tmp_path))], tmp_path / "out")
    assert plot.series == {} and "at least two different world sizes" in plot.notes[0]


def test_several_runs_with_out_dir_get_one_folder_each_and_a_scaling_plot(tmp_path):
    a, b = make_run(tmp_path, "a", world=1), make_run(tmp_path, "b", world=2)
    results = analyse([a, b], tmp_path / "out")
    assert [r.report for r in results] == [tmp_path / "out" / "a" / "report.html",
                                           tmp_path / "out" / "b" / "report.html"]
    assert (tmp_path / "out" / "scaling.png").read_bytes()[:8] == PNG_MAGIC
    assert not (a / "plots").exists()


def test_report_is_one_self_contained_page_with_the_summary_table(tmp_path):
    (res,) = analyse([make_run(tmp_path, precision="fp16", world=2)])
    html = res.report.read_text()
    assert html.count("data:image/png;base64,") == 6
    assert "<img" in html and 'src="plots/' not in html and "http" not in html.split("<body>")[1]
    rows = dict(summary_table_rows(res.summary))
    assert rows["precision"] == "fp16" and rows["world size (ranks)"] == "2"
    assert rows[STEADY_LABEL] == "180.0" and rows["status"] == "complete"
    for label in ("precision", "world size (ranks)", STEADY_LABEL, WHOLE_RUN_LABEL, "held-out accuracy (%)",
                  "stragglers (ranks)", "overflow steps", "status"):
        assert f"<th>{label}</th>" in html


def test_crashed_run_still_plots_and_says_it_did_not_complete(tmp_path):
    run = make_run(tmp_path, world=3, dead_rank=1)
    (res,) = analyse([run])
    assert not res.run.completed
    # every plot a finished run gets, each a picture: what the ranks wrote before one died is still worth seeing
    assert [p.name for p in res.plots] == ["utilisation", "throughput", "step_split", "loss", "loss_scale",
                                           "gpu_health"]
    assert all(p.path.read_bytes()[:8] == PNG_MAGIC for p in res.plots)
    assert "did not complete" in res.report.read_text()
    assert all("run did not complete" in p.title for p in res.plots)


def test_torn_last_lines_are_skipped_not_fatal(tmp_path):
    run = make_run(tmp_path, summary=False)
    for f in list((run / "metrics").glob("*.jsonl")) + list((run / "telemetry").glob("*.jsonl")):
        data = f.read_bytes()
        f.write_bytes(data[: len(data) - 25])  # cut mid-record
    loaded = load_run(run)
    assert loaded.ranks[0].steps and loaded.ranks[0].end is None
    (res,) = analyse([run])
    assert res.summary["status"].startswith("incomplete")


@pytest.mark.parametrize("setup", ["missing", "empty", "foreign", "file"])
def test_empty_or_foreign_directory_is_exit_2_naming_it(tmp_path, setup):
    target = tmp_path / "thing"
    if setup == "empty":
        target.mkdir()
    elif setup == "foreign":
        target.mkdir()
        (target / "notes.txt").write_text("hello")
    elif setup == "file":
        target.write_text("x")
    with pytest.raises(UsageError) as e:
        load_run(target)
    assert str(target) in str(e.value)
    out = subprocess.run([sys.executable, "analysis/plot.py", str(target)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert str(target) in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "thing" / "plots").exists()


def test_one_bad_dir_among_good_ones_writes_nothing(tmp_path):
    good = make_run(tmp_path, "good")
    with pytest.raises(UsageError):
        analyse([good, tmp_path / "nope"])
    assert not (good / "report.html").exists()


def test_plot_cli_json_lists_what_it_wrote(tmp_path):
    run = make_run(tmp_path)
    out = subprocess.run([sys.executable, "-m", "dscluster", "plot", str(run), "--json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    (doc,) = json.loads(out.stdout)
    assert set(doc["plots"]) == {"utilisation", "throughput", "step_split", "loss", "loss_scale", "gpu_health"}
    assert doc["report"] == str(run / "report.html") and doc["summary"]["world_size"] == 2
    assert summary_row(load_run(run))["hosts"] == ["node1", "node2"]


def test_every_rank_has_its_own_colour_and_ranks_of_one_node_share_a_family(tmp_path):
    from matplotlib.colors import to_rgb

    from dscluster.analysis.plots import _rank_style, host_colours, plot_throughput

    # 4 ranks on 2 nodes, round robin: ranks 0 and 2 on node1, 1 and 3 on node2
    run = load_run(make_run(tmp_path, world=4, hosts=["node1", "node2"]))
    assert plot_throughput(run, tmp_path / "plots").path.is_file()
    colours = host_colours(run)
    colour = {r: _rank_style(run, r, colours)[0] for r in range(4)}
    assert len(set(colour.values())) == 4  # no two ranks share a colour

    def dominant_channel(c):
        return max(zip(to_rgb(c), "rgb", strict=True))[1]

    # a node's ranks are shades of one family, the other node's of another
    assert dominant_channel(colour[0]) == dominant_channel(colour[2])
    assert dominant_channel(colour[1]) == dominant_channel(colour[3])
    assert dominant_channel(colour[0]) != dominant_channel(colour[1])


def test_a_run_too_short_for_its_warm_up_is_not_called_steady_in_the_report(tmp_path):
    from dscluster.analysis.report import SHORT_RUN
    from dscluster.analysis.stats import summary_row

    assert SHORT_RUN not in dict(summary_table_rows(summary_row(load_run(make_run(tmp_path, "long")))))[STEADY_LABEL]
    # 4 steps: every step counted (core/timing.py is_timed), from the records and from train's summary alike
    short = make_run(tmp_path, "short", steps=4, summary=False)
    assert dict(summary_table_rows(summary_row(load_run(short))))[STEADY_LABEL].endswith(SHORT_RUN)
    (short / "summary.json").write_text(json.dumps({"status": "complete", "images_per_s": 64.2, "timed_steps": 4,
                                                    "warmup_steps": 0}))
    assert dict(summary_table_rows(summary_row(load_run(short))))[STEADY_LABEL] == "64.2" + SHORT_RUN
