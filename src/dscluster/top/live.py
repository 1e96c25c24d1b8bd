"""What `dscluster top` shows: every node's GPUs, CPU, RAM and network, and a running job's ranks, now.

Sources, in order: the telemetry a running job's nodes write (runs/<id>/telemetry/<host>.jsonl) and
its ranks' metrics (metrics/rank-R.jsonl); for a node without a fresh sample there, one taken over
SSH (`python -m dscluster.top.once`, pinned host keys). Files are read from the end only, so
a long run's cost the same as a short one's. Without a shared filesystem the SSH sample also reads
the node's own copy of the run directory (`once --run-dir`, cut to `RankRecords`); the head's files
win where both have a rank. The snapshot is plain data (`Snapshot.to_dict()` is `top --once
--json`, docs/schemas.md); cli/top.py only renders it.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dscluster.analysis.stats import STRAGGLER_FACTOR
from dscluster.rundir.layout import METRICS_DIR, PROCESS_DIR, TELEMETRY_DIR, runs_root
from dscluster.telemetry.backends import SLOWDOWN_REASONS

FRESH_S = 5.0
"""A telemetry sample older than this is not "now": the node is sampled over SSH instead."""
RUNNING_S = 30.0
"""A run directory with a file written this recently is a running job (when --run-dir is not given)."""
RECENT_STEPS = 5
"""A rank's pace is the median of its last steps: one slow step (an evaluation) is not a straggler."""
TAIL_BYTES = 65536
RANK_KEYS = ("kind", "t", "rank", "host", "step", "step_time", "samples_per_s", "comm_s", "status", "exit_code")
"""The fields of a rank's records that top reads: what a node sends over SSH is cut to these."""


@dataclass
class GpuNow:
    index: int
    name: str | None
    util_percent: float | None
    mem_used_mb: float | None
    mem_total_mb: float | None
    temp_c: float | None
    power_w: float | None
    throttle: list[str]
    """NVML's slowdown reasons now (power cap, thermal, ...): idle and application clocks left out."""


@dataclass
class NodeNow:
    name: str
    """As in the hostfile."""
    host: str
    """Its hostname: the telemetry file's name."""
    source: str
    """"telemetry" (the job's sampler), "ssh" (sampled now) or "none" (neither answered: see error)."""
    age_s: float | None = None
    cpu_percent: float | None = None
    ram_used_mb: float | None = None
    ram_total_mb: float | None = None
    net_iface: str | None = None
    net_rx_bytes_per_s: float | None = None
    net_tx_bytes_per_s: float | None = None
    gpus: list[GpuNow] = field(default_factory=list)
    error: str | None = None


@dataclass
class RankNow:
    rank: int
    host: str | None
    step: int | None
    images_per_s: float | None
    """This rank's samples/s over its last steps."""
    comm_share: float | None
    """Share of its last steps spent waiting for the network (the step split); None: not measured."""
    step_time_s: float | None
    straggler: bool
    status: str
    """running, complete, failed (exit N), ..."""
    age_s: float | None
    """Seconds since its last record."""
    source: str = "file"
    """Where its records came from: "file" (the head's copy of the run directory) or "ssh" (the node's
    own copy, read over SSH: a lab without a shared filesystem, before the job's end pushes it home)."""


