"""Precision per cluster, rank detection per launcher, auto-fit search, sampler maths."""

import pytest

from dscluster.core import dist
from dscluster.core.autofit import choose_micro_batch, largest_fit, with_margin
from dscluster.core.dist import default_master_port, detect_ranks, export_env
from dscluster.core.precision import decide
from dscluster.core.sampler import StepSampler
from dscluster.errors import JobFailed, UsageError


@pytest.mark.parametrize("cap,expected", [((9, 0), "bf16"), ((8, 6), "bf16"), ((7, 5), "fp16"),
                                          ((6, 1), "fp32")])
def test_precision_from_local_gpu(cap, expected):
    assert decide("auto", cluster=None, cuda=True, capability=cap).precision == expected


def test_precision_cluster_decision_wins_and_cpu_is_fp32():
    # a lab of Ampere cards plus one Pascal card: check decided fp16 for everyone
    assert decide("auto", cluster="fp16", cuda=True, capability=(8, 6)).precision == "fp16"
    assert decide("auto", cluster=None, cuda=False, capability=None).precision == "fp32"
    assert decide("auto", cluster="bf16", cuda=False, capability=None).precision == "fp32"
    with pytest.raises(UsageError, match="needs a GPU"):
        decide("fp16", cluster=None, cuda=False, capability=None)
    with pytest.raises(UsageError, match="capability 8.0"):
        decide("bf16", cluster=None, cuda=True, capability=(7, 5))
    with pytest.raises(UsageError, match="DSCLUSTER_PRECISION"):
        decide("auto", cluster="fp8", cuda=True, capability=(9, 0))


@pytest.mark.parametrize("env,expected", [
    ({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, (3, 1, 4, "torch")),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_SIZE": "5",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "1", "PMIX_RANK": "2"}, (2, 0, 5, "openmpi")),
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}, (1, 1, 2, "pmi")),
    ({"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4(x2)"},
     (5, 1, 8, "slurm")),
    ({}, (0, 0, 1, "single")),
])
def test_rank_detection_per_launcher(env, expected):
    info = detect_ranks(env)
    assert (info.rank, info.local_rank, info.world_size, info.source) == expected


def test_a_rank_of_a_heterogeneous_slurm_job_knows_how_many_share_its_node():
    # a mixed lab's job (node1 slots=2, node2 slots=1) sets no SLURM_NTASKS_PER_NODE
    on_node2 = {"SLURM_PROCID": "2", "SLURM_LOCALID": "0", "SLURM_NTASKS": "3", "SLURM_NODEID": "1",
                "SLURM_STEP_TASKS_PER_NODE": "2,1"}
    on_node1 = {**on_node2, "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NODEID": "0"}
    assert detect_ranks(on_node2).local_world_size == 1
    assert detect_ranks(on_node1).local_world_size == 2
    assert detect_ranks({**on_node1, "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_NODEID": "1"}).local_world_size == 2


def test_rank_detection_rejects_nonsense():
    with pytest.raises(UsageError, match="outside 0..1"):
        detect_ranks({"RANK": "2", "WORLD_SIZE": "2"})


def test_export_env_warns_on_override_and_sets_master():
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "WORLD_SIZE": "8"}
    warnings = export_env(detect_ranks(env), "mpi-123", env, warn=lambda m: None)
    assert env["RANK"] == "1" and env["WORLD_SIZE"] == "2" and env["MASTER_ADDR"] == "127.0.0.1"
    assert env["MASTER_PORT"] == str(default_master_port("mpi-123"))
    assert any("WORLD_SIZE=8" in w for w in warnings)
    multi = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
             "MASTER_PORT": "30000"}
    warnings = export_env(detect_ranks(multi), "x", multi, warn=lambda m: None)
    assert "MASTER_ADDR" not in multi and any("dscluster check" in w for w in warnings)
    assert multi["MASTER_PORT"] == "30000"


FOREIGN = "192.0.2.1"  # TEST-NET-1: never an address of this host


