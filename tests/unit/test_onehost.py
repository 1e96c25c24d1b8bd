"""One workstation, as a new user starts: a hostfile naming only this machine works for `check`,
`launch`, `top` and `plan` with no sshd and no `dscluster setup` (no pinned host key anywhere)."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

from dscluster.cli import main


@pytest.fixture
def one_machine(tmp_path, monkeypatch):
    """An empty state directory (setup never ran: no known_hosts) and a hostfile of `localhost`."""
    state = tmp_path / "state"
    monkeypatch.setenv("DSCLUSTER_STATE", str(state))
    monkeypatch.setenv("DSCLUSTER_RUNS", str(tmp_path / "runs"))
    monkeypatch.delenv("DSCLUSTER_SSH_PASSWORD", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))  # where check would write the node's ~/.prte/mca-params.conf
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("localhost slots=1\n")
    return hostfile, state


def test_check_and_launch_of_localhost_need_no_sshd_and_no_setup(one_machine, capsys):
    hostfile, state = one_machine
    assert main(["check", "--hostfile", str(hostfile), "--skip-active", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert not (state / "known_hosts").exists()
    assert [n["name"] for n in doc["nodes"]] == ["localhost"] and doc["nodes"][0]["hostname"] == socket.gethostname()
    said = [f["what"] for f in doc["findings"] if f["node"] == "localhost" and f["check"] == "reach"]
    assert said == ["this machine: probed here without SSH"]
    assert Path(doc["files"]["node_env"]["localhost"]).is_file()
    # one node: no subnet pinned in the account's mpirun parameter files (every later mpirun would read it)
    assert not (hostfile.parent / ".prte").exists() and not (hostfile.parent / ".openmpi").exists()

    assert main(["launch", "--hostfile", str(hostfile), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "mpirun -np 1 --hostfile " + str(hostfile) in out and "entry_cn.sh" in out


def _sample(now: float, host: str) -> dict:
    return {"kind": "sample", "t": now, "host": host, "backend": "nvml", "cpu_percent": 12.0, "ram_used_mb": 1.0,
            "ram_total_mb": 2.0, "gpus": [{"index": 0, "name": "NVIDIA RTX 3070", "util_percent": 97.0,
                                           "mem_used_mb": 6000.0, "mem_total_mb": 8192.0}]}


def test_top_of_localhost_shows_the_jobs_gpu_figures_and_else_samples_this_machine(one_machine, capsys):
    hostfile, _ = one_machine
    run = hostfile.parent / "runs" / "plain1"
    (run / "telemetry").mkdir(parents=True)
    now = time.time()
    (run / "telemetry" / f"{socket.gethostname()}.jsonl").write_text(json.dumps(_sample(now, "x")) + "\n")
    assert main(["top", "--hostfile", str(hostfile), "--run-dir", str(run), "--once", "--json"]) == 0
    node = json.loads(capsys.readouterr().out)["nodes"][0]
    assert (node["name"], node["source"], node["error"]) == ("localhost", "telemetry", None)
    assert node["gpus"][0]["util_percent"] == 97.0

    (run / "telemetry" / f"{socket.gethostname()}.jsonl").write_text(json.dumps(_sample(now - 600, "x")) + "\n")
    assert main(["top", "--hostfile", str(hostfile), "--run-dir", str(run), "--once", "--json"]) == 0
    node = json.loads(capsys.readouterr().out)["nodes"][0]
    assert (node["source"], node["error"]) == ("ssh", None)  # sampled now, here: no "connection refused"
    assert node["ram_total_mb"] > 0


def test_plan_measures_a_hostfile_of_this_machine_in_process():
    from dscluster.plan.nodes import is_here

    assert is_here(["localhost"]) and is_here([socket.gethostname(), "127.0.0.1"])
    assert not is_here(["localhost", "192.0.2.7"])
