"""The run-identity rule (dscluster.rundir.agree.disagreement): which ranks write where, what differs, the fix."""

from __future__ import annotations

from dscluster.rundir.agree import disagreement, identity


def _rank(rank: int, host: str, run_id: str, runs: str, given: list[str]) -> dict:
    return {"rank": rank, "host": host, "run_id": run_id, "runs": runs, "given": given}


def test_ranks_that_agree_have_nothing_to_say():
    same = [_rank(r, f"node{r}", "plain40", "/lab/runs", ["DSCLUSTER_RUN_ID"]) for r in range(4)]
    assert disagreement(same) is None


def test_a_runs_folder_that_differs_names_dscluster_runs_and_its_flag():
    ranks = [_rank(0, "node1", "plain40", "/lab/runs", ["DSCLUSTER_RUN_ID", "DSCLUSTER_RUNS"]),
             _rank(1, "node1", "plain40", "/lab/runs", ["DSCLUSTER_RUN_ID", "DSCLUSTER_RUNS"]),
             _rank(2, "node2", "plain40", "/home/u/runs", ["DSCLUSTER_RUN_ID"])]
    said = disagreement(ranks)
    assert said is not None
    assert "ranks 0 (node1), 1 (node1) → /lab/runs/plain40 (DSCLUSTER_RUNS set)" in said
    assert "rank 2 (node2) → /home/u/runs/plain40 (DSCLUSTER_RUNS not set)" in said
    assert "`mpirun -x DSCLUSTER_RUNS ...`" in said and "DSCLUSTER_RUN_ID only" not in said
    assert "dscluster launch --run-id plain40" in said


def test_identity_is_what_the_rank_would_write():
    me = identity(3, {"DSCLUSTER_RUNS": "/lab/runs", "PMIX_NAMESPACE": "prterun-node1-77@1"})
    assert (me["rank"], me["run_id"], me["runs"], me["given"]) == (3, "mpi-prterun-node1-77-1", "/lab/runs",
                                                                  ["DSCLUSTER_RUNS"])
