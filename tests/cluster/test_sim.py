"""The simulated lab behaves like separate machines: own sshd, hostname, interface, accounts;
OpenMPI starts ranks across it; and `sim down` leaves nothing behind.

One 3-node lab for the module (with the test key mesh for mpirun); the teardown test builds
and removes a 5-node lab of its own.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import paramiko
import pytest

from _wait import scaled, wait_until
from dscluster.errors import UsageError
from dscluster.node.hosts import parse_hostfile
from dscluster.sim import lab as sim
from dscluster.sim.plan import SIM_ROOT

pytestmark = pytest.mark.cluster
LAB = "simtest"
HOST_FILES = ("/etc/passwd", "/etc/shadow", "/etc/group", "/etc/hosts")


def _digest(paths) -> dict[str, str]:
    return {p: hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in paths}


@pytest.fixture(scope="module")
def host_before():
    """The host's own account and name files before any lab of this module is built."""
    return _digest(HOST_FILES)


@pytest.fixture(scope="module")
def lab(host_before, keyed_lab_factory):
    return keyed_lab_factory(LAB, nodes=3)


def _password_client(node, lab) -> paramiko.SSHClient:
    client = paramiko.SSHClient()
    client.set_missing_host_key_policy(paramiko.AutoAddPolicy())  # a fresh lab: keys are new by design
    client.connect(node.ip, username=lab.user, password=lab.password, timeout=10,
                   allow_agent=False, look_for_keys=False)
    return client


def _remote(client: paramiko.SSHClient, cmd: str) -> str:
    _, out, err = client.exec_command(cmd, timeout=20)
    text = out.read().decode()
    assert out.channel.recv_exit_status() == 0, err.read().decode()
    return text


