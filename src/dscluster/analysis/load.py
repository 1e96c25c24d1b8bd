"""Read a run directory into plain Python data. Files only: never the live job.

A run directory may be partial (training still running, or crashed): every file is optional,
a torn last line is skipped, a missing summary.json means "did not complete". Only a
directory with none of the run files is rejected (UsageError, exit 2), because then the user
passed the wrong path and a page of empty plots would hide that.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dscluster.analysis.monitor import read_monitor
from dscluster.analysis.opbuild import read_tail
from dscluster.errors import UsageError
from dscluster.files import redact
from dscluster.files.filemodel import NUMBER, validate
from dscluster.files.fsutil import read_jsonl
from dscluster.rundir.layout import (
    CHECKPOINT_DIR,
    CONFIG_FILE,
    DS_CONFIG_FILE,
    ENV_DIR,
    METRICS_DIR,
    PROCESS_DIR,
    SUMMARY_FILE,
    TELEMETRY_DIR,
)

_RANK_FILE = re.compile(r"^rank-(\d+)\.(jsonl|json)$")
# Flight-recorder / trace dumps the training side may leave (names vary by torch version).
TRACE_PATTERNS = ("**/nccl_trace_rank_*", "**/flight_recorder*", "**/fr_trace*", "traces/**/*")


@dataclass
class RankMetrics:
    rank: int
    start: dict[str, Any] | None = None
    steps: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    targets: list[dict[str, Any]] = field(default_factory=list)
    """`target` records: when the held-out accuracy first reached target_accuracy."""
    end: dict[str, Any] | None = None
    last_t: float | None = None
    """Time of the last record of any kind: when the rank was last heard from."""
    process: dict[str, Any] | None = None
    """entry_cn.sh's record of a user program's rank (process/rank-R.json): start_t, end_t,
    exit_code (None while it runs), host, gpu. A script without userlog has only this."""

    @property
    def exit_code(self) -> int | None:
        code = (self.process or {}).get("exit_code")
        return code if isinstance(code, int) else None

    @property
    def host(self) -> str | None:
        for rec in (self.start, self.end, *(self.steps[-1:]), self.process):
            if rec and rec.get("host"):
                return rec["host"]
        return None

    @property
    def last_step(self) -> int | None:
        return self.steps[-1].get("step") if self.steps else None


@dataclass
class HostTelemetry:
    host: str
    meta: dict[str, Any] | None = None
    samples: list[dict[str, Any]] = field(default_factory=list)
    end: dict[str, Any] | None = None

    @property
    def backend(self) -> str:
        for rec in (self.meta, *self.samples[:1]):
            if rec and rec.get("backend"):
                return rec["backend"]
        return "none"

    @property
    def has_gpu(self) -> bool:
        return any(s.get("gpus") for s in self.samples)


@dataclass
class RunData:
    path: Path
    name: str
    ranks: dict[int, RankMetrics] = field(default_factory=dict)
    telemetry: dict[str, HostTelemetry] = field(default_factory=dict)
    env: dict[int, dict[str, Any]] = field(default_factory=dict)
    summary: dict[str, Any] | None = None
    config: dict[str, Any] | None = None
    ds_config: dict[str, Any] | None = None
    trace_files: list[Path] = field(default_factory=list)
    summary_problem: str | None = None
    """Why summary.json exists but could not be used (`read_summary`); None when it was read or is absent."""
    problems: list[str] = field(default_factory=list)
    """Files that could not be read: shown in the report rather than aborting it."""
    monitor: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    """DeepSpeed's monitor series found in the run directory, by tag (analysis/monitor.py)."""

    @property
    def completed(self) -> bool:
        """True only when rank 0 wrote summary.json with status complete."""
        return bool(self.summary) and self.summary.get("status") == "complete"

    @property
    def world_size(self) -> int | None:
        if self.summary and self.summary.get("world_size"):
            return int(self.summary["world_size"])
        sizes = [rec.get("world_size") for r in self.ranks.values() for rec in (r.start, r.process)
                 if rec and isinstance(rec.get("world_size"), int)]
        if sizes:
            return int(max(sizes))
        return len(self.ranks) or None

    @property
    def precision(self) -> str | None:
        if self.summary and self.summary.get("precision"):
            return self.summary["precision"]
        for r in self.ranks.values():
            if r.start and r.start.get("precision"):
                return r.start["precision"]
        return None

    @property
    def t0(self) -> float | None:
        """Earliest timestamp in the run: plots show seconds since this."""
        ts = [r.start["t"] for r in self.ranks.values() if r.start and "t" in r.start]
        ts += [s["t"] for r in self.ranks.values() for s in r.steps[:1] if "t" in s]
        ts += [h.samples[0]["t"] for h in self.telemetry.values() if h.samples and "t" in h.samples[0]]
        return min(ts) if ts else None

    def all_steps(self) -> list[dict[str, Any]]:
        return [s for r in sorted(self.ranks) for s in self.ranks[r].steps]

    def evals(self) -> list[dict[str, Any]]:
        """Held-out evaluations (rank 0 writes them; any rank's are accepted)."""
        out = []
        for r in sorted(self.ranks):
            out.extend(self.ranks[r].evals)
        return sorted(out, key=lambda e: (e.get("step") or 0, e.get("t") or 0))


