"""sync.mode local_sgd under real mpirun: CPU ranks on localhost that take themselves for separate nodes
(each its own host name, a UTS namespace: root), DeepSpeed on gloo, digits.

What a user would notice: the models are averaged at the steps the period says, on every rank alike, and
the step split shows it (average_s, inside comm_s); a node's own ranks reduce their gradients every step;
nodes are told apart by machine, not by host name; a resumed run goes on exactly as the run would have,
each rank with its own state, on a shared run directory and on node-local checkpoints (each node its own),
with a streamed average in flight at the checkpoint.
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
from dscluster.files.fsutil import read_jsonl

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
require_mpirun()

SPE = 1437 // 64  # digits: steps per epoch at global batch 64


@pytest.fixture(autouse=True)
def _needs_root():
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("ranks that act as separate nodes need root and unshare (a UTS namespace each)")


def clones_argv(runs: Path, per_node: int) -> list[str]:
    """Like as_node_argv, but every rank's host name is "lab": machines cloned from one image. Each node
    has its own /etc/machine-id (bind-mounted in a mount namespace of its own), and node 2 its own copy of
    the runs folder (no shared filesystem: node-local checkpoints)."""
    own = runs.with_name(runs.name + "-node2")
    own.mkdir(parents=True, exist_ok=True)
    runs.mkdir(parents=True, exist_ok=True)
    for n in (1, 2):
        (runs.parent / f"machine-id-{n}").write_text(f"{n:032x}\n")
    # mpirun numbers local ranks per real host: each clone's ranks are its own 0..per_node-1, as on two machines
    script = (f'n=$((OMPI_COMM_WORLD_RANK / {per_node} + 1)) && hostname lab && '
              f'export OMPI_COMM_WORLD_LOCAL_RANK=$((OMPI_COMM_WORLD_RANK % {per_node})) '
              f'OMPI_COMM_WORLD_LOCAL_SIZE={per_node} && '
              f'mount --bind "{runs.parent}/machine-id-$n" /etc/machine-id && '
              f'if [ "$n" = 2 ]; then mount --bind "{own}" "{runs}"; fi && exec "$@"')
    return ["unshare", "--uts", "--mount", "bash", "-c", script, "as-clone"]


def train(runs: Path, run_id: str, *overrides: str, np: int = 2, per_node: int = 1, clones: bool = False) -> str:
    cmd, env = train_command(runs, run_id, ["--config", "configs/digits.yaml", "progress=false", *overrides],
                             env={"GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"})
    cmd[cmd.index("-np") + 1] = str(np)
    i = cmd.index(str(DSCLUSTER))
    cmd[i:i] = clones_argv(runs, per_node) if clones else as_node_argv(per_node)
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


def losses_twice(run: Path, rank: int, at: range) -> tuple[list[float], list[float]]:
    """The losses of steps `at` as the first run trained them, and as the resumed run did again."""
    first: dict[int, float] = {}
    again: dict[int, float] = {}
    for s in steps(run, rank):
        (again if s["step"] in first else first)[s["step"]] = s["loss"]
    return [first[k] for k in at], [again[k] for k in at]


def test_local_sgd_averages_on_the_period_and_resumes_on_it(tmp_path):
    runs = tmp_path / "runs"
    train(runs, "lsgd", "sync.mode=local_sgd", "sync.period=4", "sync.warmup_steps=0", "max_steps=30",
          "checkpoint.every_epochs=1")
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
    out = train(runs, "lsgd", "sync.mode=local_sgd", "sync.period=4", "sync.warmup_steps=0", "max_steps=40",
                "checkpoint.every_epochs=1")
    assert "resumed from" in out and "sync state restored (local_sgd" in out, out[-2000:]
    for rank in (0, 1):
        after = [s for s in averaged_at(run, rank) if s > SPE]
        assert after[-5:] == [24, 28, 32, 36, 40]
        # exactly the steps the first run trained after its checkpoint: each rank its own AdamW moments
        first, again = losses_twice(run, rank, range(SPE + 1, 31))
        assert again == pytest.approx(first, rel=1e-6, abs=1e-7), rank


def test_clones_of_one_host_name_are_two_nodes_and_resume_a_streamed_average_node_locally(tmp_path):
    """2 'nodes' of one rank each, both named "lab", each its own machine id and run folder, with balanced
    batching's uneven shares: the models meet every 4 steps, streamed 2 steps behind, and nothing else
    crosses (taken for one node, the two would reduce their gradients every step and log one norm). A
    checkpoint at step 5 holds the average started at step 4; the resumed run sends it again and trains
    steps 6-8 exactly again. (A node's own ranks reducing in buckets during backward: test_localsgd.py.)"""
    runs = tmp_path / "runs"
    shares = [40, 24]
    args = ["sync.mode=local_sgd", "sync.period=4", "sync.delay_steps=2", "sync.warmup_steps=0", "batching=balanced",
            f"shares=[{','.join(map(str, shares))}]", "checkpoint.every_steps=5", "checkpoint.every_epochs=0"]
    train(runs, "clones", *args, "max_steps=8", clones=True)
    run_of = {0: runs / "clones", 1: tmp_path / "runs-node2" / "clones"}
    for rank in range(2):
        recs = steps(run_of[rank], rank)
        # started at 4, applied at 6; the run's last step averages at once
        assert [s["step"] for s in recs if s["average_s"] > 0] == [4, 6, 8]
        assert all(s["comm_s"] == s["average_s"] for s in recs)  # no gradient crosses between the two
        assert {s["samples"] for s in recs} == {shares[rank]}
    norms = [[s["grad_norm"] for s in steps(run_of[rank], rank)] for rank in range(2)]
    assert norms[0] != norms[1]  # two nodes, not one
    for run in run_of.values():
        assert (run / "checkpoints" / "latest").read_text().strip().endswith("00000005")  # each node its own

    out = train(runs, "clones", *args, "max_steps=12", clones=True)
    assert "sync state restored (local_sgd" in out, out[-2000:]
    for rank in range(2):
        first, again = losses_twice(run_of[rank], rank, range(6, 9))
        assert again == pytest.approx(first, rel=1e-6, abs=1e-7), rank
