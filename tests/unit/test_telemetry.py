"""The telemetry sampler: what a user sees in telemetry/<host>.jsonl and how it stops."""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dscluster.telemetry import decode_throttle_reasons, select_backend
from dscluster.telemetry.sampler import SamplerConfig, run_sampler

ROOT = Path(__file__).resolve().parents[2]
DSCLUSTER = [sys.executable, "-m", "dscluster"]
HOST = socket.gethostname()
SAMPLE_KEYS = {"kind", "t", "host", "backend", "cpu_percent", "ram_used_mb", "ram_total_mb",
               "proc_cpu_percent", "gpus"}


def _lines(path: Path) -> list[dict]:
    text = path.read_text()
    assert text.endswith("\n"), "every record ends with a newline (flushed whole lines)"
    return [json.loads(line) for line in text.splitlines()]


def _start(run_dir: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(DSCLUSTER + ["telemetry", "--run-dir", str(run_dir), "--backend", "none", *extra],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_samples(path: Path, n: int, timeout: float = 20.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and sum(1 for l in path.read_text().splitlines() if '"sample"' in l) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"{path}: fewer than {n} samples after {timeout}s")


def test_throttle_bitmask_decodes_to_names_and_keeps_unknown_bits():
    assert decode_throttle_reasons(0) == []
    assert decode_throttle_reasons(None) == []
    assert decode_throttle_reasons(0x4 | 0x40) == ["sw_power_cap", "hw_thermal_slowdown"]
    assert decode_throttle_reasons(0x1) == ["gpu_idle"]
    assert decode_throttle_reasons(0x800 | 0x8) == ["hw_slowdown", "bit_0x800"]


def test_requested_backend_none_gives_cpu_only_records():
    choice = select_backend("none")
    assert choice.backend.name == "none"
    assert choice.backend.sample() == []


def test_nvml_requested_without_a_driver_falls_back_with_the_reason():
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("this machine has NVML: the fallback path is not reachable here")
    except Exception:
        pass
    choice = select_backend("nvml")
    assert choice.backend.name == "none"
    assert "nvml unavailable" in choice.message


def test_gputil_without_distutils_falls_back_with_one_line_message():
    # Python 3.12 removed distutils, which GPUtil 1.4.0 imports: reproduce that on any Python.
    code = ("import sys; sys.modules['distutils'] = None\n"
            "from dscluster.telemetry import select_backend\n"
            "c = select_backend('gputil'); print(c.backend.name); print(c.message)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    name, message = out.stdout.strip().splitlines()
    assert name == "none"
    assert "distutils" in message and "\n" not in message


def test_duration_run_writes_meta_samples_and_end_per_contract(tmp_path):
    out = subprocess.run(DSCLUSTER + ["telemetry", "--run-dir", str(tmp_path), "--period", "0.1",
                                      "--duration", "0.45", "--backend", "none"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    recs = _lines(tmp_path / "telemetry" / f"{HOST}.jsonl")
    assert recs[0]["kind"] == "meta" and recs[0]["backend"] == "none"
    samples = [r for r in recs if r["kind"] == "sample"]
    assert len(samples) >= 4
    for s in samples:
        assert SAMPLE_KEYS <= set(s), s
        assert s["host"] == HOST and s["gpus"] == []
        assert 0 < s["ram_used_mb"] < s["ram_total_mb"]
    assert [r["kind"] for r in recs][-1] == "end"
    assert recs[-1]["reason"] == "duration reached" and recs[-1]["samples"] == len(samples)
    assert all(b["t"] >= a["t"] for a, b in itertools.pairwise(samples))


def test_sigterm_stops_cleanly_with_a_final_line_and_exit_0(tmp_path):
    proc = _start(tmp_path, "--period", "0.1")
    try:
        path = tmp_path / "telemetry" / f"{HOST}.jsonl"
        _wait_for_samples(path, 2)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0
    recs = _lines(path)
    assert recs[-1]["kind"] == "end" and recs[-1]["reason"] == "SIGTERM"


def test_second_sampler_on_the_same_node_exits_0_and_writes_nothing(tmp_path):
    first = _start(tmp_path, "--period", "0.1")
    try:
        path = tmp_path / "telemetry" / f"{HOST}.jsonl"
        _wait_for_samples(path, 1)
        second = subprocess.run(DSCLUSTER + ["telemetry", "--run-dir", str(tmp_path), "--backend", "none",
                                             "--duration", "5"], cwd=ROOT, capture_output=True, text=True,
                                timeout=60)
        assert second.returncode == 0
        assert "another sampler" in second.stderr and str(first.pid) in second.stderr
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=10)
    recs = _lines(path)
    assert sum(1 for r in recs if r["kind"] == "meta") == 1
    assert {r.get("pid") for r in recs if r["kind"] == "meta"} == {first.pid}


def test_sampler_exits_when_its_parent_process_is_gone(tmp_path):
    parent = subprocess.Popen(["sleep", "60"])
    sampler = _start(tmp_path, "--period", "0.1", "--parent-pid", str(parent.pid))
    try:
        path = tmp_path / "telemetry" / f"{HOST}.jsonl"
        _wait_for_samples(path, 1)
        parent.kill()
        parent.wait()
        rc = sampler.wait(timeout=10)
    finally:
        for p in (parent, sampler):
            if p.poll() is None:
                p.kill()
    assert rc == 0
    end = _lines(path)[-1]
    assert end["kind"] == "end" and end["reason"] == f"parent {parent.pid} exited"


@pytest.mark.parametrize("args", [["--period", "0"], ["--period", "-1"], ["--duration", "0"]])
def test_bad_period_or_duration_is_a_usage_error(tmp_path, args):
    out = subprocess.run(DSCLUSTER + ["telemetry", "--run-dir", str(tmp_path), *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert args[0] in out.stderr
    assert not (tmp_path / "telemetry").exists()


class _FlakyGpu:
    """A driver that fails one query: the only way to show that path on a machine without GPUs."""

    name = "nvml"

    def __init__(self):
        self.calls = 0

    def sample(self):
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("GPU is lost")
        return [{"index": 0, "util_percent": 50.0}]

    def close(self):
        pass


def test_a_failing_gpu_query_is_recorded_and_sampling_goes_on(tmp_path):
    stop = threading.Event()
    gpu = _FlakyGpu()
    cfg = SamplerConfig(run_dir=tmp_path, period=0.05, duration=0.3, hostname="n1")
    rc = run_sampler(cfg, stop_event=stop, install_signal_handlers=False, backend=gpu, log=open(os.devnull, "w"))
    assert rc == 0
    samples = [r for r in _lines(tmp_path / "telemetry" / "n1.jsonl") if r["kind"] == "sample"]
    assert "GPU is lost" in samples[1]["error"] and samples[1]["gpus"] == []
    assert samples[2]["gpus"] == [{"index": 0, "util_percent": 50.0}]


UUIDS = ["GPU-2026f024-622f", "GPU-99c3cba6-1a43", "GPU-86a0ff3c-d33b", "GPU-441e95f2-1090"]


@pytest.mark.parametrize("cvd,expected", [
    (None, [0, 1, 2, 3]),            # unset: the whole machine
    ("2,3", [2, 3]),                 # a lab node that owns GPUs 2 and 3 (GPU lab, node3)
    ("1", [1]),
    ("GPU-86a0,GPU-2026f024-622f", [2, 0]),  # UUID prefixes, in the order given
    ("", []),                        # CUDA_VISIBLE_DEVICES="" hides every GPU
    ("0,7,1", [0]),                  # as in CUDA: an entry that names no GPU ends the list
])
def test_a_node_samples_only_the_gpus_its_processes_see(cvd, expected):
    from dscluster.node.gpus import visible_indices

    assert visible_indices(cvd, UUIDS) == expected
