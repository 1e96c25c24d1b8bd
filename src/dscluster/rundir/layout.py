"""Run identity and the run-directory layout shared by training, telemetry and analysis.

Every rank of one job must agree on the run directory without talking to each other first
(the telemetry sampler starts before training initialises the process group), so the id is
derived from what the launcher gives every rank alike:
  DSCLUSTER_RUN_ID (set by `dscluster launch` or the user) >
  PMIX_NAMESPACE / OMPI_MCA_ess_base_jobid (OpenMPI: same on every rank of a job) >
  SLURM_JOB_ID > TORCHELASTIC_RUN_ID > a timestamp (single process).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path


def resolve_run_id(env: dict[str, str] | None = None, now: float | None = None) -> str:
    env = os.environ if env is None else env
    if env.get("DSCLUSTER_RUN_ID"):
        return _safe(env["DSCLUSTER_RUN_ID"])
    for key, prefix in (
        ("PMIX_NAMESPACE", "mpi"),
        ("OMPI_MCA_ess_base_jobid", "mpi"),
        ("SLURM_JOB_ID", "slurm"),
        ("TORCHELASTIC_RUN_ID", "elastic"),
    ):
        if env.get(key):
            return f"{prefix}-{_safe(env[key])}"
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now if now is not None else time.time()))
    return f"run-{stamp}-{os.getpid()}"


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.") or "run"


def runs_root(env: dict[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    return Path(env.get("DSCLUSTER_RUNS", "runs"))


def run_dir(env: dict[str, str] | None = None) -> Path:
    return runs_root(env) / resolve_run_id(env)


# Layout of a run directory (documented in README "Run directory").
CONFIG_FILE = "config.yaml"
DS_CONFIG_FILE = "ds_config.json"
SUMMARY_FILE = "summary.json"
PREVIOUS_SUMMARY = "summary.previous-{n}.json"  # an earlier run's summary, set aside when a run starts again
METRICS_DIR = "metrics"          # metrics/rank-R.jsonl, one writer per rank
TELEMETRY_DIR = "telemetry"      # telemetry/<host>.jsonl, one sampler per node
ENV_DIR = "env"                  # env/rank-R.json, each rank's effective environment
PROCESS_DIR = "process"          # process/rank-R.json, entry_cn.sh's record of a user program's rank
CHECKPOINT_DIR = "checkpoints"
PLOTS_DIR = "plots"
REPORT_FILE = "report.html"
SHARES_FILE = "shares.json"      # rank 0: the balanced batching's per-rank shares (train, batching=balanced)
TRACES_DIR = "traces"            # traces/rank-R.txt, Python stack dumps of every rank
NCCL_TRACE_DIR = "nccl_trace"    # torch's flight recorder dumps of a failing rank
