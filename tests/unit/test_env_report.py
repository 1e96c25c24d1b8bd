"""`dscluster env`: local versions/GPU/launcher report; secrets hidden, stable --json, no GPU needed."""

import json
import os
import subprocess
import sys

import pytest

from dscluster.check.checkfile import CheckFile
from dscluster.cli import env as cli_env
from dscluster.cli import envreport, main

TOP_KEYS = {"schema", "summary", "versions", "python", "torch", "gpus", "deepspeed", "mpi", "env", "check"}
CHECK_DOC = {
    "schema": 1, "ok": False, "created": 1_700_000_000.0, "hostfile": "hosts.txt",
    "nodes": [
        {"name": "node1", "reachable": True, "hostname": "lab-a", "checks": {"reach": "ok", "gpu": "ok"}},
        {"name": "node2", "reachable": True, "hostname": "lab-b",
         "checks": {"reach": "ok", "gpu": "error", "p2p": "warning"}},
        {"name": "node3", "reachable": False, "hostname": None, "checks": {"reach": "error", "gpu": "ok"}},
    ],
    "findings": [{"severity": "error"}, {"severity": "error"}, {"severity": "warning"}, {"severity": "info"}],
}


def cpu_only_report(**over):
    parts = dict(
        versions={"dscluster": "0.1.0", "python": "3.11.9", "torch": "2.4.0", "deepspeed": None},
        python={"version": "3.11.9", "implementation": "CPython", "executable": "/usr/bin/python3",
                "platform": "Linux"},
        torch={"version": "2.4.0+cpu", "cuda_build": None, "cuda_available": False, "nccl": None, "error": None},
        gpus=[],
        deepspeed={"version": None, "accelerator": None, "ops": None, "error": "cannot import deepspeed (No module)"},
        mpi={"mpirun": None, "version": None, "error": "mpirun not found"},
        env={},
        check=None,
    )
    parts.update(over)
    return envreport.build_report(**parts)


def test_relevant_env_keeps_distributed_variables_and_hides_secrets():
    environ = {
        "NCCL_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "eth0", "MASTER_ADDR": "10.0.0.1",
        "CUDA_VISIBLE_DEVICES": "0,1", "OMPI_MCA_btl": "tcp,self", "DS_ENV_FILE": "/x/.deepspeed_env",
        "TORCH_NCCL_BLOCKING_WAIT": "1", "DSCLUSTER_STATE": "/x/.dscluster",
        "DSCLUSTER_SSH_PASSWORD": "hunter2", "NCCL_IB_secret": "s", "DS_HUB_TOKEN": "t", "DSCLUSTER_API_KEY": "k",
        "HOME": "/home/me", "HF_TOKEN": "not ours", "PATH": "/usr/bin",
    }
    env = envreport.relevant_env(environ)
    assert env == {
        "CUDA_VISIBLE_DEVICES": "0,1", "DSCLUSTER_API_KEY": "***", "DSCLUSTER_SSH_PASSWORD": "***",
        "DSCLUSTER_STATE": "/x/.dscluster", "DS_ENV_FILE": "/x/.deepspeed_env", "DS_HUB_TOKEN": "***",
        "GLOO_SOCKET_IFNAME": "eth0", "MASTER_ADDR": "10.0.0.1", "NCCL_IB_secret": "***",
        "NCCL_SOCKET_IFNAME": "eth0", "OMPI_MCA_btl": "tcp,self", "TORCH_NCCL_BLOCKING_WAIT": "1",
    }
    assert list(env) == sorted(env)


def test_check_summary_gives_time_result_and_each_nodes_worst_cell():
    summary = envreport.summarize_check(CheckFile.from_dict(CHECK_DOC), "/s/check.json")
    assert summary["created"] == 1_700_000_000.0 and summary["ok"] is False
    assert (summary["errors"], summary["warnings"]) == (2, 1)
    assert [(n["name"], n["status"], n["problems"]) for n in summary["nodes"]] == [
        ("node1", "ok", []), ("node2", "error", ["gpu", "p2p"]), ("node3", "unreachable", ["reach"])]


def test_state_dirs_check_json_is_read_or_reported_missing_or_unreadable(tmp_path):
    env = {"DSCLUSTER_STATE": str(tmp_path)}
    assert envreport.load_check(env) is None
    (tmp_path / "check.json").write_text("{not json")
    broken = envreport.load_check(env)
    assert "unreadable" in broken["error"] and broken["nodes"] == [] and broken["ok"] is None
    (tmp_path / "check.json").write_text(json.dumps(CHECK_DOC))
    assert envreport.load_check(env)["nodes"][1]["status"] == "error"


