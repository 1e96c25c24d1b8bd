"""The simulated lab's plan: names, addresses and files, decided before anything is built.

Pure (no root, no processes), so it is unit-tested and `sim up` writes the whole plan to the state
file before the first namespace: a crash half-way leaves what `sim down` needs to clean up.
Lab k (1..250) owns 10.77.k.0/24: the host is .254, node i is .(10+i). The cables meet on a bridge
`dsl<k>sw` in a switch namespace of its own, out of reach of the host's firewall (Docker's FORWARD
policy drops bridged traffic); the host joins through one veth pair (`dsl<k>h`/`dsl<k>up`), so
nothing is forwarded. Interface names carry the lab number: the kernel allows 15 characters.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from dscluster.errors import UsageError
from dscluster.node.cpus import threads_per_rank
from dscluster.sim.netfaults import NetFaults
from dscluster.sim.options import (  # noqa: F401  (validators re-exported: callers import them here)
    LINK_NONE,
    MAX_NODES,
    assign_gpus,
    parse_link,
    validate_lab_name,
    validate_node_count,
    validate_slots,
)

SIM_ROOT = Path("/run/dscluster-sim")
SUBNET_BASE = "10.77"
MAX_LAB_INDEX = 250
HOST_OCTET = 254
NODE_OCTET_OFFSET = 10
# Real labs name the same NIC differently on each machine (old udev, PCIe slot, onboard).
IFACE_CYCLE = ("eth0", "enp3s0", "ens4f0")
# What an idle Docker install leaves behind: a bridge with the same address on every machine.
DECOY_IFACE = "docker0"
DECOY_CIDR = "172.17.0.1/16"
LAB_USER = "lab"
LAB_SHELL = "/bin/bash"
# sshd's privilege-separation user: a host without openssh-server (a GPU host given a carried
# sshd) has none, and sshd refuses to start without it.
SSHD_USER = "sshd"
# What Debian's sshd gives a session; a node's PATH puts the directories of carried tools first.
USER_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/games"
ROOT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
STATE_VERSION = 2


def iface_name(index: int) -> str:
    """Interface name of node `index` (1-based): eth0, enp3s0, ens4f0, eth0, ..."""
    return IFACE_CYCLE[(index - 1) % len(IFACE_CYCLE)]


def has_decoy(index: int) -> bool:
    """Every node but the head carries the decoy docker0 (so does a lab where Docker was installed
    on the workers): the same 172.17.0.1 on several machines, never a route between them."""
    return index != 1


def subnet_for(lab_index: int) -> ipaddress.IPv4Network:
    if not 1 <= lab_index <= MAX_LAB_INDEX:
        raise ValueError(f"lab index {lab_index} outside 1..{MAX_LAB_INDEX}")
    return ipaddress.IPv4Network(f"{SUBNET_BASE}.{lab_index}.0/24")


def host_ip(lab_index: int) -> str:
    return str(subnet_for(lab_index).network_address + HOST_OCTET)


def node_ip(lab_index: int, node_index: int) -> str:
    if not 1 <= node_index <= MAX_NODES:
        raise ValueError(f"node index {node_index} outside 1..{MAX_NODES}")
    return str(subnet_for(lab_index).network_address + NODE_OCTET_OFFSET + node_index)


def bridge_name(lab_index: int) -> str:
    # Not `br`: `ip` reads that word as a keyword, not as a device name.
    return f"dsl{lab_index}sw"


def veth_name(lab_index: int, node_index: int) -> str:
    return f"dsl{lab_index}n{node_index}"


def uplink_names(lab_index: int) -> tuple[str, str]:
    """(host end, switch end) of the host's cable to the lab switch."""
    return f"dsl{lab_index}h", f"dsl{lab_index}up"


def netns_name(lab: str, node: str) -> str:
    return f"dscluster-{lab}-{node}"


def switch_netns_name(lab: str) -> str:
    return f"dscluster-{lab}-sw"


