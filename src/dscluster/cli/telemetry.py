"""`dscluster telemetry --run-dir DIR`: the per-node GPU/CPU sampler (one per node)."""

from __future__ import annotations

import argparse
from pathlib import Path

from dscluster.errors import UsageError
from dscluster.telemetry.sampler import SamplerConfig, run_sampler


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "telemetry",
        help="sample GPU/CPU/RAM on this node into RUN_DIR/telemetry/<hostname>.jsonl",
        description="Sample this node's GPUs (NVML, else GPUtil) and CPU/RAM (psutil) every PERIOD "
        "seconds into RUN_DIR/telemetry/<hostname>.jsonl, one JSON line per sample, flushed. "
        "Only one sampler per node runs: a second one exits 0 saying so. Stops cleanly on "
        "SIGTERM/SIGINT, after --duration, or when --parent-pid exits.",
        epilog="example: dscluster telemetry --run-dir runs/$DSCLUSTER_RUN_ID --parent-pid $$ &",
    )
    p.add_argument("--run-dir", required=True, type=Path, help="run directory (runs/<id>)")
    p.add_argument("--period", type=float, default=1.0, help="seconds between samples (default 1.0)")
    p.add_argument("--backend", choices=["auto", "nvml", "gputil", "none"], default="auto",
                   help="GPU backend (default auto: NVML, else GPUtil, else none)")
    p.add_argument("--duration", type=float, default=None, help="stop after S seconds")
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    p.add_argument("--no-pcie", action="store_true", help="skip NVML PCIe throughput (~20 ms per query)")
    p.set_defaults(func=telemetry_command)


def telemetry_command(args: argparse.Namespace) -> int:
    if not (0.05 <= args.period <= 3600):
        raise UsageError(f"--period {args.period:g}: choose between 0.05 and 3600 seconds (default 1.0)")
    if args.duration is not None and args.duration <= 0:
        raise UsageError(f"--duration {args.duration:g}: must be positive seconds")
    if args.run_dir.exists() and not args.run_dir.is_dir():
        raise UsageError(f"{args.run_dir}: exists and is not a directory; pass runs/<id>")
    cfg = SamplerConfig(run_dir=args.run_dir, period=args.period, backend=args.backend,
                        duration=args.duration, parent_pid=args.parent_pid, pcie=not args.no_pcie)
    return run_sampler(cfg)
