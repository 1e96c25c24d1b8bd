"""What entry_cn.sh records for each rank of a user's own program: process/rank-R.json.

    python -m dscluster.rundir.rankrecord start -- PROGRAM ARGS...   # before the program starts
    python -m dscluster.rundir.rankrecord end RC                      # after it exited with RC

So a script that never calls dscluster.userlog still leaves each rank's start, end, exit code, host
and GPU. `end` rewrites the record atomically and writes summary.json by the run directory's rule
(docs/run-directory.md): the first failure is the cause, and rank 0's exit 0 writes "complete"
unless a summary is already there. Exit codes above 128 name the signal, as the shell reports them.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from dscluster.files.fsutil import atomic_write_json
from dscluster.node.gpus import visible_indices
from dscluster.node.ranks import detect_ranks
from dscluster.rundir import layout
from dscluster.rundir.userlog import run_dir
from dscluster.rundir.writer import summary_record, write_summary


def record_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / layout.PROCESS_DIR / f"rank-{rank}.json"


def exit_text(code: int) -> str:
    """'exit 1', or 'exit 143 (SIGTERM)' where the shell's code names a signal."""
    if code > 128:
        try:
            return f"exit {code} ({signal.Signals(code - 128).name})"
        except ValueError:
            pass
    return f"exit {code}"


def rank_gpu(local_rank: int, env: dict[str, str]) -> dict[str, Any] | None:
    """The GPU this rank uses by the torchrun convention (the local-rank-th visible one), from NVML;
    None on a node without an NVIDIA driver."""
    try:
        import pynvml  # optional (nvidia-ml-py): absent where there is no NVIDIA driver

        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        uuids = [pynvml.nvmlDeviceGetUUID(h) for h in handles]
        uuids = [u.decode() if isinstance(u, bytes) else u for u in uuids]
        visible = visible_indices(env.get("CUDA_VISIBLE_DEVICES"), uuids)
        if not visible:
            return None
        index = visible[local_rank % len(visible)]
        name = pynvml.nvmlDeviceGetName(handles[index])
        return {"index": index, "uuid": uuids[index], "name": name.decode() if isinstance(name, bytes) else name}
    except Exception:  # a half-working driver must not stop the rank: the record says "unknown"
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def launcher_job(env: dict[str, str]) -> str | None:
    """The launcher's own id of this job, alike on every rank whatever DSCLUSTER_RUN_ID they got: how
    `collect` and `diagnose` find the ranks of a split run."""
    return env.get("PMIX_NAMESPACE") or env.get("OMPI_MCA_ess_base_jobid") or env.get("SLURM_JOB_ID") or None


def start(run_dir: Path, argv: list[str], env: dict[str, str], now: float | None = None) -> dict[str, Any]:
    info = detect_ranks(env)
    rec = {"rank": info.rank, "local_rank": info.local_rank, "world_size": info.world_size,
           "host": os.uname().nodename, "entry_pid": os.getppid(), "argv": argv,
           "gpu": rank_gpu(info.local_rank, env), "start_t": time.time() if now is None else now,
           "end_t": None, "exit_code": None, "status": "running", "launcher_job": launcher_job(env)}
    atomic_write_json(record_path(run_dir, info.rank), rec)
    return rec


def end(run_dir: Path, code: int, env: dict[str, str], now: float | None = None) -> dict[str, Any]:
    info = detect_ranks(env)
    path = record_path(run_dir, info.rank)
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):  # no start record (it failed to write): the end still counts
        rec = {"rank": info.rank, "world_size": info.world_size, "host": os.uname().nodename, "start_t": None}
    end_t = time.time() if now is None else now
    rec.update(end_t=end_t, exit_code=code, status="complete" if code == 0 else "failed")
    atomic_write_json(path, rec)
    wall = round(end_t - rec["start_t"], 3) if rec.get("start_t") else None
    if code == 0 and info.rank == 0:
        _summary_complete(Path(run_dir), info.world_size, wall)
    elif code != 0:
        write_summary(run_dir, summary_record(
            status="failed", run_id=Path(run_dir).name, world_size=info.world_size, wall_s=wall,
            exit_code=code, failed_rank=info.rank, failed_host=rec.get("host"),
            error=f"{exit_text(code)} on rank {info.rank}"), only_if_absent_or_not_failed=True)
    return rec


def _summary_complete(run_dir: Path, world_size: int, wall: float | None) -> None:
    """Rank 0 exited 0: summary.json says complete with exit 0. A summary the program wrote itself
    (userlog) says more and stays, gaining the exit code; a failure another rank recorded stays."""
    path = run_dir / layout.SUMMARY_FILE
    try:
        summary = json.loads(path.read_text())
    except FileNotFoundError:
        summary = None
    except (OSError, ValueError):
        summary = None
    if not isinstance(summary, dict):
        write_summary(run_dir, summary_record(status="complete", run_id=run_dir.name, world_size=world_size,
                                              wall_s=wall, exit_code=0))
    elif summary.get("status") == "complete" and "exit_code" not in summary:
        write_summary(run_dir, {**summary, "exit_code": 0})


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    env = dict(os.environ)
    try:
        if argv[:2] == ["start", "--"]:
            start(run_dir(env), argv[2:], env)
            return 0
        if len(argv) == 2 and argv[0] == "end" and argv[1].lstrip("-").isdigit():
            end(run_dir(env), int(argv[1]), env)
            return 0
    except OSError as e:  # the program's own result matters more than its record: say so, go on
        print(f"entry_cn: warning: could not write this rank's record: {e}", file=sys.stderr)
        return 0
    print("usage: python -m dscluster.rundir.rankrecord start -- PROGRAM [ARGS] | end EXIT_CODE", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
