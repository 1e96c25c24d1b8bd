"""Rules over the pairwise link tests (check.netprobe) and the interfaces' MTUs. Pure: records in,
findings out, so each is tested on recorded results.

A record is one ordered pair as the sender saw it:
    {"from": "node1", "to": "node2", "ports": {"41234": "ok" | "TimeoutError: ...", ...},
     "mtu": {"size": 1472, "large": "ok" | "no answer" | ..., "small": "ok" | ...},
     "speed": {"bytes": N, "seconds": s, "bps": N, "tx": {iface: bytes}} | {"error": ...} | None,
     "route": "10.77.1.12 dev eno1 src ..." | None}
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from dscluster.check.facts import NodeFacts
from dscluster.check.rules import Finding
from dscluster.node.netif import NetworkPlan

SLOW_FRACTION = 0.5     # a link under half the median node's is slow
WRONG_NIC_FRACTION = 0.5  # less than half the bytes on the chosen interface: they left by another


def human_bps(bps: float) -> str:
    return f"{bps / 1e9:.2f} Gbit/s" if bps >= 1e9 else f"{bps / 1e6:.0f} Mbit/s"


def iface_mtus(facts: dict[str, NodeFacts], plan: NetworkPlan) -> dict[str, int]:
    """MTU of each node's chosen interface (the one NCCL_SOCKET_IFNAME names)."""
    out = {}
    for name, f in facts.items():
        for i in f.interfaces:
            if i.name == plan.iface.get(name) and i.mtu:
                out[name] = i.mtu
    return out


def _mtu_fix(name: str, iface: str | None, common: int) -> str:
    return (f"on {name}: `sudo ip link set dev {iface or '<iface>'} mtu {common}` (and the same in its netplan/"
            f"NetworkManager config so it survives a reboot), or jumbo frames on every node and the switch")


def rule_mtu(mtus: dict[str, int], plan: NetworkPlan) -> list[Finding]:
    """Every node's chosen interface should have the same MTU. The nodes above the smallest are
    named: the smallest is what every path carries (raising the others needs the switch too)."""
    if len(set(mtus.values())) <= 1:
        return []
    low = min(mtus.values())
    others = sorted(n for n, m in mtus.items() if m == low)
    return [Finding("error", name, "mtu",
                    f"{plan.iface.get(name)} has MTU {mtu}, {', '.join(others)} {low}: frames over {low} bytes "
                    "are dropped on the way and NCCL stalls or crawls",
                    _mtu_fix(name, plan.iface.get(name), low))
            for name, mtu in sorted(mtus.items()) if mtu > low]


def rule_df(records: list[dict], mtus: dict[str, int], plan: NetworkPlan) -> list[Finding]:
    """A full-size don't-fragment datagram that gets no answer while a small one does: one
    finding per sending node, naming every peer its large frames did not reach."""
    low = min(mtus.values(), default=1500)
    lost: dict[str, list[str]] = defaultdict(list)
    size: dict[str, int] = {}
    out = []
    for r in records:
        m = r.get("mtu") or {}
        if m.get("large") in (None, "ok"):
            continue
        a, b = r["from"], r["to"]
        if m.get("small") != "ok":
            out.append(Finding("warning", a, "mtu", f"{a} → {b}: no UDP answer at all ({m.get('small')}): "
                               "the MTU could not be tested (a firewall dropping UDP?)",
                               f"allow UDP from the cluster subnet on {b}, then re-run check"))
            continue
        lost[a].append(b)
        size[a] = int(m.get("size") or 0)
    for a, peers in sorted(lost.items()):
        out.append(Finding("error", a, "mtu",
                           f"{a} → {', '.join(sorted(peers))}: a {size[a] + 28}-byte frame ({a}'s MTU) with "
                           "don't-fragment set got no answer while a 64-byte one did: large frames from this "
                           "node are dropped on the way",
                           _mtu_fix(a, plan.iface.get(a), low)))
    return out


def rule_ports(records: list[dict], subnet: str | None) -> list[Finding]:
    """Connections to the ephemeral ports NCCL and gloo use, one finding per receiving node."""
    blocked: dict[str, list[str]] = defaultdict(list)
    reasons: dict[str, str] = {}
    for r in records:
        bad = {p: why for p, why in (r.get("ports") or {}).items() if why != "ok"}
        if bad:
            blocked[r["to"]].append(f"{r['from']} → {r['to']} ports {', '.join(sorted(bad))}")
            reasons[r["to"]] = next(iter(bad.values()))
    out = []
    net = subnet or "<cluster subnet>"
    for node, pairs in sorted(blocked.items()):
        out.append(Finding("error", node, "port",
                           f"TCP to ephemeral ports on {node} fails ({reasons[node]}): {'; '.join(pairs)}. "
                           "NCCL's and gloo's data connections use such ports, so the job hangs after the "
                           "rendezvous even where the master port is open",
                           f"on {node} allow TCP from the cluster subnet: `sudo ufw allow from {net}` (firewalld: "
                           f"`sudo firewall-cmd --permanent --zone=trusted --add-source={net} && sudo firewall-cmd "
                           f"--reload`; nftables: `sudo nft insert rule inet filter input ip saddr {net} accept`)"))
    return out


