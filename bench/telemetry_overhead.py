#!/usr/bin/env python3
"""How much CPU does the telemetry sampler cost?  Target: under 1% of one core at 1 s period.

Runs the real sampler in a child process for DURATION seconds per backend (psutil-only
"none", and "nvml" where an NVIDIA driver exists), then reports the child's CPU time over
wall time twice: steady state (the sampler's own end record, start-up excluded) and total
(rusage of the whole process, interpreter start-up and imports included).

    python bench/telemetry_overhead.py [--duration 30] [--period 1.0] [--out bench/results]
Writes bench/results/<date>-<device>-telemetry.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

# The child imports only the sampler (psutil, nvidia-ml-py, stdlib), not the whole CLI.
CHILD = (
    "import sys; from pathlib import Path\n"
    "from dscluster.telemetry.sampler import SamplerConfig, run_sampler\n"
    "sys.exit(run_sampler(SamplerConfig(run_dir=Path(sys.argv[1]), period=float(sys.argv[2]),\n"
    "    backend=sys.argv[3], duration=float(sys.argv[4]), hostname='bench')))\n"
)


def device_name() -> tuple[str, bool]:
    """(device description, whether NVML works here)."""
    try:  # optional: NVML answers only where an NVIDIA driver exists
        import pynvml

        pynvml.nvmlInit()
        n = pynvml.nvmlDeviceGetCount()
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0)) if n else "no GPU"
        pynvml.nvmlShutdown()
        name = name.decode() if isinstance(name, bytes) else name
        return (f"{n}x {name}" if n else "cpu"), n > 0
    except Exception:
        pass
    model = platform.processor() or "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu {model} ({os.cpu_count()} cores)", False


def measure(backend: str, duration: float, period: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
        start = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-c", CHILD, tmp, str(period), backend, str(duration)],
                                env=env, stderr=subprocess.PIPE, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.monotonic() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        stderr = proc.stderr.read()
        proc.stderr.close()
        if proc.returncode != 0:
            raise SystemExit(f"sampler ({backend}) failed with {proc.returncode}: {stderr}")
        lines = [json.loads(l) for l in (Path(tmp) / "telemetry" / "bench.jsonl").read_text().splitlines()]
    end = lines[-1]
    meta = lines[0]
    total_cpu = usage.ru_utime + usage.ru_stime
    gpus = next((len(l["gpus"]) for l in lines if l.get("kind") == "sample"), 0)
    return {
        "backend_requested": backend,
        "backend": meta["backend"],
        "backend_message": meta.get("backend_message"),
        "gpus_sampled": gpus,
        "period_s": period,
        "samples": end["samples"],
        "steady_wall_s": end["wall_s"],
        "steady_cpu_s": end["cpu_s"],
        "steady_percent_of_one_core": end["cpu_percent_of_core"],
        "total_wall_s": round(wall, 3),
        "total_cpu_s": round(total_cpu, 4),
        "total_percent_of_one_core": round(100.0 * total_cpu / wall, 3),
        "max_rss_mb": round(usage.ru_maxrss / 1024, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=30.0, help="seconds per backend (default 30)")
    ap.add_argument("--period", type=float, default=1.0, help="sampling period (default 1.0 s)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    device, has_nvml = device_name()
    backends = ["none"] + (["nvml"] if has_nvml else [])
    results = []
    for b in backends:
        print(f"measuring backend {b} for {args.duration:g} s ...", file=sys.stderr)
        results.append(measure(b, args.duration, args.period))
    date = time.strftime("%Y-%m-%d")
    doc = {
        "benchmark": "telemetry sampler overhead", "device": device, "date": date,
        "python": platform.python_version(), "host_cpu_count": os.cpu_count(),
        "target": "under 1% of one core at 1 s period", "results": results,
        "meets_target": all(r["steady_percent_of_one_core"] < 1.0 for r in results),
    }
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")[:60]
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{date}-{slug}-telemetry.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(doc, indent=2))
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
