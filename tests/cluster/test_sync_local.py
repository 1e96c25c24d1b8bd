"""sync.mode local_sgd under real mpirun: CPU ranks on localhost that take themselves for separate nodes
(each its own host name, a UTS namespace: root), DeepSpeed on gloo, digits.

What a user would notice: the models are averaged at the steps the period says, on every rank alike, and
the step split shows it (average_s, inside comm_s); a node's own ranks reduce their gradients every step;
a resumed run picks the averager's state back up and goes on averaging on the same steps.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from _local_mpirun import DSCLUSTER, ROOT, require_mpirun, train_command

from dscluster.bench.runner import as_node_argv
from dscluster.fsutil import read_jsonl

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
require_mpirun()

SPE = 1437 // 64  # digits: steps per epoch at global batch 64


@pytest.fixture(autouse=True)
def _needs_root():
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("ranks that act as separate nodes need root and unshare (a UTS namespace each)")


def train(runs: Path, run_id: str, *overrides: str, np: int = 2, per_node: int = 1) -> str:
    cmd, env = train_command(runs, run_id, ["--config", "configs/digits.yaml", "progress=false", *overrides],
                             env={"GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"})
    cmd[cmd.index("-np") + 1] = str(np)
    i = cmd.index(str(DSCLUSTER))
    cmd[i:i] = as_node_argv(per_node)
    t0 = time.time()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    print(f"{run_id}: {time.time() - t0:.0f} s")
    return out


def steps(run: Path, rank: int) -> list[dict]:
    return [r for r in read_jsonl(run / "metrics" / f"rank-{rank}.jsonl") if r["kind"] == "step"]


def averaged_at(run: Path, rank: int) -> list[int]:
    return [s["step"] for s in steps(run, rank) if s["average_s"] > 0]


def test_local_sgd_averages_on_the_period_and_resumes_on_it(tmp_path):
    runs = tmp_path / "runs"
    train(runs, "lsgd", "sync.mode=local_sgd", "sync.period=4", "max_steps=30", "checkpoint.every_epochs=1")
    run = runs / "lsgd"
    expected = [4, 8, 12, 16, 20, SPE, 24, 28, 30]  # every 4th step, the epoch's end (22), the run's last
    for rank in (0, 1):
        assert averaged_at(run, rank) == sorted(expected)
        for s in steps(run, rank):
            assert s["comm_s"] >= s["average_s"] >= 0  # the average is communication, not compute
            if s["average_s"] == 0:
                assert s["comm_s"] == 0  # one rank per node: nothing else crosses between steps
    hosts = {r["host"] for rank in (0, 1) for r in steps(run, rank)[:1]}
    assert hosts == {"node1", "node2"}

    # the checkpoint of epoch 1 (step 22, a sync point) resumes; averages go on at 24, 28, ... as before
    out = train(runs, "lsgd", "sync.mode=local_sgd", "sync.period=4", "max_steps=40", "checkpoint.every_epochs=1")
    assert "resumed from" in out and "sync state restored (local_sgd" in out, out[-2000:]
    for rank in (0, 1):
        after = [s for s in averaged_at(run, rank) if s > SPE]
        assert after[-5:] == [24, 28, 32, 36, 40]


def test_a_nodes_own_ranks_reduce_every_step_with_balanced_shares(tmp_path):
    """4 ranks on 2 'nodes' of 2, with balanced batching's uneven shares: gradients meet inside the node every
    step (comm_s on every step), the models across nodes every 8 steps, each rank on its own share."""
    runs = tmp_path / "runs"
    shares = [20, 12, 20, 12]
    train(runs, "hier", "sync.mode=local_sgd", "sync.period=8", "max_steps=10", "batching=balanced",
          f"shares=[{','.join(map(str, shares))}]", np=4, per_node=2)
    run = runs / "hier"
    for rank in range(4):
        recs = steps(run, rank)
        assert [s["step"] for s in recs if s["average_s"] > 0] == [8, 10]
        assert all(s["comm_s"] > 0 for s in recs)
        assert {s["samples"] for s in recs} == {shares[rank]}
    assert {steps(run, r)[0]["host"] for r in range(4)} == {"node1", "node2"}
