"""Numbers derived from a loaded run: per-rank throughput, stragglers, the summary row.

Kept apart from plotting so the report table, the plots and `diagnose` agree on one
definition of "straggler" and "throughput".
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

from dscluster import core
from dscluster.analysis.load import RunData
from dscluster.rundir.rankrecord import exit_text

STRAGGLER_FACTOR = 1.15
"""A rank is a straggler when its median step time is this much above the median rank's.
With synchronous data parallelism every rank waits for the slowest in the all-reduce, so
the compute part differs less than this on healthy hardware; 15% is a visible slowdown."""


@dataclass
class RankStat:
    rank: int
    host: str | None
    steps: int
    last_step: int | None
    median_step_time: float | None
    p90_step_time: float | None
    samples_per_s: float | None
    """This rank's median samples/s (warm-up step excluded when there are more)."""
    status: str
    """complete, failed, or running/died (no end record)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _steady(steps: list[dict]) -> list[dict]:
    """Drop the warm-up steps (JIT, compilation, allocator, communicator set-up), which the run's
    own images/s leaves out too (core/timing.py), when there are steps after them."""
    rest = steps[core.WARMUP_STEPS:]
    return rest if rest else steps


def _quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    if len(values) == 1:
        return values[0]
    pos = q * (len(values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def rank_stats(run: RunData) -> list[RankStat]:
    out = []
    for rank in sorted(run.ranks):
        rm = run.ranks[rank]
        steady = _steady(rm.steps)
        times = [float(s["step_time"]) for s in steady if isinstance(s.get("step_time"), (int, float))]
        rates = [float(s["samples_per_s"]) for s in steady if isinstance(s.get("samples_per_s"), (int, float))]
        if rm.exit_code is not None and (rm.end is None or rm.exit_code != 0):
            status = f"{'complete' if rm.exit_code == 0 else 'failed'} ({exit_text(rm.exit_code)})"
        elif rm.end is None:
            status = "running" if rm.process else "no end record"
        else:
            status = str(rm.end.get("status") or "unknown")
        out.append(RankStat(
            rank=rank, host=rm.host, steps=len(rm.steps), last_step=rm.last_step,
            median_step_time=statistics.median(times) if times else None,
            p90_step_time=_quantile(times, 0.9) if times else None,
            samples_per_s=statistics.median(rates) if rates else None,
            status=status,
        ))
    return out


def find_stragglers(stats: list[RankStat], factor: float = STRAGGLER_FACTOR) -> list[int]:
    """Ranks whose median step time is `factor` above the median over ranks (needs ≥2 ranks)."""
    medians = [s.median_step_time for s in stats if s.median_step_time]
    if len(medians) < 2:
        return []
    typical = statistics.median(medians)
    return [s.rank for s in stats if s.median_step_time and s.median_step_time > factor * typical]


def global_batch(run: RunData) -> int | None:
    for rec in (run.summary, *(run.ranks[r].start for r in sorted(run.ranks))):
        if rec and isinstance(rec.get("global_batch"), int):
            return rec["global_batch"]
    return None


def job_throughput(run: RunData) -> tuple[float | None, int]:
    """(images/s of the whole job, the steps it counts), by core/timing.py's definition.

    summary.json's figure when rank 0 wrote one. Without it (a run that crashed or is still
    going, or a script of the user's that logs through userlog) the same figure from the step
    records: each holds its share of its window's wall-clock time and the windows follow each
    other without a gap, so a rank's timed steps (warm-up left out as `timing.is_timed` leaves it
    out) add up to its wall-clock time. In synchronous data parallelism the job goes at the pace of
    its slowest rank, so the rank with the most time is the job's clock."""
    summary = run.summary or {}
    if isinstance(summary.get("images_per_s"), (int, float)):
        return float(summary["images_per_s"]), int(summary.get("timed_steps") or 0)
    clocks = []
    for rank in sorted(run.ranks):
        steps = run.ranks[rank].steps
        window = core.StepWindow(clock=lambda: 0.0)
        for done, step in enumerate(steps, start=1):
            if core.is_timed(done, len(steps)) and isinstance(step.get("step_time"), (int, float)):
                window.timed_s += float(step["step_time"])
                window.timed_steps += 1
        clocks.append(window)
    if not clocks:
        return None, 0
    slowest = max(clocks, key=lambda w: (w.timed_s, w.timed_steps))
    batch = global_batch(run)
    return (slowest.images_per_s(batch) if batch else None), slowest.timed_steps


def warmup_steps(run: RunData) -> int | None:
    """How many first steps `job_throughput` left out: summary.json's record, else as `is_timed` decides from the
    step records (`timing.warmup_left_out`: 0 for a run too short to leave any out)."""
    summary = run.summary or {}
    if isinstance(summary.get("images_per_s"), (int, float)):  # job_throughput took summary.json's figure
        recorded = summary.get("warmup_steps")
        return recorded if isinstance(recorded, int) else None  # a summary from before the field: not known
    longest = max((len(r.steps) for r in run.ranks.values()), default=0)
    return core.warmup_left_out(longest) if longest else None


def throughput(run: RunData) -> float | None:
    """Images/s for the whole job (`job_throughput`)."""
    return job_throughput(run)[0]


def overflow_counts(run: RunData) -> tuple[int, int]:
    """(overflow steps, steps) on the lowest rank that logged steps: ranks agree on overflow."""
    for rank in sorted(run.ranks):
        steps = run.ranks[rank].steps
        if steps:
            return sum(1 for s in steps if s.get("overflow")), len(steps)
    return 0, 0


