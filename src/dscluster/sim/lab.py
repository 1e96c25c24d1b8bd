"""The simulated lab: N "machines" on one Linux host, for tests and the demo (root only).

Each node is a network namespace cabled to a private switch, with its own hostname, sshd and host
key, and its own /etc and /home laid over the host's in a private mount namespace, so nothing on
the host is edited (docs/simulated-lab.md). The repository, its .venv and `Lab.shared` are at the
same path on every node, like NFS; nodes can own GPUs (`gpus=[1, 1, 2]`) and shaped cables.
`up(nodes=3, lab="dslab")` is idempotent, `lab.run("node1", [...])` runs inside a node, `down()`
returns once nothing is left. State lives in /run/dscluster-sim/<lab>/state.json so `down` and
`status` work from any process; the plan is `sim.plan`'s, the namespace plumbing `sim.ns`'s.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import secrets
import shutil
import signal
import socket
import string
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from dscluster.errors import UsageError
from dscluster.files.fsutil import atomic_write_text
from dscluster.node.hosts import is_valid_host
from dscluster.sim.build import build, restart_sshd, save_state, stray_netns, teardown, teardown_netns
from dscluster.sim.host import (
    check_gpus,
    check_link,
    extra_path_dirs,
    plan_shared_reach,
    repo_root,
    require_root,
    require_tools,
    shared_targets,
)
from dscluster.sim.netfaults import NetFaults
from dscluster.sim.ns import SimError, nsenter_argv, pid_in_netns, read_pid, sh
from dscluster.sim.options import LINK_NONE, parse_link, resolve_size, validate_env, validate_lab_name
from dscluster.sim.plan import (
    HOST_KEY_TYPES,
    ROOT_PATH,
    SIM_ROOT,
    USER_PATH,
    LabState,
    SimNode,
    free_id,
    node_path,
    node_session_env,
    pick_lab_index,
    plan_lab,
    render_hostfile,
    same_lab_or_refuse,
)
from dscluster.sim.private import host_path, plan_private

__all__ = ["Lab", "SimNode", "SimError", "up", "down", "load", "status", "require_root", "repo_root"]


class RunTimeout(subprocess.TimeoutExpired):
    """`Lab.run` past its timeout. Unlike TimeoutExpired, its message ends with the last of what the
    command printed before it was killed, so that a hang names the stage it hung in."""

    def __str__(self) -> str:
        def tail(printed: str | bytes | None) -> str:
            text = printed.decode(errors="replace") if isinstance(printed, bytes) else (printed or "")
            return text[-3000:] or "(nothing)"

        return (f"{super().__str__()}\n--- its stdout, last lines\n{tail(self.stdout)}"
                f"\n--- its stderr, last lines\n{tail(self.stderr)}")


class Lab:
    """A running simulated lab (see module docstring); a thin handle on its LabState."""

    def __init__(self, state: LabState):
        self.state = state

    name = property(lambda self: self.state.name)
    nodes = property(lambda self: self.state.nodes)
    user = property(lambda self: self.state.user)
    password = property(lambda self: self.state.password)
    subnet = property(lambda self: self.state.subnet)
    host_ip = property(lambda self: self.state.host_ip)
    hostfile = property(lambda self: Path(self.state.hostfile))
    shared = property(lambda self: Path(self.state.shared))
    uid = property(lambda self: self.state.uid)
    gid = property(lambda self: self.state.gid)

    def __repr__(self) -> str:
        return f"Lab({self.name!r}, {len(self.nodes)} nodes, {self.subnet})"

    def path_on(self, node_name: str, path: str | os.PathLike) -> Path:
        """Where the file `node_name` sees at `path` lies on the host (its own copy, without NFS)."""
        return host_path(self.state.private, self.node(node_name).nodedir, path)

    def node(self, name: str) -> SimNode:
        for n in self.nodes:
            if n.name == name:
                return n
        raise UsageError(f"lab {self.name!r} has no node {name!r} (nodes: {', '.join(n.name for n in self.nodes)})")

    def env(self, user: str | None = None, extra: dict | None = None, *, node: str | None = None) -> dict[str, str]:
        """The environment of a command run in a node: what a login through its sshd gets (PATH
        with any carried tools, --env, and with `node` that node's CUDA_VISIBLE_DEVICES), then
        `extra`."""
        session = node_session_env(self.state, self.node(node) if node else None)
        if user == "root":
            base = {"HOME": "/root", "USER": "root", "LOGNAME": "root",
                    "PATH": node_path(self.state.extra_path, ROOT_PATH)}
            session.pop("PATH", None)
        else:
            base = {"HOME": f"/home/{self.user}", "USER": self.user, "LOGNAME": self.user, "PATH": USER_PATH}
        base.update({"SHELL": "/bin/bash", "LANG": "C.UTF-8"}, **session)
        base.update({k: str(v) for k, v in (extra or {}).items()})
        return base

    _env = env   # older callers: lab._env(user, extra)

    def command(self, node_name: str, cmd: list[str] | str, *, user: str | None = None) -> list[str]:
        """argv that runs `cmd` inside the node as `user` (lab user by default); built apart
        from running it so callers can hand it to Popen themselves."""
        node = self.node(node_name)
        # A dead anchor's pid may belong to another process by now: never nsenter blindly.
        if node.anchor_pid is None or not pid_in_netns(node.anchor_pid, node.netns):
            raise SimError(f"{node.name} of lab {self.name!r} is not running; "
                           f"`dscluster sim up --lab {self.name}` rebuilds it")
        argv = nsenter_argv(node.anchor_pid)
        if user != "root":
            if user not in (None, self.user):
                raise UsageError(f"user {user!r}: a lab node has only root and {self.user!r}")
            argv += ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--init-groups", "--"]
        # cwd = the checkout, entered inside the node (not nsenter's --wd, which opens the directory
        # in the host's mounts: under a folder only the node's overlay makes reachable, getcwd()
        # then fails with EACCES and Python cannot import from '').
        argv += ["env", "-C", str(repo_root())]
        return argv + (["/bin/bash", "-c", cmd] if isinstance(cmd, str) else list(cmd))

    def run(
        self,
        node_name: str,
        cmd: list[str] | str,
        *,
        user: str | None = None,
        env: dict | None = None,
        timeout: float = 60,
        input: str | None = None,
        check: bool = False,
    ) -> subprocess.CompletedProcess[str]:
        """Run a command inside a node (network, hostname and mounts of that node), as the lab
        user with HOME set and cwd = repo root. On timeout the whole process group is killed."""
        argv = self.command(node_name, cmd, user=user)
        proc = subprocess.Popen(
            argv, env=self.env(user, env, node=node_name), text=True, start_new_session=True,
            stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        try:
            out, err = proc.communicate(input=input, timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            out, err = proc.communicate()
            raise RunTimeout(argv, timeout, output=out, stderr=err) from None
        res = subprocess.CompletedProcess(argv, proc.returncode, out, err)
        if check:
            res.check_returncode()
        return res

    # ---- fault helpers: what goes wrong in real labs --------------------------------------

    def set_hostname(self, node_name: str, new: str) -> None:
        """Rename a machine (e.g. two nodes cloned from one image share a hostname)."""
        node = self.node(node_name)
        if not is_valid_host(new) or len(new) > 64:
            raise UsageError(f"invalid hostname {new!r}: letters, digits, '-' and '.', at most 64 characters")
        self.run(node.name, f"echo '{new}' > /proc/sys/kernel/hostname && echo '{new}' > /etc/hostname",
                 user="root", check=True)
        node.hostname = new
        save_state(self.state)

    def rotate_host_key(self, node_name: str) -> None:
        """New host keys and a restarted sshd (a reinstalled machine): pinned keys must now fail."""
        node = self.node(node_name)
        keygen = " && ".join(
            f"ssh-keygen -q -t {t} -N '' -C root@{node.name} -f /etc/ssh/ssh_host_{t}_key"
            for t in HOST_KEY_TYPES
        )
        self.run(node.name, f"rm -f /etc/ssh/ssh_host_*_key /etc/ssh/ssh_host_*_key.pub && {keygen}",
                 user="root", check=True)
        restart_sshd(self.state, node)

    def disconnect(self, node_name: str) -> None:
        """Pull the node's cable: its link goes down, connections to it time out."""
        node = self.node(node_name)
        _set_port(self.state, node, "down")
        node.connected = False
        save_state(self.state)

    def reconnect(self, node_name: str) -> None:
        node = self.node(node_name)
        _set_port(self.state, node, "up")
        node.connected = True
        save_state(self.state)


def _set_port(state: LabState, node: SimNode, updown: str) -> None:
    # A state file from before the switch namespace has its ports in the host's namespace.
    where = ["-n", state.switch_netns] if state.switch_netns else []
    sh(["ip", *where, "link", "set", node.switch_port, updown])


# ---- state file ---------------------------------------------------------------------------

def _state_path(lab: str, root: Path = SIM_ROOT) -> Path:
    return root / lab / "state.json"


def _read_state(lab: str) -> LabState | None:
    path = _state_path(lab)
    try:
        return LabState.from_json(path.read_text())
    except FileNotFoundError:
        return None


@contextmanager
def _lock() -> Iterator[None]:
    """One `up`/`down` at a time on this host: lab numbers are allocated under it."""
    SIM_ROOT.mkdir(parents=True, exist_ok=True)
    os.chmod(SIM_ROOT, 0o755)
    with open(SIM_ROOT / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def load(lab: str = "dslab") -> Lab | None:
    validate_lab_name(lab)
    state = _read_state(lab)
    return Lab(state) if state else None


# ---- up -----------------------------------------------------------------------------------

def _node_healthy(node: SimNode) -> bool:
    return node.anchor_pid is not None and pid_in_netns(node.anchor_pid, node.netns)


def _sshd_running(node: SimNode) -> bool:
    pid = read_pid(node.sshd_pidfile)
    return pid is not None and pid_in_netns(pid, node.netns)


def up(
    nodes: int | None = None,
    slots: int | None = None,
    lab: str = "dslab",
    hostfile: str | os.PathLike | None = None,
    *,
    gpus: list[int] | None = None,
    link: str = LINK_NONE,
    env: dict[str, str] | None = None,
    shared_fs: bool = True,
    faults: NetFaults | None = None,
) -> Lab:
    """Build the lab, or return it if it is already up with the same nodes, GPUs and link.
    `gpus=[1, 1, 2]`: three nodes owning GPUs 0, 1 and 2-3 (sets the node count; one hostfile
    slot per GPU). `link="1gbit"`: every node's cable shaped to that rate, both ways.
    `shared_fs=False`: each node its own checkout copy and shared folder (sim.private). `faults`:
    per-node MTU, link rate, firewall and second NIC (sim.netfaults)."""
    validate_lab_name(lab)
    nodes, slots = resolve_size(nodes, slots, gpus)
    link, env = parse_link(link), validate_env(env or {})
    faults = (faults or NetFaults()).check_nodes(nodes)
    require_root()
    tools = require_tools(link, faults)
    if gpus:
        check_gpus(gpus)
    check_link(link, faults)
    with _lock():
        state = _read_state(lab)
        if state is not None:
            if all(_node_healthy(n) for n in state.nodes):
                same_lab_or_refuse(state, nodes, gpus, link, env, shared_fs, faults)
                _refresh(state, slots, hostfile)
                return Lab(state)
            teardown(state)  # half-built or broken (e.g. after a reboot): start again
        else:
            teardown_netns(stray_netns(lab))  # namespaces of a lab whose state was lost
        state = _plan(lab, nodes, slots, hostfile, gpus=gpus, link=link, env=env, tools=tools, shared_fs=shared_fs,
                      faults=faults)
        try:
            build(state)
        except BaseException:
            teardown(state)
            raise
        return Lab(state)


def _refresh(state: LabState, slots: int, hostfile: str | os.PathLike | None) -> None:
    """`up` on a lab that is up: undo what fault helpers or crashes left (a pulled cable,
    a dead sshd) and rewrite the hostfile; the nodes, keys and homes stay as they are."""
    for node in state.nodes:
        if not node.connected:
            _set_port(state, node, "up")
            node.connected = True
        if not _sshd_running(node):
            restart_sshd(state, node)
    state.slots = slots
    if hostfile is not None:
        state.hostfile = str(Path(hostfile).absolute())
    atomic_write_text(state.hostfile, render_hostfile(state), mode=0o644)
    save_state(state)


def _plan(lab: str, nodes: int, slots: int, hostfile, *, gpus, link: str, env, tools: dict[str, str],
          shared_fs: bool, faults: NetFaults) -> LabState:
    used, lab_uids = set(), set()
    for p in SIM_ROOT.glob("*/state.json"):
        try:
            other = LabState.from_json(p.read_text())
        except (OSError, ValueError, KeyError, TypeError):
            continue
        used.add(other.index)
        lab_uids.add(other.uid)
    taken = [ipaddress.IPv4Interface(a).network for a in _host_ipv4_cidrs()]
    index = pick_lab_index(used, taken)
    ids = {int(l.split(":")[2]) for l in _read_lines("/etc/passwd") if l.count(":") >= 3}
    ids |= {int(l.split(":")[2]) for l in _read_lines("/etc/group") if l.count(":") >= 3}
    # Each lab's user is its own: every lab names its nodes node1, node2, ... and their /tmp is the
    # host's, where an MPI program's processes keep their session directory, /tmp/ompi.<host>.<uid>,
    # removed when it empties. Two labs with one uid would share, and remove, each other's.
    uid = free_id(ids | lab_uids)
    alphabet = string.ascii_letters + string.digits
    password = "".join(secrets.choice(alphabet) for _ in range(14))
    state = plan_lab(
        lab, index=index, nodes=nodes, slots=slots, uid=uid, gid=uid, password=password,
        created=time.time(), hostfile=str(Path(hostfile).absolute()) if hostfile else None,
        gpus=gpus, link=link, sshd=tools["sshd"], extra_path=extra_path_dirs(tools), env=env, faults=faults,
    )
    # Refused here, before anything is made, if the lab user cannot reach what the nodes share.
    state.mounts = plan_shared_reach(state.shared, state.hostfile, state.extra_path, uid, uid)
    if not shared_fs:
        software = shared_targets(state.shared, None, state.extra_path)
        state.private = plan_private(str(repo_root()), state.shared, software)
    return state


def _read_lines(path: str) -> list[str]:
    return Path(path).read_text().splitlines()


def _host_ipv4_cidrs() -> list[str]:
    res = sh(["ip", "-o", "-4", "addr", "show"], check=False)
    return [line.split()[3] for line in res.stdout.splitlines() if len(line.split()) > 3]


# ---- down ---------------------------------------------------------------------------------

def down(lab: str = "dslab") -> bool:
    """Remove the lab: processes, namespaces, links, files. False if there was no such lab."""
    validate_lab_name(lab)
    require_root()
    with _lock():
        state = _read_state(lab)
        if state is None:
            stray = stray_netns(lab)
            if not stray and not (SIM_ROOT / lab).exists():
                return False
            teardown_netns(stray)
            shutil.rmtree(SIM_ROOT / lab, ignore_errors=True)
            return True
        teardown(state)
        return True


# ---- status -------------------------------------------------------------------------------

def status(lab: str = "dslab") -> dict | None:
    """Health of each node as a JSON-able dict (None if the lab does not exist)."""
    validate_lab_name(lab)
    state = _read_state(lab)
    if state is None:
        return None
    nodes = []
    for n in state.nodes:
        alive = _node_healthy(n)
        nodes.append({
            "name": n.name, "hostname": n.hostname, "ip": n.ip, "iface": n.iface, "netns": n.netns,
            "switch_port": n.switch_port, "gpus": n.gpus,
            "decoys": n.decoys, "connected": n.connected, "anchor_alive": alive,
            "sshd_running": alive and _sshd_running(n),
            "ssh_port_open": alive and n.connected and _port_open(n.ip, 22),
        })
    healthy = all(x["anchor_alive"] and x["sshd_running"] for x in nodes)
    return {
        "lab": state.name, "healthy": healthy, "subnet": state.subnet, "host_ip": state.host_ip,
        "bridge": state.bridge, "switch_netns": state.switch_netns, "uplink": state.uplink,
        "link": state.link, "env": state.env, "user": state.user, "uid": state.uid,
        "hostfile": state.hostfile, "shared": state.shared, "slots": state.slots,
        "created": state.created, "mounts": state.mounts, "shared_fs": state.shared_fs, "nodes": nodes,
    }


def _port_open(ip: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((ip, port), timeout=timeout):
            return True
    except OSError:
        return False