def test_mpirun_starts_one_rank_on_each_node(lab):
    res = lab.run(
        "node1",
        [".venv/bin/mpirun", "-np", "3", "--hostfile", str(lab.hostfile),
         # Without this the TCP transport also tries the decoy docker0 (172.17.0.1 on two
         # nodes) and the job aborts: the same trap `check` writes DSCLUSTER_BTL_TCP_IF_INCLUDE for.
         "--mca", "btl_tcp_if_include", lab.subnet,
         ".venv/bin/python", "setup/hello_mpi.py"],
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [l for l in res.stdout.splitlines() if l.startswith("rank ")]
    assert len(lines) == 3, res.stdout
    hosts = {l.rsplit(" on ", 1)[1] for l in lines}
    assert hosts == {"node1", "node2", "node3"}
    assert "all 3 ranks answered from 3 hosts" in res.stdout


def test_password_login_sees_the_nodes_own_interface_and_hostname(lab):
    for node in lab.nodes:
        client = _password_client(node, lab)
        try:
            addrs = _remote(client, f"{shutil.which('ip')} -o -4 addr show")
            assert _remote(client, "hostname").strip() == node.hostname
        finally:
            client.close()
        by_iface = {line.split()[1]: line.split()[3] for line in addrs.splitlines()}
        assert by_iface[node.iface] == f"{node.ip}/24"
        others = {n.iface for n in lab.nodes} - {node.iface}
        assert not others & set(by_iface), f"{node.name} sees another node's interface: {addrs}"
        if node.decoys:
            assert by_iface["docker0"] == "172.17.0.1/16"
    assert [n.iface for n in lab.nodes] == ["eth0", "enp3s0", "ens4f0"]
    assert any(n.decoys for n in lab.nodes)


def test_hostfile_lists_node_names_that_resolve_inside_every_node(lab):
    hf = parse_hostfile(lab.hostfile)
    assert hf.names == ["node1", "node2", "node3"] and hf.total_slots == 3
    for node in lab.nodes:
        res = lab.run(node.name, ["getent", "hosts", "node1", "node2", "node3"], check=True)
        assert [l.split()[0] for l in res.stdout.splitlines()] == [n.ip for n in lab.nodes]


def test_lab_user_can_run_the_venv_and_share_files(lab, host_before):
    uids = {lab.run(n.name, ["id", "-u"], check=True).stdout.strip() for n in lab.nodes}
    assert uids == {str(lab.uid)} and lab.uid != 0
    res = lab.run("node2", 'stat -c %a /root; d=$(mktemp -d); stat -c %a "$d"; rmdir "$d"; '
                           '.venv/bin/python -c "import mpi4py.MPI; print(\'ok\')"; echo "$HOME"; pwd',
                  check=True, timeout=120)
    assert res.stdout.split() == ["711", "700", "ok", "/home/lab", str(sim.repo_root())]
    note = lab.shared / "from-node1.txt"
    lab.run("node1", ["sh", "-c", f"echo written-on-$(hostname) > {note}"], check=True)
    assert lab.run("node3", ["cat", str(note)], check=True).stdout.strip() == "written-on-node1"
    # nothing of the lab leaks into the host's own files
    assert _digest(HOST_FILES) == host_before
    assert str(lab.uid) not in {line.split(":")[2] for line in Path("/etc/passwd").read_text().splitlines()}
    assert oct(os.stat("/root").st_mode & 0o777) == "0o700"


def test_up_again_is_safe_and_a_different_size_is_refused(lab):
    before = {n.name: n.anchor_pid for n in lab.nodes}
    again = sim.up(nodes=3, lab=LAB)
    assert {n.name: n.anchor_pid for n in again.nodes} == before
    assert sim.status(LAB)["healthy"]
    with pytest.raises(UsageError, match="already up with 3 nodes"):
        sim.up(nodes=4, lab=LAB)
    assert lab.run("node1", ["ssh", "-o", "BatchMode=yes", "node3", "hostname"], check=True).stdout.strip() == "node3"


def test_cli_exec_runs_in_the_node_and_returns_the_commands_exit_code(lab):
    cli = [sys.executable, "-m", "dscluster", "sim"]
    res = subprocess.run([*cli, "exec", "node2", "--lab", LAB, "--", "sh", "-c", "hostname; id -un; exit 3"],
                         capture_output=True, text=True, timeout=60)
    assert (res.returncode, res.stdout.split()) == (3, ["node2", "lab"])
    res = subprocess.run([*cli, "exec", "--lab", LAB, "--root", "node3", "--", "id", "-u"],
                         capture_output=True, text=True, timeout=60)
    assert (res.returncode, res.stdout.strip()) == (0, "0")
    res = subprocess.run([*cli, "status", "--lab", LAB, "--json"], capture_output=True, text=True, timeout=60)
    st = json.loads(res.stdout)
    assert res.returncode == 0 and st["healthy"] and "password" not in st
    assert [n["ssh_port_open"] for n in st["nodes"]] == [True, True, True]


def test_cli_exec_timeout_stops_the_commands_children_too(lab):
    cli = [sys.executable, "-m", "dscluster", "sim"]
    marker = "sleep 4242"
    t0 = time.time()
    res = subprocess.run([*cli, "exec", "node2", "--lab", LAB, "--timeout", "2", "--", "sh", "-c",
                          f"{marker} & {marker} & wait"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 124 and "killed after 2 s" in res.stderr
    assert time.time() - t0 < scaled(30)  # the 2 s timeout plus start-up, not the children's 4242 s
    # Lab.run's own timeout kills the same way, and its error ends with what the command printed before it hung
    # (printed as 'a-b' from '%s-%s' a b: words the command line itself does not contain)
    with pytest.raises(subprocess.TimeoutExpired) as hung:
        lab.run("node2", ["sh", "-c", f"printf '%s-%s\\n' daemons started; printf '%s-%s\\n' waiting node3 >&2; "
                          f"exec {marker}"], timeout=2)
    assert "daemons-started" in str(hung.value) and "waiting-node3" in str(hung.value), str(hung.value)
    left = lab.run("node2", ["pgrep", "-f", marker], user="root")
    assert left.stdout.strip() == "", f"children outlived the timeout: {left.stdout}"


def test_non_root_user_gets_exit_2_with_the_reason(lab):
    for args in (["sim", "up", "--lab", "nope"], ["sim", "status", "--lab", LAB], ["sim", "down", "--lab", LAB]):
        res = lab.run("node1", [".venv/bin/dscluster", *args], timeout=60)
        assert res.returncode == 2, (args, res.stdout, res.stderr)
        assert "needs root" in res.stderr
    assert sim.status(LAB)["healthy"]


def test_fault_helpers_change_what_a_client_sees(lab):
    def host_key(node):
        transport = paramiko.Transport((node.ip, 22))
        try:
            transport.start_client(timeout=10)
            return transport.get_remote_server_key().get_fingerprint()
        finally:
            transport.close()

    node = lab.node("node3")
    lab.set_hostname("node3", "node2")
    try:
        assert lab.run("node3", ["hostname"], check=True).stdout.strip() == "node2"
        assert sim.load(LAB).node("node3").hostname == "node2"
    finally:
        lab.set_hostname("node3", "node3")

    old = host_key(node)
    lab.rotate_host_key("node3")
    assert host_key(node) != old

    lab.disconnect("node3")
    try:
        with pytest.raises(OSError):
            socket.create_connection((node.ip, 22), timeout=2).close()
        res = lab.run("node1", ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=2", "node2", "true"])
        assert res.returncode == 0, "the other nodes stay reachable"
    finally:
        lab.reconnect("node3")
    socket.create_connection((node.ip, 22), timeout=5).close()


def test_a_fresh_clone_in_a_0700_folder_runs_on_the_nodes_without_touching_the_host(lab_factory, lab):
    """The lab works wherever the checkout is. A clone inside a `mkdtemp` folder (0700) is
    reached by the lab user through the nodes' own mounts: its entry_cn.sh runs there with the
    clone's code; the host's folder keeps its mode; `sim up` as the lab user exits 2. A second
    lab beside the first has a user of its own (both have a node2, and OpenMPI names its
    session directory in the shared /tmp by host name and uid)."""
    first_uid = lab.uid
    name = "simclone"
    cli = [sys.executable, "-m", "dscluster", "sim"]
    # A lab of this name left by an interrupted run points at a clone that is gone: start clean.
    subprocess.run([*cli, "down", "--lab", name], capture_output=True, text=True, timeout=120)
    tmp = Path(tempfile.mkdtemp())
    clone = tmp / "clone"
    try:
        subprocess.run(["sh", "-c", 'umask 022 && git clone -q "$0" "$1"', str(sim.repo_root()), str(clone)],
                       check=True, timeout=120)
        # The code under test is this working tree's, not the last commit's.
        shutil.copytree(sim.repo_root() / "src", clone / "src", dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy2(sim.repo_root() / "entry_cn.sh", clone / "entry_cn.sh")
        env = dict(os.environ, PYTHONPATH=str(clone / "src"))
        up = subprocess.run([*cli, "up", "--nodes", "2", "--lab", name, "--json"], cwd=clone, env=env,
                            capture_output=True, text=True, timeout=120)
        assert up.returncode == 0, up.stderr
        lab = sim.load(name)
        assert lab.uid != first_uid
        mounts = lab.state.mounts
        assert ["overlay", str(tmp)] in mounts and ["bind", str(clone)] in mounts
        # What a rank runs: the clone's entry_cn.sh (by hand, one process) with this Python's
        # environment (a fresh clone has no .venv of its own), running a program of the user's.
        probe = "import dscluster, os; print(dscluster.__file__, os.environ['DSCLUSTER_RUN_DIR'], os.getcwd())"
        res = subprocess.run([*cli, "exec", "node2", "--lab", name, "--", "env", f"PYTHONPATH={clone / 'src'}",
                              f"DSCLUSTER_VENV={sys.prefix}", f"DSCLUSTER_RUNS={lab.shared / 'runs'}",
                              "DSCLUSTER_RUN_ID=from-clone", str(clone / "entry_cn.sh"), "python", "-c", probe],
                             cwd=clone, env=env, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stdout + res.stderr
        assert res.stdout.split()[-3:] == [str(clone / "src" / "dscluster" / "__init__.py"),
                                           str(lab.shared / "runs" / "from-clone"), str(clone)], res.stdout
        # writes into the clone (root's: the lab user may not write there) reach the host's folder,
        # which every node shares, not one node's overlay layer
        subprocess.run([*cli, "exec", "--root", "node2", "--lab", name, "--", "sh", "-c", "hostname > from-node"],
                       cwd=clone, env=env, check=True, timeout=120)
        assert (clone / "from-node").read_text() == "node2\n"
        as_lab_user = subprocess.run([*cli, "exec", "node1", "--lab", name, "--", "env",
                                      f"PYTHONPATH={clone / 'src'}", sys.executable, "-m", "dscluster", "sim", "up",
                                      "--lab", "nope"], cwd=clone, env=env, capture_output=True, text=True, timeout=120)
        assert as_lab_user.returncode == 2 and "needs root" in as_lab_user.stderr, as_lab_user.stderr
        assert "Traceback" not in as_lab_user.stderr
        assert os.stat(tmp).st_mode & 0o777 == 0o700
    finally:
        down = subprocess.run([*cli, "down", "--lab", name], capture_output=True, text=True, timeout=120)
        shutil.rmtree(tmp, ignore_errors=True)
    assert down.returncode == 0, down.stderr


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def _leftovers(state: dict, pids: list[int]) -> list[str]:
    found = []
    netns = set(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else set()
    found += [f"netns {ns}" for ns in [n["netns"] for n in state["nodes"]] + [state["switch_netns"]] if ns in netns]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    # Link names carry the lab's number, which a lab another test starts may be given once this one is down.
    reused = any(json.loads(p.read_text()).get("subnet") == state["subnet"]
                 for p in SIM_ROOT.glob("*/state.json") if p.parent.name != state["lab"])
    for name in [] if reused else [state["bridge"], state["uplink"]] + [n["switch_port"] for n in state["nodes"]]:
        if f": {name}:" in links or f": {name}@" in links:
            found.append(f"link {name}")
    found += [f"mount {line.split()[4]}" for line in Path("/proc/self/mountinfo").read_text().splitlines()
              if f"/dscluster-sim/{state['lab']}" in line]
    found += [f"pid {p}" for p in pids if os.path.exists(f"/proc/{p}")]
    if os.path.exists(f"/run/dscluster-sim/{state['lab']}"):
        found.append("lab directory")
    return found


def test_down_leaves_no_namespace_link_mount_or_process(lab_factory):
    name = "simdown"
    cli = [sys.executable, "-m", "dscluster", "sim"]
    # Leftovers of an interrupted run would be counted as this lab's: start clean.
    subprocess.run([*cli, "down", "--lab", name], capture_output=True, text=True, timeout=120)
    start = time.monotonic()
    up = subprocess.run([*cli, "up", "--nodes", "5", "--lab", name, "--json"], capture_output=True, text=True,
                        timeout=120)
    up_s = time.monotonic() - start
    assert up.returncode == 0, up.stderr
    assert [n["hostname"] for n in json.loads(up.stdout)["nodes"]] == [f"node{i}" for i in range(1, 6)]
    print(f"sim up --nodes 5: {up_s:.1f} s")
    lab = sim.load(name)
    try:
        # Things a run leaves behind: a detached job and an open ssh session.
        lab.run("node4", "setsid -f sleep 300 >/dev/null 2>&1 < /dev/null", check=True)
        client = _password_client(lab.node("node2"), lab)
        client.exec_command("sleep 300")

        def sleeps_started() -> list[int]:
            # both sleeps must be running before the lab is taken down, or `down` is not tested on them
            pids = sorted({int(p) for n in lab.nodes for p in subprocess.run(
                ["ip", "netns", "pids", n.netns], capture_output=True, text=True).stdout.split()})
            sleeping = [p for p in pids if _cmdline(p) == ["sleep", "300"]]
            return pids if len(sleeping) == 2 else []

        pids = wait_until(sleeps_started, 30, "the detached sleep in node4 and the ssh session's sleep in node2")
        st = sim.status(name)
        assert len(pids) >= 5 * 2 + 2  # anchor + sshd per node, the sleeps
        assert st["uplink"] in subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    finally:
        down = subprocess.run([*cli, "down", "--lab", name], capture_output=True, text=True, timeout=120)
    assert down.returncode == 0, down.stderr
    assert _leftovers(st, pids) == []
    client.close()
    again = subprocess.run([*cli, "down", "--lab", name], capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "was not up" in again.stdout
    status = subprocess.run([*cli, "status", "--lab", name, "--json"], capture_output=True, text=True, timeout=60)
    assert status.returncode == 1 and json.loads(status.stdout)["up"] is False
