"""Interface selection: the subnet all nodes share, whatever each node calls its interface."""

from pathlib import Path

from dscluster.check.facts import node_facts
from dscluster.node.netif import Interface, candidate_networks, iface_for_address, parse_ip_addr, plan_network

DATA = Path(__file__).resolve().parents[1] / "data" / "facts" / "lab-3070-1080"


def lab():
    return {f"node{n}": node_facts(f"node{n}", (DATA / f"node{n}.probe.txt").read_text()).interfaces for n in (1, 2, 3)}


def test_common_subnet_with_different_names_and_docker0_everywhere():
    plan = plan_network(lab())
    # docker0 (172.17.0.0/16) is on every node but never chosen; wlp2s0 exists only on node3.
    assert plan.subnet == "192.168.10.0/24" and plan.common == ["192.168.10.0/24"]
    assert plan.iface == {"node1": "eno1", "node2": "enp3s0", "node3": "ens4f0"}
    assert plan.address == {"node1": "192.168.10.11", "node2": "192.168.10.12", "node3": "192.168.10.13"}


def test_up_docker0_with_a_shared_address_is_still_excluded():
    ifs = [Interface("docker0", up=True,
                     addresses=parse_ip_addr("3: docker0    inet 172.17.0.1/16 scope global docker0")),
           Interface("br-1a2b", up=True,
                     addresses=parse_ip_addr("5: br-1a2b    inet 172.18.0.1/16 scope global br-1a2b")),
           Interface("veth9", up=True),
           Interface("lo", up=True, addresses=parse_ip_addr("1: lo    inet 127.0.0.1/8 scope host lo"))]
    assert candidate_networks(ifs) == {}
    assert plan_network({"a": ifs, "b": ifs}).subnet is None


def test_no_shared_subnet_lists_each_nodes_subnets():
    nodes = lab()
    nodes["node3"] = [i for i in nodes["node3"] if i.name != "ens4f0"]  # only its Wi-Fi left
    plan = plan_network(nodes)
    assert plan.subnet is None and plan.missing["node3"] == ["10.20.30.0/24"]


def test_prefers_the_subnet_ssh_used_when_two_are_shared():
    a = parse_ip_addr("2: eth0    inet 10.0.0.1/24 scope global eth0\n3: ib0    inet 10.1.0.1/16 scope global ib0")
    b = parse_ip_addr("2: eth1    inet 10.0.0.2/24 scope global eth1\n3: ib0    inet 10.1.0.2/16 scope global ib0")
    ifs = lambda addrs: [Interface(x.iface, up=True, addresses=[x]) for x in addrs]  # noqa: E731
    plan = plan_network({"a": ifs(a), "b": ifs(b)}, {"a": "10.1.0.1", "b": "10.1.0.2"})
    assert plan.subnet == "10.1.0.0/16" and plan.iface == {"a": "ib0", "b": "ib0"}
    plan = plan_network({"a": ifs(a), "b": ifs(b)})
    assert plan.subnet == "10.0.0.0/24"  # narrowest when SSH says nothing


def test_iface_for_master_address():
    assert iface_for_address(lab()["node2"], "192.168.10.11") == "enp3s0"
    assert iface_for_address(lab()["node2"], "8.8.8.8") is None


def test_single_host_without_a_network_uses_loopback():
    plan = plan_network({"localhost": []})
    assert (plan.subnet, plan.iface, plan.address) == ("127.0.0.0/8", {"localhost": "lo"}, {"localhost": "127.0.0.1"})