def test_mpirun_path_and_its_first_version_line(tmp_path, monkeypatch):
    tool = tmp_path / "mpirun"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    seen = []

    def fake_run(argv, **kw):
        seen.append(argv)
        return subprocess.CompletedProcess(argv, 0, "mpirun (Open MPI) 5.0.5\n\nReport bugs to ...\n", "")

    info = envreport.collect_mpi(str(tool), run=fake_run)
    assert info == {"mpirun": str(tool), "version": "mpirun (Open MPI) 5.0.5", "error": None}
    assert seen == [[str(tool), "--version"]]
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    missing = envreport.collect_mpi("mpirun", run=fake_run)
    assert missing["mpirun"] is None and "not found" in missing["error"]
    assert envreport.collect_mpi(str(tmp_path / "gone" / "mpirun"), run=fake_run)["mpirun"] is None


def test_nccl_version_formats():
    assert envreport.format_nccl_version((2, 21, 5)) == "2.21.5"
    assert envreport.format_nccl_version(2708) == "2708"
    assert envreport.format_nccl_version(None) is None


def test_human_report_without_gpu_deepspeed_or_mpirun_still_renders(capsys):
    doc = cpu_only_report(env={"NCCL_DEBUG": "INFO", "DSCLUSTER_SSH_PASSWORD": "***"},
                          check=envreport.summarize_check(CheckFile.from_dict(CHECK_DOC), "/s/check.json"))
    cli_env.render(doc)
    out = capsys.readouterr().out
    assert "dscluster 0.1.0, python 3.11.9, torch 2.4.0, deepspeed not installed" in out
    assert "GPUs: none visible to torch (CUDA not available)" in out
    assert "CUDA build none (CPU-only)" in out and "mpirun not found" in out
    assert "NCCL_DEBUG" in out and "***" in out
    assert "node2 error: gpu, p2p" in out and "node3 unreachable" in out


def test_human_report_lists_gpus(capsys):
    gpus = [{"index": 0, "name": "NVIDIA GeForce RTX 3070", "capability": "8.6", "memory_gib": 7.8},
            {"index": 1, "name": "NVIDIA GeForce GTX 1080", "capability": "6.1", "memory_gib": 7.9}]
    torch = {"version": "2.4.0+cu121", "cuda_build": "12.1", "cuda_available": True, "nccl": "2.20.5", "error": None}
    cli_env.render(cpu_only_report(gpus=gpus, torch=torch))
    out = capsys.readouterr().out
    assert "RTX 3070" in out and "6.1" in out and "7.9 GiB" in out and "2.20.5" in out


def test_version_flag_prints_the_env_summary_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    line = capsys.readouterr().out.strip()
    assert line == envreport.versions_line(envreport.package_versions())
    assert line.startswith("dscluster ") and ", python " in line and ", torch " in line and ", deepspeed " in line


def test_env_json_from_the_command_line(tmp_path):
    (tmp_path / "check.json").write_text(json.dumps(CHECK_DOC))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "DSCLUSTER_", "DS_"))}
    env.update(DSCLUSTER_STATE=str(tmp_path), DSCLUSTER_SSH_PASSWORD="hunter2", NCCL_DEBUG="INFO")
    proc = subprocess.run([sys.executable, "-m", "dscluster", "env", "--json"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)  # DeepSpeed's own log lines must not land on stdout
    assert set(doc) == TOP_KEYS and doc["schema"] == 1
    assert set(doc["torch"]) == {"version", "cuda_build", "cuda_available", "nccl", "error"}
    assert set(doc["deepspeed"]) == {"version", "accelerator", "ops", "ops_needed", "error"}
    assert set(doc["mpi"]) == {"mpirun", "version", "error"}
    assert set(doc["check"]) == {"path", "created", "ok", "hostfile", "errors", "warnings", "nodes", "error"}
    assert doc["env"]["DSCLUSTER_SSH_PASSWORD"] == "***" and doc["env"]["NCCL_DEBUG"] == "INFO"
    assert "hunter2" not in proc.stdout + proc.stderr
    assert doc["summary"] == envreport.versions_line(doc["versions"])
    assert doc["torch"]["cuda_available"] or doc["gpus"] == []
    for gpu in doc["gpus"]:
        assert set(gpu) == {"index", "name", "capability", "memory_gib"}
    assert [n["status"] for n in doc["check"]["nodes"]] == ["ok", "error", "unreachable"]
