"""check's MPI hello when mpirun does not return: every rank answered (PRRTE 3.0.14 lost a rank that ended
at once, docs/failure-behaviour.md) against a hello that really failed. mpirun's runs are answered from
the hello's real output (setup/hello_mpi.py on a 4-node lab) through test_nccltune's RecordedLaunch."""

from __future__ import annotations

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
