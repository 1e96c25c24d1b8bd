"""A rank stopped by SIGTERM still says so: its `end` record, and rank 0's summary.json.

Launchers stop every rank with SIGTERM when one dies, when a job is cancelled, or on Ctrl-C; a
cancelled Slurm job is written as `cancelled`, not failed (`slurm_cancel`). The main thread may be
waiting in a collective, where a Python signal handler never runs, so the handler's C half writes
to a pipe (`signal.set_wakeup_fd`) and a thread writes the summary and exits 143, the signal's own
code (docs/failure-behaviour.md)."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from dscluster.launch import slurmjob
from dscluster.rundir import checkpoints, layout

EXIT_CODE = 128 + signal.SIGTERM


class OnTerminate:
    """SIGTERM → `then()` (if set) on a thread of its own → `os._exit(143)`. Only in the main thread
    (where signal handlers are set); elsewhere it does nothing."""

    def __init__(self) -> None:
        self.then: Callable[[], None] | None = None
        self._fds: tuple[int, int] | None = None
        self._previous: tuple[object, int] | None = None
        if threading.current_thread() is not threading.main_thread():
            return
        r, w = os.pipe()
        os.set_blocking(w, False)
        try:
            old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
            old_handler = signal.signal(signal.SIGTERM, _ignored)
        except (ValueError, OSError):
            os.close(r)
            os.close(w)
            return
        self._fds, self._previous = (r, w), (old_handler, old_fd)
        threading.Thread(target=self._wait, args=(r,), name="dscluster-sigterm", daemon=True).start()

    def _wait(self, r: int) -> None:
        try:
            while True:
                data = os.read(r, 64)
                if not data:  # the write end closed: the run ended without a SIGTERM
                    os.close(r)
                    return
                if signal.SIGTERM in data:  # other signals with a Python handler (SIGINT) wake it too
                    break
        except OSError:
            return
        try:
            if self.then is not None:
                self.then()
        finally:
            os._exit(EXIT_CODE)

    def close(self) -> None:
        """The run is over: SIGTERM's handler and the wake-up pipe as they were before (call it after
        faulthandler let go of SIGTERM, which gives back the handler it found: this one's)."""
        if self._fds is None or self._previous is None:
            return
        old_handler, old_fd = self._previous
        signal.signal(signal.SIGTERM, old_handler)  # type: ignore[arg-type]
        signal.set_wakeup_fd(old_fd)
        w = self._fds[1]
        self._fds = None
        os.close(w)  # the thread reads the end of the pipe and closes its own side


def _ignored(signum, frame) -> None:
    """The Python half: nothing; the waiting thread acts (the main thread may be stuck in a collective)."""


STOPPED = ("rank 0 was stopped by SIGTERM before it learned why (a launcher stops every rank when one dies, "
           "when the job is cancelled, and on Ctrl-C): `dscluster diagnose {run_dir}` names the rank that "
           "stopped first")
"""summary.json's error when rank 0 is stopped: no rank is blamed (failed_rank null), as for a peer's failure."""

STOPPED_END = "stopped by SIGTERM (its launcher stopping the job)"
"""The `end` record's error of a stopped rank (status `stopped`): diagnose counts it a consequence, not a cause."""


CANCELLED_BY = "Slurm job {job_id} was cancelled (scancel, or Ctrl-C under `dscluster launch --submit`)"
SLURM_QUERY_S = 2.0
"""How long rank 0 waits for `scontrol`, twice at most: Slurm's KillWait (30 s by default, 5 on the lab)
is all the time it has before SIGKILL."""


def record_stop(log, record, run_dir: Path, started: float, *, summary: bool) -> Callable[[], None]:
    """`OnTerminate.then` for a training rank: its `end` record (status `stopped`), and with `summary`
    (rank 0, not a calibration) summary.json: `cancelled` where Slurm says the job was cancelled (over
    a failure that blames no rank, and the last word), else a failed one, unless the run's summary is
    already there (a complete run a launcher stops in its teardown stays complete; a rank's own
    failure stays)."""

    def then() -> None:
        log.record("end", status="stopped", error=STOPPED_END, final=True)  # the main thread may still be stepping
        if not summary:
            return
        wall_s = round(time.time() - started, 3)
        cancel = slurm_cancel(run_dir)
        if cancel:
            log.write_summary(record.summary(status="cancelled", wall_s=wall_s, **cancel), over_guesses=True,
                              final=True)
        else:
            log.write_summary(record.summary(status="failed", wall_s=wall_s, error=STOPPED.format(run_dir=run_dir)),
                              only_if_absent=True)

    return then


def slurm_cancel(run_dir: Path, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """summary.json's `cancelled_by` and `resume` when this rank runs under Slurm and Slurm says the
    job is being cancelled; {} otherwise, or when scontrol does not answer in time."""
    env = os.environ if env is None else env
    job_id = env.get("SLURM_JOB_ID")
    if not job_id:
        return {}
    fields: dict[str, str] = {}
    for _ in range(2):  # once more where a busy slurmctld did not answer
        try:
            fields = slurmjob.job_fields(job_id, timeout=SLURM_QUERY_S)
        except (OSError, subprocess.SubprocessError):
            continue
        if fields:
            break
    if not slurmjob.cancelling(fields):
        return {}
    return {"cancelled_by": CANCELLED_BY.format(job_id=job_id), "resume": resume_text(run_dir, fields.get("Command"))}


def resume_text(run_dir: Path, script: str | None) -> str:
    """How to go on: the same run id submitted again; training resumes from the run's last checkpoint."""
    run_id = Path(run_dir).name
    tag = checkpoints.find_latest(Path(run_dir) / layout.CHECKPOINT_DIR)
    start = f"from its checkpoint {tag}" if tag else "from step 0 (no checkpoint was saved in the run directory)"
    return (f"DSCLUSTER_RUN_ID={run_id} sbatch {shlex.quote(script) if script else 'JOB_SCRIPT'} (or `dscluster "
            f"launch --launcher slurm --submit --run-id {run_id} -- <the same train arguments>`): training resumes "
            f"{start}")
