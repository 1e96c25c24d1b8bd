"""What a rank does around training: disk-full detection, blaming a dead peer, versions in the
run directory, when the memory fit runs, and DeepSpeed's CPU start-up without a JIT build."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dscluster.core.config import load_config
from dscluster.core.dist import default_extensions_dir, is_peer_failure
from dscluster.core.setup_engine import calibration_batch, needs_memory_fit
from dscluster.rundir.writer import RunLog, RunRecord
from dscluster.train.checkpoint import is_write_failure


def test_torch_save_on_a_full_disk_counts_as_a_write_failure(tmp_path):
    # /dev/full answers every write with ENOSPC, like the tmpfs of the fault test; torch.save's
    # C++ writer turns that into a RuntimeError, not an OSError.
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    with pytest.raises(RuntimeError) as e:
        torch.save({"w": torch.zeros(100_000)}, "/dev/full")
    assert is_write_failure(e.value)
    assert is_write_failure(OSError(28, "No space left on device"))
    assert not is_write_failure(RuntimeError("Connection reset by peer"))  # not a storage problem


@pytest.mark.parametrize("text", [
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:41234: Connection reset by peer",
    "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 6000ms for recv operation",
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection closed by peer [127.0.0.1]:9155",
    "NCCL communicator was aborted on rank 0.",
])
def test_a_collective_failing_because_of_a_peer_is_not_this_ranks_fault(text):
    assert is_peer_failure(RuntimeError(text))
    try:  # DeepSpeed re-raises inside its own handlers: the cause counts too
        try:
            raise RuntimeError(text)
        except RuntimeError as inner:
            raise ValueError("while reducing gradients") from inner
    except ValueError as outer:
        assert is_peer_failure(outer)
    assert not is_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_peer_failure(ValueError("Connection reset by peer"))


def test_env_snapshot_names_the_software_versions(tmp_path):
    log = RunLog(tmp_path, 3, "nodeX")
    log.write_env()
    log.close()
    env = json.loads((tmp_path / "env" / "rank-3.json").read_text())
    v = env["versions"]
    assert v["torch"] == torch.__version__ and v["python"] == ".".join(map(str, sys.version_info[:3]))
    assert v["deepspeed"] and v["dscluster"]


def test_balanced_batching_on_gpu_measures_the_memory_fit_even_with_a_fixed_micro_batch():
    fixed_balanced = load_config(None, ["batching=balanced", "micro_batch=64"])
    assert needs_memory_fit(fixed_balanced, "cuda")      # the fit caps each rank's share
    assert not needs_memory_fit(fixed_balanced, "cpu")   # no device memory to fit on CPU
    assert needs_memory_fit(load_config(None, ["micro_batch=auto"]), "cuda")
    assert not needs_memory_fit(load_config(None, ["micro_batch=64"]), "cuda")


def test_extensions_dir_defaults_to_a_per_user_cache_and_keeps_an_explicit_one(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    path = Path(default_extensions_dir(env))
    assert path.is_relative_to(tmp_path / "dscluster" / "torch_extensions") and torch.__version__ in path.name
    assert env["TORCH_EXTENSIONS_DIR"] == str(path)
    assert default_extensions_dir({"TORCH_EXTENSIONS_DIR": "/x/y"}) == "/x/y"


_BRING_UP = r"""
import datetime, os, sys, time
import torch
from dscluster.core import dist
dist.prepare_accelerator()
t = time.time()
dist.init_process_group(dist.RankInfo(0, 0, 1, 1, "single"), "gloo", 30)
import deepspeed.comm as dcomm
x = torch.ones(3)
dcomm.inference_all_reduce(x)  # the shm op's only user: falls back to torch.distributed.all_reduce
print("up", round(time.time() - t, 2), x.tolist())
dist.destroy()
"""


def test_cpu_bring_up_builds_no_shared_memory_op(tmp_path):
    ext = tmp_path / "ext"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(TORCH_EXTENSIONS_DIR=str(ext), DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29000 + os.getpid() % 1000))
    p = subprocess.run([sys.executable, "-c", _BRING_UP], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "up " in p.stdout and "[1.0, 1.0, 1.0]" in p.stdout
    built = sorted(str(q.relative_to(ext)) for q in ext.rglob("*")) if ext.exists() else []
    assert not built, f"DeepSpeed JIT-built {built} at start-up"


def test_speed_calibration_of_a_small_card_stays_within_its_memory_fit():
    # 4x H200 with one rank capped to 8 GB: micro_batch 128 OOM'd that rank in calibration (fit 79)
    assert calibration_batch(128, 79) == 79
    assert calibration_batch(64, 900) == 64
    assert calibration_batch(32, None) == 32  # CPU: no fit measured


def test_the_run_record_gives_summary_json_its_fields():
    record = RunRecord(run_id="r1", world_size=2, hosts=["node1", "node2"], model="vit_tiny", dataset="digits",
                       epochs=3)
    failed = record.summary(status="failed", wall_s=1.5, failed_rank=1, failed_host="node2", error="boom")
    assert failed["status"] == "failed" and failed["failed_host"] == "node2" and failed["steps"] == 0
    assert failed["precision"] is None and failed["peak_mem_mb"] is None  # not reached yet, still said
    assert not {"plan", "vanished_hosts", "timed_steps", "target_accuracy"} & set(failed)
    record.steps, record.overflow_steps, record.peak_mem_mb, record.vanished_hosts = 12, 3, 812.5, []
    record.time_to_accuracy = {"target_accuracy": 0.9, "time_to_accuracy": None}
    done = record.summary(status="complete", wall_s=9.0)
    assert (done["steps"], done["overflow_steps"], done["peak_mem_mb"]) == (12, 3, 812.5)
    assert done["vanished_hosts"] == [] and done["target_accuracy"] == 0.9 and done["time_to_accuracy"] is None
    assert list(done)[:3] == ["status", "run_id", "world_size"]
