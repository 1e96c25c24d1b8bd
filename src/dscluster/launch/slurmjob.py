"""Submitting the Slurm script and following the job: `dscluster launch --launcher slurm --submit`.

`sbatch` returns at once with the job id; the job is then followed with `scontrol show job` (no
accounting database needed) while its output file is copied to our stdout as it grows, so the
command behaves like the other launchers: output streamed, the job's own exit code, Ctrl-C stops
the job (`scancel`). Measured against Slurm 22.05's slurmctld and slurmd on the simulated lab.

Reading scontrol's text, telling a cancel from other ends and turning a job's end into an exit code
and a sentence are pure (`parse_job`, `cancelling`, `job_report`); `follow` does the I/O. A rank that
Slurm stops asks `job_fields` whether the job was cancelled (train/stopped.py).
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING")
POLL_S = 1.0
OUTPUT = "slurm-%j.out"
"""The job's output file (Slurm's own default name), relative to the script's --chdir."""


def sbatch_submit_argv(script: str) -> list[str]:
    """`sbatch --parsable --output=slurm-%j.out SCRIPT`: prints only the job id, returns at once."""
    return ["sbatch", "--parsable", f"--output={OUTPUT}", script]


def parse_job(text: str) -> dict[str, str]:
    """`scontrol show job N` as KEY -> value (its words are KEY=VALUE, values without spaces but the
    command lines', which are not needed here)."""
    fields: dict[str, str] = {}
    for word in text.split():
        key, sep, value = word.partition("=")
        if sep and key not in fields:
            fields[key] = value
    return fields


@dataclass(frozen=True)
class JobEnd:
    job_id: str
    state: str          # JobState: COMPLETED, FAILED, CANCELLED, TIMEOUT, NODE_FAIL, ... ("" unknown)
    exit_code: int      # ExitCode's code part (the batch script's)
    signal: int         # ExitCode's signal part
    reason: str = ""


def job_end(job_id: str, fields: dict[str, str]) -> JobEnd:
    code, _, sig = fields.get("ExitCode", "0:0").partition(":")
    return JobEnd(job_id, fields.get("JobState", ""), int(code) if code.isdigit() else 0,
                  int(sig) if sig.isdigit() else 0, fields.get("Reason", ""))


def cancelling(fields: dict[str, str]) -> bool:
    """Whether Slurm is ending the job because it was cancelled (scancel; Ctrl-C under `launch --submit`).

    Its ranks get SIGTERM while the job is COMPLETING with no reason, and it ends CANCELLED; a time
    limit gives the reason TimeLimit, a failed batch script NonZeroExitCode, and the ranks that srun
    stops when one of them failed see the job still RUNNING."""
    state = fields.get("JobState")
    return state == "CANCELLED" or (state == "COMPLETING" and fields.get("Reason") in ("None", ""))


def job_report(end: JobEnd, run_dir: Path, *, interrupted: bool = False, summary: dict | None = None
               ) -> tuple[int, str]:
    """Exit code and closing line for a followed job, in the words of `launch.run`'s job_report;
    `summary`: the run's summary.json, whose `resume` says how to go on after a cancel."""
    see = f"per-rank logs and metrics are in {run_dir}; `dscluster diagnose {run_dir}` says more"
    job = f"Slurm job {end.job_id}"
    if end.state == "COMPLETED":
        return 0, f"done; {job} completed; run directory {run_dir}"
    if end.state == "CANCELLED":
        who = "on Ctrl-C (scancel)" if interrupted else "(scancel)"
        summary = summary or {}
        at = f" at step {summary['steps']}" if isinstance(summary.get("steps"), int) else ""
        resume = summary.get("resume") if isinstance(summary.get("resume"), str) else (
            f"submit it again with DSCLUSTER_RUN_ID={run_dir.name}: training resumes from its last checkpoint")
        return (130 if interrupted else 1), (f"{job} was cancelled {who}{at}; Slurm stopped every rank. "
                                              f"To resume: {resume}. {see}")
    code = end.exit_code or (128 + end.signal if end.signal else 1)
    why = f", reason {end.reason}" if end.reason and end.reason != "None" else ""
    return code, f"{job} ended {end.state or 'in an unknown state'} (exit {end.exit_code}:{end.signal}{why}); {see}"


def job_fields(job_id: str, timeout: float = 60) -> dict[str, str]:
    """`scontrol show job JOB_ID` as parse_job reads it; {} where scontrol does not know the job."""
    res = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=timeout)
    return parse_job(res.stdout) if res.returncode == 0 else {}


class _Tail:
    """Copy what is appended to a file to our stdout."""

    def __init__(self, path: Path):
        self.path, self.offset = path, 0

    def pump(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return  # not there until the job starts
        self.offset += len(data)
        sys.stdout.write(data.decode("utf-8", "replace"))
        sys.stdout.flush()


def follow(job_id: str, output: Path) -> tuple[JobEnd, bool]:
    """Stream the job's output until Slurm says it ended; Ctrl-C cancels it (and a second one
    leaves it running). Returns how it ended and whether Ctrl-C was pressed."""
    tail, interrupted = _Tail(output), False
    fields: dict[str, str] = {}
    while True:
        try:
            tail.pump()
            fields = job_fields(job_id)
            if fields.get("JobState") not in ACTIVE:
                break   # ended (or forgotten by slurmctld: reported as an unknown state)
            time.sleep(POLL_S)
        except KeyboardInterrupt:
            if interrupted:
                print(f"dscluster launch: stopped following Slurm job {job_id}; "
                      f"`scancel {job_id}` stops it", file=sys.stderr)
                raise
            interrupted = True
            subprocess.run(["scancel", job_id], timeout=60, check=False)
    tail.pump()
    return job_end(job_id, fields), interrupted
