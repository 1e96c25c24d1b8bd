"""NCCL's socket transport, tuned by measurement. Pure: measured grid in, env and finding out.

Over plain TCP (NET/Socket) NCCL's bandwidth is set by NCCL_SOCKET_NTHREADS times
NCCL_NSOCKS_PERTHREAD, and the defaults (1 x 1 outside AWS and GCP) leave part of a 10 GbE link
unused (docs/troubleshooting.md). So on fast links with NCCL, check runs its all-reduce once more
per point of `GRID` (check/run.py), and this module writes the best point into the env files when
it beats the defaults by `MIN_GAIN` or more; otherwise the defaults stay and check says so. The
record is check.json's active.nccl_socket (docs/schemas.md).
"""

from __future__ import annotations

from dscluster.check.netrules import human_bps
from dscluster.check.rules import Finding

THREADS, SOCKS = "NCCL_SOCKET_NTHREADS", "NCCL_NSOCKS_PERTHREAD"
DEFAULT = (1, 1)
# NCCL allows threads <= 16 and threads x sockets <= 64. Short: each point is one more mpirun.
GRID = ((1, 1), (4, 2), (4, 4), (8, 2))
# The 10 Gbit/s class as check's link test measures it: one Python TCP stream for 0.4 s carries at most
# 94 % of the line rate (1448 of 1538 bytes a frame at MTU 1500), less on a busy host
# (docs/troubleshooting.md); 2.5 GbE stays under it.
MIN_LINK_BPS = 5 * 10**9
MIN_GAIN = 0.05


def grid_envs() -> list[dict[str, str]]:
    """The environment of each measurement, default first."""
    return [{THREADS: str(t), SOCKS: str(s)} for t, s in GRID]


def why_not_tuned(backend: str | None, link_bps: float | None, no_tune: bool = False) -> str | None:
    """Why the grid is not measured (None: measure it), from check's all-reduce and its link tests."""
    if backend != "nccl":
        return (f"the all-reduce ran on {backend or 'no backend'}; {THREADS} and {SOCKS} apply to NCCL "
                "(GPU nodes) only")
    if no_tune:
        return "--no-tune"
    if not link_bps:
        return "no link between nodes was measured (one node, or the link tests failed)"
    if link_bps < MIN_LINK_BPS:
        return (f"the slowest link measured {human_bps(link_bps)}, under the 10 Gbit/s class where NCCL's "
                "defaults leave part of the line unused")
    return None


def grid_point(env: dict[str, str], result: dict | None, seconds: float, error: str | None = None) -> dict:
    """One entry of active.nccl_socket.grid from one all-reduce run at `env` (`dscluster.bench.allreduce
    --json`'s document, None when the run failed): the bus bandwidth of its largest message."""
    rows = [r for r in (result or {}).get("results") or [] if isinstance(r, dict) and r.get("busbw_GBps")]
    best = max(rows, key=lambda r: r.get("bytes") or 0, default=None)
    point = {THREADS: int(env[THREADS]), SOCKS: int(env[SOCKS]), "busbw_GBps": best["busbw_GBps"] if best else None,
             "bytes": best.get("bytes") if best else None, "seconds": round(seconds, 2)}
    if best is None:
        point["error"] = error or "no all-reduce result"
    return point


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
                        f"{best / base - 1:.0%} over the defaults' {base:.3f} GB/s "
                        f"(GB/s by threads x sockets: {table})",
                        "nothing to do: written to the env files")

