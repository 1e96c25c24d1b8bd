"""The simulated lab's plan: addresses, names, node files and the state file (no root needed)."""

from __future__ import annotations

import ipaddress

import pytest

from dscluster.errors import UsageError
from dscluster.hosts import parse_hostfile_text
from dscluster.sim_plan import (
    LabState, bridge_name, iface_name, pick_lab_index, plan_lab, render_group, render_hostfile,
    render_hosts, render_passwd, render_shadow, render_sshd_config, validate_lab_name, veth_name,
)


def _plan(nodes=3, **kw):
    args = dict(index=4, nodes=nodes, slots=2, uid=2000, gid=2000, password="pw", created=1.5)
    args.update(kw)
    return plan_lab("dslab", **args)


def test_addresses_are_unique_inside_the_lab_subnet_and_differ_between_labs():
    a, b = _plan(nodes=5, index=1), _plan(nodes=5, index=2)
    net = ipaddress.IPv4Network(a.subnet)
    ips = [n.ip for n in a.nodes] + [a.host_ip]
    assert len(set(ips)) == 6 and all(ipaddress.IPv4Address(ip) in net for ip in ips)
    assert a.host_ip == "10.77.1.254" and a.nodes[0].ip == "10.77.1.11"
    assert not net.overlaps(ipaddress.IPv4Network(b.subnet))
    assert a.bridge != b.bridge and {n.veth_host for n in a.nodes}.isdisjoint(n.veth_host for n in b.nodes)


def test_kernel_interface_names_fit_in_15_characters_for_the_largest_lab():
    for name in (bridge_name(250), veth_name(250, 32)):
        assert len(name) <= 15, name


def test_interface_names_cycle_and_the_head_has_no_docker_decoy():
    lab = _plan(nodes=4)
    assert [iface_name(i) for i in range(1, 5)] == ["eth0", "enp3s0", "ens4f0", "eth0"]
    assert [n.iface for n in lab.nodes] == ["eth0", "enp3s0", "ens4f0", "eth0"]
    assert lab.nodes[0].decoys == [] and all(n.decoys == ["docker0"] for n in lab.nodes[1:])


def test_lab_index_skips_labs_in_use_and_subnets_already_on_the_host():
    taken = [ipaddress.IPv4Network("10.77.2.0/24"), ipaddress.IPv4Network("10.0.0.0/8")]
    assert pick_lab_index(set()) == 1
    assert pick_lab_index({1, 3}, [ipaddress.IPv4Network("10.77.2.0/24")]) == 4
    with pytest.raises(UsageError, match="no free lab subnet"):
        pick_lab_index(set(), taken)


@pytest.mark.parametrize("bad", ["", "Lab", "my lab", "-x", "x-", "a" * 25, "../etc"])
def test_bad_lab_names_are_refused(bad):
    with pytest.raises(UsageError, match="invalid lab name"):
        validate_lab_name(bad)


@pytest.mark.parametrize("nodes,slots,msg", [(0, 1, "1 to 32 nodes"), (33, 1, "1 to 32 nodes"), (2, 0, "at least one slot")])
def test_bad_sizes_are_refused(nodes, slots, msg):
    with pytest.raises(UsageError, match=msg):
        _plan(nodes=nodes, slots=slots)


def test_state_file_round_trips_and_ignores_unknown_keys():
    lab = _plan()
    lab.nodes[1].anchor_pid = 4242
    lab.nodes[2].connected = False
    data = lab.to_dict()
    data["future_field"] = 1
    data["nodes"][0]["future_node_field"] = "x"
    back = LabState.from_dict(data)
    assert back == lab
    assert LabState.from_json(lab.to_json()) == lab
    assert back.nodes[1].anchor_pid == 4242 and back.nodes[2].connected is False


def test_hostfile_is_valid_openmpi_syntax_with_node_names():
    lab = _plan(nodes=3, slots=2)
    hf = parse_hostfile_text(render_hostfile(lab))
    assert hf.names == ["node1", "node2", "node3"] and hf.total_slots == 6


def test_hosts_file_maps_every_node_name_to_its_ip():
    lab = _plan(nodes=3)
    entries = {}
    for line in render_hosts(lab).splitlines():
        if line and not line.startswith("#"):
            ip, *names = line.split()
            for name in names:
                entries.setdefault(name, ip)
    assert {f"node{i}": entries[f"node{i}"] for i in (1, 2, 3)} == {n.name: n.ip for n in lab.nodes}
    assert entries["localhost"] == "127.0.0.1"


def test_account_files_keep_the_hosts_lines_and_replace_an_existing_lab_user():
    passwd = "root:x:0:0:root:/root:/bin/bash\nlab:x:1001:1001::/home/old:/bin/sh\n"
    out = render_passwd(passwd, "lab", 2000, 2000, "/home/lab").splitlines()
    assert out == ["root:x:0:0:root:/root:/bin/bash", "lab:x:2000:2000:dscluster lab user:/home/lab:/bin/bash"]
    assert render_group("root:x:0:\n", "lab", 2000).splitlines() == ["root:x:0:", "lab:x:2000:"]
    shadow = render_shadow("root:*:19000:0:99999:7:::\n", "lab", "$6$salt$hash", 20000).splitlines()
    assert shadow[1].split(":")[:3] == ["lab", "$6$salt$hash", "20000"]


def test_sshd_config_allows_password_login_without_pam_and_has_a_pid_file_per_node():
    lab = _plan(nodes=2)
    configs = [render_sshd_config(n) for n in lab.nodes]
    for cfg, node in zip(configs, lab.nodes):
        lines = set(cfg.splitlines())
        assert {"PasswordAuthentication yes", "UsePAM no", "Port 22", "PermitRootLogin no"} <= lines
        assert f"PidFile {node.nodedir}/sshd.pid" in lines
    assert configs[0] != configs[1]
