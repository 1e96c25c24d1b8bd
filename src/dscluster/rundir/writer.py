"""Writing this rank's part of the run directory (schema in README "Run directory").

metrics/rank-R.jsonl (one writer per rank, a line per record, flushed), env/rank-R.json
(the environment that decided networking and placement), and on rank 0 config.yaml,
ds_config.json and summary.json. Every metrics record carries kind, t, rank, host.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

from dscluster.files import redact
from dscluster.files.fsutil import JsonlWriter, atomic_write_json
from dscluster.rundir import layout

_ENV_PREFIXES = ("NCCL_", "GLOO_", "MASTER_", "OMPI_COMM_WORLD_", "DSCLUSTER_", "TORCH_NCCL_", "TORCH_FR_", "SLURM_",
                 "PMI_")
_ENV_KEYS = ("CUDA_VISIBLE_DEVICES", "PMIX_RANK", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
             "DS_ACCELERATOR", "PMIX_NAMESPACE", "OMP_NUM_THREADS", "TORCH_EXTENSIONS_DIR")


def effective_env(env: dict | None = None) -> dict:
    env = os.environ if env is None else env
    return redact.redact_env({k: v for k, v in sorted(env.items()) if k in _ENV_KEYS or k.startswith(_ENV_PREFIXES)})


def software_versions() -> dict[str, str | None]:
    """What ran: a rank on a node with another torch/DeepSpeed behaves differently (diagnose compares)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("torch", "deepspeed", "dscluster"):
        mod = sys.modules.get(name)  # an imported module's own version names the build (torch: +cu130)
        try:
            out[name] = getattr(mod, "__version__", None) or metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


class RunLog:
    """This rank's writers; `record(kind, **fields)` stamps t, rank and host (`final=True`: the file's last
    record, see JsonlWriter)."""

    def __init__(self, run_dir: Path, rank: int, host: str):
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.host = host
        self.metrics = JsonlWriter(self.run_dir / layout.METRICS_DIR / f"rank-{rank}.jsonl")
        self._secrets = redact.secret_values()  # an error message may quote one: records never do
        self._summary_lock = threading.Lock()
        self._summary_sealed = False

    def record(self, kind: str, *, final: bool = False, **fields) -> dict:
        rec = {"kind": kind, "t": time.time(), "rank": self.rank, "host": self.host, **fields}
        if any(isinstance(v, str) for v in fields.values()):
            rec = redact.redact_doc(rec, values=self._secrets)
        self.metrics.write(rec, final=final)
        return rec

    def write_env(self, **facts) -> None:
        """env/rank-R.json: the effective environment, versions, and `facts` (e.g. the rank's CPUs)."""
        snap = effective_env()
        snap.update({"host": self.host, "pid": os.getpid(), "versions": software_versions(), **facts})
        atomic_write_json(self.run_dir / layout.ENV_DIR / f"rank-{self.rank}.json",
                          redact.redact_doc(snap, values=self._secrets))

    def write_summary(self, summary: dict, *, only_if_absent_or_not_failed: bool = False,
                      only_if_absent: bool = False, over_guesses: bool = False, final: bool = False) -> None:
        """`write_summary` for this rank; `final`: the run's last word (a cancel, written by the SIGTERM
        thread), which the main thread, failing in a collective as the job is torn down, cannot replace."""
        with self._summary_lock:
            if self._summary_sealed:
                return
            write_summary(self.run_dir, summary, only_if_absent_or_not_failed=only_if_absent_or_not_failed,
                          only_if_absent=only_if_absent, over_guesses=over_guesses, secrets=self._secrets)
            self._summary_sealed = final

    def close(self) -> None:
        self.metrics.close()