def test_a_job_on_one_host_meets_over_loopback_when_checks_head_is_elsewhere():
    # check ran on node1..node3 (MASTER_ADDR = node1); this job is node3 alone, both ranks there
    for rank in ("0", "1"):
        env = {"OMPI_COMM_WORLD_RANK": rank, "OMPI_COMM_WORLD_LOCAL_RANK": rank, "OMPI_COMM_WORLD_SIZE": "2",
               "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": FOREIGN, "MASTER_PORT": "29500"}
        export_env(detect_ranks(env), "x", env, warn=lambda m: None)
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == "29500"


def test_rank_0_away_from_the_rendezvous_says_so_instead_of_waiting():
    base = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            "MASTER_ADDR": FOREIGN}
    multi = dict(base)
    with pytest.raises(UsageError, match=rf"MASTER_ADDR {FOREIGN} is not an address of this host.*first in"):
        export_env(detect_ranks(multi), "x", multi, warn=lambda m: None)
    other = {**base, "OMPI_COMM_WORLD_RANK": "2"}  # rank 0 is elsewhere: it may well be there
    export_env(detect_ranks(other), "x", other, warn=lambda m: None)
    assert other["MASTER_ADDR"] == FOREIGN
    here = {**base, "MASTER_ADDR": "127.0.0.1"}
    export_env(detect_ranks(here), "x", here, warn=lambda m: None)
    assert here["MASTER_ADDR"] == "127.0.0.1"
    # a name that does not resolve here is a launcher's own: left to it
    named = {**base, "MASTER_ADDR": "head-of-another-launcher.invalid"}
    export_env(detect_ranks(named), "x", named, warn=lambda m: None)
    assert named["MASTER_ADDR"] == "head-of-another-launcher.invalid"


@pytest.mark.parametrize("limit", [1, 2, 3, 37, 64, 100, 1000])
def test_largest_fit_finds_the_boundary_with_few_probes(limit):
    probes = []

    def fits(b):
        probes.append(b)
        return b <= limit

    assert largest_fit(fits, maximum=1024) == limit
    assert len(probes) <= 2 * 11


def test_largest_fit_at_the_ends():
    assert largest_fit(lambda b: False) == 0
    assert largest_fit(lambda b: True, maximum=300) == 300


def test_choose_micro_batch_keeps_the_global_batch():
    # 8 GB cards OOM'd at 64 per GPU: fit says 48 → 32 × 2 accumulation keeps 256 on 4 ranks
    assert choose_micro_batch(with_margin(53, 0.9), 4, 256) == (32, 2)
    assert choose_micro_batch(20, 2, None) == (20, 1)
    with pytest.raises(JobFailed):
        choose_micro_batch(0, 2, 64)


def test_sampler_equal_steps_disjoint_and_resumable():
    n = 301  # not divisible by the world size
    samplers = [StepSampler(n, [8, 8], 2, r, seed=3) for r in range(2)]
    assert {s.steps_per_epoch for s in samplers} == {301 // 32}
    steps = [list(s.steps(epoch=1)) for s in samplers]
    seen = [i for rank in steps for step in rank for micro in step for i in micro]
    assert len(seen) == len(set(seen)) == 9 * 32
    resumed = list(samplers[0].steps(epoch=1, start_step=4))
    assert resumed == steps[0][4:]
    assert list(samplers[0].steps(epoch=2)) != steps[0]
    with pytest.raises(UsageError, match="fewer than one global batch"):
        StepSampler(10, [8, 8], 1, 0, 0)


@pytest.mark.parametrize("local_rank,visible,index", [(0, 2, 0), (1, 2, 1), (3, 4, 3), (1, 1, 0), (2, 2, 0)])
def test_each_local_rank_takes_its_own_visible_gpu(local_rank, visible, index):
    assert dist.device_for(local_rank, visible) == index


def test_ranks_that_landed_on_one_physical_gpu_are_found():
    # Slurm's per-task binding: each rank sees one GPU, all different: nothing shared.
    assert dist.shared_gpus(["n1/GPU-a", "n1/GPU-b", "n2/GPU-a"]) == []
    # Two ranks on a node whose CUDA_VISIBLE_DEVICES lists one GPU: they share it.
    assert dist.shared_gpus(["n1/GPU-a", "n1/GPU-a", "n2/GPU-c"]) == [[0, 1]]


def test_a_rank_without_a_visible_gpu_is_told_why():
    with pytest.raises(UsageError, match="CUDA_VISIBLE_DEVICES"):
        dist.device_for(0, 0)
