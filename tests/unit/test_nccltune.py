"""NCCL socket tuning: the decision from a measured grid, and the env files it reaches.

The default point, 1.146 GB/s on a 10 Gbit/s link, is the low end of what the GPU lab measured over
`sim up --link 10gbit` with NCCL's defaults (1.146-1.19 GB/s); the other grid points below are
illustrations of the rule, not measurements.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dscluster.check.facts import node_facts
from dscluster.check.nccltune import GRID, MIN_LINK_BPS, decide_socket_tuning, grid_envs
from dscluster.check.rules import deepspeed_env, evaluate, node_envs
from dscluster.check.run import ActiveLaunch, tune_sockets
from dscluster.node.hosts import parse_hostfile_text

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


# ---------------------------------------------------------------------------- the grid run by check

def allreduce_output(busbw: float, backend: str = "nccl") -> str:
    """What mpirun prints for check's all-reduce: rank 0's JSON line among the ranks' other output. The
    1.194 GB/s point is the GPU lab's 256 MiB all-reduce at 10 Gbit/s with NCCL's defaults (4 ranks,
    NVIDIA H200, bench/results/2026-11-26-nvidia-h200-lab-10gbit-4node.json); the others illustrate."""
    doc = {"backend": backend, "world_size": 4, "hosts": ["node1", "node2", "node3", "node4"],
           "device": "NVIDIA H200", "nccl": "2.28.9", "torch": "2.11.0+cu130", "iters": 10,
           "results": [{"bytes": 268435456, "time_us": round(268435456 * 1.5 / busbw / 1e3, 1),
                        "algbw_GBps": round(busbw / 1.5, 3), "busbw_GBps": busbw}], "peak_busbw_GBps": busbw}
    return "allreduce: cleared the launcher's CPU binding\nNCCL version 2.28.9+cuda13.0\n" + json.dumps(doc) + "\n"


class RecordedLaunch(ActiveLaunch):
    """check's mpirun launcher, its runs answered from recorded outputs (no GPU nodes in unit tests)."""

    def __init__(self, outputs: list[tuple[bool, str]], nodes: int = 4):
        hf = parse_hostfile_text("".join(f"node{n} slots=1\n" for n in range(1, nodes + 1)), "hosts.txt")
        super().__init__(hostfile=hf, cidr="10.77.1.0/24", mpirun="/v/bin/mpirun", env={},
                         exports=["MASTER_ADDR", "MASTER_PORT"], as_root=False, limit=60.0)
        self.outputs, self.argvs = list(outputs), []

    def run(self, argv, limit):
        self.argvs.append(argv)
        ok, out = self.outputs.pop(0)
        return ok, out, 14.0


def active_after(backend: str = "nccl", link_bps: int | None = 9_400_000_000) -> dict:
    """active as check holds it after its all-reduce; 9.4 Gbit/s: what TCP carries on a 10 Gbit/s link."""
    return {"allreduce": {"ok": True, "result": json.loads(allreduce_output(1.19, backend).splitlines()[-1])},
            "links": {"pairs": [], "slowest": {"from": "node2", "to": "node1", "bps": link_bps} if link_bps else None}}


def test_each_grid_point_is_one_mpirun_of_the_largest_message_with_its_values_passed_by_x():
    launch = RecordedLaunch([(True, allreduce_output(b)) for b in (1.194, 1.21, 1.232, 1.228)])
    record, findings = tune_sockets(launch, "/v/bin/python", active_after())
    assert findings == [] and len(launch.argvs) == len(GRID) == 4
    assert launch.argvs[1] == [
        "/v/bin/mpirun", "-np", "4", "--hostfile", "hosts.txt", "--map-by", "slot", "-x", "MASTER_ADDR",
        "-x", "MASTER_PORT", "-x", "NCCL_SOCKET_NTHREADS=4", "-x", "NCCL_NSOCKS_PERTHREAD=2",
        "--mca", "btl_tcp_if_include", "10.77.1.0/24", "--mca", "oob_tcp_if_include", "10.77.1.0/24",
        "/v/bin/python", "-m", "dscluster.bench.allreduce", "--json", "--iters", "10", "--warmup", "3",
        "--timeout", "60", "--sizes", "268435456"]
    assert [a[a.index("-x", 10) + 1] for a in launch.argvs] == [f"NCCL_SOCKET_NTHREADS={t}" for t, _ in GRID]
    assert record["link_bps"] == 9_400_000_000
    assert [(g["NCCL_SOCKET_NTHREADS"], g["NCCL_NSOCKS_PERTHREAD"], g["busbw_GBps"]) for g in record["grid"]] == [
        (1, 1, 1.194), (4, 2, 1.21), (4, 4, 1.232), (8, 2, 1.228)]
    assert all(g["bytes"] == 268435456 and g["seconds"] == 14.0 for g in record["grid"])
    # the record is what the rule reads: 4x4 is 3.2 % over the defaults, so they stay
    env, finding = decide_socket_tuning(record)
    assert env == {} and "9.40 Gbit/s link" in finding.what and "4x4 1.232" in finding.what


def test_a_failed_point_stops_the_grid_and_the_points_measured_still_decide():
    launch = RecordedLaunch([(True, allreduce_output(1.146)), (True, allreduce_output(1.215)),
                             (False, "NCCL WARN socket connect failed\n(timed out after 60 s)")])
    record, findings = tune_sockets(launch, "/v/bin/python", active_after())
    assert len(launch.argvs) == 3 and record["grid"][2]["busbw_GBps"] is None
    assert "timed out after 60 s" in record["grid"][2]["error"]
    assert findings[0].severity == "warning"
    assert "NCCL_SOCKET_NTHREADS=4 NCCL_NSOCKS_PERTHREAD=4 failed" in findings[0].what
    assert decide_socket_tuning(record)[0] == {"NCCL_SOCKET_NTHREADS": "4", "NCCL_NSOCKS_PERTHREAD": "2"}


@pytest.mark.parametrize("backend, link, no_tune, words", [
    ("gloo", 9_400_000_000, False, "apply to NCCL (GPU nodes) only"),
    ("nccl", 941_000_000, False, "slowest link measured 941 Mbit/s"),
    ("nccl", None, False, "no link between nodes was measured"),
    ("nccl", 9_400_000_000, True, "--no-tune"),
])
def test_no_grid_on_cpu_slow_links_or_with_no_tune_and_check_says_why(backend, link, no_tune, words):
    launch = RecordedLaunch([])
    record, findings = tune_sockets(launch, "/v/bin/python", active_after(backend, link), no_tune)
    assert launch.argvs == [] and words in record["skipped"]
    assert [(f.severity, f.check) for f in findings] == [("info", "allreduce")] and words in findings[0].what
    assert decide_socket_tuning(record) == ({}, None)


def test_no_grid_after_a_failed_allreduce():
    launch = RecordedLaunch([])
    assert tune_sockets(launch, "/v/bin/python", {"allreduce": {"ok": False, "result": None}}) == (
        {"skipped": "no all-reduce result (it failed or did not run)"}, [])
    assert launch.argvs == []


def test_check_help_says_what_no_tune_skips_and_what_the_grid_costs(capsys):
    from dscluster.cli import main

    with pytest.raises(SystemExit) as e:
        main(["check", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--no-tune" in text and "4 more times" in text and "about 4.5 s on 10 GbE with 4 ranks" in text