def write_summary(run_dir: Path, summary: dict, *, only_if_absent_or_not_failed: bool = False,
                  only_if_absent: bool = False, over_guesses: bool = False, secrets=None) -> None:
    """summary.json, atomically, through the one secret rule (`secrets`: values to hide besides the
    environment's, redact.secret_values()); with `only_if_absent_or_not_failed` a failure already
    there stays, with `only_if_absent` any summary already there (a stopped rank's guess never
    replaces a run's own story, complete or failed); with `over_guesses` only a failure that blames
    no rank is replaced (a peer's absence or a SIGTERM seen before the cause: a cancel's consequences)."""
    path = Path(run_dir) / layout.SUMMARY_FILE
    if only_if_absent and path.exists():
        return
    if (only_if_absent_or_not_failed or over_guesses) and path.exists():
        try:
            there = json.loads(path.read_text())
        except (OSError, ValueError):
            there = {}
        there = there if isinstance(there, dict) else {}
        if only_if_absent_or_not_failed and there.get("status") == "failed":
            return  # a better-informed rank already told the story
        if over_guesses and there and not (there.get("status") == "failed" and there.get("failed_rank") is None):
            return  # complete, or a failure with its rank: the run's own story
    atomic_write_json(path, redact.redact_doc(summary, values=redact.secret_values() if secrets is None else secrets))


def set_aside_summary(run_dir: Path) -> Path | None:
    """A new run starting in `run_dir`: an earlier run's summary.json moves to summary.previous-N.json
    (N the next free number), so summary.json tells only this run's story (a rank-0 exit 0 keeps a
    summary already there, and an earlier failure would stay). Returns where it went, or None."""
    path = Path(run_dir) / layout.SUMMARY_FILE
    if not path.is_file():
        return None
    n = 1
    while (aside := path.with_name(layout.PREVIOUS_SUMMARY.format(n=n))).exists():
        n += 1
    os.replace(path, aside)
    return aside


def summary_record(**fields) -> dict:
    keys = ("status", "run_id", "world_size", "hosts", "precision", "model", "dataset", "epochs", "steps",
            "global_batch", "images_per_s", "accuracy", "wall_s", "overflow_steps", "failed_rank", "failed_host",
            "error")
    out = {k: fields.get(k) for k in keys}
    out.update({k: v for k, v in fields.items() if k not in out})
    return out


@dataclass
class RunRecord:
    """What summary.json tells of a run, filled in as it goes: the loop sets the run's shape and its
    end, the log window counts overflow steps (logwindow.py)."""

    run_id: str
    world_size: int
    hosts: list[str]
    model: str
    dataset: str
    epochs: int
    steps: int = 0
    """The last global step reached: what a failed run's summary reports."""
    overflow_steps: int = 0
    precision: str | None = None
    global_batch: int | None = None
    images_per_s: float | None = None
    accuracy: float | None = None
    peak_mem_mb: float | None = None
    peak_host_mb: float | None = None
    """Rank 0's peak resident host memory (train/memory.py)."""
    timed_steps: int | None = None
    timed_s: float | None = None
    warmup_steps: int | None = None
    """The first steps of this process left out of images_per_s: 5, or 0 when it trained 5 or fewer (all counted)."""
    run_images_per_s: float | None = None
    """Images ÷ seconds from the first step's start to the end (core/timing.py `StepWindow.whole_run`);
    images_per_s is the steady figure, after the warm-up steps."""
    run_s: float | None = None
    time_to_accuracy: dict = field(default_factory=dict)
    """evaluation.TimeToAccuracy.summary(): target_accuracy and time_to_accuracy where a target is set."""
    plan: dict | None = None
    """plan's saved prediction against this run (runmodel/predicted.py), where there was one."""
    vanished_hosts: list[str] | None = None
    """Nodes that stopped answering when a collective failed (liveness.py)."""

    def summary(self, *, status: str, wall_s: float, **failure) -> dict:
        """summary.json's record: the fields set so far (peak_mem_mb always), then `failure`'s."""
        fields = {k: v for k, v in asdict(self).items()
                  if k != "time_to_accuracy" and (v is not None or k in _ALWAYS_IN_SUMMARY)}
        return summary_record(status=status, wall_s=wall_s, **fields, **self.time_to_accuracy, **failure)


# summary_record's keys are always there; of the rest, peak_mem_mb too (null on CPU)
_ALWAYS_IN_SUMMARY = ("peak_mem_mb",)
