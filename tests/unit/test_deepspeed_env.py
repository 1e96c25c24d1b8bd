""".deepspeed_env is DeepSpeed's file and the user's: `check` merges its keys in (marked by one
KEY=VALUE line, since DeepSpeed's launcher cannot read comments) and `launch --launcher deepspeed`
keeps ~/.deepspeed_env, which its per-run DS_ENV_FILE would otherwise hide."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_launch import make_plan
from test_launch_cli import lab_dir, write_check  # noqa: F401 (lab_dir is a fixture)

from dscluster.cli import main
from dscluster.files import state
from dscluster.launch import builders as launch

CHECK_KEYS = {"DSCLUSTER_PRECISION": "fp32", "MASTER_ADDR": "10.0.0.1", "NCCL_SOCKET_IFNAME": "eth0"}


def deepspeed_reads(text: str) -> dict[str, str]:
    """DeepSpeed 0.19's launcher (runner.py main) on a .deepspeed_env: it raises on any line
    without '=' (a comment, a blank line) and exports key.strip() = value.strip()."""
    exports = {}
    for var in text.splitlines(keepends=True):
        key, val = var.split("=", maxsplit=1)
        exports[key.strip()] = val.strip()
    return exports


def test_check_keeps_the_users_keys_and_marks_its_own(tmp_path):
    path = tmp_path / ".deepspeed_env"
    path.write_text("NCCL_DEBUG=INFO\nNCCL_SOCKET_IFNAME=eth9\n")
    _, notes = state.update_deepspeed_env(path, CHECK_KEYS)
    assert path.read_text() == ("NCCL_DEBUG=INFO\nNCCL_SOCKET_IFNAME=eth9\n"
                                "DSCLUSTER_ENV_KEYS=DSCLUSTER_PRECISION,MASTER_ADDR\n"
                                "DSCLUSTER_PRECISION=fp32\nMASTER_ADDR=10.0.0.1\n")
    assert notes == [f"{path}: kept your NCCL_SOCKET_IFNAME=eth9 (check found eth0; delete the line to take "
                     "check's)"]
    assert deepspeed_reads(path.read_text())["NCCL_DEBUG"] == "INFO"


def test_a_second_check_replaces_its_own_keys_only(tmp_path):
    path = tmp_path / ".deepspeed_env"
    state.update_deepspeed_env(path, CHECK_KEYS)
    path.write_text(path.read_text() + "TORCH_NCCL_BLOCKING_WAIT=1\n")  # the user adds one after
    _, notes = state.update_deepspeed_env(path, {"DSCLUSTER_PRECISION": "bf16", "MASTER_ADDR": "10.0.0.2"})
    assert notes == []
    assert path.read_text() == ("TORCH_NCCL_BLOCKING_WAIT=1\nDSCLUSTER_ENV_KEYS=DSCLUSTER_PRECISION,MASTER_ADDR\n"
                                "DSCLUSTER_PRECISION=bf16\nMASTER_ADDR=10.0.0.2\n")  # eth0 gone with check's mark
    before = path.read_text()
    state.update_deepspeed_env(path, {"DSCLUSTER_PRECISION": "bf16", "MASTER_ADDR": "10.0.0.2"})
    assert path.read_text() == before


def test_a_file_from_before_the_mark_loses_stale_dscluster_keys_and_unreadable_lines(tmp_path):
    path = tmp_path / ".deepspeed_env"
    old = "# my settings\nDSCLUSTER_PRECISION=fp16\n\nNCCL_IB_DISABLE=1\n"
    path.write_text(old)
    _, notes = state.update_deepspeed_env(path, CHECK_KEYS)
    text = path.read_text()
    assert text.startswith("NCCL_IB_DISABLE=1\nDSCLUSTER_ENV_KEYS=")
    assert deepspeed_reads(text)["DSCLUSTER_PRECISION"] == "fp32"  # a DSCLUSTER_ key is always check's
    assert any("dropped '# my settings'" in n for n in notes) and any("a blank line" in n for n in notes)
    assert (tmp_path / ".deepspeed_env.bak").read_text() == old
    with pytest.raises(ValueError):
        deepspeed_reads(old)  # what DeepSpeed itself does with such a file


def test_launch_layers_home_cwd_and_the_runs_exports():
    base = {"DSCLUSTER_ENV_KEYS": "DSCLUSTER_PRECISION,NCCL_SOCKET_IFNAME", "DSCLUSTER_PRECISION": "fp32",
            "NCCL_SOCKET_IFNAME": "eth0", "NCCL_DEBUG": "INFO", "DSCLUSTER_RUN_ID": "stale"}
    home = {"NCCL_SOCKET_IFNAME": "ib0", "NCCL_DEBUG": "WARN", "HF_HOME": "/data/hf"}
    merged, notes = launch.deepspeed_env_layers(make_plan(), base, home)
    assert merged == {"DSCLUSTER_PRECISION": "fp32", "NCCL_SOCKET_IFNAME": "ib0", "NCCL_DEBUG": "INFO",
                      "HF_HOME": "/data/hf", "DSCLUSTER_RUN_ID": "launch-1",
                      "DSCLUSTER_STATE": "/srv/lab/.dscluster"}
    assert notes == ["kept NCCL_SOCKET_IFNAME=ib0 from ~/.deepspeed_env (check found eth0)",
                     "DSCLUSTER_RUN_ID=stale from .deepspeed_env is replaced by this run's DSCLUSTER_RUN_ID=launch-1"]


def test_home_file_follows_deepspeeds_rule(tmp_path):
    assert state.home_deepspeed_env_path({}, home=str(tmp_path)) == tmp_path / ".deepspeed_env"
    assert state.home_deepspeed_env_path({"DS_ENV_FILE": "lab.env"}, home="/h") == Path("/h/lab.env")
    assert state.home_deepspeed_env_path({"DS_ENV_FILE": "/etc/ds.env"}) is None  # one file, no home copy


def test_launch_deepspeed_keeps_home_deepspeed_env(lab_dir, monkeypatch, capsys, tmp_path):  # noqa: F811
    write_check(lab_dir)
    (lab_dir / ".deepspeed_env").write_text("DSCLUSTER_ENV_KEYS=DSCLUSTER_PRECISION\nDSCLUSTER_PRECISION=fp32\n")
    home = tmp_path / "home"
    home.mkdir()
    (home / ".deepspeed_env").write_text("HF_HOME=/data/hf\nDSCLUSTER_RUN_ID=old\n")
    monkeypatch.setenv("HOME", str(home))
    assert main(["launch", "--launcher", "deepspeed", "--dry-run", "--json", "--run-id", "r3"]) == 0
    out = capsys.readouterr()
    exports = deepspeed_reads(json.loads(out.out)["env_file_text"])
    assert exports["HF_HOME"] == "/data/hf" and exports["DSCLUSTER_RUN_ID"] == "r3"
    assert exports["DSCLUSTER_PRECISION"] == "fp32" and "DSCLUSTER_ENV_KEYS" not in exports
    assert "DSCLUSTER_RUN_ID=old from ~/.deepspeed_env is replaced by this run's DSCLUSTER_RUN_ID=r3" in out.err
