"""`dscluster plot RUN_DIR [RUN_DIR ...]`, and `python analysis/plot.py` (`main`): the same command."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dscluster.analysis import analyse
from dscluster.errors import DsclusterError, UsageError
from dscluster.files import redact


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directory runs/<id> (several: scaling plot)")
    p.add_argument("--out", default=None, help="write pictures and report.html here "
                   "(default: RUN_DIR/plots/ and RUN_DIR/report.html)")
    p.add_argument("--json", action="store_true", help="print what was written and the summary as JSON")
    p.epilog = "example: python analysis/plot.py runs/mpi-1234 runs/mpi-1300 --out /tmp/scaling"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plot",
        help="plots and report.html for run directories",
        description="Draw utilisation, memory, throughput per rank (stragglers), loss and accuracy, "
        "fp16 loss scale, GPU temperature/power/throttling, and with several runs the scaling "
        "curve; write one self-contained report.html. Reads only files; works on crashed runs.",
    )
    add_arguments(p)
    p.set_defaults(func=plot_command)


def plot_command(args: argparse.Namespace) -> int:
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        raise UsageError(f"--out {args.out}: is a file, not a directory; pass a directory for the pictures and "
                         "report.html (it is created when missing), e.g. --out plots/")
    results = analyse(args.run_dirs, args.out)
    if args.json:
        print(json.dumps(redact.redact_doc([{
            "run_dir": str(r.run.path), "report": str(r.report),
            "plots": {p.name: str(p.path) for p in r.plots}, "summary": r.summary,
            "healthy": r.diagnosis["healthy"],
        } for r in results]), indent=2))
        return 0
    for r in results:
        state = ("complete" if r.run.completed else f"outcome unknown: {r.run.summary_problem}" if r.run.summary_problem
                 else f"did NOT complete ({r.summary['status']})")
        print(f"{r.run.path}: run {state}")
        for p in r.plots:
            print(f"  {p.path}" + (f"  ({'; '.join(p.notes)})" if p.notes else ""))
        print(f"  report: {r.report}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python analysis/plot.py RUN_DIR [RUN_DIR ...] [--out DIR]`."""
    parser = argparse.ArgumentParser(prog="analysis/plot.py", description=
                                     "Plots and a one-page report.html for dscluster run directories.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return plot_command(args)
    except DsclusterError as e:
        print(f"plot: {e}", file=sys.stderr)
        return e.exit_code