def pick_lab_index(used: set[int], taken_subnets: list[ipaddress.IPv4Network] = ()) -> int:
    """Lowest lab number not used by another lab and whose /24 overlaps nothing on the host."""
    for k in range(1, MAX_LAB_INDEX + 1):
        if k in used:
            continue
        net = subnet_for(k)
        if any(net.overlaps(t) for t in taken_subnets):
            continue
        return k
    raise UsageError(f"no free lab subnet in {SUBNET_BASE}.1-{MAX_LAB_INDEX}.0/24; "
                     "run `dscluster sim down` on old labs")


@dataclass
class SimNode:
    """One simulated machine: a network namespace plus private mount and UTS namespaces."""

    name: str            # name in the hostfile and /etc/hosts (node1..nodeN)
    hostname: str        # what `hostname` prints inside the node (a fault helper can change it)
    ip: str
    iface: str           # the node's own name for its lab NIC
    netns: str
    switch_port: str     # the switch end of the node's cable, a port of the lab bridge
    nodedir: str         # host-side directory with this node's files
    home: str            # host-side path of the lab user's home on this node
    decoys: list[str] = field(default_factory=list)
    gpus: list[int] = field(default_factory=list)   # physical indices; [] = every GPU, unmanaged
    anchor_pid: int | None = None   # process that keeps the namespaces alive; nsenter target
    connected: bool = True

    @property
    def etc_upper(self) -> Path:
        """Overlay upper layer of the node's /etc: its own passwd, shadow, hosts, ssh keys."""
        return Path(self.nodedir) / "etc-upper"

    @property
    def sshd_pidfile(self) -> Path:
        return Path(self.nodedir) / "sshd.pid"

    @property
    def anchor_pidfile(self) -> Path:
        return Path(self.nodedir) / "anchor.pid"


@dataclass
class LabState:
    """Everything `sim down`/`status`/`load` need, from any process: the state file's content."""

    name: str
    index: int
    subnet: str
    host_ip: str
    bridge: str
    labdir: str
    shared: str
    hostfile: str
    slots: int
    user: str
    uid: int
    gid: int
    password: str
    created: float
    nodes: list[SimNode]
    switch_netns: str = ""       # "" in a state file from before the switch namespace
    uplink: str = ""             # the host's end of its cable to the switch
    link: str = LINK_NONE        # shaped rate of every node's cable, both directions
    sshd: str = "/usr/sbin/sshd"  # absolute path sshd was found at (it re-executes itself by it)
    extra_path: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)   # --env, set in every node
    mounts: list[list[str]] = field(default_factory=list)  # sim_reach ops: [kind, path]
    private: list[list[str]] = field(default_factory=list)  # sim.private ops; [] = a shared filesystem
    faults: dict = field(default_factory=dict)   # NetFaults.to_dict(): per-node MTU, link, firewall, NIC
    version: int = STATE_VERSION

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "LabState":
        known = {f.name for f in fields(cls)}
        node_known = {f.name for f in fields(SimNode)}
        kwargs = {k: v for k, v in data.items() if k in known}
        nodes = []
        for n in data["nodes"]:
            n = dict(n)
            if "veth_host" in n:   # version 1: the bridge port lived in the host's namespace
                n.setdefault("switch_port", n.pop("veth_host"))
            nodes.append(SimNode(**{k: v for k, v in n.items() if k in node_known}))
        kwargs["nodes"] = nodes
        return cls(**kwargs)

    @property
    def shared_fs(self) -> bool:
        """Every node sees the host's checkout and shared folder (like NFS); else each its own copy."""
        return not self.private

    @property
    def uses_gpus(self) -> bool:
        return any(n.gpus for n in self.nodes)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "LabState":
        return cls.from_dict(json.loads(text))