@dataclass
class Snapshot:
    t: float
    run_dir: str | None
    nodes: list[NodeNow]
    ranks: list[RankNow]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def tail_records(path: Path, max_bytes: int = TAIL_BYTES) -> list[dict]:
    """The complete JSON lines in the last `max_bytes` of a file (a torn last line is skipped)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return []
    lines = data.split(b"\n")
    if size > max_bytes:
        lines = lines[1:]  # the first line was cut by the seek
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def find_running_run(root: Path | None = None, now: float | None = None) -> Path | None:
    """The newest run directory under runs/ with a telemetry or metrics file written in the last RUNNING_S."""
    root = runs_root() if root is None else root
    now = time.time() if now is None else now
    best: tuple[float, Path] | None = None
    for run in root.glob("*") if root.is_dir() else ():
        for f in [*run.glob(f"{TELEMETRY_DIR}/*.jsonl"), *run.glob(f"{METRICS_DIR}/*.jsonl")]:
            try:
                mtime = f.stat().st_mtime
            except OSError:
                continue
            if now - mtime <= RUNNING_S and (best is None or mtime > best[0]):
                best = (mtime, run)
    return best[1] if best else None


def gpu_now(g: dict) -> GpuNow:
    return GpuNow(index=g.get("index", 0), name=g.get("name"), util_percent=g.get("util_percent"),
                  mem_used_mb=g.get("mem_used_mb"), mem_total_mb=g.get("mem_total_mb"), temp_c=g.get("temp_c"),
                  power_w=g.get("power_w"),
                  throttle=[r for r in g.get("throttle_reasons") or [] if r in SLOWDOWN_REASONS])


def byte_rate(new: dict, old: dict | None, key: str) -> float | None:
    if not old or not isinstance(new.get(key), int) or not isinstance(old.get(key), int):
        return None
    dt = new["t"] - old["t"]
    return max(0.0, (new[key] - old[key]) / dt) if dt > 0 else None


def node_from_samples(name: str, host: str, samples: list[dict], source: str, now: float) -> NodeNow:
    """A node from its last samples (the last two give bytes/s); `net_*_bytes_per_s` already in a
    sample (taken over SSH) win."""
    last, prev = samples[-1], (samples[-2] if len(samples) > 1 else None)
    return NodeNow(
        name=name, host=host, source=source, age_s=round(max(0.0, now - last["t"]), 1),
        cpu_percent=last.get("cpu_percent"), ram_used_mb=last.get("ram_used_mb"),
        ram_total_mb=last.get("ram_total_mb"), net_iface=last.get("net_iface"),
        net_rx_bytes_per_s=last.get("net_rx_bytes_per_s", byte_rate(last, prev, "net_rx_bytes")),
        net_tx_bytes_per_s=last.get("net_tx_bytes_per_s", byte_rate(last, prev, "net_tx_bytes")),
        gpus=[gpu_now(g) for g in last.get("gpus") or []], error=last.get("error"))


def fresh_samples(run_dir: Path, host: str, now: float) -> list[dict]:
    """The last samples of a node's telemetry file when the newest is under FRESH_S old, else []."""
    samples = [r for r in tail_records(run_dir / TELEMETRY_DIR / f"{host}.jsonl")
               if r.get("kind", "sample") == "sample" and isinstance(r.get("t"), (int, float))]
    return samples if samples and now - samples[-1]["t"] <= FRESH_S else []


def telemetry_nodes(run_dir: Path | None, hosts: dict[str, str], now: float) -> dict[str, NodeNow]:
    """{hostfile name: node} for the nodes whose sampler wrote a sample in the last FRESH_S."""
    out: dict[str, NodeNow] = {}
    if run_dir is None:
        return out
    for name, host in hosts.items():
        samples = fresh_samples(run_dir, host, now)
        if samples:
            out[name] = node_from_samples(name, host, samples, "telemetry", now)
    return out


def _recent(steps: list[dict], key: str) -> float | None:
    values = [s[key] for s in steps[-RECENT_STEPS:] if isinstance(s.get(key), (int, float))]
    return statistics.median(values) if values else None


def _compact(rec: dict) -> dict:
    return {k: rec[k] for k in RANK_KEYS if k in rec}


@dataclass
class RankRecords:
    """What top reads of one rank: its last RECENT_STEPS step records, its last record and its end
    record (metrics/rank-R.jsonl), entry_cn.sh's process record (process/rank-R.json), each cut to
    RANK_KEYS, and where they were read."""
    steps: list[dict] = field(default_factory=list)
    last: dict = field(default_factory=dict)
    end: dict | None = None
    process: dict | None = None
    source: str = "file"
    """"file" (the head's copy of the run directory) or "ssh" (a node's own copy, read over SSH)."""

    def to_dict(self) -> dict[str, Any]:
        """The records as `once --run-dir` sends them (the source is the reader's to say)."""
        return {"steps": self.steps, "last": self.last, "end": self.end, "process": self.process}

    @classmethod
    def from_dict(cls, d: dict, source: str) -> RankRecords:
        steps = [r for r in d.get("steps") or [] if isinstance(r, dict)]
        end, process = (d.get(k) if isinstance(d.get(k), dict) else None for k in ("end", "process"))
        return cls(steps=steps[-RECENT_STEPS:], last=d["last"] if isinstance(d.get("last"), dict) else {},
                   end=end, process=process, source=source)


