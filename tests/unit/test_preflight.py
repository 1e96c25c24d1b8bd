"""Every preflight rule on recorded facts: what the user would be told, and the env they get."""

import copy
from pathlib import Path

import pytest

from dscluster.check.facts import node_facts
from dscluster.check.rules import (
    cell_status,
    decide_batching,
    decide_precision,
    deepspeed_env,
    evaluate,
    has_errors,
    node_envs,
)
from dscluster.node.hosts import parse_hostfile_text

DATA = Path(__file__).resolve().parents[1] / "data" / "facts"
HOSTS = parse_hostfile_text("node1 slots=2\nnode2 slots=2\nnode3 slots=1\n", "hosts.txt")


@pytest.fixture
def lab():
    return {f"node{n}": node_facts(f"node{n}", (DATA / "lab-3070-1080" / f"node{n}.probe.txt").read_text(),
                                   clock_offset_s=0.01) for n in (1, 2, 3)}


def about(findings, node=None, check=None, severity=None):
    return [f for f in findings if (node is None or f.node == node) and (check is None or f.check == check)
            and (severity is None or f.severity == severity)]


def test_mixed_3070_1080_cluster_runs_fp32_and_says_why(lab):
    ev = evaluate(lab, HOSTS)
    assert ev.precision.value == "fp32" and not ev.precision.deprecated_fp16
    assert "GTX 1080 (6.1) on node3" in ev.precision.reason
    [w] = about(ev.findings, "node3", "precision")
    assert w.severity == "warning" and "--allow-deprecated-fp16" in w.fix
    # cu126 wheels carry sm_60, which runs on sm_61: no arch finding, and the cluster is clean.
    assert about(ev.findings, check="gpu", severity="error") == []
    assert not has_errors(ev.findings)


def test_opt_in_gives_fp16_with_the_deepspeed_override(lab):
    ev = evaluate(lab, HOSTS, allow_deprecated_fp16=True)
    assert ev.precision.value == "fp16" and ev.precision.deprecated_fp16
    per_node, cluster = node_envs(ev, lab, master_port=29500, created=1.0, hostfile_sha256="ab")
    assert cluster["DS_ALLOW_DEPRECATED_FP16"] == "1" and per_node["node3"]["DSCLUSTER_PRECISION"] == "fp16"
    assert about(ev.findings, "node3", "precision", "warning")


def test_precision_thresholds(lab):
    ampere = {k: v for k, v in lab.items() if k != "node3"}
    assert decide_precision(ampere)[0].value == "bf16"
    turing = copy.deepcopy(ampere)
    turing["node2"].gpus[0].compute_capability = "7.5"
    p, findings = decide_precision(turing)
    assert p.value == "fp16" and findings == []
    assert decide_precision({})[0].value == "fp32"


def test_cuda_build_without_pascal_is_an_arch_error_on_the_1080_node(lab):
    cu128 = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]
    for f in lab.values():
        f.python.arch_list = cu128
        f.python.torch, f.python.torch_cuda = "2.8.0+cu128", "12.8"
    ev = evaluate(lab, HOSTS)
    [e] = about(ev.findings, "node3", "gpu", "error")
    assert "sm_61" in e.what and "no kernel image" in e.what and "cu126" in e.fix
    assert about(ev.findings, "node1", "gpu", "error") == []
    assert cell_status(ev.findings, "node3", "gpu") == "error"


def test_duplicate_hostname_is_an_error_on_both_nodes(lab):
    lab["node3"].hostname = "ws-ampere2.lab.local"
    ev = evaluate(lab, HOSTS)
    dup = about(ev.findings, check="hostname", severity="error")
    assert sorted(f.node for f in dup) == ["node2", "node3"]
    assert "hangs" in dup[0].what and "hostnamectl" in dup[0].fix


def test_duplicate_address_but_not_dockers_shared_one(lab):
    ev = evaluate(lab, HOSTS)
    assert about(ev.findings, check="network") == []  # docker0 172.17.0.1 is on all three: ignored
    lab["node2"].interfaces[1].addresses[0] = lab["node1"].interfaces[1].addresses[0]
    ev = evaluate(lab, HOSTS)
    assert {f.node for f in about(ev.findings, check="network", severity="error")} >= {"node1", "node2"}


def test_version_drift_names_the_odd_node_and_the_pip_fix(lab):
    lab["node2"].python.deepspeed = "0.15.0"
    lab["node3"].python.nccl = "2.21.5"
    ev = evaluate(lab, HOSTS)
    [ds] = about(ev.findings, "node2", "versions")
    assert "DeepSpeed 0.15.0" in ds.what and "0.16.9" in ds.what and "pip install deepspeed==0.16.9" in ds.fix
    [nccl] = about(ev.findings, "node3", "versions")
    assert "NCCL" in nccl.what and nccl.severity == "error"
    assert about(ev.findings, "node1", "versions") == []


