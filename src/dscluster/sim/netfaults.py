"""Per-node network faults of `sim up`: what breaks real Ethernet labs, built on purpose.

    --mtu node2=9000          jumbo frames on node2's NIC; the switch ports stay at 1500
    --link node2=100mbit      node2's cable shaped to that rate (tc tbf, both directions)
    --firewall node2[=P,...]  inbound TCP dropped except ssh and the ports (default 29500)
    --second-nic node2        a second NIC and a more specific route: traffic leaves by it

Parsing and the commands are pure (unit-tested); `apply_faults` runs them while the lab is built.
Every mistake is exit 2 before anything exists (docs/simulated-lab.md).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import asdict, dataclass, field
from typing import Callable

from dscluster.errors import UsageError
from dscluster.sim.options import LINK_NONE, parse_link, tbf_argv

MTU_MIN, MTU_MAX = 576, 9216
DEFAULT_OPEN_PORTS = (29500,)
SSH_PORT = 22
SECOND_NIC = "eno1"             # what an onboard 1 GbE port is called next to the fast card
SECOND_NIC_OCTET_OFFSET = 100   # its address: 10.77.k.(100+i), same subnet as the lab NIC
NFT_TABLE = "dscluster_fw"
_NODE_RE = re.compile(r"^node([1-9][0-9]*)$")


@dataclass(kw_only=True)
class NetFaults:
    """Faults per node name (node1..nodeN)."""

    mtu: dict[str, int] = field(default_factory=dict)
    link: dict[str, str] = field(default_factory=dict)
    firewall: dict[str, list[int]] = field(default_factory=dict)
    second_nic: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: dict | None) -> "NetFaults":
        doc = doc or {}
        return cls(mtu=dict(doc.get("mtu") or {}), link=dict(doc.get("link") or {}),
                   firewall={k: list(v) for k, v in (doc.get("firewall") or {}).items()},
                   second_nic=list(doc.get("second_nic") or []))

    def any(self) -> bool:
        return bool(self.mtu or self.link or self.firewall or self.second_nic)

    def describe(self) -> str:
        parts = [f"mtu {n}={v}" for n, v in sorted(self.mtu.items())]
        parts += [f"link {n}={v}" for n, v in sorted(self.link.items())]
        parts += [f"firewall {n}={','.join(map(str, v))}" for n, v in sorted(self.firewall.items())]
        parts += [f"second-nic {n}" for n in sorted(self.second_nic)]
        return " ".join(parts) or "none"

    def check_nodes(self, nodes: int) -> "NetFaults":
        """Every named node exists in a lab of `nodes` nodes."""
        named = [("--mtu", n) for n in self.mtu] + [("--link", n) for n in self.link]
        named += [("--firewall", n) for n in self.firewall] + [("--second-nic", n) for n in self.second_nic]
        for flag, name in named:
            m = _NODE_RE.match(name)
            if m is None or int(m.group(1)) > nodes:
                raise UsageError(f"{flag} {name}: the lab has nodes node1 to node{nodes}; name one of them")
        return self


# ---- parsing ---------------------------------------------------------------------------------

def _node_items(flag: str, items: list[str], parse: Callable[[str, str], object], *,
                value_optional: bool = False) -> dict[str, object]:
    out: dict[str, object] = {}
    for item in items:
        node, sep, value = item.partition("=")
        node = node.strip()
        if (not sep and not value_optional) or _NODE_RE.match(node) is None:
            raise UsageError(f"{flag} {item!r}: write NODE=VALUE, e.g. {flag} node2={_EXAMPLE[flag]}")
        if node in out:
            raise UsageError(f"{flag} {item!r}: {node} given twice; give each node once")
        out[node] = parse(item, value.strip() if sep else "")
    return out


_EXAMPLE = {"--mtu": "9000", "--link": "100mbit", "--firewall": "29500"}


def _mtu(item: str, value: str) -> int:
    if not value.isdigit() or not MTU_MIN <= int(value) <= MTU_MAX:
        raise UsageError(f"--mtu {item!r}: the MTU must be a whole number from {MTU_MIN} to {MTU_MAX}, e.g. 9000")
    return int(value)


def parse_mtu(items: list[str]) -> dict[str, int]:
    """`--mtu node2=9000` (repeatable)."""
    return _node_items("--mtu", items, _mtu)  # type: ignore[return-value]


def parse_links(items: list[str]) -> tuple[str, dict[str, str]]:
    """`--link RATE` (every node) and `--link NODE=RATE` (that node), repeatable: (all, per node)."""
    every = [i for i in items if "=" not in i]
    if len(every) > 1:
        raise UsageError(f"--link {' '.join(every)}: give one rate for every node, and NODE=RATE for single nodes")
    all_nodes = parse_link(every[0]) if every else LINK_NONE

    def rate(item: str, value: str) -> str:
        try:
            return parse_link(value)
        except UsageError:
            raise UsageError(f"--link {item!r}: give a rate such as 100mbit or 1gbit after '=', "
                             "e.g. --link node2=100mbit") from None
    return all_nodes, _node_items("--link", [i for i in items if "=" in i], rate)  # type: ignore[return-value]


def _ports(item: str, value: str) -> list[int]:
    if not value:
        return list(DEFAULT_OPEN_PORTS)
    ports = []
    for part in value.split(","):
        if not part.strip().isdigit() or not 0 < int(part) < 65536:
            raise UsageError(f"--firewall {item!r}: {part!r} is not a TCP port (1-65535); "
                             "e.g. --firewall node2=29500")
        ports.append(int(part))
    return ports


def parse_firewall(items: list[str]) -> dict[str, list[int]]:
    """`--firewall node2` or `--firewall node2=29500,8080`: the TCP ports left open besides ssh."""
    return _node_items("--firewall", items, _ports, value_optional=True)  # type: ignore[return-value]


def parse_second_nic(items: list[str]) -> list[str]:
    for item in items:
        if _NODE_RE.match(item.strip()) is None:
            raise UsageError(f"--second-nic {item!r}: name a node, e.g. --second-nic node2")
    if len(set(items)) != len(items):
        raise UsageError(f"--second-nic {' '.join(items)}: a node is named twice")
    return [i.strip() for i in items]


def parse_faults(*, mtu: list[str] = (), link: list[str] = (), firewall: list[str] = (),
                 second_nic: list[str] = ()) -> tuple[str, NetFaults]:
    """All fault flags at once: (rate of every node's link, per-node faults)."""
    all_nodes, per_node = parse_links(list(link))
    return all_nodes, NetFaults(mtu=parse_mtu(list(mtu)), link=per_node, firewall=parse_firewall(list(firewall)),
                                second_nic=parse_second_nic(list(second_nic)))


def fault_tools(faults: NetFaults) -> tuple[str, ...]:
    """Host tools the faults need besides the lab's own."""
    return (("tc",) if faults.link else ()) + (("nft",) if faults.firewall else ())


# ---- the commands ----------------------------------------------------------------------------

def nft_ruleset(open_ports: list[int]) -> str:
    """Inbound TCP dropped (silently, as a host firewall does) except established connections,
    ssh and `open_ports`; the node's own connections out still work."""
    ports = ", ".join(str(p) for p in sorted({SSH_PORT, *open_ports}))
    return "\n".join([
        f"table inet {NFT_TABLE} {{",
        "  chain input {",
        "    type filter hook input priority 0; policy accept;",
        "    ct state established,related accept",
        "    iifname \"lo\" accept",
        f"    tcp dport {{ {ports} }} accept",
        "    meta l4proto tcp drop",
        "  }",
        "}",
        "",
    ])


def second_nic_address(subnet: str, node_index: int) -> str:
    net = ipaddress.IPv4Network(subnet)
    return f"{net.network_address + SECOND_NIC_OCTET_OFFSET + node_index}/{net.prefixlen}"


def stolen_route(subnet: str) -> str:
    """The lower half of the lab subnet: every node's address, not the host's (.254), so ssh from
    the host still answers through the lab NIC while node-to-node traffic takes the second NIC."""
    net = ipaddress.IPv4Network(subnet)
    return str(next(net.subnets(prefixlen_diff=1)))


def second_nic_port(lab_index: int, node_index: int) -> str:
    return f"dsl{lab_index}s{node_index}"


def node_fault_argv(state, node) -> list[list[str]]:
    """Commands (host side) that give one node its faults, in order."""
    faults = NetFaults.from_dict(getattr(state, "faults", None))
    ns, sw = node.netns, state.switch_netns
    out: list[list[str]] = []
    if node.name in faults.mtu:
        out.append(["ip", "-n", ns, "link", "set", node.iface, "mtu", str(faults.mtu[node.name])])
    if node.name in faults.link and faults.link[node.name] != LINK_NONE:
        rate = faults.link[node.name]
        out += [tbf_argv(ns, node.iface, rate), tbf_argv(sw, node.switch_port, rate)]
    if node.name in faults.second_nic:
        index = int(_NODE_RE.match(node.name).group(1))
        port = second_nic_port(state.index, index)
        out += [
            ["ip", "-n", sw, "link", "add", port, "type", "veth", "peer", "name", SECOND_NIC, "netns", ns],
            ["ip", "-n", sw, "link", "set", port, "master", state.bridge, "up"],
            # Loose reverse-path filter: replies come back on the lab NIC to an address of the node.
            ["ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv4.conf.all.rp_filter=0"],
            ["ip", "-n", ns, "addr", "add", second_nic_address(state.subnet, index), "dev", SECOND_NIC],
            ["ip", "-n", ns, "link", "set", SECOND_NIC, "up"],
            ["ip", "-n", ns, "route", "add", stolen_route(state.subnet), "dev", SECOND_NIC],
        ]
    return out


def apply_faults(state, run: Callable[..., object]) -> None:
    """Give every node its faults; `run(argv, input=...)` is the build's command runner."""
    faults = NetFaults.from_dict(getattr(state, "faults", None))
    for node in state.nodes:
        for argv in node_fault_argv(state, node):
            run(argv)
        if node.name in faults.firewall:
            run(["ip", "netns", "exec", node.netns, "nft", "-f", "-"], input=nft_ruleset(faults.firewall[node.name]))


def repair_argv(state, node) -> list[list[str]]:
    """Host-side commands that undo one node's faults the way its admin would fix them: the MTU
    back to the lab's 1500, the shaping removed, the firewall's table deleted, the stealing route
    and the second NIC's address on the cluster subnet deleted (the NIC itself stays)."""
    faults = NetFaults.from_dict(getattr(state, "faults", None))
    ns, out = node.netns, []
    if node.name in faults.mtu:
        out.append(["ip", "-n", ns, "link", "set", node.iface, "mtu", "1500"])
    if node.name in faults.link:
        out += [["tc", "-n", ns, "qdisc", "del", "dev", node.iface, "root"],
                ["tc", "-n", state.switch_netns, "qdisc", "del", "dev", node.switch_port, "root"]]
    if node.name in faults.firewall:
        out.append(["ip", "netns", "exec", ns, "nft", "delete", "table", "inet", NFT_TABLE])
    if node.name in faults.second_nic:
        index = int(_NODE_RE.match(node.name).group(1))
        out += [["ip", "-n", ns, "route", "del", stolen_route(state.subnet), "dev", SECOND_NIC],
                ["ip", "-n", ns, "addr", "del", second_nic_address(state.subnet, index), "dev", SECOND_NIC]]
    return out
