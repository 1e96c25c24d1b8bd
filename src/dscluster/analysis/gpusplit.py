"""Each GPU's NVML utilisation beside the measured step split of the rank that used it.

NVML counts a GPU as busy while any kernel runs, and an NCCL all-reduce kernel spinning on bytes
from a slow network is a kernel: a GPU can read 100 % busy while its steps wait for the network
(the step split, core/split.py; docs/run-directory.md). This module pairs the two per GPU so the
utilisation picture, the report and `diagnose` can say it in words.

A rank's GPU: the one entry_cn.sh recorded for it (process/rank-R.json), else the local-rank-th
of its host's sampled GPUs (the torchrun convention `dscluster train` follows).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from dscluster.analysis.load import RunData
from dscluster.analysis.stats import RankSplit, step_split

BUSY_UTIL = 80.0
"""NVML utilisation (%) at or above which a GPU "looks busy"."""
WAITING_SHARE = 0.5
"""Share of the step spent waiting for the network above which a GPU that looks busy is mostly waiting."""


@dataclass
class GpuView:
    host: str
    index: int
    util_percent: float | None
    """Mean NVML utilisation while the job's steps ran (None: no GPU samples)."""
    ranks: list[int] = field(default_factory=list)
    shares: dict[str, float | None] = field(default_factory=dict)
    """compute, comm, data, other: mean share of the step of this GPU's ranks (None: not measured)."""

    @property
    def busy_but_waiting(self) -> bool:
        comm = self.shares.get("comm")
        return (self.util_percent is not None and self.util_percent >= BUSY_UTIL
                and comm is not None and comm > WAITING_SHARE)

    def label(self) -> str:
        """'compute 3% · network 96% · data 1%', or '' where no split was measured for this GPU."""
        parts = [(name, self.shares.get(key)) for key, name in (("compute", "compute"), ("comm", "network"),
                                                                   ("data", "data"))]
        return " · ".join(f"{name} {share:.0%}" for name, share in parts if share is not None)


def _rank_gpu(run: RunData, rank: int, host_gpus: dict[str, list[int]]) -> tuple[str, int] | None:
    rm = run.ranks[rank]
    host = rm.host
    gpus = host_gpus.get(host or "", [])
    recorded = ((rm.process or {}).get("gpu") or {}).get("index")
    if host and isinstance(recorded, int) and recorded in gpus:
        return host, recorded
    local = (rm.start or {}).get("local_rank")
    if host and gpus and isinstance(local, int):
        return host, gpus[local % len(gpus)]
    return None


def _shares(splits: list[RankSplit]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for part in ("compute", "comm", "data", "other"):
        values = [s.seconds.get(f"{part}_s") for s in splits]
        if not values or any(v is None for v in values):
            out[part] = None
        else:
            out[part] = statistics.fmean(v / s.step_s for v, s in zip(values, splits, strict=True) if s.step_s > 0)
    return out


def _step_window(run: RunData) -> tuple[float, float] | None:
    ts = [s["t"] for r in run.ranks.values() for s in r.steps if isinstance(s.get("t"), (int, float))]
    return (min(ts), max(ts)) if len(ts) >= 2 else None


def gpu_views(run: RunData) -> list[GpuView]:
    """Every sampled GPU with its mean NVML utilisation over the steps and its ranks' step split."""
    window = _step_window(run)
    host_gpus: dict[str, list[int]] = {}
    util: dict[tuple[str, int], list[float]] = {}
    for host, tel in run.telemetry.items():
        indices = sorted({g["index"] for s in tel.samples for g in s["gpus"] if isinstance(g.get("index"), int)})
        host_gpus[host] = indices
        for s in tel.samples:
            if window and not window[0] <= s["t"] <= window[1]:
                continue
            for g in s["gpus"]:
                if isinstance(g.get("util_percent"), (int, float)):
                    util.setdefault((host, g["index"]), []).append(float(g["util_percent"]))
    splits = {s.rank: s for s in step_split(run)}
    by_gpu: dict[tuple[str, int], list[int]] = {}
    for rank in sorted(run.ranks):
        where = _rank_gpu(run, rank, host_gpus)
        if where:
            by_gpu.setdefault(where, []).append(rank)
    views = []
    for host in sorted(host_gpus):
        for index in host_gpus[host]:
            ranks = by_gpu.get((host, index), [])
            samples = util.get((host, index))
            views.append(GpuView(host, index, statistics.fmean(samples) if samples else None, ranks,
                                 _shares([splits[r] for r in ranks if r in splits])))
    return views


def busy_but_waiting_words(views: list[GpuView]) -> str | None:
    """'GPUs look 100 % busy, but 96 % of each step waits for the network', where that is so."""
    flagged = [v for v in views if v.busy_but_waiting]
    if not flagged:
        return None
    util = statistics.fmean(v.util_percent for v in flagged)
    comm = statistics.fmean(v.shares["comm"] for v in flagged)
    which = "GPUs" if len(flagged) == len(views) else f"{len(flagged)} of {len(views)} GPUs"
    return (f"{which} look {util:.0f} % busy, but {100 * comm:.0f} % of each step waits for the network: "
            "NVML counts a GPU as busy while a communication kernel waits for bytes")
