"""`dscluster hosts check HOSTFILE`: validate an OpenMPI hostfile."""

from __future__ import annotations

import argparse
import json

from rich.table import Table

from dscluster import console
from dscluster.hosts import parse_hostfile


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("hosts", help="hostfile tools", description="Hostfile tools.")
    hs = p.add_subparsers(dest="hosts_command", metavar="COMMAND", required=True)
    c = hs.add_parser(
        "check",
        help="validate a hostfile (the syntax both mpirun and DeepSpeed's launcher accept)",
        description="Validate a hostfile: 'host slots=N [max_slots=M]' per line, '#' comments. "
        "slots=N is required right after the host (DeepSpeed's launcher refuses a bare host line "
        "that OpenMPI would take). Errors name FILE:LINE and the fix, and exit 2.",
        epilog="example: dscluster hosts check hosts.txt --json",
    )
    c.add_argument("hostfile")
    c.add_argument("--json", action="store_true", help="print the parsed hostfile as JSON")
    c.set_defaults(func=check_command)


def check_command(args: argparse.Namespace) -> int:
    hf = parse_hostfile(args.hostfile)
    if args.json:
        print(json.dumps(hf.to_dict(), indent=2))
        return 0
    table = Table(title=f"{hf.path}: {len(hf.hosts)} hosts, {hf.total_slots} slots")
    table.add_column("line", justify="right")
    table.add_column("host")
    table.add_column("slots", justify="right")
    table.add_column("max_slots", justify="right")
    for h in hf.hosts:
        table.add_row(str(h.line), h.name, str(h.slots), "" if h.max_slots is None else str(h.max_slots))
    console.out.print(table)
    return 0
