"""A cancelled Slurm job says so: rank 0, stopped by Slurm's SIGTERM, asks `scontrol` why and writes a
`cancelled` summary.json (the step reached, how to resume); `launch --submit`, `diagnose` and the report
read it. scontrol is a stand-in here that prints what Slurm 22.05.8 printed on the simulated lab; the
real daemons run in tests/cluster/test_launchers_lab.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _analysis_runs import make_run

from dscluster.analysis.diagnose import diagnose
from dscluster.analysis.load import load_run
from dscluster.analysis.report import render_report
from dscluster.analysis.stats import summary_row
from dscluster.files.fsutil import read_jsonl
from dscluster.launch import slurmjob
from dscluster.rundir.writer import RunLog, RunRecord
from dscluster.train.stopped import record_stop

# `scontrol show job 15` (a heterogeneous job, shortened) from inside a rank's SIGTERM handler after
# `scancel 15`, then the same job once it ended.
CANCELLING = """JobId=15 HetJobId=15 HetJobOffset=0 JobName=dscluster
   JobState=COMPLETING Reason=None Dependency=(null)
   Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:15
   Command=/shared/work/scancel.sbatch
JobId=16 HetJobId=15 HetJobOffset=1 JobName=dscluster
   JobState=COMPLETING Reason=None Dependency=(null)
"""


@pytest.mark.parametrize("state, reason, cancelled", [
    ("COMPLETING", "None", True),       # scancel: the ranks' SIGTERM
    ("CANCELLED", "None", True),
    ("COMPLETING", "TimeLimit", False),  # the job's time limit
    ("RUNNING", "None", False),         # srun stopping the others after a rank failed
    ("FAILED", "NonZeroExitCode", False),
])
def test_a_cancel_is_told_from_the_other_ends_of_a_job(state, reason, cancelled):
    assert slurmjob.cancelling({"JobState": state, "Reason": reason}) is cancelled
    assert slurmjob.cancelling(slurmjob.parse_job(CANCELLING))


def test_launch_submit_closing_line_says_the_step_and_how_to_resume():
    end = slurmjob.job_end("15", {"JobState": "CANCELLED", "ExitCode": "0:15"})
    summary = {"status": "cancelled", "steps": 7, "resume": "DSCLUSTER_RUN_ID=slurm-15 sbatch job.sbatch"}
    code, message = slurmjob.job_report(end, Path("/runs/slurm-15"), interrupted=True, summary=summary)
    assert code == 130
    assert message.startswith("Slurm job 15 was cancelled on Ctrl-C (scancel) at step 7; Slurm stopped every rank. "
                              "To resume: DSCLUSTER_RUN_ID=slurm-15 sbatch job.sbatch. ")


@pytest.fixture
def slurm_job(tmp_path, monkeypatch):
    """This process as a rank of Slurm job 15, with an scontrol that says it is being cancelled."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\ncat <<'EOF'\n{CANCELLING}EOF\n")
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("SLURM_JOB_ID", "15")


def _stop_rank_0(run: Path, earlier: dict | None = None) -> dict:
    record = RunRecord(run_id=run.name, world_size=2, hosts=["node1"], model="m", dataset="digits", epochs=1,
                       steps=7)
    log = RunLog(run, rank=0, host="node1")
    if earlier:
        log.write_summary(earlier)
    record_stop(log, record, run, started=0.0, summary=True)()
    # the main thread, its collective broken by the teardown, fails after the stop was written: dropped
    log.write_summary({"status": "failed", "failed_rank": None, "error": "a peer is gone"})
    log.close()
    assert read_jsonl(run / "metrics" / "rank-0.jsonl")[-1]["status"] == "stopped"
    return json.loads((run / "summary.json").read_text())


def test_a_cancelled_rank_0_writes_cancelled_with_the_step_and_how_to_resume(tmp_path, slurm_job):
    summary = _stop_rank_0(tmp_path / "slurm-15")
    assert (summary["status"], summary["steps"], summary["error"]) == ("cancelled", 7, None)
    assert summary["cancelled_by"].startswith("Slurm job 15 was cancelled (scancel")
    assert summary["resume"] == (
        "DSCLUSTER_RUN_ID=slurm-15 sbatch /shared/work/scancel.sbatch (or `dscluster launch --launcher slurm "
        "--submit --run-id slurm-15 -- <the same train arguments>`): training resumes from step 0 (no checkpoint "
        "was saved in the run directory)")
    saved = tmp_path / "saved"
    (saved / "checkpoints" / "epoch0001-step00000006").mkdir(parents=True)
    (saved / "checkpoints" / "latest").write_text("epoch0001-step00000006\n")
    assert _stop_rank_0(saved)["resume"].endswith("training resumes from its checkpoint epoch0001-step00000006")


@pytest.mark.parametrize("earlier, kept", [
    ({"status": "failed", "failed_rank": None, "error": "a peer is gone"}, False),  # the cancel's consequence
    ({"status": "complete"}, True),                                            # ended before the cancel
    ({"status": "failed", "failed_rank": 1, "error": "NaN loss"}, True),       # its own failure
])
def test_a_cancel_replaces_only_a_summary_that_blames_no_rank(tmp_path, slurm_job, earlier, kept):
    summary = _stop_rank_0(tmp_path / "run", earlier)
    assert (summary == earlier) is kept and (summary["status"] == "cancelled") is not kept


def test_diagnose_and_the_report_say_cancelled_and_count_the_stopped_ranks_its_consequences(tmp_path):
    run = make_run(tmp_path, "slurm-15", stop_at={0: 7, 1: 6}, summary=False)
    for rank in (0, 1):
        with open(run / "metrics" / f"rank-{rank}.jsonl", "a") as f:
            f.write(json.dumps({"kind": "end", "t": 1_700_000_002.0, "rank": rank, "host": f"node{rank + 1}",
                                "status": "stopped", "error": "stopped by SIGTERM"}) + "\n")
    resume = "DSCLUSTER_RUN_ID=slurm-15 sbatch job.sbatch"
    (run / "summary.json").write_text(json.dumps({
        "status": "cancelled", "run_id": "slurm-15", "world_size": 2, "steps": 7, "failed_rank": None,
        "error": None, "cancelled_by": "Slurm job 15 was cancelled (scancel)", "resume": resume}))
    loaded = load_run(run)
    doc = diagnose(loaded)
    first = doc["findings"][0]
    assert (first["kind"], first["severity"]) == ("run_cancelled", "warning")
    assert first["message"] == f"Slurm job 15 was cancelled (scancel) at step 7; to resume: {resume}"
    # each rank stopped by the cancel, rank 1 a step behind: warnings, not the run's failure
    assert doc["healthy"] and {f["kind"] for f in doc["findings"][1:]} == {"rank_died", "rank_behind"}
    html = render_report(loaded, summary_row(loaded), [], doc)
    assert f"<b>This run was cancelled</b> at step 7; to resume: <code>{resume}</code>" in html
