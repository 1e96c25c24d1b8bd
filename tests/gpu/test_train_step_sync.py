"""On GPUs: whole `dscluster train` steps (DeepSpeed engine, clip, optimizer, data) never make the
host wait for the GPU after warm-up, in the configurations the ViT benchmark and the fp16 path use.

Each case runs `dscluster train ... sync_debug=warn` as a user would (torchrun, one process per GPU)
and reads the `host_sync` records the ranks wrote; a failing case prints the call sites. Skipped
without CUDA; the 2-rank case needs 2 GPUs.
"""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from dscluster.bench.runner import dscluster_train_module_args, free_port, torchrun_argv
from dscluster.files.fsutil import read_jsonl

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SMALL_VIT = ["model.name=vit_small_image", "model.patch_size=8", "model.embed_dim=192", "model.depth=4",
             "model.num_heads=3", "data.dataset=synthetic", "data.img_size=64", "data.num_classes=10",
             "data.synthetic_samples=16384", "data.augment=false", "micro_batch=64", "max_steps=40", "epochs=1",
             "log_every=10", "checkpoint.every_epochs=0", "checkpoint.resume=false", "progress=false",
             "sync_debug=warn"]

CASES = {
    "bf16-compiled-1gpu": (1, ["precision=bf16", "compile=true"]),
    "fp16-amp-1gpu": (1, ["precision=fp16"]),
    "bf16-ddp-2gpus": (2, ["precision=bf16"]),
    "bf16-accumulate-2gpus": (2, ["precision=bf16", "grad_accum=2"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_training_steps_make_no_host_sync(tmp_path, name):
    ranks, extra = CASES[name]
    if torch.cuda.device_count() < ranks:
        pytest.skip(f"needs {ranks} GPUs")
    argv = torchrun_argv(ranks, dscluster_train_module_args(None, SMALL_VIT + extra), free_port())
    env = {**os.environ, "DSCLUSTER_RUNS": str(tmp_path), "DSCLUSTER_RUN_ID": name, "PYTHONUNBUFFERED": "1"}
    job = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    records = [r for rank in range(ranks) for r in read_jsonl(tmp_path / name / "metrics" / f"rank-{rank}.jsonl")]
    steps = [r for r in records if r["kind"] == "step"]
    assert len(steps) == 40 * ranks  # the run really trained every step it was asked for
    syncs = [r for r in records if r["kind"] == "host_sync"]
    assert not syncs, "\n".join(f"rank {r['rank']}: {r['count']}x\n    " + "\n    ".join(r["stack"]) for r in syncs)
    assert "no host synchronisation in 35 watched steps" in job.stderr, job.stderr[-2000:]


def test_the_watch_sees_deepspeeds_own_fp16_optimizer_sync(tmp_path):
    """DeepSpeed's fp16 optimizer (amp=false) reads its overflow flag on the host every step: the
    watch must find that, or a clean result above means nothing."""
    argv = torchrun_argv(1, dscluster_train_module_args(None, SMALL_VIT + ["precision=fp16", "amp=false"]),
                         free_port())
    env = {**os.environ, "DSCLUSTER_RUNS": str(tmp_path), "DSCLUSTER_RUN_ID": "ds-fp16", "PYTHONUNBUFFERED": "1"}
    job = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    syncs = [r for r in read_jsonl(tmp_path / "ds-fp16" / "metrics" / "rank-0.jsonl") if r["kind"] == "host_sync"]
    assert syncs and sum(r["count"] for r in syncs) >= 35
    assert any("deepspeed/" in frame for r in syncs for frame in r["stack"])
    print("\n".join(f"{r['count']}x " + " <- ".join(reversed(r["stack"][-3:])) for r in syncs))
