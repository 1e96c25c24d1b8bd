"""NCCL's socket transport, tuned by measurement. Pure: measured grid in, env and finding out.

Over plain TCP (NET/Socket) NCCL's bandwidth is set by how many helper threads it runs per
connection (NCCL_SOCKET_NTHREADS) times the sockets each thread drives (NCCL_NSOCKS_PERTHREAD).
With the defaults (1 x 1 outside AWS and GCP) a 10 GbE link stayed 4-8 % under its line rate on
our GPU lab. So on links of 10 Gbit/s or faster check's all-reduce is run once per point of
`GRID`, and the best point is written into the env files when it beats the defaults by
`MIN_GAIN` or more; otherwise the defaults stay and check says so.

The measurement record, `check.json` active.nccl_socket:
    {"link_bps": 10000000000,
     "grid": [{"NCCL_SOCKET_NTHREADS": 1, "NCCL_NSOCKS_PERTHREAD": 1, "busbw_GBps": 1.146}, ...]}
"""

from __future__ import annotations

from dscluster.check.netrules import human_bps
from dscluster.check.rules import Finding

THREADS, SOCKS = "NCCL_SOCKET_NTHREADS", "NCCL_NSOCKS_PERTHREAD"
DEFAULT = (1, 1)
# NCCL allows threads <= 16 and threads x sockets <= 64.
GRID = ((1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (8, 2))
MIN_LINK_BPS = 10 * 10**9
MIN_GAIN = 0.05


def grid_envs() -> list[dict[str, str]]:
    """The environment of each measurement, default first."""
    return [{THREADS: str(t), SOCKS: str(s)} for t, s in GRID]


def _points(grid: list[dict]) -> dict[tuple[int, int], float]:
    out = {}
    for g in grid:
        try:
            out[(int(g[THREADS]), int(g[SOCKS]))] = float(g["busbw_GBps"])
        except (KeyError, TypeError, ValueError):
            continue
    return out


def decide_socket_tuning(record: dict | None) -> tuple[dict[str, str], Finding | None]:
    """(env to write, what check says) from a measurement record (module docstring)."""
    if not record:
        return {}, None
    link = record.get("link_bps")
    if not isinstance(link, (int, float)) or link < MIN_LINK_BPS:
        return {}, None
    points = _points(record.get("grid") or [])
    base = points.get(DEFAULT)
    if not base:
        return {}, Finding("warning", None, "allreduce", "NCCL socket tuning: no measurement with the defaults "
                           f"({THREADS}=1, {SOCKS}=1), so no point of the grid can be compared",
                           "re-run check; NCCL_DEBUG=INFO shows why the default run failed")
    (t, s), best = max(points.items(), key=lambda kv: (kv[1], -kv[0][0] * kv[0][1]))
    table = ", ".join(f"{a}x{b} {v:.3f}" for (a, b), v in sorted(points.items()))
    line = human_bps(link)
    if (t, s) == DEFAULT or best < base * (1 + MIN_GAIN):
        return {}, Finding("info", None, "allreduce",
                           f"NCCL socket tuning on a {line} link: the defaults (1x1, {base:.3f} GB/s) are within "
                           f"{MIN_GAIN:.0%} of the best point (GB/s by threads x sockets: {table})",
                           "nothing to do: the defaults stay")
    env = {THREADS: str(t), SOCKS: str(s)}
    return env, Finding("info", None, "allreduce",
                        f"NCCL socket tuning on a {line} link: {THREADS}={t} {SOCKS}={s} reached {best:.3f} GB/s, "
                        f"{best / base - 1:.0%} over the defaults' {base:.3f} GB/s (GB/s by threads x sockets: {table})",
                        "nothing to do: written to the env files")