def is_run_dir(path: Path) -> bool:
    return any((path / n).exists() for n in (METRICS_DIR, TELEMETRY_DIR, SUMMARY_FILE, ENV_DIR, PROCESS_DIR))


def _read_json(path: Path, problems: list[str]) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        problems.append(f"{path}: unreadable ({type(e).__name__}: {e}); ignored")
        return None


def _read_records(path: Path, problems: list[str]) -> list[dict]:
    try:
        records = read_jsonl(path)
    except (OSError, UnicodeDecodeError) as e:
        problems.append(f"{path}: unreadable ({type(e).__name__}: {e}); ignored")
        return []
    return [r for r in records if isinstance(r, dict)]


# summary.json's fields (runlog.summary_record) and their types, for dscluster.files.filemodel.
SUMMARY_TYPES: dict[str, tuple[type, ...]] = {
    "status": (str,), "run_id": (str,), "world_size": (int,), "hosts": (list,), "hosts[]": (str,),
    "precision": (str,), "model": (str,), "dataset": (str,), "epochs": (int,), "steps": (int,),
    "global_batch": (int,), "images_per_s": NUMBER, "accuracy": NUMBER, "wall_s": NUMBER, "overflow_steps": (int,),
    "failed_rank": (int,), "failed_host": (str,), "error": (str,), "failed_ranks": (list,), "failed_ranks[]": (int,),
    "vanished_hosts": (list,), "vanished_hosts[]": (str,), "peak_mem_mb": NUMBER, "peak_host_mb": NUMBER,
    "plan": (dict,), "run_images_per_s": NUMBER, "run_s": NUMBER,
    "warmup_steps": (int,), "resume": (str,), "cancelled_by": (str,),
}


