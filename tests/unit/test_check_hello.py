"""check's MPI hello when mpirun does not return: every rank answered (PRRTE 3.0.14 lost a rank that ended
at once, docs/failure-behaviour.md) against a hello that really failed. mpirun's runs are answered from
the hello's real output (setup/hello_mpi.py on a 4-node lab) through test_nccltune's RecordedLaunch."""

from __future__ import annotations

import json

import pytest
from test_nccltune import RecordedLaunch, allreduce_output

from dscluster.check.run import TIMED_OUT, run_active

HELLO = ("rank 0 of 4 on node1\nrank 2 of 4 on node3\nrank 1 of 4 on node2\nrank 3 of 4 on node4\n"
         "all 4 ranks answered from 4 hosts: node1 node2 node3 node4\n")


def test_every_rank_answered_but_mpirun_never_returned_warns_and_check_goes_on():
    launch = RecordedLaunch([(False, HELLO + "\n" + TIMED_OUT.format(60.0)), (True, allreduce_output(1.19))])
    active, findings = run_active(launch, "/v/bin/python")
    assert active["mpi_hello"]["ok"] and active["allreduce"]["ok"] and len(launch.argvs) == 2
    (warning,) = [f for f in findings if f.check == "mpi"]
    assert warning.severity == "warning" and not any(f.severity == "error" for f in findings)
    assert "all 4 ranks answered" in warning.what and "did not return within 14 s" in warning.what
    assert "PRRTE 3.0.14" in warning.fix and "nothing to fix for training" in warning.fix


@pytest.mark.parametrize("ok, out", [
    (False, "rank 0 of 4 on node1\nrank 2 of 4 on node3\n\n" + TIMED_OUT.format(60.0)),  # two never answered
    (False, HELLO + "mpirun noticed that process rank 3 ... exited on signal 11 (Segmentation fault)."),  # returned
])
def test_a_hello_that_failed_is_an_error_and_nothing_else_runs(ok, out):
    launch = RecordedLaunch([(ok, out)])
    active, findings = run_active(launch, "/v/bin/python")
    assert not active["mpi_hello"]["ok"] and "allreduce" not in active and len(launch.argvs) == 1
    assert [f.severity for f in findings] == ["error"] and "MPI hello over hosts.txt failed" in findings[0].what


# One workstation (`localhost slots=1`, no sshd): what check's hello and gloo all-reduce printed on it, 2026-11-29.
ONE_HELLO = "rank 0 of 1 on vm\nall 1 ranks answered from 1 hosts: vm\n"
ONE_ALLREDUCE = json.dumps({
    "backend": "gloo", "device": "cpu", "hosts": ["vm"], "iters": 10, "nccl": None, "peak_busbw_GBps": 0.0,
    "results": [{"algbw_GBps": 1.906, "busbw_GBps": 0.0, "bytes": 65536, "time_us": 34.4},
                {"algbw_GBps": 113.439, "busbw_GBps": 0.0, "bytes": 4194304, "time_us": 37.0}],
    "torch": "2.14.1+cu130", "world_size": 1}) + "\n"


def test_one_rank_is_one_rank_and_its_all_reduce_claims_no_bandwidth():
    launch = RecordedLaunch([(True, ONE_HELLO), (True, ONE_ALLREDUCE)], nodes=1)
    active, findings = run_active(launch, "/v/bin/python")
    assert active["allreduce"]["ok"] and not any(f.severity != "info" for f in findings)
    said = {f.check: f.what for f in findings}
    assert said["mpi"] == "MPI hello: 1 rank answered in 14.0 s"
    assert said["allreduce"] == "all-reduce gloo ran on its one rank: no link to measure"  # not "busbw 0.000 GB/s"
