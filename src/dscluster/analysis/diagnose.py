"""Name what went wrong in a run from its files: a node that vanished, dead ranks, the rank
missing from a collective, environment mismatches between ranks, and what flight-recorder
dumps say.

A hang in data-parallel training shows up in the files as: one rank's last step is behind
(it never reached the collective the others wait in) or ahead (it skipped a collective and
went on), and in flight-recorder dumps as one rank that never recorded the collective
sequence number the others did. Everything here reads files only.
"""

from __future__ import annotations

import json
import pickle
import re
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dscluster import core
from dscluster.analysis.gpusplit import busy_but_waiting_words, gpu_views
from dscluster.analysis.load import RunData
from dscluster.analysis.opbuild import op_build_cause
from dscluster.analysis.stats import COMM_BOUND_SHARE, comm_share, rank_stats, step_split
from dscluster.rundir.agree import split_here, split_message
from dscluster.rundir.rankrecord import exit_text

STOPPED_CODES = (130, 137, 143)
"""Exit codes of a rank the launcher (or the user) stopped: SIGINT, SIGKILL, SIGTERM."""

# Must be identical on every rank; anything else here differing means ranks were started
# from different configs, venvs or check results.
MUST_AGREE = (
    "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "DSCLUSTER_RUN_ID",
    "DSCLUSTER_PRECISION", "DSCLUSTER_HOSTFILE_SHA256", "DSCLUSTER_BTL_TCP_IF_INCLUDE",
    "DSCLUSTER_CHECK_CREATED", "DS_ALLOW_DEPRECATED_FP16", "TORCH_NCCL_BLOCKING_WAIT",
    "NCCL_IB_DISABLE", "NCCL_DEBUG_SUBSYS",
)
_VERSION_KEY = re.compile(r"version", re.IGNORECASE)
_TRACE_RANK = re.compile(r"(\d+)(?:\.\w+)?$")
# A collective's data connection that never got through: gloo's and c10d's timeouts, NCCL's socket
# transport (NET/Socket) failing to connect or to progress, the kernel's own errors.
_DATA_PATH_ERROR = re.compile(
    r"Timed out waiting \d+ ?ms for (?:send|recv)|Connection timed out|No route to host|"
    r"socketStartConnect|socketProgress|NET/Socket|Connect to \S+ failed", re.IGNORECASE)


def _clock(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


@dataclass
class Finding:
    severity: str  # "error" (the run is broken) or "warning" (look at it)
    kind: str
    message: str
    rank: int | None = None
    host: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, f"{key}."))
        else:
            out[key] = v
    return out


def env_findings(run: RunData) -> list[Finding]:
    """Keys that must agree but differ between ranks (interface names may differ by node)."""
    if len(run.env) < 2:
        return []
    flat = {r: _flatten(e) for r, e in run.env.items()}
    keys = sorted({k for f in flat.values() for k in f})
    findings = []
    for key in keys:
        leaf = key.rsplit(".", 1)[-1]
        if leaf not in MUST_AGREE and not _VERSION_KEY.search(key):
            continue
        values = {r: f.get(key) for r, f in flat.items()}
        distinct = Counter(json.dumps(v, sort_keys=True) for v in values.values())
        if len(distinct) < 2:
            continue
        common = distinct.most_common(1)[0][0]
        odd = sorted(r for r, v in values.items() if json.dumps(v, sort_keys=True) != common)
        detail = ", ".join(f"rank {r}={values[r]!r}" for r in sorted(values))
        findings.append(Finding(
            "error", "env_mismatch",
            f"{key} differs between ranks ({detail}); every rank must use the same value — "
            "re-run `dscluster check` and relaunch so all nodes source the same env files",
            rank=odd[0] if len(odd) == 1 else None,
            host=(run.env[odd[0]].get("host") if len(odd) == 1 else None),
        ))
    return findings


