"""The simulated lab's plan: addresses, names, node files and the state file (no root needed)."""

from __future__ import annotations

import ipaddress

import pytest

from dscluster.errors import UsageError
from dscluster.node.hosts import parse_hostfile_text
from dscluster.sim.options import (
    assign_gpus,
    check_gpu_supply,
    count_listed_gpus,
    link_rate_bps,
    parse_env,
    parse_gpus,
    parse_link,
    resolve_size,
    tbf_argv,
)
from dscluster.sim.plan import (
    LabState,
    bridge_name,
    iface_name,
    node_path,
    node_session_env,
    pick_lab_index,
    plan_lab,
    rank_threads,
    render_group,
    render_hostfile,
    render_hosts,
    render_passwd,
    render_shadow,
    render_sshd_config,
    uplink_names,
    validate_lab_name,
    veth_name,
)
from dscluster.sim.reach import DirInfo, ancestors, plan_reach


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
    assert a.bridge != b.bridge and {n.switch_port for n in a.nodes}.isdisjoint(n.switch_port for n in b.nodes)


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


@pytest.mark.parametrize("nodes,slots,msg",
                         [(0, 1, "1 to 32 nodes"), (33, 1, "1 to 32 nodes"), (2, 0, "at least one slot")])
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
    for cfg, node in zip(configs, lab.nodes, strict=True):
        lines = set(cfg.splitlines())
        assert {"PasswordAuthentication yes", "UsePAM no", "Port 22", "PermitRootLogin no"} <= lines
        assert f"PidFile {node.nodedir}/sshd.pid" in lines
    assert configs[0] != configs[1]


# ---- GPU lab: GPUs per node, link shaping, what each node's processes see -------------------

# `nvidia-smi -L` on a 4x H100 host, one GPU split by MIG on another.
SMI_4_H100 = """GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-5b1c7c55-0c5e-1b2a-3f4d-0a1b2c3d4e5f)
GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-6c2d8d66-1d6f-2c3b-4e5e-1b2c3d4e5f60)
GPU 2: NVIDIA H100 80GB HBM3 (UUID: GPU-7d3e9e77-2e70-3d4c-5f6f-2c3d4e5f6071)
GPU 3: NVIDIA H100 80GB HBM3 (UUID: GPU-8e4fa088-3f81-4e5d-6070-3d4e5f607182)
"""
SMI_MIG = """GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-1b1c7c55-0c5e-1b2a-3f4d-0a1b2c3d4e5f)
  MIG 3g.20gb     Device  0: (UUID: MIG-2c2d8d66-1d6f-2c3b-4e5e-1b2c3d4e5f60)
  MIG 3g.20gb     Device  1: (UUID: MIG-3d3e9e77-2e70-3d4c-5f6f-2c3d4e5f6071)
"""


def test_gpus_per_node_get_consecutive_physical_indices_and_set_the_node_count():
    assert parse_gpus("1,1,2") == [1, 1, 2] and parse_gpus(" 2 , 1") == [2, 1]
    assert assign_gpus([1, 1, 2]) == [[0], [1], [2, 3]]
    assert resolve_size(None, None, [1, 1, 2]) == (3, 1)
    assert resolve_size(3, None, [1, 1, 2]) == (3, 1)
    assert resolve_size(None, None, None) == (3, 1) and resolve_size(5, 2, None) == (5, 2)
    lab = _plan(nodes=3, gpus=[1, 1, 2])
    assert [n.gpus for n in lab.nodes] == [[0], [1], [2, 3]] and lab.uses_gpus
    assert not _plan(nodes=3).uses_gpus and all(n.gpus == [] for n in _plan(nodes=3).nodes)


@pytest.mark.parametrize("text,msg", [
    ("1,0,2", r"entry 2 \('0'\) is not a whole number >= 1"),
    ("1,,2", r"entry 2 \(''\)"),
    ("", r"entry 1 \(''\)"),
    ("two", r"entry 1 \('two'\)"),
    ("1,-1", r"entry 2 \('-1'\)"),
    (",".join(["1"] * 33), "1 to 32 nodes"),
])
def test_bad_gpu_lists_are_refused_with_the_entry_named(text, msg):
    with pytest.raises(UsageError, match=msg):
        parse_gpus(text)


