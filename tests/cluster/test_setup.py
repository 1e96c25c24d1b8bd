"""`dscluster setup` on a simulated lab: real sshd per node, real Paramiko, real ssh and mpirun.

Every command runs the way a user would: as the lab user inside node1, with the password in
DSCLUSTER_SSH_PASSWORD. The tests share one lab and run in file order (first contact first).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from _wait import scaled
from dscluster.bringup import files as bf

pytestmark = pytest.mark.cluster
LAB = "setuplab"


@pytest.fixture(scope="module")
def lab(lab_factory):
    return lab_factory(LAB)


def _state(lab) -> str:
    return str(lab.shared / "setup-state")


def setup(lab, *args, password=None, timeout=120):
    env = {"DSCLUSTER_SSH_PASSWORD": lab.password if password is None else password, "DSCLUSTER_STATE": _state(lab)}
    return lab.run("node1", [".venv/bin/dscluster", "setup", "--hostfile", str(lab.hostfile), *args],
                   env=env, timeout=timeout)


def _json(res) -> dict:
    return json.loads(res.stdout)


def _authorized(lab, node: str) -> list[str]:
    res = lab.run(node, "cat ~/.ssh/authorized_keys", check=True)
    return [ln for ln in res.stdout.splitlines() if ln.strip()]


def test_wrong_password_names_user_and_host_and_hides_password(lab):
    secret = "Wr0ng-Pa55-zz9"
    res = setup(lab, "--trust-new-hosts", password=secret)
    assert res.returncode == 1
    for n in lab.nodes:
        assert f"authentication failed for {lab.user}@{n.name}" in res.stdout
    assert secret not in res.stdout + res.stderr


def test_first_contact_refused_without_trust_then_pinned(lab):
    kh = lab.shared / "setup-state" / "known_hosts"
    kh.unlink(missing_ok=True)  # the previous test pinned keys with --trust-new-hosts
    res = setup(lab, "--json")
    assert res.returncode == 1
    doc = _json(res)
    assert {n["error_kind"] for n in doc["nodes"]} == {"host_key_unknown"}
    assert all("--trust-new-hosts" in n["error"] and "SHA256:" in n["error"] for n in doc["nodes"])
    assert not kh.exists()

    res = setup(lab, "--trust-new-hosts", "--fix-path")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "pinned new host key for node2" in res.stderr
    assert "Next: step 4 of setup/CHECKLIST.md" in res.stdout
    pinned = kh.read_text()
    assert all(n.name in pinned for n in lab.nodes)


def test_rerun_is_idempotent_restores_modes_and_mesh_is_complete(lab):
    lab.run("node2", "chmod 755 ~/.ssh && chmod 644 ~/.ssh/authorized_keys", check=True)
    res = setup(lab, "--fix-path", "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    doc = _json(res)
    names = [n.name for n in lab.nodes]
    assert doc["mesh"] == {a: {b: True for b in names} for a in names}
    assert len({n["python"] for n in doc["nodes"]}) == 1 and len({n["mpirun"] for n in doc["nodes"]}) == 1
    keys = [lab.run(n, "cat ~/.ssh/id_ed25519.pub", check=True).stdout.split()[1] for n in names]
    for n in names:
        lines = _authorized(lab, n)
        assert sorted(bf.parse_public_key(ln).blob for ln in lines) == sorted(keys)
        modes = lab.run(n, "stat -c '%a' ~/.ssh ~/.ssh/authorized_keys ~/.ssh/config ~/.ssh/id_ed25519", check=True)
        assert modes.stdout.split() == ["700", "600", "600", "600"]
        cfg = lab.run(n, "cat ~/.ssh/config", check=True).stdout
        assert cfg.count(bf.BEGIN) == 1
    # A third run changes nothing at all.
    doc = _json(setup(lab, "--fix-path", "--json"))
    assert all(n["changes"] == [] for n in doc["nodes"]), [(n.get("name"), n["changes"]) for n in doc["nodes"]]


def test_plain_mpirun_works_afterwards(lab):
    # No ssh options at all. The interface restriction is not about ssh: without it OpenMPI's
    # TCP transport tries the lab's decoy docker0 and hangs — choosing it is step 4 (`check`).
    net = ["--mca", "btl_tcp_if_include", lab.subnet, "--mca", "oob_tcp_if_include", lab.subnet]
    res = lab.run("node1", [".venv/bin/mpirun", *net, "-np", "3", "--hostfile", str(lab.hostfile),
                            ".venv/bin/python", "setup/hello_mpi.py"], timeout=90)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "all 3 ranks answered from 3 hosts" in res.stdout


def test_kill_mid_install_leaves_authorized_keys_valid(lab):
    # Fresh keys force real writes on every node, then the run is killed at several moments.
    for n in lab.nodes:
        lab.run(n.name, "rm -f ~/.ssh/id_ed25519 ~/.ssh/id_ed25519.pub", check=True)
    env = lab._env(None, {"DSCLUSTER_SSH_PASSWORD": lab.password, "DSCLUSTER_STATE": _state(lab)})
    argv = lab.command("node1", [".venv/bin/dscluster", "setup", "--hostfile", str(lab.hostfile)])
    # Moments to kill at, not waits for a condition: wherever they fall, the files must stay
    # valid. They stretch with the load so that they fall in the same phases of the run.
    for delay in (0.8, 1.6, 2.4):
        proc = subprocess.Popen(argv, env=env, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(scaled(delay))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for n in lab.nodes:
            res = lab.run(n.name, "cat ~/.ssh/authorized_keys 2>/dev/null || true")
            assert all(bf.parse_public_key(ln) for ln in res.stdout.splitlines() if ln.strip()), res.stdout
    res = setup(lab, "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    for n in lab.nodes:
        assert lab.run(n.name, "ls -a ~/.ssh | grep -c dscluster- || true").stdout.strip() == "0"


def test_unreachable_node_reported_within_timeout_others_configured(lab):
    lab.disconnect("node2")
    try:
        t0 = time.monotonic()
        res = setup(lab, "--timeout", "4", "--json")
        elapsed = time.monotonic() - t0
    finally:
        lab.reconnect("node2")
    doc = _json(res)
    assert res.returncode == 1
    by = {n["name"]: n for n in doc["nodes"]}
    assert by["node2"]["error_kind"] in ("unreachable", "timeout")
    assert by["node1"]["ok"] and by["node3"]["ok"]
    assert doc["mesh"]["node1"]["node3"] and doc["mesh"]["node3"]["node1"]
    assert elapsed < 4 + scaled(30)  # one connect timeout plus start-up, not a retry loop
    assert any(p.startswith("node2:") for p in doc["problems"])


def test_rotated_host_key_refused_with_both_fingerprints(lab):
    before = _authorized(lab, "node3")
    fingerprint = "ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub"
    old = lab.run("node3", fingerprint, user="root", check=True).stdout.split()[1]
    lab.rotate_host_key("node3")
    new = lab.run("node3", fingerprint, user="root", check=True).stdout.split()[1]
    for extra in ([], ["--trust-new-hosts"]):
        res = setup(lab, *extra)
        assert res.returncode == 1
        text = " ".join((res.stdout + res.stderr).split())
        assert "HOST KEY CHANGED" in text and old in text and new in text
        assert _authorized(lab, "node3") == before
    doc = _json(setup(lab, "--json"))
    by = {n["name"]: n for n in doc["nodes"]}
    assert by["node3"]["error_kind"] == "host_key_changed"
    assert by["node1"]["ok"] and by["node2"]["ok"] and doc["mesh"]["node1"]["node2"]
