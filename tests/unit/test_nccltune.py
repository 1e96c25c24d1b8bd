"""NCCL socket tuning: the decision from a measured grid, and the env files it reaches.

The default point, 1.146 GB/s on a 10 Gbit/s link, is the low end of what the GPU lab measured over
`sim up --link 10gbit` with NCCL's defaults (1.146-1.19 GB/s); the other grid points below are
illustrations of the rule, not measurements.
"""

from __future__ import annotations

from pathlib import Path

from dscluster.check.facts import node_facts
from dscluster.check.nccltune import GRID, MIN_LINK_BPS, decide_socket_tuning, grid_envs
from dscluster.check.rules import deepspeed_env, evaluate, node_envs
from dscluster.hosts import parse_hostfile_text

DATA = Path(__file__).resolve().parents[1] / "data" / "facts"
TEN_GBIT = 10 * 10**9


def record(link_bps, **points):
    grid = [{"NCCL_SOCKET_NTHREADS": int(k[1]), "NCCL_NSOCKS_PERTHREAD": int(k[3]), "busbw_GBps": v}
            for k, v in points.items()]
    return {"link_bps": link_bps, "grid": grid}


def test_a_point_5_percent_or_more_over_the_defaults_is_written_and_said():
    env, finding = decide_socket_tuning(record(TEN_GBIT, t1s1=1.146, t2s2=1.19, t4s2=1.215, t4s4=1.214))
    assert env == {"NCCL_SOCKET_NTHREADS": "4", "NCCL_NSOCKS_PERTHREAD": "2"}
    assert "reached 1.215 GB/s, 6% over the defaults' 1.146 GB/s" in finding.what
    assert "written to the env files" in finding.fix


def test_under_5_percent_the_defaults_stay_and_check_says_so():
    env, finding = decide_socket_tuning(record(TEN_GBIT, t1s1=1.19, t2s2=1.21, t4s2=1.22))
    assert env == {} and "within 5%" in finding.what and "defaults stay" in finding.fix


def test_slow_links_and_missing_records_are_not_tuned():
    assert decide_socket_tuning(record(MIN_LINK_BPS - 1, t1s1=0.11, t4s2=0.2)) == ({}, None)
    assert decide_socket_tuning(None) == ({}, None)
    env, finding = decide_socket_tuning(record(TEN_GBIT, t4s2=1.2))
    assert env == {} and finding.severity == "warning" and "no measurement with the defaults" in finding.what


def test_the_grid_starts_at_the_defaults_and_stays_inside_nccls_limits():
    assert grid_envs()[0] == {"NCCL_SOCKET_NTHREADS": "1", "NCCL_NSOCKS_PERTHREAD": "1"}
    assert all(t <= 16 and t * s <= 64 for t, s in GRID)


def test_the_tuned_values_reach_every_node_env_file_and_deepspeeds():
    facts = {f"node{n}": node_facts(f"node{n}", (DATA / "lab-3070-1080" / f"node{n}.probe.txt").read_text())
             for n in (1, 2, 3)}
    hosts = parse_hostfile_text("node1 slots=2\nnode2 slots=2\nnode3 slots=1\n", "hosts.txt")
    env, _ = decide_socket_tuning(record(TEN_GBIT, t1s1=1.146, t4s2=1.215))
    per_node, cluster = node_envs(evaluate(facts, hosts), facts, master_port=29500, created=1.0,
                                  hostfile_sha256="cafe", tuned=env)
    assert all(e["NCCL_SOCKET_NTHREADS"] == "4" and e["NCCL_NSOCKS_PERTHREAD"] == "2" for e in per_node.values())
    assert deepspeed_env(cluster, per_node)["NCCL_SOCKET_NTHREADS"] == "4"