def plan_lab(
    name: str,
    *,
    index: int,
    nodes: int,
    slots: int,
    uid: int,
    gid: int,
    password: str,
    created: float,
    root: Path = SIM_ROOT,
    hostfile: str | None = None,
    gpus: list[int] | None = None,
    link: str = LINK_NONE,
    sshd: str = "/usr/sbin/sshd",
    extra_path: list[str] = (),
    env: dict[str, str] | None = None,
    faults: NetFaults | None = None,
) -> LabState:
    """The whole lab on paper: names, addresses and paths for `nodes` machines."""
    validate_lab_name(name)
    validate_node_count(nodes)
    validate_slots(slots)
    if gpus is not None and len(gpus) != nodes:
        raise ValueError(f"{len(gpus)} GPU counts for {nodes} nodes")
    per_node = assign_gpus(gpus) if gpus else [[] for _ in range(nodes)]
    labdir = root / name
    plan_nodes = []
    for i in range(1, nodes + 1):
        node = f"node{i}"
        nodedir = labdir / "nodes" / node
        plan_nodes.append(
            SimNode(
                name=node,
                hostname=node,
                ip=node_ip(index, i),
                iface=iface_name(i),
                netns=netns_name(name, node),
                switch_port=veth_name(index, i),
                nodedir=str(nodedir),
                home=str(nodedir / "home" / LAB_USER),
                decoys=[DECOY_IFACE] if has_decoy(i) else [],
                gpus=per_node[i - 1],
            )
        )
    return LabState(
        name=name,
        index=index,
        subnet=str(subnet_for(index)),
        host_ip=host_ip(index),
        bridge=bridge_name(index),
        labdir=str(labdir),
        shared=str(labdir / "shared"),
        hostfile=hostfile or str(labdir / "hosts.txt"),
        slots=slots,
        user=LAB_USER,
        uid=uid,
        gid=gid,
        password=password,
        created=created,
        nodes=plan_nodes,
        switch_netns=switch_netns_name(name),
        uplink=uplink_names(index)[0],
        link=parse_link(link),
        sshd=sshd,
        extra_path=list(extra_path),
        env=dict(env or {}),
        faults=(faults or NetFaults()).check_nodes(nodes).to_dict(),
    )


def same_lab_or_refuse(state: LabState, nodes: int, gpus, link: str, env, shared_fs: bool,
                       faults: NetFaults | None = None) -> None:
    """`up` again changes no node, GPU, link, environment, file layout or network fault of a running
    lab: say how to rebuild."""
    def described(node_count, gpus, link, env, shared_fs, faults) -> list[str]:
        return [f"{node_count} nodes", f"GPUs {','.join(map(str, gpus))}" if gpus else "no GPUs", f"link {link}",
                f"env {' '.join(f'{k}={v}' for k, v in env.items()) or 'none'}",
                "a shared filesystem" if shared_fs else "no shared filesystem", f"faults {faults.describe()}"]
    had = described(len(state.nodes), [len(n.gpus) for n in state.nodes] if state.uses_gpus else None,
                    state.link, state.env, state.shared_fs, NetFaults.from_dict(state.faults))
    asked = described(nodes, gpus, link, dict(env or {}), shared_fs, faults or NetFaults())
    diff = [i for i in range(len(had)) if had[i] != asked[i]]
    if diff:
        raise UsageError(
            f"lab {state.name!r} is already up with {', '.join(had[i] for i in diff)}; run "
            f"`dscluster sim down --lab {state.name}` first to rebuild it with {', '.join(asked[i] for i in diff)}"
        )


# ---- files each node sees in its own /etc ---------------------------------------------------

def render_hosts(state: LabState) -> str:
    lines = [
        "127.0.0.1\tlocalhost",
        "::1\tlocalhost ip6-localhost ip6-loopback",
        "ff02::1\tip6-allnodes",
        "ff02::2\tip6-allrouters",
        f"# simulated lab {state.name} ({state.subnet})",
    ]
    lines += [f"{n.ip}\t{n.name}" for n in state.nodes]
    return "\n".join(lines) + "\n"


def render_hostfile(state: LabState) -> str:
    """One slot per GPU in a GPU lab (one rank per GPU), else --slots per node."""
    return "".join(f"{n.name} slots={len(n.gpus) or state.slots}\n" for n in state.nodes)


def rank_threads(state: LabState, cores: int | None = None) -> int:
    """A rank's share of the host's cores: they over the lab's slots (render_hostfile's), at least 1."""
    return threads_per_rank(sum(len(n.gpus) or state.slots for n in state.nodes), cores)


def node_path(extra_dirs: list[str], base: str = USER_PATH) -> str:
    """PATH inside a node: directories of tools found outside the usual ones (a folder of
    carried ssh/ip/tc binaries on a host that lacks them) first, then the standard PATH."""
    std = base.split(":")
    extra = [d for d in dict.fromkeys(extra_dirs) if d not in std]
    return ":".join(extra + std)


