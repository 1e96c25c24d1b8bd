"""`make demo` end to end on its own lab, as a user runs it: the README's `mpirun -np 3 --hostfile H
entry_cn.sh` with no arguments (the digits preset, 20 epochs) reaches 90% held-out, every rank on its own
node's interface with one master address, telemetry from every node; every step runs, the lab is gone
afterwards, and the run directory (with plots) is where the demo says."""

import ipaddress
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dscluster.files.fsutil import read_jsonl
from dscluster.sim import lab as sim
from dscluster.sim.plan import iface_name

# Slow, and must stay so: the whole `make demo` journey on a 3-node lab it builds, the preset's 20 epochs.
pytestmark = [pytest.mark.cluster, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
LAB = "demotest"


def test_demo_runs_the_whole_journey_and_removes_its_lab(lab_factory, tmp_path):
    # lab_factory is requested for its root/tools skip only: the demo builds and removes its own lab.
    sim.down(LAB)  # one left by an interrupted run would be reused as it is
    runs = tmp_path / "runs"
    out = subprocess.run(
        [sys.executable, "-m", "dscluster.demo", "--lab", LAB, "--runs-dir", str(runs)],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )
    text = out.stdout + out.stderr
    # a failing step's own output comes early (check's findings), the demo's table at the end: show both
    assert out.returncode == 0, text[:6000] + "\n[...]\n" + text[-4000:] if len(text) > 10000 else text
    order = ["== sim up", "== dscluster setup", "== dscluster check", "entry_cn.sh", "== sim down"]
    positions = [text.find(marker) for marker in order]
    assert all(p >= 0 for p in positions), list(zip(order, positions, strict=True))
    assert positions == sorted(positions)
    assert not re.search(r"^failed ", text, re.M)

    assert sim.load(LAB) is None
    assert not list(Path("/run/netns").glob(f"*{LAB}*")), "the demo left network namespaces behind"

    run_dirs = [p for p in runs.iterdir() if p.is_dir()]
    assert len(run_dirs) == 1
    run = run_dirs[0]
    assert f"run directory: {run}" in text
    assert run.name.startswith("mpi-")  # every rank derived the same id from the job
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["world_size"] == 3
    assert summary["accuracy"] >= 0.90, summary
    hosts = ["node1", "node2", "node3"]
    assert sorted(p.name for p in (run / "telemetry").glob("*.jsonl")) == [f"{h}.jsonl" for h in hosts]
    for h in hosts:
        samples = [r for r in read_jsonl(run / "telemetry" / f"{h}.jsonl") if r.get("kind", "sample") == "sample"]
        assert samples, f"{h}: no samples"
    envs = [json.loads((run / "env" / f"rank-{rank}.json").read_text()) for rank in range(3)]
    assert sorted(e["host"] for e in envs) == hosts  # one rank per node
    for e in envs:  # each node's own NIC name (the lab's nodes name theirs differently), from check
        assert e["GLOO_SOCKET_IFNAME"] == e["NCCL_SOCKET_IFNAME"] == iface_name(int(e["host"][-1])), e
    # one master address, node1's on the lab: not loopback, not the workers' decoy docker0 (172.17.0.1)
    [master] = {e["MASTER_ADDR"] for e in envs}
    addr = ipaddress.ip_address(master)
    assert addr.is_private and not addr.is_loopback and addr not in ipaddress.ip_network("172.17.0.0/16"), master
    if (REPO / "analysis" / "plot.py").exists():
        assert list((run / "plots").glob("*.png")), "analysis/plot.py made no pictures"
        assert f"pictures: {run / 'plots'}" in text