def exit_findings(run: RunData) -> list[Finding]:
    """A user program's ranks by entry_cn.sh's record: the first to fail with its exit code is the
    cause; ranks the launcher then stopped (SIGTERM, SIGKILL) are consequences, so warnings."""
    ended = {r: rm for r, rm in run.ranks.items() if rm.process is not None}
    failed = {r: rm for r, rm in ended.items() if rm.exit_code}
    causes = {r for r, rm in failed.items() if rm.exit_code not in STOPPED_CODES} or set(failed)
    findings = []
    for r, rm in sorted(ended.items()):
        if rm.exit_code is None and rm.end is None:
            why = (f"the launcher stopped it after rank {min(causes)} failed, before its end could be recorded"
                   if causes else "it is still running, or its node stopped before the end could be recorded")
            findings.append(Finding("warning", "rank_no_exit", f"rank {r} on {rm.host or '?'} has no exit code: {why}",
                                    rank=r, host=rm.host))
        elif r in failed:
            code = rm.exit_code
            cause = r in causes
            findings.append(Finding(
                "error" if cause else "warning", "rank_failed",
                f"rank {r} on {rm.host or '?'} failed ({exit_text(code)})" + (
                    f": {rm.end['error']}" if rm.end and rm.end.get("error") else "") + (
                    "" if cause else f": stopped after rank {min(causes)} failed"), rank=r, host=rm.host))
    if ended and not any(rm.steps for rm in run.ranks.values()):
        findings.append(Finding("warning", "no_step_records",
                                "the program wrote no step records (it does not call dscluster.userlog): the run "
                                "shows exit codes, telemetry and any DeepSpeed monitor series (docs/byo-script.md)"))
    return findings


def _another_cause(run: RunData, rank: int) -> bool:
    """Whether a rank other than `rank` died (no end record) or failed on its own (not a peer's absence)."""
    for r, rm in run.ranks.items():
        if r == rank or rm.process is not None:
            continue
        if rm.end is None or (rm.end.get("status") == "failed"
                              and not str(rm.end.get("error") or "").startswith(core.PEER_FAILURE)):
            return True
    return False


def progress_findings(run: RunData) -> list[Finding]:
    """Dead ranks, failed ranks, and the rank out of step with the others."""
    findings: list[Finding] = []
    stats = {s.rank: s for s in rank_stats(run)}
    world = run.world_size or 0
    missing = [r for r in range(world) if r not in run.ranks]
    for r in missing:
        env_host = run.env.get(r, {}).get("host")
        findings.append(Finding("error", "rank_missing",
                                f"rank {r} wrote no metrics file (world size {world}): it never started "
                                "training or could not write to the run directory", rank=r, host=env_host))
    findings += exit_findings(run)
    for r, rm in sorted(run.ranks.items()):
        s = stats[r]
        last = f"last step {s.last_step}" if s.last_step is not None else "no step completed"
        when = f", last record {_clock(rm.last_t)}" if rm.last_t else ""
        if rm.process is not None and (rm.end is None or rm.exit_code):
            continue  # entry_cn.sh's record says how it ended (exit_findings)
        if rm.end is None:
            findings.append(Finding("error", "rank_died",
                                    f"rank {r} on {rm.host or '?'} has no end record: it died or hung ({last}{when})",
                                    rank=r, host=rm.host))
        elif rm.end.get("status") == "stopped" and _another_cause(run, r):
            # its launcher's SIGTERM (train/stopped.py) after another rank died or failed: a consequence
            findings.append(Finding("warning", "rank_stopped", f"rank {r} on {rm.host or '?'} was stopped by its "
                                    f"launcher after another rank ended ({last})", rank=r, host=rm.host))
        elif rm.end.get("status") == "stopped":  # nothing else ended it: the others waited for this one
            findings.append(Finding("error", "rank_died", f"rank {r} on {rm.host or '?'} was stopped by SIGTERM "
                                    f"while no other rank had died or failed on its own: it hung, or the signal "
                                    f"came to it first ({last}{when})", rank=r, host=rm.host))
        elif rm.end.get("status") == "failed":
            err = rm.end.get("error") or "no error text"
            findings.append(Finding("error", "rank_failed",
                                    f"rank {r} on {rm.host or '?'} failed ({last}): {err}", rank=r, host=rm.host))
    lasts = {r: (rm.last_step or 0) for r, rm in run.ranks.items()}
    if len(lasts) >= 2 and len(set(lasts.values())) > 1:
        counts = Counter(lasts.values())
        majority, n = counts.most_common(1)[0]
        unique_majority = list(counts.values()).count(n) == 1 and n > len(lasts) / 2
        if unique_majority:
            for r in sorted(r for r, v in lasts.items() if v != majority):
                host = run.ranks[r].host or "?"
                if lasts[r] < majority:
                    msg = (f"rank {r} on {host} stopped at step {lasts[r]} while the others reached {majority}: "
                           f"it was missing from the collective of step {lasts[r] + 1}")
                    findings.append(Finding("error", "rank_behind", msg, rank=r, host=run.ranks[r].host))
                else:
                    msg = (f"rank {r} on {host} ran ahead to step {lasts[r]} while the others stopped at "
                           f"{majority}: it skipped a collective the others waited in")
                    findings.append(Finding("error", "rank_ahead", msg, rank=r, host=run.ranks[r].host))
        else:
            # No majority (e.g. 2 ranks): the brief rule is "the one behind was missing".
            low = min(lasts.values())
            for r in sorted(r for r, v in lasts.items() if v == low):
                findings.append(Finding(
                    "error", "rank_behind",
                    f"rank {r} on {run.ranks[r].host or '?'} stopped at step {low} while others got further "
                    f"({', '.join(f'rank {q}: {v}' for q, v in sorted(lasts.items()) if v != low)}): it was "
                    f"missing from the collective of step {low + 1}", rank=r, host=run.ranks[r].host))
    return findings


