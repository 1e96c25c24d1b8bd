"""`launch --launcher slurm --submit`: reading `scontrol show job` and the closing line of a job."""

from __future__ import annotations

from pathlib import Path

import pytest

from dscluster.cli import main
from dscluster.launch import slurmjob

# `scontrol show job 1` from Slurm 22.05.8 (Debian 12) on the simulated lab, shortened.
SHOW_JOB = """JobId=1 JobName=dscluster
   UserId=dslab(1001) GroupId=dslab(1001) MCS_label=N/A
   Priority=4294901759 Nice=0 Account=(null) QOS=(null)
   JobState=FAILED Reason=NonZeroExitCode Dependency=(null)
   Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=143:0
   RunTime=00:00:21 TimeLimit=UNLIMITED TimeMin=N/A
   NodeList=node[1-2] BatchHost=node1
   Command=/shared/work/srun-kill.sbatch
   WorkDir=/shared/work
"""


def test_parse_job_reads_state_exit_code_and_reason():
    end = slurmjob.job_end("1", slurmjob.parse_job(SHOW_JOB))
    assert (end.state, end.exit_code, end.signal, end.reason) == ("FAILED", 143, 0, "NonZeroExitCode")


@pytest.mark.parametrize("state,exit_code,interrupted,code,words", [
    ("COMPLETED", "0:0", False, 0, "Slurm job 7 completed"),
    ("FAILED", "143:0", False, 143, "Slurm job 7 ended FAILED (exit 143:0"),
    ("NODE_FAIL", "0:9", False, 137, "ended NODE_FAIL"),
    ("CANCELLED", "0:15", False, 1, "Slurm job 7 was cancelled (scancel); Slurm stopped every rank"),
    ("CANCELLED", "0:15", True, 130, "cancelled on Ctrl-C (scancel)"),
])
def test_job_report_gives_the_jobs_code_and_says_how_it_ended(state, exit_code, interrupted, code, words):
    end = slurmjob.job_end("7", {"JobState": state, "ExitCode": exit_code})
    got, message = slurmjob.job_report(end, Path("/runs/slurm-7"), interrupted=interrupted)
    assert got == code and words in message, message


def test_sbatch_argv_returns_at_once_with_the_job_id():
    assert slurmjob.sbatch_submit_argv("job.sbatch") == ["sbatch", "--parsable", "--output=slurm-%j.out", "job.sbatch"]


def test_submit_without_slurm_is_a_usage_error(capsys):
    assert main(["launch", "--launcher", "mpirun", "--submit"]) == 2
    assert "--launcher slurm" in capsys.readouterr().err
