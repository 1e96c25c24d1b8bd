"""`python -m dscluster.top.once [--iface IF] [--run-dir DIR]`: this node now, as one JSON line.

What `dscluster top` runs over SSH on a node with no fresh sample in the head's files: the sampler's
record (telemetry/sampler.py) plus CPU and network rates over a short window, so one call gives
"now". `--run-dir` also reads this node's own copy of the run directory (where a node without a
shared filesystem writes until the job ends): the job sampler's fresh sample, if any, is sent
instead of a new one, and each rank's records cut to what top reads (live.py RankRecords), at most
MAX_RANKS of them, so the line stays small.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from pathlib import Path

from dscluster.telemetry.backends import select_backend
from dscluster.telemetry.sampler import HostSampler
from dscluster.top.live import byte_rate, fresh_samples, read_rank_records

WINDOW_S = 0.5
MAX_RANKS = 64
"""Ranks one node reports (more GPUs than any node has): bounds the line's size."""


def new_sample(iface: str | None, window_s: float = WINDOW_S) -> dict:
    """One sample taken now, with CPU and bytes/s over `window_s`."""
    host = HostSampler(iface)
    before = host.sample()  # primes the CPU counters and reads the byte counters
    t0 = time.time()
    time.sleep(window_s)
    rec = {"kind": "sample", "t": time.time(), "host": socket.gethostname()}
    rec.update(host.sample())
    choice = select_backend("auto", pcie=False)
    try:
        rec["backend"] = choice.backend.name
        rec["gpus"] = choice.backend.sample()
    except Exception as e:  # a driver hiccup: the host figures still count
        rec["gpus"], rec["error"] = [], f"{type(e).__name__}: {e}"
    finally:
        choice.backend.close()
    dt = rec["t"] - t0
    for key in ("net_rx_bytes", "net_tx_bytes"):
        if isinstance(rec.get(key), int) and isinstance(before.get(key), int) and dt > 0:
            rec[f"{key}_per_s"] = max(0.0, (rec[key] - before[key]) / dt)
    return rec


def job_sample(run_dir: Path, now: float) -> dict | None:
    """The job sampler's newest sample in this node's copy of the run directory, if fresh, with its
    bytes/s from the sample before it; marked `job_sampler`."""
    samples = fresh_samples(run_dir, socket.gethostname(), now)
    if not samples:
        return None
    rec = dict(samples[-1], job_sampler=True)
    for key in ("net_rx_bytes", "net_tx_bytes"):
        rate = byte_rate(samples[-1], samples[-2] if len(samples) > 1 else None, key)
        if rate is not None:
            rec[f"{key}_per_s"] = rate
    return rec


def sample_once(iface: str | None, window_s: float = WINDOW_S, run_dir: Path | None = None) -> dict:
    rec = job_sample(run_dir, time.time()) if run_dir is not None else None
    if rec is None:
        rec = new_sample(iface, window_s)
    if run_dir is not None:
        ranks = sorted(read_rank_records(run_dir).items())[:MAX_RANKS]
        rec["ranks"] = {str(rank): records.to_dict() for rank, records in ranks}
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dscluster.top.once", description=__doc__.splitlines()[0])
    p.add_argument("--iface", default=None, help="interface whose bytes/s to report (default: the node env's)")
    p.add_argument("--run-dir", type=Path, default=None,
                   help="the job's run directory: also report this node's copy of its telemetry and ranks")
    args = p.parse_args(argv)
    print(json.dumps(sample_once(args.iface, run_dir=args.run_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
