"""The bench harness end to end on CPU: real `dscluster train` (DeepSpeed on gloo) and the real
DDP baseline, tiny ViT, a few steps. Proves the commands, the run-directory reading and the
result file; the figures themselves mean nothing on CPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _childenv import RANK_VARS

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _bench(args, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARS}   # another test's one-rank group
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    out = subprocess.run([sys.executable, "-m", "dscluster", "bench", *args, "--device", "cpu", "--model", "tiny",
                          "--out", str(tmp_path / "results"), "--work-dir", str(tmp_path / "work"), "--timeout", "400"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    files = sorted((tmp_path / "results").glob("*.json"))
    return out, files


def test_bench_vit_cpu_runs_both_paths_and_writes_a_result(tmp_path):
    out, files = _bench(["vit", "--gpus", "1", "--steps", "3", "--warmup", "1"], tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert [f.name.endswith("-cpu.json") for f in files] == [True]
    doc = json.loads(files[0].read_text())
    assert doc["versions"]["deepspeed"] and doc["model"] == "tiny"
    (row,) = doc["results"]
    assert row["dscluster"]["status"] == "complete" and row["dscluster"]["images_per_s"] > 0
    assert row["baseline"]["status"] == "complete" and row["baseline"]["images_per_s"] > 0
    assert row["baseline"]["micro_batch"] == row["dscluster"]["micro_batch"]
    # the ratio a user reads in the table is dscluster's images/s over the baseline's, at 3 decimals
    assert row["ratio"] == pytest.approx(row["dscluster"]["images_per_s"] / row["baseline"]["images_per_s"])
    assert f"{row['ratio']:.3f}" in out.stdout
    # each path its own run directory / result (--repeat's alternation: unit/test_bench.py)
    work = tmp_path / "work"
    assert (work / "ds-g1" / "metrics").is_dir() and (work / "baseline-g1.json").is_file()
    assert "dscluster" in out.stdout and "baseline" in out.stdout  # the table


def test_bench_balanced_cpu_compares_uniform_and_balanced(tmp_path):
    out, files = _bench(["balanced", "--ranks", "2", "--micro-batch", "4", "--steps", "6", "--warmup", "1"],
                        tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    doc = json.loads(files[0].read_text())
    (s,) = doc["scenarios"]
    assert s["uniform"]["micro_batches"] == [4, 4]
    assert sum(s["balanced"]["micro_batches"]) == 8  # same global batch, measured shares
    # balanced batching's speed-up, as the table prints it: its images/s over uniform batching's
    assert s["speedup"] == pytest.approx(s["balanced"]["images_per_s"] / s["uniform"]["images_per_s"])
    assert f"{s['speedup']:.2f}x" in out.stdout
    assert s["target_loss"] is not None