def test_gpu_count_below_slots(lab):
    hosts = parse_hostfile_text("node1 slots=2\nnode2 slots=4\nnode3 slots=1\n", "hosts.txt")
    ev = evaluate(lab, hosts)
    [e] = about(ev.findings, "node2", "gpu", "error")
    assert "slots=4" in e.what and "node2 slots=2" in e.fix


def test_interfaces_env_p2p_and_master(lab):
    ev = evaluate(lab, HOSTS)
    per_node, cluster = node_envs(ev, lab, master_port=29501, created=1795658000.0, hostfile_sha256="cafe")
    assert per_node["node1"]["NCCL_SOCKET_IFNAME"] == "eno1"
    assert per_node["node2"]["GLOO_SOCKET_IFNAME"] == "enp3s0"
    assert per_node["node3"]["NCCL_SOCKET_IFNAME"] == "ens4f0"
    # Two consumer GPUs behind the host bridge: P2P off on those nodes only.
    assert per_node["node1"]["NCCL_P2P_DISABLE"] == "1" and "NCCL_P2P_DISABLE" not in per_node["node3"]
    assert cluster["MASTER_ADDR"] == "192.168.10.11" and cluster["MASTER_PORT"] == "29501"
    assert cluster["DSCLUSTER_BTL_TCP_IF_INCLUDE"] == "192.168.10.0/24"
    assert cluster["DSCLUSTER_PRECISION"] == "fp32" and cluster["DSCLUSTER_HOSTFILE_SHA256"] == "cafe"
    ds = deepspeed_env(cluster, per_node)
    assert "NCCL_SOCKET_IFNAME" not in ds  # names differ: only per-node files can carry them
    assert ds["MASTER_ADDR"] == "192.168.10.11"


def test_shm_clock_disk(lab):
    lab["node1"].shm_total_bytes = 64 << 20
    lab["node2"].clock_offset_s = -2.5
    lab["node3"].disk_free_bytes = 512 << 20
    ev = evaluate(lab, HOSTS)
    assert about(ev.findings, "node1", "shm", "warning")
    [c] = about(ev.findings, "node2", "clock", "warning")
    assert "-2.5 s" in c.what
    assert about(ev.findings, "node3", "disk", "error")
    lab["node3"].disk_free_bytes = 5 << 30
    assert about(evaluate(lab, HOSTS).findings, "node3", "disk", "warning")


def test_unreachable_node_reported_and_the_rest_still_evaluated(lab):
    del lab["node2"]
    ev = evaluate(lab, HOSTS, unreachable={"node2": "timeout: node2: no answer from node2:22 within 5 s"})
    [r] = about(ev.findings, "node2", "reach")
    assert r.severity == "error" and "no answer" in r.what
    assert ev.network.subnet == "192.168.10.0/24" and set(ev.network.iface) == {"node1", "node3"}


def test_cpu_only_cluster_is_clean_fp32(lab):
    for f in lab.values():
        f.gpus, f.topology = [], None
    ev = evaluate(lab, HOSTS)
    assert ev.precision.value == "fp32" and not has_errors(ev.findings)
    assert about(ev.findings, None, "gpu", "info")


def test_missing_gpus_on_one_node_and_broken_python(lab):
    lab["node3"].gpus = []
    lab["node2"].python.error = "import torch failed: ImportError: libcudnn.so.9"
    ev = evaluate(lab, HOSTS)
    assert about(ev.findings, "node3", "gpu", "error")
    assert about(ev.findings, "node2", "versions", "error")


def test_mixed_gpus_make_balanced_batching_the_cluster_default(lab):
    ev = evaluate(lab, HOSTS)
    assert ev.batching.value == "balanced"
    assert "NVIDIA GeForce GTX 1080 8 GiB on node3" in ev.batching.reason
    assert "NVIDIA GeForce RTX 3070 8 GiB on node1, node2" in ev.batching.reason
    per_node, cluster = node_envs(ev, lab, master_port=29500, created=1.0, hostfile_sha256="ab")
    assert cluster["DSCLUSTER_BATCHING"] == "balanced" == per_node["node3"]["DSCLUSTER_BATCHING"]
    assert any("batching balanced" in f.what for f in about(ev.findings, check="gpu", severity="info"))


def test_alike_gpus_or_none_keep_uniform_batching(lab):
    same = {n: f for n, f in lab.items() if n != "node3"}  # the two RTX 3070 nodes
    assert decide_batching(same).value == "uniform"
    assert "RTX 3070 8 GiB" in decide_batching(same).reason
    h200 = {"gpu1": node_facts("gpu1", (DATA / "h200x2-probe" / "probe.txt").read_text())}
    assert decide_batching(h200).value == "uniform"
    cpu = copy.deepcopy(same)
    for f in cpu.values():
        f.gpus = []
    assert decide_batching(cpu).value == "uniform"