def speed_matrix(records: list[dict]) -> dict[tuple[str, str], int]:
    return {(r["from"], r["to"]): int(r["speed"]["bps"]) for r in records
            if isinstance(r.get("speed"), dict) and r["speed"].get("bps")}


def rule_speed(records: list[dict]) -> list[Finding]:
    """Each node's link is at least as fast as its fastest pair; a node whose fastest pair runs
    under half the median node's has the slow link, and names every pair it slows."""
    matrix = speed_matrix(records)
    best: dict[str, int] = defaultdict(int)
    for (a, b), bps in matrix.items():
        best[a], best[b] = max(best[a], bps), max(best[b], bps)
    if len(best) < 3:
        return []   # two nodes: one link, nothing to compare it with
    median = statistics.median(best.values())
    out = []
    for node, fastest in sorted(best.items()):
        if fastest >= SLOW_FRACTION * median:
            continue
        pairs = "; ".join(f"{a} → {b} {human_bps(bps)}" for (a, b), bps in sorted(matrix.items()) if node in (a, b))
        out.append(Finding("error", node, "speed",
                           f"{node}'s link is slow: {pairs}, against {human_bps(median)} for the median node. "
                           "Data parallelism runs every step at the pace of the slowest link",
                           f"check {node}'s cable and switch port: `ethtool <iface>` on {node} should say "
                           "Speed: 1000Mb/s or more (100Mb/s: a bad cable or an old switch); replace the cable "
                           f"or move it to another port, or leave {node} out of the hostfile"))
    return out


def rule_nic(records: list[dict], plan: NetworkPlan) -> list[Finding]:
    """The bytes of the speed test must leave by the chosen interface: one finding per sender,
    naming the peers whose traffic took another NIC and the route that sent it there."""
    wrong: dict[str, list[tuple[str, str, int, int, str]]] = defaultdict(list)
    for r in records:
        tx = r["speed"].get("tx") if isinstance(r.get("speed"), dict) else None
        a, chosen = r["from"], plan.iface.get(r["from"])
        if not tx or not chosen:
            continue
        total = sum(v for i, v in tx.items() if i != "lo")
        other = max(((i, v) for i, v in tx.items() if i not in ("lo", chosen)), key=lambda x: x[1], default=None)
        if total and other and tx.get(chosen, 0) < WRONG_NIC_FRACTION * total:
            route = (r.get("route") or "").split(" uid ")[0].strip() or f"`ip route get {plan.address.get(r['to'])}`"
            wrong[a].append((r["to"], other[0], other[1], tx.get(chosen, 0), route))
    out = []
    for a, rows in sorted(wrong.items()):
        chosen, nics = plan.iface[a], sorted({nic for _, nic, _, _, _ in rows})
        pairs = "; ".join(f"{a} → {b}: {sent / 1e6:.0f} MB left by {nic}, {ok / 1e6:.0f} MB by {chosen} "
                          f"(route: {route})" for b, nic, sent, ok, route in rows)
        out.append(Finding("error", a, "nic",
                           f"traffic to the other nodes leaves by {', '.join(nics)}, not by {chosen}, the interface "
                           f"NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME name: {pairs}",
                           f"on {a}: remove the route or address that sends the cluster subnet through "
                           f"{', '.join(nics)} (`ip route` lists it; `sudo ip route del <that route>`), or take "
                           f"{', '.join(nics)} off the cluster subnet"))
    return out


def links_summary(records: list[dict]) -> dict:
    """What check.json keeps of the link tests: the matrix and the slowest pair (the plan's link)."""
    matrix = speed_matrix(records)
    slowest = min(matrix.items(), key=lambda kv: kv[1], default=None)
    return {"pairs": records,
            "slowest": {"from": slowest[0][0], "to": slowest[0][1], "bps": slowest[1]} if slowest else None}


def evaluate_links(records: list[dict], facts: dict[str, NodeFacts], plan: NetworkPlan,
                   server_failed: dict[str, str] | None = None) -> list[Finding]:
    mtus = iface_mtus(facts, plan)
    out = rule_mtu(mtus, plan) + rule_df(records, mtus, plan) + rule_ports(records, plan.subnet)
    out += rule_speed(records) + rule_nic(records, plan)
    for name, why in (server_failed or {}).items():
        out.append(Finding("warning", name, "port", f"link tests to {name} not run: its test server did not "
                           f"start ({why})", "re-run check; if it persists, run the check on that node by hand"))
    for r in records:
        if r.get("error"):
            out.append(Finding("warning", r["from"], "port", f"link test {r['from']} → {r['to']} failed: {r['error']}",
                               "re-run check"))
    return out
