"""The one secret rule (dscluster.files.redact) and the places that write or print an environment through it."""

import json

import pytest

from dscluster.cli import envreport, main
from dscluster.files import redact
from dscluster.rundir.writer import RunLog, effective_env

KEY_BLOCK = "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n-----END OPENSSH PRIVATE KEY-----\n"
# One planted secret of each kind: a word in the name, a known name, a value that is a private key.
PLANTED = {
    "DSCLUSTER_SSH_PASSWD": "plant-passwd-1", "DS_CREDENTIALS": "plant-cred-2", "NCCL_IB_SECRET": "plant-secret-3",
    "DSCLUSTER_AUTH_HEADER": "plant-auth-4", "NCCL_PASS": "plant-pass-5", "DSCLUSTER_TOKEN": "plant-token-6",
    "DSCLUSTER_API_KEY": "plant-key-7", "DSCLUSTER_SSH_PASSWORD": "plant-password-8",
    "WANDB_API_KEY": "plant-wandb-9", "HF_TOKEN": "plant-hf-10", "AWS_SECRET_ACCESS_KEY": "plant-aws-11",
    "DSCLUSTER_NOTE": KEY_BLOCK,
}


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_each_kind_of_secret_is_one(name):
    assert redact.is_secret(name, PLANTED[name])


@pytest.mark.parametrize("name, value", [("NCCL_SOCKET_IFNAME", "eth0"), ("MASTER_ADDR", "10.0.0.1"),
                                         ("DSCLUSTER_PRECISION", "bf16"), ("CUDA_VISIBLE_DEVICES", "0,1")])
def test_ordinary_settings_are_not(name, value):
    assert not redact.is_secret(name, value)


def test_free_text_loses_secret_values_and_private_keys():
    text = f"error: login with plant-wandb-9 failed; key {KEY_BLOCK} rejected; eth0 up"
    out = redact.redact_text(text, PLANTED)
    assert "plant-wandb-9" not in out and "PRIVATE KEY" not in out and "b3BlbnNz" not in out
    assert "eth0 up" in out and out.count(redact.HIDDEN) == 2


def test_dscluster_env_hides_every_kind(monkeypatch, capsys):
    for k, v in PLANTED.items():
        monkeypatch.setenv(k, v)
    shown = envreport.relevant_env(dict(PLANTED, NCCL_DEBUG="INFO"))
    assert shown["NCCL_DEBUG"] == "INFO"
    assert all(shown[k] == redact.HIDDEN for k in shown if k != "NCCL_DEBUG")


def test_run_directory_records_hide_every_kind(tmp_path, monkeypatch):
    for k, v in PLANTED.items():
        monkeypatch.setenv(k, v)
    log = RunLog(tmp_path, 0, "node1")
    log.write_env()
    log.record("end", status="failed", error="wandb refused plant-wandb-9")
    log.write_summary({"status": "failed", "error": "HF said no to plant-hf-10"})
    log.close()
    written = "".join(p.read_text() for p in tmp_path.rglob("*") if p.is_file())
    for value in PLANTED.values():
        assert value.strip() not in written
    env = json.loads((tmp_path / "env" / "rank-0.json").read_text())
    assert env["NCCL_IB_SECRET"] == env["DSCLUSTER_SSH_PASSWD"] == redact.HIDDEN
    shown = effective_env({"NCCL_IB_SECRET": "x", "NCCL_DEBUG": "INFO"})
    assert shown == {"NCCL_IB_SECRET": "***", "NCCL_DEBUG": "INFO"}


def test_diagnose_hides_secrets_of_a_record_written_before_the_rule(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "env").mkdir(parents=True)
    (run / "metrics").mkdir()
    for rank in (0, 1):
        planted = {"host": f"n{rank}", "HF_TOKEN": f"plant-hf-{rank}0"}
        (run / "env" / f"rank-{rank}.json").write_text(json.dumps(planted))
    main(["diagnose", str(run), "--json"])
    out = capsys.readouterr().out
    assert "plant-hf" not in out


def test_a_secret_assignment_in_a_command_line_is_hidden_by_its_name():
    line = "mpirun -x WANDB_API_KEY=abc123 -x NCCL_DEBUG=INFO -x HF_TOKEN='x y' ./entry_cn.sh epochs=2"
    assert redact.redact_text(line, {}) == ("mpirun -x WANDB_API_KEY=*** -x NCCL_DEBUG=INFO -x HF_TOKEN=*** "
                                            "./entry_cn.sh epochs=2")


def test_launch_dry_run_json_does_not_show_a_secret_passed_with_env(tmp_path, monkeypatch, capsys):
    import hashlib

    hosts = "node1 slots=1\nnode2 slots=1\n"
    (tmp_path / "hosts.txt").write_text(hosts)
    (tmp_path / ".dscluster").mkdir()
    (tmp_path / ".dscluster" / "check.json").write_text(json.dumps(
        {"hostfile": "hosts.txt", "hostfile_sha256": hashlib.sha256(hosts.encode()).hexdigest(), "ok": True}))
    (tmp_path / ".dscluster" / "cluster.env").write_text("export MASTER_ADDR='10.77.1.1'\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DSCLUSTER_STATE", raising=False)
    for argv in (["--json"], []):
        assert main(["launch", "--dry-run", *argv, "--env", "WANDB_API_KEY=plant-wandb-9"]) == 0
        out = capsys.readouterr().out
        assert "plant-wandb-9" not in out and "WANDB_API_KEY=***" in out, out
