"""Plots, report and diagnosis from REAL recorded runs (tests/data/runs/, see its README).

cpu-2node: `dscluster setup/check/launch` on a 2-node simulated lab, DeepSpeed on gloo, with
the telemetry sampler entry_cn.sh starts on each node. h200-telemetry: the NVML sampler on an
NVIDIA H200 under a bf16 matmul load (power capping shows up as throttle reasons).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dscluster.analysis import analyse
from dscluster.analysis.diagnose import diagnose
from dscluster.analysis.load import load_run
from dscluster.analysis.report import STEADY_LABEL, summary_table_rows
from dscluster.core.timing import WARMUP_STEPS

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "runs"
CPU_RUN = DATA / "cpu-2node"
GPU_TELEMETRY = DATA / "h200-telemetry"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """The recorded run analysed once (plots take a few seconds on 2 cores)."""
    run = _copy(CPU_RUN, tmp_path_factory.mktemp("rec") / "cpu-2node")
    (res,) = analyse([run])
    return res


def _host(rank: int) -> str:
    first = json.loads((CPU_RUN / "metrics" / f"rank-{rank}.jsonl").read_text().splitlines()[0])
    return first["host"]


def _steps(rank: int) -> list[dict]:
    lines = (CPU_RUN / "metrics" / f"rank-{rank}.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "step"]


def test_recorded_run_is_complete_and_every_plot_is_a_real_png(recorded):
    assert recorded.run.completed
    names = {p.name for p in recorded.plots}
    assert names == {"utilisation", "throughput", "step_split", "loss", "loss_scale", "gpu_health"}
    for p in recorded.plots:
        data = p.path.read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000, p.path


def test_cpu_utilisation_has_one_series_per_node_with_every_sample(recorded):
    util = {p.name: p for p in recorded.plots}["utilisation"]
    assert "CPU utilisation" in util.title
    hosts = sorted(p.stem for p in (CPU_RUN / "telemetry").glob("*.jsonl"))
    assert hosts
    for host in hosts:
        lines = [json.loads(l) for l in (CPU_RUN / "telemetry" / f"{host}.jsonl").read_text().splitlines()]
        samples = [l for l in lines if l["kind"] == "sample"]
        assert util.series[f"cpu {host}"]["y"] == [s["cpu_percent"] for s in samples]
        assert len(util.series[f"ram {host}"]["x"]) == len(samples) > 10


def test_throughput_per_rank_covers_every_step_of_both_ranks(recorded):
    thr = {p.name: p for p in recorded.plots}["throughput"]
    for rank in (0, 1):
        host = _host(rank)
        steps = _steps(rank)
        series = thr.series[f"samples_per_s rank {rank} ({host})"]
        assert series["x"] == [s["step"] for s in steps]
        assert series["y"] == [s["samples_per_s"] for s in steps]
        # the step-time boxes leave out the warm-up steps, as the run's images/s does
        assert len(thr.series[f"step_time rank {rank} ({host})"]["y"]) == len(steps) - WARMUP_STEPS


def test_loss_and_held_out_accuracy_match_the_metrics(recorded):
    loss = {p.name: p for p in recorded.plots}["loss"]
    assert loss.series[f"loss rank 0 ({_host(0)})"]["y"] == [s["loss"] for s in _steps(0)]
    evals = [r for r in map(json.loads, (CPU_RUN / "metrics" / "rank-0.jsonl").read_text().splitlines())
             if r["kind"] == "eval"]
    assert loss.series["held-out accuracy"]["x"] == [e["step"] for e in evals]
    assert loss.series["held-out accuracy"]["y"] == pytest.approx([100 * e["accuracy"] for e in evals])


def test_cpu_run_says_not_fp16_and_no_gpu_data(recorded):
    plots = {p.name: p for p in recorded.plots}
    assert any(n.startswith("not fp16 (precision: fp32)") for n in plots["loss_scale"].notes)
    assert "no GPU data" in plots["gpu_health"].notes


def test_report_embeds_the_pictures_and_the_summary_table(recorded):
    html = recorded.report.read_text()
    summary = json.loads((CPU_RUN / "summary.json").read_text())
    rows = dict(summary_table_rows(recorded.summary))
    assert rows["world size (ranks)"] == "2" and rows["precision"] == "fp32" and rows["status"] == "complete"
    assert rows[STEADY_LABEL] == f"{summary['images_per_s']:.1f}"
    assert rows["held-out accuracy (%)"] == f"{100 * summary['accuracy']:.1f}"
    for label, value in rows.items():
        assert f"<th>{label}</th>" in html and value.replace("'", "&#x27;") in html
    assert html.count("data:image/png;base64,") == 6
    assert "did not complete" not in html


def test_recorded_run_diagnoses_healthy(recorded):
    assert recorded.diagnosis["healthy"], recorded.diagnosis["findings"]
    out = subprocess.run([sys.executable, "-m", "dscluster", "diagnose", str(CPU_RUN)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_truncated_copy_still_plots_and_says_it_did_not_complete(tmp_path):
    run = _copy(CPU_RUN, tmp_path / "cut")
    (run / "summary.json").unlink()
    for f in list((run / "metrics").glob("*.jsonl")) + list((run / "telemetry").glob("*.jsonl")):
        data = f.read_bytes()
        f.write_bytes(data[: int(len(data) * 0.6)])  # a crash mid-write: the last line is torn
    out = subprocess.run([sys.executable, "analysis/plot.py", str(run), "--out", str(tmp_path / "plots")],
                         cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert "did NOT complete" in out.stdout
    pngs = sorted((tmp_path / "plots").glob("*.png"))
    assert len(pngs) == 6 and all(p.read_bytes()[:8] == PNG_MAGIC for p in pngs)
    html = (tmp_path / "plots" / "report.html").read_text()
    assert "This run did not complete" in html
    loaded = load_run(run)
    assert 0 < loaded.ranks[0].last_step < _steps(0)[-1]["step"]
    kinds = {(f["kind"], f["rank"]) for f in diagnose(loaded)["findings"]}
    assert ("rank_died", 0) in kinds and ("rank_died", 1) in kinds


def test_real_h200_telemetry_shows_power_capping(tmp_path):
    (res,) = analyse([GPU_TELEMETRY], tmp_path)
    plots = {p.name: p for p in res.plots}
    assert "GPU utilisation" in plots["utilisation"].title
    assert max(plots["utilisation"].series["util gpunode1 GPU0"]["y"]) == 100.0
    health = plots["gpu_health"]
    assert max(health.series["power gpunode1 GPU0"]["y"]) > 300
    assert all("sw_power_cap" in r for r in health.series["throttle gpunode1 GPU0"]["y"])
    assert "no step records" in plots["throughput"].notes