def test_gpus_contradicting_nodes_or_slots_are_refused():
    with pytest.raises(UsageError, match=r"--nodes 2 but --gpus 1,1,2 lists 3 nodes"):
        resolve_size(2, None, [1, 1, 2])
    with pytest.raises(UsageError, match="--slots with --gpus"):
        resolve_size(None, 2, [1, 1])


def test_gpu_count_comes_from_nvidia_smi_list_and_a_shortfall_names_both_numbers():
    assert count_listed_gpus(SMI_4_H100) == 4
    assert count_listed_gpus(SMI_MIG) == 1 and count_listed_gpus("") == 0
    check_gpu_supply([1, 1, 2], 4)
    with pytest.raises(UsageError, match=r"asks for 4 GPUs but `nvidia-smi -L` lists 2 .* --gpus 1,1\)"):
        check_gpu_supply([1, 1, 2], 2)


def test_gpu_lab_hostfile_has_one_slot_per_gpu():
    lab = _plan(nodes=3, gpus=[1, 1, 2])
    assert render_hostfile(lab) == "node1 slots=1\nnode2 slots=1\nnode3 slots=2\n"
    assert parse_hostfile_text(render_hostfile(lab)).total_slots == 4


def test_each_node_sees_only_its_own_gpus_in_pci_order():
    lab = _plan(nodes=3, gpus=[1, 1, 2], env={"NCCL_DEBUG": "INFO"})
    envs = [node_session_env(lab, n) for n in lab.nodes]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0", "1", "2,3"]
    assert all(e["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID" and e["NCCL_DEBUG"] == "INFO" for e in envs)
    assert "PATH" not in envs[0]   # nothing carried: sshd's own PATH stays
    # the nodes share the host's cores: idle OpenMP threads sleep rather than spin, and each rank has
    # its share of the cores (the lab's 4 slots here)
    share = str(rank_threads(lab))
    assert node_session_env(lab, None) == {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": share,
                                           "NCCL_DEBUG": "INFO"}
    two = _plan(nodes=2)
    assert node_session_env(two, two.nodes[0]) == {"OMP_WAIT_POLICY": "PASSIVE",
                                                   "OMP_NUM_THREADS": str(rank_threads(two))}


def test_each_rank_of_the_lab_gets_its_share_of_the_hosts_cores():
    assert rank_threads(_plan(nodes=3, gpus=[1, 1, 2]), cores=16) == 4  # 4 slots
    assert rank_threads(_plan(nodes=2, slots=1), cores=16) == 8
    assert rank_threads(_plan(nodes=2, slots=2), cores=16) == 4  # 2 ranks on each node
    assert rank_threads(_plan(nodes=3), cores=2) == 1  # never 0


def test_sshd_config_sets_the_nodes_environment_in_one_setenv_line():
    lab = _plan(nodes=3, gpus=[1, 1, 2], extra_path=["/opt/carried/bin"])
    cfg = render_sshd_config(lab.nodes[2], node_session_env(lab, lab.nodes[2])).splitlines()
    setenv = [l for l in cfg if l.startswith("SetEnv")]
    assert setenv == [f"SetEnv OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS={rank_threads(lab)} "
                      "PATH=/opt/carried/bin:/usr/local/bin:/usr/bin:/bin:/usr/games "
                      "CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=2,3"]
    assert "Subsystem sftp internal-sftp" in cfg
    assert not [l for l in render_sshd_config(_plan(nodes=1).nodes[0], {}).splitlines() if l.startswith("SetEnv")]


def test_node_path_puts_carried_tool_folders_first_once():
    assert node_path([]) == "/usr/local/bin:/usr/bin:/bin:/usr/games"
    assert node_path(["/x/bin", "/usr/bin", "/x/bin"]) == "/x/bin:/usr/local/bin:/usr/bin:/bin:/usr/games"


@pytest.mark.parametrize("items,msg", [(["NOEQUALS"], "write NAME=VALUE"), (["1X=2"], "write NAME=VALUE"),
                                       (["A=b c"], "blanks, quotes"), (["A=\"x\""], "blanks, quotes")])
def test_bad_env_options_are_refused(items, msg):
    with pytest.raises(UsageError, match=msg):
        parse_env(items)


def test_env_options_become_a_dict():
    assert parse_env(["NCCL_DEBUG=INFO", "X=", "NCCL_DEBUG=WARN"]) == {"NCCL_DEBUG": "WARN", "X": ""}


def test_link_rates_parse_to_a_canonical_spelling():
    assert parse_link("none") == "none" and parse_link(" 1Gbit ") == "1gbit"
    assert link_rate_bps("1gbit") == 10**9 and link_rate_bps("10gbit") == 10**10
    assert link_rate_bps("2.5gbit") == 2_500_000_000 and link_rate_bps("100mbit") == 10**8


@pytest.mark.parametrize("bad", ["1g", "fast", "1 gbit", "0mbit", "500gbit", "-1gbit"])
def test_bad_link_rates_are_refused(bad):
    with pytest.raises(UsageError, match="--link"):
        parse_link(bad)


def test_tbf_argv_shapes_one_interface_in_its_namespace():
    assert tbf_argv("dscluster-dslab-node1", "eth0", "1gbit") == [
        "tc", "-n", "dscluster-dslab-node1", "qdisc", "replace", "dev", "eth0", "root", "tbf",
        "rate", "1000000000bit", "burst", "500000", "latency", "50ms"]
    assert tbf_argv("dscluster-dslab-sw", "dsl4n1", "10gbit") == [
        "tc", "-n", "dscluster-dslab-sw", "qdisc", "replace", "dev", "dsl4n1", "root", "tbf",
        "rate", "10000000000bit", "burst", "5000000", "latency", "50ms"]
    # a slow link still holds two 64 KiB GSO packets
    assert tbf_argv("n", "eth0", "100mbit")[12] == "131072"


def test_switch_lives_in_its_own_namespace_with_names_ip_can_parse():
    lab = _plan(nodes=2)
    assert lab.switch_netns == "dscluster-dslab-sw" and lab.bridge == "dsl4sw" and lab.uplink == "dsl4h"
    assert uplink_names(4) == ("dsl4h", "dsl4up")
    for name in (*uplink_names(250), bridge_name(250)):
        assert len(name) <= 15 and name != "br"


def test_state_file_keeps_gpus_link_and_reads_a_version_1_file():
    lab = _plan(nodes=3, gpus=[1, 1, 2], link="10gbit", env={"A": "1"}, sshd="/opt/t/bin/sshd")
    lab.mounts = [["overlay", "/tmp/x"], ["bind", "/tmp/x/repo"]]
    assert LabState.from_json(lab.to_json()) == lab
    old = _plan(nodes=2).to_dict()
    for key in ("switch_netns", "uplink", "link", "sshd", "extra_path", "env", "mounts"):
        del old[key]
    for n in old["nodes"]:
        n["veth_host"] = n.pop("switch_port")
        del n["gpus"]
    back = LabState.from_dict(old)
    assert back.switch_netns == "" and back.link == "none" and back.nodes[1].switch_port == "dsl4n2"
    assert back.nodes[0].gpus == [] and not back.uses_gpus


def test_sshd_privilege_separation_user_is_added_only_where_the_host_has_none():
    ubuntu = "root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534::/nonexistent:/usr/sbin/nologin\n"
    out = render_passwd(ubuntu, "lab", 2000, 2000, "/home/lab", sshd_uid=101).splitlines()
    assert out[-1] == "sshd:x:101:65534::/run/sshd:/usr/sbin/nologin"
    debian = ubuntu + "sshd:x:105:65534::/run/sshd:/usr/sbin/nologin\n"
    out = render_passwd(debian, "lab", 2000, 2000, "/home/lab", sshd_uid=101).splitlines()
    assert [l for l in out if l.startswith("sshd:")] == ["sshd:x:105:65534::/run/sshd:/usr/sbin/nologin"]


# ---- what the lab user must reach inside the nodes (sim_reach) ------------------------------

def _fs(modes: dict[str, int], owner: int = 0):
    """A host's directories by path: mode (owner root unless told), for plan_reach's stat."""
    return lambda p: DirInfo(modes[p], owner, owner) if p in modes else None


BASE = {"/": 0o755, "/root": 0o700, "/root/.pyenv": 0o755, "/root/.pyenv/versions": 0o755,
        "/root/.pyenv/versions/3.11.7": 0o755, "/run": 0o755, "/run/dscluster-sim": 0o755,
        "/tmp": 0o1777, "/home": 0o755}
PY = "/root/.pyenv/versions/3.11.7"


def test_a_clone_in_a_0700_temp_folder_is_overlaid_there_and_bound_back_shared():
    fs = _fs(BASE | {"/tmp/tmpab12": 0o700, "/tmp/tmpab12/clone": 0o755, "/tmp/tmpab12/clone/.venv": 0o755})
    ops = plan_reach(["/tmp/tmpab12/clone", "/tmp/tmpab12/clone/.venv", PY, "/run/dscluster-sim/x/shared"],
                     fs, uid=2000, gid=2000, keep_clear=("/run/dscluster-sim",))
    # /root is overlaid by every node anyway: the Python under it is bound back, like the clone
    assert ops == [["overlay", "/tmp/tmpab12"], ["bind", "/tmp/tmpab12/clone"], ["bind", PY]]


def test_nested_unreachable_folders_are_overlaid_shallowest_first():
    fs = _fs(BASE | {"/srv": 0o750, "/srv/a": 0o700, "/srv/a/repo": 0o755})
    assert plan_reach(["/srv/a/repo"], fs, uid=2000, gid=2000) == [
        ["overlay", "/srv"], ["overlay", "/srv/a"], ["bind", "/srv/a/repo"]]


def test_reachable_paths_need_no_mounts_and_group_or_owner_access_counts():
    fs = _fs(BASE | {"/work": 0o755, "/work/repo": 0o755, "/usr": 0o755})
    assert plan_reach(["/work/repo", "/usr"], fs, uid=2000, gid=2000) == []
    owned = lambda p: DirInfo(0o710, 0, 2000) if p == "/work" else fs(p)  # noqa: E731  group 2000 may enter
    assert plan_reach(["/work/repo"], owned, uid=2000, gid=2000) == []


def test_a_checkout_in_a_0750_home_is_bound_into_the_nodes_own_home():
    fs = _fs(BASE | {"/home/alice": 0o750, "/home/alice/src": 0o755, "/home/alice/src/repo": 0o755})
    assert plan_reach(["/home/alice/src/repo"], fs, uid=2000, gid=2000) == [["home-bind", "/home/alice/src/repo"]]


def test_a_shared_folder_the_lab_user_cannot_read_is_refused_with_the_fix():
    fs = _fs(BASE | {"/tmp/tmpab12": 0o700, "/tmp/tmpab12/clone": 0o700})
    with pytest.raises(UsageError, match=r"/tmp/tmpab12/clone \(mode 0700\).*cannot read it; fix: `chmod o\+rx "
                                         r"/tmp/tmpab12/clone`"):
        plan_reach(["/tmp/tmpab12/clone"], fs, uid=2000, gid=2000)
    inner = _fs(BASE | {"/work": 0o755, "/work/repo": 0o755, "/work/repo/.venv": 0o700, "/work/repo/.venv/bin": 0o755})
    with pytest.raises(UsageError, match=r"/work/repo/.venv \(mode 0700\).*cannot enter it; fix: `chmod o\+x"):
        plan_reach(["/work/repo", "/work/repo/.venv/bin"], inner, uid=2000, gid=2000)


def test_an_unreachable_folder_above_the_labs_own_directory_is_refused():
    fs = _fs(BASE | {"/run": 0o700})
    with pytest.raises(UsageError, match=r"/run \(mode 0700\).*lab's own directory lies below it.*chmod o\+x /run"):
        plan_reach(["/run/dscluster-sim/x/shared"], fs, uid=2000, gid=2000, keep_clear=("/run/dscluster-sim",))


def test_ancestors_run_from_the_root_down():
    assert ancestors("/a/b/c") == ["/", "/a", "/a/b"] and ancestors("/a") == ["/"]