def read_rank_records(run_dir: Path | None, source: str = "file") -> dict[int, RankRecords]:
    """{rank: its records} from a run directory's metrics/rank-R.jsonl and process/rank-R.json."""
    out: dict[int, RankRecords] = {}
    if run_dir is None:
        return out
    for path in (run_dir / METRICS_DIR).glob("rank-*.jsonl"):
        if not path.stem.split("-")[1].isdigit():
            continue
        recs = tail_records(path)
        steps = [_compact(r) for r in recs if r.get("kind") == "step"][-RECENT_STEPS:]
        end = next((r for r in reversed(recs) if r.get("kind") == "end"), None)
        out[int(path.stem.split("-")[1])] = RankRecords(steps=steps, last=_compact(recs[-1]) if recs else {},
                                                        end=_compact(end) if end else None, source=source)
    for path in (run_dir / PROCESS_DIR).glob("rank-*.json"):
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and isinstance(rec.get("rank"), int):
            out.setdefault(rec["rank"], RankRecords(source=source)).process = _compact(rec)
    return out


def merge_rank_records(head: dict[int, RankRecords], nodes: list[dict[int, RankRecords]]) -> dict[int, RankRecords]:
    """Every rank once: the head's files win where both have it (after the job's end pushed a node's
    part home, or on a shared filesystem); between nodes, the one with the newer last record."""
    def last_t(r: RankRecords) -> float:
        t = r.last.get("t")
        return float(t) if isinstance(t, (int, float)) else float("-inf")

    merged: dict[int, RankRecords] = {}
    for records in nodes:
        for rank, rec in records.items():
            if rank not in merged or last_t(rec) > last_t(merged[rank]):
                merged[rank] = rec
    merged.update(head)
    return merged


def rank_views(records: dict[int, RankRecords], now: float) -> list[RankNow]:
    """Every rank of the job: its last step, pace and network wait (metrics), or its exit (process)."""
    ranks: list[RankNow] = []
    for rank, rec in sorted(records.items()):
        steps = rec.steps
        last = rec.last
        proc = rec.process or {}
        comm = [s["comm_s"] / s["step_time"] for s in steps[-RECENT_STEPS:]
                if isinstance(s.get("comm_s"), (int, float)) and s.get("step_time")]
        code = proc.get("exit_code")
        exited = "running" if code is None else ("complete" if code == 0 else f"failed (exit {code})")
        status = str(rec.end.get("status")) if rec.end else "running"
        if not last:  # no metrics: a program without dscluster.userlog, known by its process record
            status = exited
        elif code not in (None, 0):
            status = exited
        ranks.append(RankNow(
            rank=rank, host=last.get("host", proc.get("host")), step=steps[-1].get("step") if steps else None,
            images_per_s=_recent(steps, "samples_per_s"), comm_share=statistics.fmean(comm) if comm else None,
            step_time_s=_recent(steps, "step_time"), straggler=False, status=status,
            age_s=round(now - last["t"], 1) if isinstance(last.get("t"), (int, float)) else None,
            source=rec.source))
    mark_stragglers(ranks)
    return ranks


def mark_stragglers(ranks: list[RankNow], factor: float = STRAGGLER_FACTOR) -> None:
    """Plot's rule (analysis/stats.py) on the recent pace: a step time `factor` above the median rank's."""
    times = [r.step_time_s for r in ranks if r.step_time_s]
    if len(times) < 2:
        return
    typical = statistics.median(times)
    for r in ranks:
        r.straggler = bool(r.step_time_s and r.step_time_s > factor * typical)


def once_command(python: str = sys.executable, iface: str | None = None, run_dir: Path | None = None) -> str:
    """What runs on a node to sample it once (same python path on every node, like entry_cn.sh's);
    `run_dir` (absolute: the same path on every node) also reads the node's own copy of the job's files."""
    return (f"{shlex.quote(python)} -m dscluster.top.once" + (f" --iface {shlex.quote(iface)}" if iface else "")
            + (f" --run-dir {shlex.quote(str(run_dir))}" if run_dir is not None else ""))


def parse_once(name: str, host: str, stdout: str, now: float) -> tuple[NodeNow, dict[int, RankRecords]]:
    """The node and the ranks a node's `once` line reports; a sample its job's sampler wrote counts as
    "telemetry", one taken now as "ssh"; the ranks' records are marked "ssh"."""
    try:
        sample = json.loads(stdout.strip().splitlines()[-1])
        source = "telemetry" if sample.get("job_sampler") else "ssh"
        node = node_from_samples(name, sample.get("host") or host, [sample], source, now)
        ranks = {int(r): RankRecords.from_dict(d, "ssh") for r, d in (sample.get("ranks") or {}).items()
                 if str(r).isdigit() and isinstance(d, dict)}
        return node, ranks
    except (ValueError, IndexError, AttributeError, KeyError, TypeError) as e:
        return NodeNow(name=name, host=host, source="none", error=f"unreadable sample ({type(e).__name__})"), {}
