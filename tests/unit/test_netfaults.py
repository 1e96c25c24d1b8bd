"""`sim up`'s per-node network faults: parsing (exit 2 with the fix), and the commands that build
and undo them (no root needed)."""

from __future__ import annotations

import pytest

from dscluster.errors import UsageError
from dscluster.sim.netfaults import (
    NetFaults,
    nft_ruleset,
    node_fault_argv,
    parse_faults,
    repair_argv,
    second_nic_address,
    stolen_route,
)
from dscluster.sim.plan import LabState, plan_lab


def _plan(faults: NetFaults, nodes: int = 3) -> LabState:
    return plan_lab("dslab", index=4, nodes=nodes, slots=1, uid=2000, gid=2000, password="pw", created=1.0,
                    faults=faults)


def test_flags_parse_into_per_node_faults_and_a_rate_for_every_node():
    link, faults = parse_faults(mtu=["node2=9000"], link=["1gbit", "node3=100Mbit"],
                                firewall=["node2", "node3=29500,8080"], second_nic=["node1"])
    assert link == "1gbit"
    assert faults == NetFaults(mtu={"node2": 9000}, link={"node3": "100mbit"},
                               firewall={"node2": [29500], "node3": [29500, 8080]}, second_nic=["node1"])
    assert NetFaults.from_dict(faults.to_dict()) == faults


@pytest.mark.parametrize("kw, message", [
    ({"mtu": ["node2"]}, "--mtu 'node2': write NODE=VALUE, e.g. --mtu node2=9000"),
    ({"mtu": ["node2=90000"]}, "576 to 9216"),
    ({"mtu": ["node2=1500", "node2=9000"]}, "node2 given twice"),
    ({"link": ["node2=fast"]}, "--link node2=100mbit"),
    ({"link": ["1gbit", "10gbit"]}, "one rate for every node"),
    ({"firewall": ["node2=http"]}, "not a TCP port"),
    ({"firewall": ["eth0=22"]}, "write NODE=VALUE"),
    ({"second_nic": ["node2", "node2"]}, "named twice"),
])
def test_bad_fault_flags_are_refused_with_an_example(kw, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_faults(**kw)


def test_a_fault_on_a_node_the_lab_does_not_have_is_refused_before_anything_is_planned():
    with pytest.raises(UsageError, match="--mtu node4: the lab has nodes node1 to node3"):
        _plan(NetFaults(mtu={"node4": 9000}))


def test_fault_commands_give_each_node_exactly_its_faults():
    state = _plan(NetFaults(mtu={"node2": 9000}, link={"node3": "100mbit"}, second_nic=["node2"]))
    n1, n2, n3 = state.nodes
    assert node_fault_argv(state, n1) == []
    cmds = node_fault_argv(state, n2)
    assert ["ip", "-n", n2.netns, "link", "set", "enp3s0", "mtu", "9000"] in cmds
    assert ["ip", "-n", n2.netns, "addr", "add", "10.77.4.102/24", "dev", "eno1"] in cmds
    assert ["ip", "-n", n2.netns, "route", "add", "10.77.4.0/25", "dev", "eno1"] in cmds
    shaped = node_fault_argv(state, n3)
    assert [c[:8] for c in shaped] == [
        ["tc", "-n", n3.netns, "qdisc", "replace", "dev", "ens4f0", "root"],
        ["tc", "-n", state.switch_netns, "qdisc", "replace", "dev", n3.switch_port, "root"]]
    assert all("100000000bit" in c for c in shaped)


def test_the_stolen_route_covers_every_node_but_not_the_host():
    import ipaddress
    route = ipaddress.IPv4Network(stolen_route("10.77.4.0/24"))
    assert all(ipaddress.IPv4Address(f"10.77.4.{10 + i}") in route for i in range(1, 33))
    assert ipaddress.IPv4Address("10.77.4.254") not in route
    assert second_nic_address("10.77.4.0/24", 2) == "10.77.4.102/24"


def test_the_firewall_keeps_ssh_and_the_given_ports_and_drops_other_tcp():
    rules = nft_ruleset([29500])
    assert "tcp dport { 22, 29500 } accept" in rules
    assert "ct state established,related accept" in rules
    assert rules.index("accept") < rules.index("meta l4proto tcp drop")


def test_repair_undoes_each_fault_the_way_an_admin_would():
    state = _plan(NetFaults(mtu={"node2": 9000}, firewall={"node2": [29500]}, link={"node3": "20mbit"},
                            second_nic=["node1"]))
    n1, n2, n3 = state.nodes
    assert repair_argv(state, n1) == [["ip", "-n", n1.netns, "route", "del", "10.77.4.0/25", "dev", "eno1"],
                                      ["ip", "-n", n1.netns, "addr", "del", "10.77.4.101/24", "dev", "eno1"]]
    assert repair_argv(state, n2) == [
        ["ip", "-n", n2.netns, "link", "set", "enp3s0", "mtu", "1500"],
        ["ip", "netns", "exec", n2.netns, "nft", "delete", "table", "inet", "dscluster_fw"]]
    assert [c[:4] for c in repair_argv(state, n3)] == [["tc", "-n", n3.netns, "qdisc"],
                                                      ["tc", "-n", state.switch_netns, "qdisc"]]


def test_a_state_file_from_before_the_faults_loads_without_any():
    doc = _plan(NetFaults()).to_dict()
    del doc["faults"]
    assert LabState.from_dict(doc).faults == {}
    assert NetFaults.from_dict(LabState.from_dict(doc).faults) == NetFaults()
