"""`dscluster check` on a simulated lab: real sshd per node, real Paramiko, real mpirun.

Everything runs as a user would: as the lab user inside node1, after `dscluster setup`.
One lab for the module; each fault is undone in `finally` so the tests stay independent.
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.cluster
LAB = "checklab"


@pytest.fixture(scope="module")
def lab(lab_factory):
    lab = lab_factory(LAB)
    env = {"DSCLUSTER_SSH_PASSWORD": lab.password, "DSCLUSTER_STATE": str(lab.shared / "check-state")}
    res = lab.run("node1", [".venv/bin/dscluster", "setup", "--hostfile", str(lab.hostfile),
                            "--trust-new-hosts", "--fix-path"], env=env, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    return lab


def check(lab, *args, timeout=300):
    state = lab.shared / "check-state"
    env = {"DSCLUSTER_STATE": str(state), "DS_ENV_FILE": str(state / "deepspeed_env"),
           "DSCLUSTER_RUNS": str(lab.shared / "runs")}
    res = lab.run("node1", [".venv/bin/dscluster", "check", "--hostfile", str(lab.hostfile), "--json", *args],
                  env=env, timeout=timeout)
    assert res.returncode in (0, 1), res.stdout + res.stderr
    return res.returncode, json.loads(res.stdout)


def errors(doc, check=None):
    return [f for f in doc["findings"] if f["severity"] == "error" and (check is None or f["check"] == check)]


def test_clean_lab_per_node_interface_env_files_and_active_tests(lab):
    rc, doc = check(lab)
    assert rc == 0 and doc["ok"], errors(doc)
    # Interface names differ per node and a decoy docker0 exists; each node gets its own name.
    expected = {n.name: n.iface for n in lab.nodes}
    assert doc["network"]["iface"] == expected
    assert "docker0" not in doc["network"]["iface"].values()
    assert doc["network"]["subnet"] == lab.subnet
    for n in lab.nodes:
        env_file = doc["files"]["node_env"][n.name]
        assert env_file.endswith(f"/{n.hostname}.env")
        res = lab.run(n.name, ["bash", "-c",
                               f"source {env_file} && echo $NCCL_SOCKET_IFNAME $GLOO_SOCKET_IFNAME $MASTER_ADDR"],
                      check=True)
        assert res.stdout.split() == [n.iface, n.iface, lab.nodes[0].ip]
    # Active tests: mpirun over the hostfile and a gloo all-reduce across all three nodes.
    assert doc["active"]["mpi_hello"]["ok"]
    ar = doc["active"]["allreduce"]["result"]
    assert ar["backend"] == "gloo" and ar["world_size"] == 3 and len(ar["hosts"]) == 3
    assert all(r["busbw_GBps"] > 0 for r in ar["results"])
    # NCCL's socket tuning: nothing runs on gloo, and check says why
    assert "NCCL (GPU nodes) only" in doc["active"]["nccl_socket"]["skipped"]
    assert any(f["what"].startswith("NCCL socket tuning not run: the all-reduce ran on gloo") for f in doc["findings"])


def test_two_nodes_sharing_a_hostname_are_flagged_before_any_launch(lab):
    old = lab.node("node3").hostname
    lab.set_hostname("node3", lab.node("node2").hostname)
    try:
        rc, doc = check(lab)
    finally:
        lab.set_hostname("node3", old)
    assert rc == 1 and not doc["ok"]
    assert sorted(f["node"] for f in errors(doc, "hostname")) == ["node2", "node3"]
    # Nothing was launched: the mpirun that would hang was not even tried.
    assert doc["active"]["mpi_hello"] is None and "hang" in doc["active"]["skipped"]


def test_a_node_with_a_different_deepspeed_is_flagged(lab):
    # The probe reads versions from package metadata, the same lookup pip and importlib do.
    # A dist-info of another version earlier on that node's sys.path (PYTHONPATH set in the
    # top of the node's ~/.bashrc, above the non-interactive return, which ssh-started shells -- and
    # so mpirun's ranks -- read) is what a second, different DeepSpeed install on that machine looks
    # like to everything that asks "which DeepSpeed is this", without needing a second real install
    # in the test.
    setup = (
        "mkdir -p ~/shadow/deepspeed-0.14.0.dist-info && "
        "printf 'Metadata-Version: 2.1\\nName: deepspeed\\nVersion: 0.14.0\\n' "
        "> ~/shadow/deepspeed-0.14.0.dist-info/METADATA && "
        "cp ~/.bashrc ~/.bashrc.before-check-test && sed -i '1i export PYTHONPATH=$HOME/shadow' ~/.bashrc"
    )
    lab.run("node2", setup, check=True)
    try:
        rc, doc = check(lab, "--skip-active")
    finally:
        lab.run("node2", "mv ~/.bashrc.before-check-test ~/.bashrc && rm -rf ~/shadow", check=True)
    assert rc == 1
    [f] = errors(doc, "versions")
    assert f["node"] == "node2" and "DeepSpeed 0.14.0" in f["what"] and "pip install deepspeed==" in f["fix"]


def test_unreachable_node_is_reported_while_the_rest_are_checked(lab):
    lab.disconnect("node3")
    try:
        rc, doc = check(lab, "--skip-active", "--timeout", "6")
    finally:
        lab.reconnect("node3")
    assert rc == 1
    [f] = errors(doc, "reach")
    assert f["node"] == "node3"
    nodes = {n["name"]: n for n in doc["nodes"]}
    assert not nodes["node3"]["reachable"]
    assert nodes["node1"]["reachable"] and nodes["node2"]["reachable"]
    assert doc["network"]["iface"] == {"node1": lab.node("node1").iface, "node2": lab.node("node2").iface}
    assert nodes["node2"]["checks"]["mesh"] == "ok" and nodes["node2"]["checks"]["port"] == "ok"
