"""Network interfaces: which subnet connects every node, and each node's interface on it.

NCCL and gloo pick an interface by *name* (NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME), but lab
machines name the same network differently (eth0 on one, enp3s0 on the next), and every
machine with Docker has a docker0 that looks routable and is not. So, like Horovod's runner,
we intersect what the nodes have in common: here the IPv4 *subnets* (not names), skipping
loopback and virtual bridges; then each node gets its own interface name for the chosen
subnet, and OpenMPI gets the subnet as a CIDR (`btl_tcp_if_include` accepts CIDRs, which is
what makes it work when names differ).
"""

from __future__ import annotations

import ipaddress
import random
import re
import socket
from dataclasses import asdict, dataclass, field

# Interfaces that never carry traffic between machines (container/VM bridges, loopback).
EXCLUDED_PREFIXES = ("lo", "docker", "br-", "veth", "virbr")

_ADDR_RE = re.compile(
    r"^\d+:\s+(?P<iface>[^\s@:]+)(?:@\S+)?:?\s+(?P<family>inet6?)\s+(?P<addr>[0-9A-Fa-f.:]+/\d+)"
)
_LINK_RE = re.compile(
    r"^\d+:\s+(?P<iface>[^\s@:]+)(?:@[^\s:]+)?:\s+<(?P<flags>[^>]*)>(?P<rest>.*)$"
)


@dataclass(frozen=True)
class Address:
    iface: str
    cidr: str          # address with prefix, e.g. 10.77.1.2/24
    family: str        # "inet" or "inet6"

    @property
    def ip(self) -> str:
        return self.cidr.split("/")[0]

    @property
    def network(self) -> str:
        return str(ipaddress.ip_interface(self.cidr).network)


@dataclass
class Interface:
    """One network interface as `ip -o link` / `ip -o addr` show it."""

    name: str
    up: bool = False
    mtu: int | None = None
    mac: str | None = None
    addresses: list[Address] = field(default_factory=list)

    @property
    def excluded(self) -> bool:
        return is_excluded(self.name)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["addresses"] = [a.cidr for a in self.addresses]
        return d


def is_excluded(name: str) -> bool:
    return name == "lo" or any(name.startswith(p) for p in EXCLUDED_PREFIXES if p != "lo")


def parse_ip_addr(text: str) -> list[Address]:
    """Parse `ip -o addr` output (one line per address)."""
    out = []
    for line in text.splitlines():
        m = _ADDR_RE.match(line.strip())
        if m:
            out.append(Address(iface=m.group("iface"), cidr=m.group("addr"), family=m.group("family")))
    return out


def parse_ip_link(text: str) -> list[Interface]:
    """Parse `ip -o link` output: names, UP flag, MTU, MAC."""
    out = []
    for line in text.splitlines():
        m = _LINK_RE.match(line.strip())
        if not m:
            continue
        flags = m.group("flags").split(",")
        rest = m.group("rest")
        mtu = re.search(r"\bmtu (\d+)", rest)
        mac = re.search(r"link/\w+ ([0-9a-f:]{17})", rest)
        state = re.search(r"\bstate (\w+)", rest)
        up = "UP" in flags and (state is None or state.group(1) in ("UP", "UNKNOWN"))
        out.append(Interface(name=m.group("iface"), up=up, mtu=int(mtu.group(1)) if mtu else None,
                             mac=mac.group(1) if mac else None))
    return out


def merge_interfaces(links: list[Interface], addrs: list[Address]) -> list[Interface]:
    """Attach addresses to links; an address on an interface `ip link` did not list still counts."""
    by_name = {i.name: i for i in links}
    for a in addrs:
        iface = by_name.get(a.iface)
        if iface is None:
            iface = by_name[a.iface] = Interface(name=a.iface, up=True)
        iface.addresses.append(a)
    return list(by_name.values())


def candidate_networks(ifaces: list[Interface]) -> dict[str, str]:
    """IPv4 subnet -> interface name, for interfaces that can carry traffic between nodes."""
    out: dict[str, str] = {}
    for iface in ifaces:
        if iface.excluded or not iface.up:
            continue
        for a in iface.addresses:
            if a.family != "inet":
                continue
            ip = ipaddress.ip_interface(a.cidr)
            if ip.ip.is_loopback or ip.ip.is_link_local or ip.network.prefixlen == 32:
                continue
            out.setdefault(a.network, iface.name)
    return out


@dataclass
class NetworkPlan:
    """The subnet all nodes share, and each node's interface and address on it."""

    subnet: str | None
    common: list[str]                       # every subnet all nodes share, best first
    iface: dict[str, str]                   # node -> interface name on `subnet`
    address: dict[str, str]                 # node -> IPv4 address on `subnet`
    missing: dict[str, list[str]] = field(default_factory=dict)  # node -> its subnets, when none shared

    def to_dict(self) -> dict:
        return asdict(self)


def plan_network(
    node_ifaces: dict[str, list[Interface]], preferred_ips: dict[str, str] | None = None
) -> NetworkPlan:
    """Intersect the nodes' subnets; prefer the one the head reached the nodes through
    (`preferred_ips`: node -> the address SSH connected to), then the narrowest prefix."""
    nets = {node: candidate_networks(ifs) for node, ifs in node_ifaces.items()}
    if not nets:
        return NetworkPlan(None, [], {}, {})
    common = set.intersection(*(set(n) for n in nets.values()))
    preferred_ips = preferred_ips or {}

    def score(net: str) -> tuple:
        network = ipaddress.ip_network(net)
        hits = sum(1 for ip in preferred_ips.values() if _in(ip, network))
        return (-hits, -network.prefixlen, str(network))

    ordered = sorted(common, key=score)
    if not ordered and len(nets) == 1:
        # One machine (e.g. a localhost hostfile on a multi-GPU host): loopback is the network.
        node = next(iter(nets))
        return NetworkPlan("127.0.0.0/8", ["127.0.0.0/8"], {node: "lo"}, {node: "127.0.0.1"})
    if not ordered:
        return NetworkPlan(None, [], {}, {}, missing={n: sorted(v) for n, v in nets.items()})
    subnet = ordered[0]
    iface = {node: nets[node][subnet] for node in nets}
    address: dict[str, str] = {}
    for node, ifs in node_ifaces.items():
        for i in ifs:
            for a in i.addresses:
                if a.family == "inet" and a.network == subnet and i.name == iface[node]:
                    address.setdefault(node, a.ip)
    return NetworkPlan(subnet, ordered, iface, address)


def _in(ip: str, network: ipaddress._BaseNetwork) -> bool:
    try:
        return ipaddress.ip_address(ip) in network
    except ValueError:
        return False


def iface_for_address(ifaces: list[Interface], target_ip: str) -> str | None:
    """The local interface whose subnet contains `target_ip` (e.g. MASTER_ADDR)."""
    for iface, net in ((n, net) for net, n in candidate_networks(ifaces).items()):
        if _in(target_ip, ipaddress.ip_network(net)):
            return iface
    return None


# Below Linux's ephemeral range (ip_local_port_range, 32768-60999 by default): a port the kernel hands
# out is the one any outgoing connection may take next, and a job's rank 0 binds its rendezvous seconds
# after the port was picked. Two test workers' ssh and gloo connections took it (EADDRINUSE).
_RENDEZVOUS_PORTS = range(20000, 32000)


def free_port() -> int:
    """A TCP port free right now on 127.0.0.1 (a one-host job's own rendezvous), drawn at random from
    below the ephemeral range so that no outgoing connection is handed it before the job binds it."""
    for port in random.sample(_RENDEZVOUS_PORTS, 64):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
