"""`python -m dscluster.telemetry.once [--iface IF]`: one sample of this node as a JSON line.

What `dscluster top` runs over SSH on a node with no running sampler: the sampler's own record
(telemetry/sampler.py: CPU, RAM, GPUs, the interface's byte counters) plus the CPU and network
rates over a short window, so one call gives "now" without a previous sample.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time

from dscluster.telemetry.backends import select_backend
from dscluster.telemetry.sampler import HostSampler

WINDOW_S = 0.5


def sample_once(iface: str | None, window_s: float = WINDOW_S) -> dict:
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dscluster.telemetry.once", description=__doc__.splitlines()[0])
    p.add_argument("--iface", default=None, help="interface whose bytes/s to report (default: the node env's)")
    args = p.parse_args(argv)
    print(json.dumps(sample_once(args.iface)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
