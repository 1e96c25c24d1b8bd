"""check's link rules on recorded link tests (tests/data/links/: `dscluster check` on a 4-node
simulated lab with node2 at MTU 9000 behind a firewall, node3 on a 20mbit cable, node4 with a
second NIC that a route sends its traffic through)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from dscluster.check.netprobe import parse_client, parse_server_ready, rounds
from dscluster.check.netrules import evaluate_links, links_summary, rule_df, rule_mtu, rule_nic, rule_ports, rule_speed
from dscluster.node.netif import NetworkPlan

DATA = Path(__file__).resolve().parents[1] / "data" / "links" / "lab-4node-faults.json"


@pytest.fixture()
def rec():
    doc = json.loads(DATA.read_text())
    n = doc["network"]
    plan = NetworkPlan(subnet=n["subnet"], common=n["common"], iface=n["iface"], address=n["address"])
    return doc["pairs"], doc["mtus"], plan


def clean(pairs: list[dict], plan: NetworkPlan | None = None) -> list[dict]:
    """The same records as on a lab without faults: every port open, every frame answered, the
    bytes on the chosen NIC, every rate like the fast pairs'."""
    out = copy.deepcopy(pairs)
    for r in out:
        r["ports"] = {p: "ok" for p in r["ports"]}
        r["mtu"]["large"] = "ok"
        nic = plan.iface[r["from"]] if plan else "eth0"
        r["speed"] = {"bytes": 10**8, "seconds": 0.4, "bps": 2 * 10**9, "tx": {nic: 10**8, "lo": 10**3}}
    return out


def test_the_node_with_the_odd_mtu_is_named_with_the_command_that_fixes_it(rec):
    _, mtus, plan = rec
    [f] = rule_mtu(mtus, plan)
    assert f.node == "node2" and "MTU 9000" in f.what and "node1, node3, node4 1500" in f.what
    assert f.fix.startswith("on node2: `sudo ip link set dev enp3s0 mtu 1500`")


def test_large_frames_lost_from_one_node_are_one_finding_naming_its_peers(rec):
    pairs, mtus, plan = rec
    [f] = rule_df(pairs, mtus, plan)
    assert (f.node, f.check, f.severity) == ("node2", "mtu", "error")
    assert "node2 → node1, node3, node4: a 9000-byte frame" in f.what and "mtu 1500" in f.fix
    assert rule_df(clean(pairs), mtus, plan) == []


def test_blocked_ephemeral_ports_name_the_receiving_node_every_sender_and_the_firewall_fix(rec):
    pairs, _, plan = rec
    [f] = rule_ports(pairs, plan.subnet)
    assert f.node == "node2" and f.check == "port"
    assert all(f"{a} → node2" in f.what for a in ("node1", "node3", "node4"))
    assert f"sudo ufw allow from {plan.subnet}" in f.fix
    assert rule_ports(clean(pairs), plan.subnet) == []


def test_the_slow_cable_is_named_with_every_pair_it_slows(rec):
    pairs, _, _ = rec
    [f] = rule_speed(pairs)
    assert f.node == "node3" and "node3's link is slow" in f.what and "Mbit/s" in f.what
    assert "node1 → node3" in f.what and "node1 → node4" not in f.what and "ethtool" in f.fix
    assert rule_speed(clean(pairs)) == []


def test_a_pair_under_half_the_median_is_slow_and_a_two_node_cluster_has_nothing_to_compare():
    def r(a, b, bps):
        return {"from": a, "to": b, "speed": {"bps": bps}}
    fast = [r("a", "b", 10**9), r("b", "c", 10**9), r("c", "a", 10**9)]
    assert rule_speed(fast + [r("d", "a", 4 * 10**8), r("a", "d", 4 * 10**8)])[0].node == "d"
    assert rule_speed(fast + [r("d", "a", 6 * 10**8)]) == []      # over half: not flagged
    assert rule_speed([r("a", "b", 10**6), r("b", "a", 10**6)]) == []


def test_bytes_that_left_by_the_second_nic_name_the_node_the_nic_and_the_route(rec):
    pairs, _, plan = rec
    [f] = rule_nic(pairs, plan)
    assert f.node == "node4" and "leaves by eno1, not by eth0" in f.what
    assert "route: 10.77.1.11 dev eno1" in f.what and "ip route del" in f.fix
    assert rule_nic(clean(pairs, plan), plan) == []


def test_all_link_rules_together_and_the_slowest_pair_for_the_plan(rec):
    pairs, mtus, plan = rec
    facts = {}   # MTUs come from the facts in check; here the recorded ones are checked above
    found = {(f.node, f.check) for f in evaluate_links(pairs, facts, plan) if f.severity == "error"}
    assert found == {("node2", "mtu"), ("node2", "port"), ("node3", "speed"), ("node4", "nic")}
    slowest = links_summary(pairs)["slowest"]
    assert "node3" in (slowest["from"], slowest["to"]) and slowest["bps"] < 25 * 10**6
    assert links_summary([])["slowest"] is None


def test_rounds_cover_every_ordered_pair_once_with_one_receiver_per_node_per_round():
    names = ["n1", "n2", "n3", "n4"]
    rs = rounds(names)
    assert sorted(p for r in rs for p in r) == sorted((a, b) for a in names for b in names if a != b)
    assert all(sorted(b for _, b in r) == names for r in rs)


def test_probe_lines_parse_and_garbage_does_not():
    assert parse_server_ready('LISTENING {"tcp": [4000, 4001], "udp": 4002}') == {"tcp": [4000, 4001], "udp": 4002}
    assert parse_server_ready("LISTENING {") is None and parse_server_ready("Traceback") is None
    assert parse_client('noise\nLINK {"peer": "n2", "ports": {}}\n') == {"peer": "n2", "ports": {}}
    assert parse_client("LINK {bad") is None and parse_client("") is None


def test_two_jumbo_nodes_of_three_are_both_told_to_come_down_to_what_every_path_carries():
    plan = NetworkPlan(subnet="10.0.0.0/24", common=["10.0.0.0/24"], iface={"a": "eth0", "b": "eth1", "c": "eth2"},
                       address={})
    found = rule_mtu({"a": 1500, "b": 9000, "c": 9000}, plan)
    assert [(f.node, "MTU 9000, a 1500" in f.what) for f in found] == [("b", True), ("c", True)]
    assert all("mtu 1500" in f.fix and "the switch" in f.fix for f in found)
    lost = [{"from": x, "to": y, "mtu": {"size": 8972, "large": "no answer", "small": "ok"}}
            for x, y in (("b", "a"), ("b", "c"), ("c", "a"), ("c", "b"))]
    assert [(f.node, "mtu 1500" in f.fix) for f in rule_df(lost, {"a": 1500, "b": 9000, "c": 9000}, plan)] == \
        [("b", True), ("c", True)]