def node_session_env(state: LabState, node: SimNode | None) -> dict[str, str]:
    """Variables every process in the node gets, whether it came through the node's sshd (so
    mpirun's remote daemons and their ranks have them) or through `Lab.run`/`sim exec`.
    Without a node: what every node has in common (no GPU variables).

    The nodes share the host's cores. Each rank gets its share of them as PyTorch's thread count
    (OMP_NUM_THREADS: the host's cores over the lab's slots, at least 1), as `cpus.share_cores` splits
    one machine's cores between its ranks, not each node all the host's cores. Idle OpenMP threads
    sleep instead of spinning (OMP_WAIT_POLICY=PASSIVE), so one node's idle threads do not take the
    cores another node's ranks wait for (docs/simulated-lab.md). Neither changes a result; --env can
    override both."""
    env = {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": str(rank_threads(state))}
    if state.extra_path:
        env["PATH"] = node_path(state.extra_path)
    if node is not None and node.gpus:
        # PCI order, so that index 2 is the GPU `nvidia-smi` calls 2 (CUDA's default order is
        # fastest first, which on a mixed host is not nvidia-smi's).
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, node.gpus))
    env.update(state.env)
    return env


def free_id(used: set[int], start: int = 2000) -> int:
    i = start
    while i in used:
        i += 1
    return i


def _replace_or_append(text: str, name: str, line: str) -> str:
    out = [l for l in text.splitlines() if l.split(":", 1)[0] != name]
    out.append(line)
    return "\n".join(out) + "\n"


def render_passwd(host_passwd: str, user: str, uid: int, gid: int, home: str, shell: str = LAB_SHELL,
                  sshd_uid: int | None = None) -> str:
    text = _replace_or_append(host_passwd, user, f"{user}:x:{uid}:{gid}:dscluster lab user:{home}:{shell}")
    if sshd_uid is not None and not any(l.split(":", 1)[0] == SSHD_USER for l in text.splitlines()):
        # 65534 is nogroup on Debian and Ubuntu; the user owns nothing, it only needs to exist.
        text = _replace_or_append(text, SSHD_USER, f"{SSHD_USER}:x:{sshd_uid}:65534::/run/sshd:/usr/sbin/nologin")
    return text


def render_group(host_group: str, user: str, gid: int) -> str:
    return _replace_or_append(host_group, user, f"{user}:x:{gid}:")


def render_shadow(host_shadow: str, user: str, password_hash: str, days_since_epoch: int) -> str:
    return _replace_or_append(host_shadow, user, f"{user}:{password_hash}:{days_since_epoch}:0:99999:7:::")


def render_sshd_config(node: SimNode, env: dict[str, str] | None = None) -> str:
    """sshd for one node. PAM is off: pam_loginuid cannot work in a namespace and sshd checks
    the password against the node's own /etc/shadow itself. `env` (node_session_env) goes into
    one SetEnv line (OpenSSH >= 7.8; sshd uses only the first SetEnv line it reads)."""
    setenv = [f"SetEnv {' '.join(f'{k}={v}' for k, v in env.items())}"] if env else []
    return "\n".join([
        f"# sshd of simulated node {node.name}",
        "Port 22",
        "HostKey /etc/ssh/ssh_host_ed25519_key",
        "HostKey /etc/ssh/ssh_host_ecdsa_key",
        "PasswordAuthentication yes",
        "KbdInteractiveAuthentication no",
        "PubkeyAuthentication yes",
        "UsePAM no",
        "PermitRootLogin no",
        f"PidFile {node.sshd_pidfile}",
        "PrintMotd no",
        "AcceptEnv LANG LC_*",
        # OpenMPI's tree launch and a parallel `check` open many sessions at once.
        "MaxStartups 200:30:400",
        "MaxSessions 100",
        # Built into sshd: a host with a carried sshd has no sftp-server binary, and
        # `dscluster setup` writes the nodes' files over sftp.
        "Subsystem sftp internal-sftp",
        *setenv,
        "",
    ])


HOST_KEY_TYPES = ("ed25519", "ecdsa")