class _SafeUnpickler(pickle.Unpickler):
    """Flight-recorder dumps are pickles of plain dicts/lists; refuse anything that would run code."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a trace file")


def read_trace(path: Path) -> dict[str, Any] | None:
    data = path.read_bytes()
    for parse in (lambda b: json.loads(b.decode("utf-8")),
                  lambda b: _SafeUnpickler(__import__("io").BytesIO(b)).load()):
        try:
            obj = parse(data)
        except Exception:
            continue
        if isinstance(obj, dict):
            return obj
        if isinstance(obj, list):
            return {"entries": obj}
    return None


def _trace_rank(path: Path, dump: dict[str, Any]) -> int | None:
    for key in ("rank", "global_rank"):
        if isinstance(dump.get(key), int):
            return dump[key]
    m = _TRACE_RANK.search(path.name)
    return int(m.group(1)) if m else None


def trace_findings(run: RunData) -> tuple[list[Finding], list[dict[str, Any]]]:
    """From flight-recorder dumps: per rank, the last collective sequence number per process
    group; the rank whose last number is behind the others was missing from the next one."""
    summaries, findings = [], []
    per_pg: dict[str, dict[int, int]] = {}
    for path in run.trace_files:
        dump = read_trace(path)
        rel = str(path.relative_to(run.path))
        if dump is None:
            summaries.append({"file": rel, "parsed": False})
            continue
        rank = _trace_rank(path, dump)
        entries = [e for e in dump.get("entries", []) if isinstance(e, dict)]
        colls = [e for e in entries if isinstance(e.get("collective_seq_id"), int)]
        last = max(colls, key=lambda e: e["collective_seq_id"], default=None)
        summaries.append({"file": rel, "parsed": True, "rank": rank, "entries": len(entries),
                          "last_collective": None if last is None else
                          f"{last.get('profiling_name')}#{last['collective_seq_id']} ({last.get('state')})"})
        if rank is None:
            continue
        for e in entries:
            seq = e.get("collective_seq_id")
            if not isinstance(seq, int) or e.get("is_p2p"):
                continue
            pg = str(e.get("pg_id", e.get("process_group", "0")))
            per_pg.setdefault(pg, {})
            per_pg[pg][rank] = max(per_pg[pg].get(rank, 0), seq)
    for pg, seqs in per_pg.items():
        if len(seqs) < 2 or len(set(seqs.values())) < 2:
            continue
        top = max(seqs.values())
        for r in sorted(r for r, s in seqs.items() if s < top):
            findings.append(Finding(
                "error", "trace_missing_collective",
                f"flight recorder: rank {r} last recorded collective #{seqs[r]} in process group {pg} while "
                f"others recorded up to #{top}: rank {r} was missing from collective #{seqs[r] + 1}",
                rank=r, host=(run.ranks[r].host if r in run.ranks else None)))
    return findings, summaries


def vanished_findings(run: RunData, findings: list[Finding]) -> list[Finding]:
    """A node that stopped answering (summary.json `vanished_hosts`, probed by the rank whose
    collective failed): named first. The ranks on the other nodes that were stopped when
    the job was ended are then consequences, not causes, and become warnings."""
    vanished = [h for h in (run.summary or {}).get("vanished_hosts") or [] if isinstance(h, str)]
    if not vanished:
        return findings
    hosts = {r: rm.host or run.env.get(r, {}).get("host") for r, rm in run.ranks.items()}
    for r, env in run.env.items():
        hosts.setdefault(r, env.get("host"))
    out = []
    for h in vanished:
        on = sorted(r for r, host in hosts.items() if host == h)
        ranks = f"rank{'s' if len(on) != 1 else ''} {', '.join(map(str, on))}" if on else "its ranks"
        out.append(Finding(
            "error", "host_vanished",
            f"{h} vanished: it stopped answering on the network while the job ran ({ranks} lost), so the "
            f"others' collectives failed and the job was ended. Check its power and cable; once it answers, "
            f"run the same command again: training resumes from the last checkpoint",
            rank=on[0] if on else None, host=h))
    for f in findings:
        if f.kind == "rank_died" and f.host not in vanished:
            f.severity = "warning"
            f.message += f" (stopped when the job was ended after {', '.join(vanished)} vanished)"
        out.append(f)
    return out


def cancelled_findings(run: RunData, findings: list[Finding]) -> list[Finding]:
    """A cancelled run (summary.json status `cancelled`: scancel, or Ctrl-C under `launch --submit`) is said
    first, with the step it reached and how to resume. The cancel stopped its ranks mid-step, so a rank
    without an end record, one a step behind or one that saw its peer go are its consequences: warnings."""
    summary = run.summary or {}
    if summary.get("status") != "cancelled":
        return findings
    who = summary.get("cancelled_by") if isinstance(summary.get("cancelled_by"), str) else "the job was cancelled"
    resume = summary.get("resume") if isinstance(summary.get("resume"), str) else "run it again with the same run id"
    out = [Finding("warning", "run_cancelled", f"{who} at step {summary.get('steps')}; to resume: {resume}")]
    for f in findings:
        peer_gone = f.kind == "rank_failed" and core.PEER_FAILURE in f.message
        if f.severity == "error" and (f.kind in _CANCEL_SHOWS or peer_gone):
            f.severity = "warning"
            f.message += " (stopped by the cancel)"
        out.append(f)
    return out


_CANCEL_SHOWS = ("rank_died", "rank_behind", "rank_ahead", "trace_missing_collective")


def data_path_findings(run: RunData) -> list[Finding]:
    """Every rank got through the rendezvous (each wrote its metrics file), none completed a step,
    and a collective timed out or could not connect: the master port works but the nodes' data
    connections do not get through. What the ranks see of a firewall that drops the ephemeral
    ports, an MTU the switch does not carry, or traffic routed out of another NIC."""
    world = run.world_size or 0
    if world < 2 or len(run.ranks) < world or any(rm.last_step for rm in run.ranks.values()):
        return []
    texts = [rm.end.get("error") for rm in run.ranks.values() if rm.end] + [(run.summary or {}).get("error")]
    hit = next((t for t in texts if t and _DATA_PATH_ERROR.search(t)), None)
    if hit is None:
        return []
    what = _DATA_PATH_ERROR.search(hit).group(0)
    return [Finding("error", "data_path_blocked",
                    f"all {world} ranks reached the rendezvous, but the first collective failed before any step "
                    f"('{what}'): the data connections between the nodes do not get through. Usual causes: a "
                    "firewall that opens the master port but drops the ephemeral ports NCCL and gloo connect to, "
                    "an MTU the switch does not carry, traffic leaving by another NIC than NCCL_SOCKET_IFNAME "
                    "names. `dscluster check` tests each between every pair of nodes (columns port, mtu, nic) "
                    "and names the node and the fix")]


def comm_findings(run: RunData) -> list[Finding]:
    """A job that spends much of each step waiting for the network (measured in the step records)."""
    share = comm_share(step_split(run))
    if share is None or share <= COMM_BOUND_SHARE:
        return []
    return [Finding("warning", "comm_bound",
                    f"communication-bound: {share:.0%} of step time waiting for the network (mean over ranks, "
                    f"after warm-up): `dscluster plan --config {run.path / 'config.yaml'}` predicts which gradient "
                    "accumulation (global_batch=...) and comm.compression would scale")]


def not_here_findings(run: RunData, findings: list[Finding], hosts: list[str]) -> list[Finding]:
    """Without a shared filesystem a node's records stay on it until collected: a host of the job
    (`hosts`, from check.json) with no file here is not a dead node, and its ranks are not dead ranks."""
    here = {rm.host for rm in run.ranks.values()} | set(run.telemetry) | {e.get("host") for e in run.env.values()}
    absent = [h for h in hosts if h not in here]
    short = len(run.ranks) < (run.world_size or 0)
    if (absent or short) and (split := split_here(run.path)):  # this job's other ranks, under another run id
        kept = [f for f in findings if f.kind != "rank_missing"]
        return kept + [Finding("error", "split_run", split_message(", ".join(absent) or "the missing ranks", split,
                                                                   run.path))]
    if not absent:
        return findings
    kept = [f for f in findings if not (f.kind == "rank_missing" and f.host in (None, *absent))]
    return kept + [Finding("error", "files_not_here", f"{h}'s files are not here (no shared filesystem): "
                           f"run `dscluster collect {run.path}` (it also finds ranks of this job that wrote under "
                           "another run id)", host=h) for h in absent]


def op_build_findings(run: RunData) -> list[Finding]:
    """Ranks that died building a DeepSpeed JIT op (analysis/opbuild.py): the cause and its fix."""
    out = []
    for r, rm in sorted(run.ranks.items()):
        texts = [(rm.end or {}).get("error"), (rm.process or {}).get("stderr_tail")]
        hit = next((h for t in texts if (h := op_build_cause(t))), None)
        if hit is not None:
            cause, line = hit
            out.append(Finding("error", "op_build_failed", f"rank {r} on {rm.host or '?'} died building a DeepSpeed "
                               f"op: {cause.what} ({line}). Fix: {cause.fix}", rank=r, host=rm.host))
    return out


def busy_waiting_findings(run: RunData) -> list[Finding]:
    """NVML says the GPUs are busy while the step split says they wait for the network."""
    words = busy_but_waiting_words(gpu_views(run))
    return [Finding("warning", "gpu_busy_waiting", words)] if words else []


def diagnose(run: RunData, unshared_hosts: list[str] = ()) -> dict[str, Any]:
    """Everything found, as the stable `--json` document. `unshared_hosts`: the job's hosts when
    check found that they do not share the run directory."""
    findings = (op_build_findings(run) + vanished_findings(run, progress_findings(run)) + env_findings(run)
                + comm_findings(run) + busy_waiting_findings(run))
    findings = data_path_findings(run) + not_here_findings(run, findings, list(unshared_hosts))
    tfind, traces = trace_findings(run)
    findings = cancelled_findings(run, findings + tfind)
    if not run.ranks:
        findings.append(Finding("error", "no_metrics",
                                f"{run.path}: no metrics/rank-*.jsonl: training never wrote a step"))
    if run.summary_problem:
        findings.append(Finding("error", "summary_unreadable",
                                f"{run.path / 'summary.json'}: {run.summary_problem}: the run's outcome is unknown; "
                                "each rank's end record is in metrics/rank-R.jsonl"))
    elif not run.summary and not findings:
        findings.append(Finding("warning", "incomplete",
                                "no summary.json but every rank has an end record: rank 0 did not finish writing it"))
    if run.summary and run.summary.get("status") not in (None, "complete", "cancelled"):
        fr, fh = run.summary.get("failed_rank"), run.summary.get("failed_host")
        if not any((f.rank == fr and fr is not None) or (f.kind == "host_vanished" and f.host == fh)
                   for f in findings):
            findings.append(Finding("error", "run_failed",
                                    f"summary.json: status {run.summary.get('status')}, failed rank {fr} on {fh}: "
                                    f"{run.summary.get('error')}", rank=fr, host=fh))
    ranks = [{"rank": s.rank, "host": s.host, "last_step": s.last_step, "status": s.status,
              "last_t": run.ranks[s.rank].last_t} for s in rank_stats(run)]
    return {
        "run_dir": str(run.path),
        "healthy": not any(f.severity == "error" for f in findings),
        "findings": [f.to_dict() for f in findings],
        "ranks": ranks,
        "traces": traces,
        "unreadable": list(run.problems),
    }