def read_summary(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(summary.json validated against SUMMARY_TYPES, None) or (None, why it is unreadable); (None, None)
    when there is none (still running, or crashed before rank 0 wrote it)."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None, None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, f"summary.json is unreadable ({type(e).__name__}: {e})"
    if not isinstance(doc, dict):
        return None, f"summary.json is unreadable (a JSON {type(doc).__name__}, not an object)"
    try:
        validate(doc, SUMMARY_TYPES)
    except ValueError as e:
        return None, f"summary.json is unreadable ({e})"
    return doc, None


def load_rank_metrics(path: Path, rank: int, problems: list[str]) -> RankMetrics:
    rm = RankMetrics(rank=rank)
    for rec in _read_records(path, problems):
        kind = rec.get("kind")
        if kind == "start":
            rm.start = rec
        elif kind == "step" and isinstance(rec.get("step"), (int, float)):
            rm.steps.append(rec)
        elif kind == "eval":
            rm.evals.append(rec)
        elif kind == "target":
            rm.targets.append(rec)
        elif kind == "end":
            rm.end = rec
        if isinstance(rec.get("t"), (int, float)):
            rm.last_t = rec["t"] if rm.last_t is None else max(rm.last_t, rec["t"])
    # A resumed run appends: keep the last record of each step number, in step order.
    by_step = {int(s["step"]): s for s in rm.steps}
    rm.steps = [by_step[k] for k in sorted(by_step)]
    return rm


def load_host_telemetry(path: Path, problems: list[str]) -> HostTelemetry:
    ht = HostTelemetry(host=path.stem)
    for rec in _read_records(path, problems):
        kind = rec.get("kind", "sample")
        if kind == "meta":
            ht.meta = rec
        elif kind == "end":
            ht.end = rec
        elif kind == "sample" and isinstance(rec.get("t"), (int, float)):
            rec.setdefault("gpus", [])
            ht.samples.append(rec)
    if ht.meta and ht.meta.get("host"):
        ht.host = ht.meta["host"]
    ht.samples.sort(key=lambda s: s["t"])
    return ht


def find_trace_files(path: Path) -> list[Path]:
    """Flight-recorder/trace dumps anywhere in the run dir (nccl_trace/, traces/, top level),
    except inside checkpoints/, which can be large and never holds them."""
    found: set[Path] = set()
    for pattern in TRACE_PATTERNS:
        for p in path.glob(pattern):
            if p.is_file() and not p.name.startswith(".") and CHECKPOINT_DIR not in p.relative_to(path).parts:
                found.add(p)
    return sorted(found)


def load_run(path: str | Path) -> RunData:
    """Load everything there is; raise UsageError only for a missing, empty or foreign dir."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{path}: no such run directory (pass runs/<id>, as printed by dscluster train)")
    if not path.is_dir():
        raise UsageError(f"{path}: not a directory (pass a run directory runs/<id>)")
    if not is_run_dir(path):
        raise UsageError(
            f"{path}: not a dscluster run directory (no {METRICS_DIR}/, {TELEMETRY_DIR}/, {ENV_DIR}/, "
            f"{PROCESS_DIR}/ or {SUMMARY_FILE}); pass runs/<id>, as printed by dscluster train"
        )
    run = RunData(path=path, name=path.resolve().name)
    problems = run.problems
    for f in sorted((path / METRICS_DIR).glob("rank-*.jsonl")):
        m = _RANK_FILE.match(f.name)
        if m:
            run.ranks[int(m.group(1))] = load_rank_metrics(f, int(m.group(1)), problems)
    for f in sorted((path / TELEMETRY_DIR).glob("*.jsonl")):
        ht = load_host_telemetry(f, problems)
        run.telemetry[ht.host] = ht
    for f in sorted((path / PROCESS_DIR).glob("rank-*.json")):
        m = _RANK_FILE.match(f.name)
        data = _read_json(f, problems)
        if m and isinstance(data, dict):
            tail = read_tail(f.with_suffix(".stderr"))  # the program's last words (analysis/opbuild.py)
            run.ranks.setdefault(int(m.group(1)), RankMetrics(rank=int(m.group(1)))).process = (
                {**data, "stderr_tail": tail} if tail else data)
    for f in sorted((path / ENV_DIR).glob("rank-*.json")):
        m = _RANK_FILE.match(f.name)
        data = _read_json(f, problems)
        if m and isinstance(data, dict):  # a record written before the secret rule, or by hand: hidden here
            run.env[int(m.group(1))] = redact.redact_env(data)
    run.summary, run.summary_problem = read_summary(path / SUMMARY_FILE)
    if run.summary_problem:
        problems.append(f"{path / SUMMARY_FILE}: {run.summary_problem}")
    ds = _read_json(path / DS_CONFIG_FILE, problems)
    run.ds_config = ds if isinstance(ds, dict) else None
    try:
        cfg = yaml.safe_load((path / CONFIG_FILE).read_text(encoding="utf-8"))
        run.config = cfg if isinstance(cfg, dict) else None
    except FileNotFoundError:
        pass
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        problems.append(f"{path / CONFIG_FILE}: unreadable ({type(e).__name__}); ignored")
    run.trace_files = find_trace_files(path)
    run.monitor = read_monitor(path, problems)
    return run
