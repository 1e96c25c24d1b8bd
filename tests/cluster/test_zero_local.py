"""ZeRO-3 under real mpirun: 2 CPU ranks on localhost, DeepSpeed on gloo, digits, every parameter partitioned
(stage3_param_persistence_threshold 0). Each rank is a "node" of its own that shares no file with the
other: its own host name and its own runs folder bound over the common path (root: a UTS and a mount
namespace each), as on a lab without NFS.

What a user would notice: zero_stage=3 trains and evaluates on 2 ranks; a run killed after its first
checkpoint leaves on each node that node's own shards only, and the same command resumes from them with
the very losses the killed run had reached. On one rank the same command is refused with what to run instead,
and that, as printed, trains.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from _local_mpirun import DSCLUSTER, ROOT, require_mpirun, train_command

from dscluster.files.fsutil import read_jsonl

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
require_mpirun()

# 256 samples at global batch 64: 4 steps an epoch, a checkpoint and an evaluation after each epoch.
ARGS = ["--config", "configs/digits.yaml", "progress=false", "zero_stage=3", "data.limit=256", "epochs=2",
        "optim.warmup_steps=0", "deepspeed.zero_optimization.stage3_param_persistence_threshold=0"]
# Every rank its own node: a host name, a runs folder of its own at the common path, local rank 0.
AS_OWN_NODE = ["unshare", "--uts", "--mount", "bash", "-c",
               'n=node$((OMPI_COMM_WORLD_RANK + 1)); hostname "$n" && mount --bind "$NODES/$n" "$DSCLUSTER_RUNS" '
               '&& OMPI_COMM_WORLD_LOCAL_RANK=0 OMPI_COMM_WORLD_LOCAL_SIZE=1 exec "$@"', "as-node"]


@pytest.fixture(autouse=True)
def _needs_root():
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("ranks that share no files need root and unshare (a UTS and a mount namespace each)")


def train(tmp: Path, fault: str | None = None, ranks: int = 2, run_id: str = "z3") -> subprocess.CompletedProcess:
    nodes = tmp / "nodes"
    for n in ("node1", "node2"):
        (nodes / n).mkdir(parents=True, exist_ok=True)
    cmd, env = train_command(tmp / "runs", run_id, ARGS, fault=fault,
                             env={"GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1", "NODES": str(nodes)})
    cmd[cmd.index("-np") + 1] = str(ranks)
    (tmp / "runs").mkdir(exist_ok=True)
    i = cmd.index(str(DSCLUSTER))
    cmd[i:i] = AS_OWN_NODE
    t0 = time.time()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    print(f"{'killed' if fault else 'resumed'} run: {time.time() - t0:.0f} s")
    p.stdout += p.stderr
    return p


def records(tmp: Path, rank: int, kind: str) -> list[dict]:
    path = tmp / "nodes" / f"node{rank + 1}" / "z3" / "metrics" / f"rank-{rank}.jsonl"
    return [r for r in read_jsonl(path) if r["kind"] == kind]


def test_zero3_trains_evaluates_and_a_killed_run_resumes_from_each_nodes_own_shards(tmp_path):
    first = train(tmp_path, fault="exit:rank=1,step=7")
    assert first.returncode != 0, first.stdout[-3000:]
    for rank in (0, 1):
        ckpt = tmp_path / "nodes" / f"node{rank + 1}" / "z3" / "checkpoints"
        assert (ckpt / "latest").read_text().strip() == "epoch0000-step00000004", first.stdout[-3000:]
        # the node holds its own rank's partition of the weights and of the optimizer, nothing of the other's
        assert sorted(p.name for p in (ckpt / "epoch0000-step00000004").iterdir()) == [
            f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt", f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"]
    before = {rank: {s["step"]: s["loss"] for s in records(tmp_path, rank, "step")} for rank in (0, 1)}
    assert set(before[1]) == set(range(1, 7))

    again = train(tmp_path)
    assert again.returncode == 0, again.stdout[-3000:]
    assert "resumed from" in again.stdout and "at global step 4" in again.stdout
    for rank in (0, 1):
        assert [s["resumed_from_step"] for s in records(tmp_path, rank, "start")] == [0, 4]
        steps = records(tmp_path, rank, "step")
        resumed = {s["step"]: s["loss"] for s in steps[len(before[rank]):]}
        assert sorted(resumed) == [5, 6, 7, 8]
        # the partitioned weights and AdamW moments came back: steps 5 and 6 again, to the last digit printed
        for step in (5, 6):
            assert resumed[step] == pytest.approx(before[rank][step], rel=1e-5), (rank, step)
    assert steps[-1]["loss"] < steps[0]["loss"]
    # every rank ran the held-out forwards (the weights are all-gathered); rank 0 alone records them
    evals = records(tmp_path, 0, "eval")
    assert [e["step"] for e in evals] == [4, 8] and {e["samples"] for e in evals} == {359}
    assert not records(tmp_path, 1, "eval")
    summary = json.loads((tmp_path / "nodes" / "node1" / "z3" / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["steps"] == 8 and summary["accuracy"] == evals[-1]["accuracy"]
    assert records(tmp_path, 0, "start")[0]["params"] == 228_202  # the whole model's, not a rank's partition

    # the same command on one rank (node2 gone, say): node1's shard is refused with what to run, not a traceback,
    # and nothing is trained; the advice to train afresh, as printed, trains on that one rank
    trained = len(records(tmp_path, 0, "step"))
    alone = train(tmp_path, ranks=1)
    assert alone.returncode == 2, alone.stdout[-3000:]
    assert ("epoch0001-step00000008 holds ZeRO state partitioned over 2 ranks and this job has 1" in alone.stdout
            and "mpirun -np 2" in alone.stdout and "train afresh with another DSCLUSTER_RUN_ID" in alone.stdout
            ), alone.stdout[-3000:]
    assert "Traceback" not in alone.stdout and len(records(tmp_path, 0, "step")) == trained
    afresh = train(tmp_path, ranks=1, run_id="z3-alone")
    assert afresh.returncode == 0, afresh.stdout[-3000:]
    assert json.loads((tmp_path / "nodes" / "node1" / "z3-alone" / "summary.json").read_text())["steps"] == 8