def final_accuracy(run: RunData) -> float | None:
    if run.summary and isinstance(run.summary.get("accuracy"), (int, float)):
        return float(run.summary["accuracy"])
    evals = [e for e in run.evals() if isinstance(e.get("accuracy"), (int, float))]
    return float(evals[-1]["accuracy"]) if evals else None


def run_status(run: RunData) -> str:
    """summary.json's status; with the exit code where entry_cn.sh recorded one: "complete (exit 0)",
    "failed (exit 1) on rank 3"; "unknown: ..." where summary.json is unreadable."""
    summary = run.summary or {}
    code = summary.get("exit_code")
    if summary.get("status") and isinstance(code, int):
        where = f" on rank {summary['failed_rank']}" if summary.get("failed_rank") is not None else ""
        return f"{summary['status']} ({exit_text(code)}){where}"
    if summary.get("status"):
        return str(summary["status"])
    if run.summary_problem:
        return f"unknown: {run.summary_problem}"
    if run.ranks and all(r.exit_code == 0 for r in run.ranks.values()):
        return "complete (exit 0)"
    if any(r.process and r.exit_code is None for r in run.ranks.values()):
        return "running (or stopped without a record: a rank has not exited)"
    if any(r.end and r.end.get("status") == "failed" for r in run.ranks.values()):
        return "failed (no summary.json)"
    return "incomplete (no summary.json: still running or crashed)"


def summary_row(run: RunData) -> dict[str, Any]:
    """The report's one-line summary of a run."""
    stats = rank_stats(run)
    overflows, steps = overflow_counts(run)
    hosts = sorted({s.host for s in stats if s.host} | set(run.telemetry))
    return {
        "run": run.name,
        "status": run_status(run),
        "completed": run.completed,
        "precision": run.precision,
        "world_size": run.world_size,
        "hosts": hosts,
        "steps": max((s.last_step or 0 for s in stats), default=0),
        "images_per_s": throughput(run),
        "warmup_steps": warmup_steps(run),
        "run_images_per_s": (run.summary or {}).get("run_images_per_s"),
        "accuracy": final_accuracy(run),
        "stragglers": find_stragglers(stats),
        "overflow_steps": overflows,
        "overflow_rate": (overflows / steps) if steps else None,
        "wall_s": (run.summary or {}).get("wall_s"),
        **time_to_accuracy(run),
    }


def time_to_accuracy(run: RunData) -> dict[str, Any]:
    """`target_accuracy` and `time_to_accuracy` (seconds, step, epoch, images; None: not reached) as
    summary.json has them; an unfinished run: its `target` record, if one was written."""
    summary = run.summary or {}
    if "target_accuracy" in summary:
        tta = summary.get("time_to_accuracy")
        return {"target_accuracy": summary["target_accuracy"],
                "time_to_accuracy": tta if isinstance(tta, dict) else None}
    recs = [r for m in run.ranks.values() for r in m.targets if isinstance(r.get("seconds"), (int, float))]
    if recs:
        return {"target_accuracy": recs[0].get("target"), "time_to_accuracy": recs[0]}
    return {"target_accuracy": None, "time_to_accuracy": None}


SPLIT_PARTS = ("compute_s", "comm_s", "data_s", "other_s")
"""A step record's measured split (core/split.py): they add up to its step_time."""
COMM_BOUND_SHARE = 0.2
"""More of the step than this waiting for the network, and the job cannot reach the 80% scaling
efficiency `dscluster plan` aims for: 'communication-bound'."""


@dataclass
class RankSplit:
    rank: int
    host: str | None
    steps: int
    """Steps averaged (after warm-up, when there are more)."""
    seconds: dict[str, float | None]
    """Mean seconds per step of each SPLIT_PARTS entry; comm_s None where training could not measure it;
    with sync.mode local_sgd or diloco also average_s, the models' average, which comm_s includes."""
    step_s: float
    """Mean step_time over the same steps."""

    @property
    def comm_share(self) -> float | None:
        comm = self.seconds.get("comm_s")
        return None if comm is None or self.step_s <= 0 else comm / self.step_s


def step_split(run: RunData) -> list[RankSplit]:
    """Per rank, the mean split of its steady steps (means, not medians: means add up to the step)."""
    out = []
    for rank in sorted(run.ranks):
        rm = run.ranks[rank]
        steps = [s for s in _steady(rm.steps)
                 if isinstance(s.get("step_time"), (int, float)) and isinstance(s.get("compute_s"), (int, float))]
        if not steps:
            continue
        seconds: dict[str, float | None] = {}
        for part in SPLIT_PARTS:
            values = [s.get(part) for s in steps]
            seconds[part] = (None if any(not isinstance(v, (int, float)) for v in values)
                             else statistics.fmean(values))
        averages = [s.get("average_s") for s in steps]
        if all(isinstance(v, (int, float)) for v in averages):  # sync.mode local_sgd / diloco: part of comm_s
            seconds["average_s"] = statistics.fmean(averages)
        out.append(RankSplit(rank=rank, host=rm.host, steps=len(steps), seconds=seconds,
                             step_s=statistics.fmean(s["step_time"] for s in steps)))
    return out


def comm_share(splits: list[RankSplit]) -> float | None:
    """Share of step time the job waited for the network: the mean over ranks that measured it."""
    shares = [s.comm_share for s in splits if s.comm_share is not None]
    return statistics.fmean(shares) if shares else None
