"""`dscluster plan` on a simulated 2-node lab: the compute probe runs on every node over SSH, and the
node slowed by DSCLUSTER_FAULT is the one plan names (real sshd and `dscluster setup`, as in
test_launch_lab.py)."""

from __future__ import annotations

import json
import shlex

import pytest
from test_launch_lab import DSCLUSTER, REPO, explain, set_up

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def cluster(lab_factory):
    return set_up(lab_factory, "planlab", nodes=2)  # keys and pinned host keys: what plan's probe needs


def test_plan_measures_every_node_on_itself_and_names_the_slowed_one(cluster):
    # rank 1 is node2's (mpirun fills the hostfile in order); the probe there honours the fault as
    # training's rank would: on CPU it sleeps 4 s a step, far above this machine's noise. The lab's
    # nodes share this machine's cores, so the probes run one thread each (OMP_NUM_THREADS travels
    # with them): with 2 threads each, 3 probes on a 2-core CI machine spun 6 s for a 0.04 s step. Two nodes:
    # one slowed, one not, each measured on itself (a third, unslowed node cost a probe's start-up and showed no more)
    fault = "slow_gpu:rank=1,ms=4000"
    res = cluster.sh(f"OMP_NUM_THREADS=1 DSCLUSTER_FAULT={shlex.quote(fault)} {DSCLUSTER} plan "
                     f"--hostfile {cluster.hostfile} --config {REPO}/configs/digits.yaml --busbw 1.0 "
                     "--no-calibration --json", timeout=600)
    assert res.returncode == 0, explain(res)
    doc = json.loads(res.stdout)
    assert doc["compute"]["source"] == "measured on the nodes", doc["compute"]
    figures = doc["compute"]["nodes"]
    print({n: round(f["seconds"], 3) for n, f in figures.items()}, doc["notes"])  # shown with -s
    assert set(figures) == {"node1", "node2"}
    assert {n: figures[n]["measured_on"] for n in figures} == {"node1": "node1", "node2": "node2"}  # each on itself
    assert figures["node2"]["fault_ms"] == 4000 and figures["node1"]["fault_ms"] == 0
    assert {figures[n]["threads"] for n in figures} == {1}
    assert figures["node2"]["seconds"] >= 4.0  # the sleep is a floor: the probe timed the slowed steps
    assert figures["node2"]["seconds"] > figures["node1"]["seconds"] + 1.0
    by_node = {n["name"]: n["compute_s"] for n in doc["nodes"]}
    assert max(by_node, key=by_node.get) == "node2"
    assert any(note.startswith("slowest node: node2") for note in doc["notes"]), doc["notes"]
