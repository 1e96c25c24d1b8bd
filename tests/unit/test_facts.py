"""Facts parsing on recorded probe output: what the rules later rely on must come out right."""

from pathlib import Path

from dscluster.check.facts import (
    clock_offset,
    compute_capability_from_name,
    node_facts,
    parse_nvidia_smi_gpus,
    parse_topology,
    split_sections,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "facts"


def lab_node(n: int):
    return node_facts(f"node{n}", (DATA / "lab-3070-1080" / f"node{n}.probe.txt").read_text())


def test_real_h200_probe_output_parses_versions_gpu_and_missing_tools():
    f = node_facts("gpu1", (DATA / "h200-probe" / "probe.txt").read_text())
    assert f.hostname == "vm"
    assert f.python.torch == "2.11.0+cu130" and f.python.torch_cuda == "13.0"
    assert f.python.nccl == "2.28.9" and f.python.deepspeed is None
    assert "sm_90" in f.python.arch_list and f.python.cuda_available is True
    assert f.python.mpi_library == "Open MPI v4.1.6" and f.mpirun == "Open MPI 4.1.6"
    [gpu] = f.gpus
    assert (gpu.name, gpu.cc, gpu.memory_total_mb, gpu.driver, gpu.ecc_uncorrected) == (
        "NVIDIA H200", (9, 0), 143771, "580.159.04", 0)
    # That host has no `ip`: a fact, not a crash.
    assert f.missing == ["ip"] and f.interfaces == []
    assert f.cpus == 16 and f.mem_total_mb == 131981020 // 1024
    assert f.shm_total_bytes == 137438953472 and f.disk_free_bytes == 68701642752
    assert f.topology.gpus == ["GPU0"] and f.topology.pairs() == []  # one GPU: no pairs


def test_real_topology_with_ansi_header_is_read():
    topo = parse_topology((DATA / "h200-1gpu" / "topo-m.txt").read_text())
    assert topo is not None and topo.gpus == ["GPU0"] and topo.pairs() == []


def test_real_query_gpu_csv():
    [g] = parse_nvidia_smi_gpus((DATA / "h200-1gpu" / "query-gpu.csv").read_text())
    assert g.uuid.startswith("GPU-9123") and g.sm == "sm_90"


def test_geforce_lab_node_gpus_topology_and_interfaces():
    f = lab_node(1)
    assert [g.name for g in f.gpus] == ["NVIDIA GeForce RTX 3070"] * 2
    assert all(g.ecc_uncorrected is None for g in f.gpus)  # [N/A] on GeForce
    assert f.topology.pairs() == [("GPU0", "GPU1", "PHB")]
    assert f.topology.only_host_bridge() and not f.topology.nvlink()
    names = {i.name: i for i in f.interfaces}
    assert names["eno1"].up and [a.cidr for a in names["eno1"].addresses][0] == "192.168.10.11/24"
    assert names["docker0"].excluded and not names["docker0"].up


def test_pascal_node():
    f = lab_node(3)
    [g] = f.gpus
    assert g.cc == (6, 1) and g.sm == "sm_61"
    assert f.cpus == 8


def test_old_driver_without_compute_cap_field_falls_back_to_the_name():
    gpus = parse_nvidia_smi_gpus("0, NVIDIA GeForce GTX 1080 Ti, GPU-1, 11264 MiB, 470.256.02, [N/A]\n")
    assert gpus[0].compute_capability == "6.1" and gpus[0].memory_total_mb == 11264
    assert compute_capability_from_name("NVIDIA GeForce RTX 3070") == "8.6"
    assert compute_capability_from_name("Some Future Card") is None


def test_nvlink_topology_with_nic_columns():
    text = (
        "\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
        "GPU0\t X \tNV18\tNV18\tNV18\tPXB\t0-47\t0\t\tN/A\n"
        "GPU1\tNV18\t X \tNV18\tNV18\tSYS\t0-47\t0\t\tN/A\n"
        "GPU2\tNV18\tNV18\t X \tNV18\tSYS\t48-95\t1\t\tN/A\n"
        "GPU3\tNV18\tNV18\tNV18\t X \tSYS\t48-95\t1\t\tN/A\n"
        "NIC0\tPXB\tSYS\tSYS\tSYS\t X \n\nLegend:\n"
    )
    t = parse_topology(text)
    assert t.gpus == ["GPU0", "GPU1", "GPU2", "GPU3"]
    assert len(t.pairs()) == 6 and t.nvlink() and not t.only_host_bridge()


def test_probe_cut_off_keeps_what_came_and_failing_sections_are_problems():
    text = ("@@dscluster-section hostname\nnodeA\n@@dscluster-rc hostname 0\n"
            "@@dscluster-section nvidia_smi\n"
            "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n"
            "@@dscluster-rc nvidia_smi 9\n@@dscluster-section python\n")
    assert set(split_sections(text)) == {"hostname", "nvidia_smi", "python"}
    f = node_facts("a", text)
    assert f.hostname == "nodeA" and f.gpus == []
    assert any(p.startswith("nvidia_smi: exit 9: NVIDIA-SMI has failed") for p in f.problems)
    assert f.python.error  # no JSON line: unusable, said so


def test_clock_offset_uses_the_midpoint_of_the_round_trip():
    assert clock_offset(1002.0, 1000.0, 1000.2) == 1002.0 - 1000.1


def test_real_two_h200_host_reports_nvlink_and_keeps_p2p():
    f = node_facts("gpu", (DATA / "h200x2-probe" / "probe.txt").read_text())
    assert [g.name for g in f.gpus] == ["NVIDIA H200", "NVIDIA H200"]
    assert f.topology.pairs() == [("GPU0", "GPU1", "NV18")]
    assert f.topology.nvlink() and not f.topology.only_host_bridge()
    assert f.python.nccl == "2.28.9" and f.python.cuda_available is True


def test_real_4gpu_nvlink_topology_and_gpus():
    """Recorded on a 4x H200 host: all pairs NV18, so P2P stays on and check reports NVLink."""
    topo = parse_topology((DATA / "h200-4gpu" / "topo-m.txt").read_text())
    assert topo.gpus == ["GPU0", "GPU1", "GPU2", "GPU3"]
    assert len(topo.pairs()) == 6 and {k for _, _, k in topo.pairs()} == {"NV18"}
    assert topo.nvlink() and not topo.only_host_bridge()
    gpus = parse_nvidia_smi_gpus((DATA / "h200-4gpu" / "query-gpu.csv").read_text())
    assert [g.name for g in gpus] == ["NVIDIA H200"] * 4
    assert len({g.uuid for g in gpus}) == 4


def test_a_node_whose_jobs_see_one_of_two_gpus_counts_one():
    # nvidia-smi lists the whole machine; the probe's CUDA_VISIBLE_DEVICES section narrows it, as
    # on a GPU lab node or a workstation that gives the cluster only some of its GPUs. Without the
    # narrowing, check told every GPU lab node "4 GPUs, slots=1: 3 GPU(s) idle".
    text = (DATA / "h200x2-probe" / "probe.txt").read_text()
    whole = node_facts("gpu", text)
    uuid = whole.gpus[1].uuid
    narrowed = node_facts("gpu", text + "@@dscluster-section cuda_visible\n1\n@@dscluster-rc cuda_visible 0\n")
    assert [g.uuid for g in narrowed.gpus] == [uuid]
    unset = node_facts("gpu", text + "@@dscluster-section cuda_visible\n@@dscluster-rc cuda_visible 1\n")
    assert len(unset.gpus) == 2
