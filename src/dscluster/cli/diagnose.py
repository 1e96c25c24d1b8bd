"""`dscluster diagnose RUN_DIR`: name dead ranks, the rank missing from a collective, env mismatches."""

from __future__ import annotations

import argparse
import json

from rich.markup import escape
from rich.table import Table

from dscluster import console
from dscluster.analysis.diagnose import diagnose
from dscluster.analysis.load import load_run
from dscluster.check import checkfile
from dscluster.files import redact, state


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "diagnose",
        help="say what went wrong in a run (dead rank, rank missing from a collective, env mismatch)",
        description="Read RUN_DIR's metrics, env and flight-recorder/trace files and name the ranks "
        "that died, the rank that stopped progressing (missing from a collective), and environment "
        "values that differ between ranks. Exit 0 healthy, 1 problems found, 2 bad directory.",
        epilog="example: dscluster diagnose runs/mpi-1234 --json",
    )
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    p.set_defaults(func=diagnose_command)


def _unshared_hosts() -> list[str]:
    """The hosts of the last check, when it found that they do not share the run directory."""
    try:
        check = checkfile.load(state.check_json_path())
    except (FileNotFoundError, checkfile.CheckFileError):
        return []
    return [n.hostname for n in check.nodes if n.hostname] if check.shared_runs() is False else []


def diagnose_command(args: argparse.Namespace) -> int:
    result = redact.redact_doc(diagnose(load_run(args.run_dir), unshared_hosts=_unshared_hosts()))
    if args.json:
        print(json.dumps(result, indent=2))
        return 0 if result["healthy"] else 1
    table = Table(title=f"{args.run_dir}: ranks")
    for col in ("rank", "host", "last step", "status"):
        table.add_column(col)
    for r in result["ranks"]:
        table.add_row(str(r["rank"]), escape(r["host"] or "?"), str(r["last_step"]), r["status"])
    console.out.print(table)
    for t in result["traces"]:
        if t.get("parsed"):
            console.out.print(escape(f"trace {t['file']}: rank {t.get('rank')}, {t['entries']} entries"
                              + (f", last collective {t['last_collective']}" if t["last_collective"] else "")))
        else:
            console.out.print(escape(f"trace {t['file']}: not a format dscluster reads (listed only)"))
    if not result["findings"]:
        console.out.print("[green]healthy[/]: every rank finished at the same step with the same environment")
    for f in result["findings"]:
        colour = "red" if f["severity"] == "error" else "yellow"
        console.out.print(f"[{colour}]{f['severity']}[/] {f['kind']}: {escape(f['message'])}")
    return 0 if result["healthy"] else 1
