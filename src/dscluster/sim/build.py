"""Building a simulated lab's nodes (files, host keys, network, anchors, sshd) and taking them down.

Split from `sim` (the public API): this is the part that runs once per `sim up`, in stages
over all nodes at once (all host keys, then all links, then all anchors, then all sshds), so
a 5-node lab comes up in about as long as a 1-node one; and `teardown`, its reverse, for
`sim down` and for an `up` that finds a broken lab.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
import shutil
import stat
import subprocess
import time
from pathlib import Path

from dscluster.files.fsutil import atomic_write_text
from dscluster.sim.netfaults import apply_faults
from dscluster.sim.ns import (
    SimError,
    anchor_script,
    host_mounts_under,
    kill_and_wait,
    link_names,
    netns_exists,
    netns_pids,
    pid_in_netns,
    read_pid,
    sh,
    start_anchor,
    start_sshd,
    wait_anchor,
    wait_for,
    wait_sshd,
)
from dscluster.sim.options import LINK_NONE, tbf_argv
from dscluster.sim.plan import (
    DECOY_CIDR,
    HOST_KEY_TYPES,
    LabState,
    SimNode,
    free_id,
    node_path,
    node_session_env,
    render_group,
    render_hostfile,
    render_hosts,
    render_passwd,
    render_shadow,
    render_sshd_config,
    uplink_names,
)
from dscluster.sim.private import anchor_lines, make_private_dirs, ops_checkout, tracked_files
from dscluster.sim.reach import HOME_BIND, OVERLAY, REBIND


def save_state(state: LabState) -> None:
    # 0600: it holds the lab password.
    atomic_write_text(Path(state.labdir) / "state.json", state.to_json(), mode=0o600)


def build(state: LabState) -> None:
    labdir = Path(state.labdir)
    labdir.mkdir(parents=True, exist_ok=True)
    os.chmod(labdir, 0o755)
    save_state(state)  # before anything exists: a crash from here on can be cleaned by `down`
    shared = Path(state.shared)
    shared.mkdir(exist_ok=True)
    os.chown(shared, state.uid, state.gid)
    os.chmod(shared, 0o755)
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation directory

    pw_hash = sh(["openssl", "passwd", "-6", "-stdin"], input=state.password + "\n").stdout.strip()
    keygens = [write_node_files(state, node, pw_hash) for node in state.nodes]
    if state.private:   # no shared filesystem: each node its own copy of the checkout
        files = tracked_files(ops_checkout(state.private))
        for node in state.nodes:
            first = state.nodes[0].nodedir
            make_private_dirs(state.private, node.nodedir, state.uid, state.gid, files,
                              git_from=None if node.nodedir == first else first)
    for proc in (p for group in keygens for p in group):
        if proc.wait(timeout=30) != 0:
            raise SimError(f"ssh-keygen failed: {proc.stderr.read().strip() if proc.stderr else ''}")

    build_network(state)
    for node in state.nodes:
        start_anchor(node.netns, Path(node.nodedir))
    for node in state.nodes:
        node.anchor_pid = wait_anchor(Path(node.nodedir))
    save_state(state)
    for node in state.nodes:
        start_sshd(node.anchor_pid, state.sshd, node.sshd_pidfile, Path(node.nodedir) / "sshd.log")
    for node in state.nodes:
        wait_sshd(node.sshd_pidfile, Path(node.nodedir) / "sshd.log")
    atomic_write_text(state.hostfile, render_hostfile(state), mode=0o644)
    save_state(state)


def write_node_files(state: LabState, node: SimNode, pw_hash: str) -> list[subprocess.Popen]:
    """Lay out the node's overlay layers and home; start its host-key generation (returned)."""
    node_dir = Path(node.nodedir)
    for sub, mode in (("etc-upper", 0o755), ("etc-work", 0o700), ("root-upper", 0o711),
                      ("root-work", 0o700), ("home", 0o755)):
        (node_dir / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(node_dir / sub, mode)
    _make_mount_dirs(state, node_dir)
    etc = node_dir / "etc-upper"
    days = int(time.time() // 86400)
    home_in_node = f"/home/{state.user}"
    host_passwd = Path("/etc/passwd").read_text()
    used_ids = {int(l.split(":")[2]) for l in host_passwd.splitlines() if l.count(":") >= 3} | {state.uid}
    files = {
        "passwd": (render_passwd(host_passwd, state.user, state.uid, state.gid, home_in_node,
                                 sshd_uid=free_id(used_ids, start=100)), 0o644),
        "group": (render_group(Path("/etc/group").read_text(), state.user, state.gid), 0o644),
        "shadow": (render_shadow(Path("/etc/shadow").read_text(), state.user, pw_hash, days), 0o640),
        "hosts": (render_hosts(state), 0o644),
        "hostname": (node.hostname + "\n", 0o644),
        # Each machine its own id, as installed machines have: with one kernel (one boot id) for every node,
        # it is what tells two nodes apart when a fault gives them one hostname (core/dist.py node_identity).
        "machine-id": (hashlib.sha256(str(node_dir).encode()).hexdigest()[:32] + "\n", 0o444),
        # No DNS server is reachable from the lab; without this every name not in /etc/hosts
        # (and getent's AAAA-first lookups) waits out resolver timeouts. Port 53 on the node's
        # own lo is closed, so lookups fail at once, as with a DNS server that answers NXDOMAIN.
        "resolv.conf": ("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n", 0o644),
    }
    if state.extra_path:
        # A login shell's /etc/profile resets PATH; put the carried tools back in front.
        files["profile.d/dscluster-sim-path.sh"] = (f"export PATH={node_path(state.extra_path)}\n", 0o644)
    for name, (text, mode) in files.items():
        atomic_write_text(etc / name, text, mode=mode)
    shadow_gid = os.stat("/etc/shadow").st_gid
    os.chown(etc / "shadow", 0, shadow_gid)

    ssh = etc / "ssh"
    ssh.mkdir(exist_ok=True)
    atomic_write_text(ssh / "sshd_config", render_sshd_config(node, node_session_env(state, node)), mode=0o644)
    ours = {f"ssh_host_{t}_key{suffix}" for t in HOST_KEY_TYPES for suffix in ("", ".pub")}
    for host_key in Path("/etc/ssh").glob("ssh_host_*"):
        if host_key.name not in ours and not (ssh / host_key.name).exists():
            # overlay whiteout: the node must not see the host's own keys
            os.mknod(ssh / host_key.name, stat.S_IFCHR | 0o000, os.makedev(0, 0))

    home = Path(node.home)
    if not home.exists():
        shutil.copytree("/etc/skel", home, symlinks=True)
    for p in [home, *home.rglob("*")]:
        os.lchown(p, state.uid, state.gid)
    os.chmod(home, 0o755)

    anchor = anchor_script(hostname=node.hostname, nodedir=node_dir, mounts=state.mounts,
                           private=anchor_lines(state.private, str(node_dir)))
    atomic_write_text(node_dir / "anchor.sh", anchor, mode=0o755)
    procs = []
    for t in HOST_KEY_TYPES:
        key = ssh / f"ssh_host_{t}_key"
        for p in (key, key.with_name(key.name + ".pub")):
            if p.exists():
                p.unlink()
        procs.append(subprocess.Popen(
            ["ssh-keygen", "-q", "-t", t, "-N", "", "-C", f"root@{node.name}", "-f", str(key)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        ))
    return procs


def _make_mount_dirs(state: LabState, node_dir: Path) -> None:
    """Host-side directories the anchor's reach mounts use (sim_reach): where a shared directory
    is set aside, an overlay's layers, and mount points in the node's own /home."""
    for i, (kind, path) in enumerate(state.mounts):
        if kind in (REBIND, HOME_BIND):
            (node_dir / "keep" / str(i)).mkdir(parents=True, exist_ok=True)
        if kind == OVERLAY:
            for sub, mode in (("upper", 0o711), ("work", 0o700)):
                (node_dir / "reach" / str(i) / sub).mkdir(parents=True, exist_ok=True)
                os.chmod(node_dir / "reach" / str(i) / sub, mode)
        if kind == HOME_BIND:
            point = node_dir / "home"
            for part in Path(path).relative_to("/home").parts:
                point = point / part
                if not point.exists():
                    point.mkdir(mode=0o711)   # traversable by the lab user, like /root in a node


def build_network(state: LabState) -> None:
    """The switch namespace with its bridge, the host's cable to it, and one cable per node
    (node end named like a real NIC, in the node's namespace; other end a bridge port)."""
    prefix = ipaddress.IPv4Network(state.subnet).prefixlen
    switch_ns = state.switch_netns
    up_host, up_switch = uplink_names(state.index)
    if not netns_exists(switch_ns):
        sh(["ip", "netns", "add", switch_ns])
    sh(["ip", "-n", switch_ns, "link", "add", "name", state.bridge, "type", "bridge", "forward_delay", "0"])
    sh(["ip", "-n", switch_ns, "link", "set", state.bridge, "up"])
    # The host's address sits on its end of a plain veth: nothing is bridged in its namespace.
    sh(["ip", "link", "add", up_host, "type", "veth", "peer", "name", up_switch, "netns", switch_ns])
    sh(["ip", "-n", switch_ns, "link", "set", up_switch, "master", state.bridge, "up"])
    sh(["ip", "addr", "replace", f"{state.host_ip}/{prefix}", "dev", up_host])
    sh(["ip", "link", "set", up_host, "up"])
    for node in state.nodes:
        ns = node.netns
        if not netns_exists(ns):
            sh(["ip", "netns", "add", ns])
        sh(["ip", "-n", switch_ns, "link", "add", node.switch_port, "type", "veth",
            "peer", "name", node.iface, "netns", ns])
        sh(["ip", "-n", switch_ns, "link", "set", node.switch_port, "master", state.bridge, "up"])
        sh(["ip", "-n", ns, "link", "set", "lo", "up"])
        sh(["ip", "-n", ns, "addr", "add", f"{node.ip}/{prefix}", "dev", node.iface])
        sh(["ip", "-n", ns, "link", "set", node.iface, "up"])
        sh(["ip", "-n", ns, "route", "add", "default", "via", state.host_ip])
        for decoy in node.decoys:
            sh(["ip", "-n", ns, "link", "add", decoy, "type", "bridge"])
            sh(["ip", "-n", ns, "addr", "add", DECOY_CIDR, "dev", decoy])
            sh(["ip", "-n", ns, "link", "set", decoy, "up"])
        if state.link != LINK_NONE:
            # tbf shapes what leaves an interface: the node's end limits what the node sends,
            # the bridge port what it receives.
            sh(tbf_argv(ns, node.iface, state.link))
            sh(tbf_argv(switch_ns, node.switch_port, state.link))
    apply_faults(state, sh)


def restart_sshd(state: LabState, node: SimNode) -> None:
    pid = read_pid(node.sshd_pidfile)
    if pid is not None and pid_in_netns(pid, node.netns):
        left = kill_and_wait([pid], timeout=10)
        if left:
            raise SimError(f"{node.name}: old sshd (pid {pid}) did not exit")
    log = Path(node.nodedir) / "sshd.log"
    start_sshd(node.anchor_pid, state.sshd, node.sshd_pidfile, log)
    wait_sshd(node.sshd_pidfile, log)


# ---- taking a lab down -----------------------------------------------------------------

def stray_netns(lab: str) -> list[str]:
    """Namespaces named for `lab` that are still there (a lab whose state file was lost)."""
    return [ns for ns in _netns_names() if re.fullmatch(rf"dscluster-{re.escape(lab)}-(node[0-9]+|sw)", ns)]


def _netns_names() -> list[str]:
    try:
        return sorted(os.listdir("/run/netns"))
    except FileNotFoundError:
        return []


def teardown_netns(names: list[str]) -> list[int]:
    """Kill every process in the namespaces (until none is left), then delete them."""
    left: list[int] = []
    for _ in range(5):
        pids = sorted({p for ns in names for p in netns_pids(ns)})
        if not pids:
            break
        left = kill_and_wait(pids)
    for ns in names:
        if netns_exists(ns):
            sh(["ip", "netns", "del", ns], check=False)
    return left


def teardown(state: LabState) -> None:
    """Remove everything `build` made; SimError naming what is left if anything stays."""
    names = [n.netns for n in state.nodes] + ([state.switch_netns] if state.switch_netns else [])
    left = teardown_netns(names)
    # Deleting the switch namespace deleted the host's cable to it; a state file from before the
    # switch namespace has the bridge and its ports in the host's namespace.
    ours = {n.switch_port for n in state.nodes} | {state.bridge} | ({state.uplink} if state.uplink else set())
    for name in ours & set(link_names()):
        sh(["ip", "link", "del", name], check=False)
    # The kernel frees a namespace's veth ends asynchronously; wait for them to be gone.
    wait_for(lambda: not ours & set(link_names()), 10, interval=0.05)
    problems = []
    if left:
        problems.append(f"processes still running: {left}")
    if [ns for ns in names if netns_exists(ns)]:
        problems.append("network namespaces still present")
    if ours & set(link_names()):
        problems.append(f"links still present: {sorted(ours & set(link_names()))}")
    mounts = host_mounts_under(state.labdir)
    if mounts:
        problems.append(f"mounts still present: {mounts}")
    if problems:
        raise SimError(f"lab {state.name!r} not fully removed: " + "; ".join(problems))
    shutil.rmtree(state.labdir, ignore_errors=True)
