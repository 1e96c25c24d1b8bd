"""`dscluster hosts check HOSTFILE`: validate an OpenMPI hostfile."""

from __future__ import annotations

import argparse
import json

from rich.table import Table

from dscluster import console
from dscluster.node.hosts import parse_hostfile


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("hosts", help="hostfile tools", description="Hostfile tools.")
    hosts_commands = p.add_subparsers(dest="hosts_command", metavar="COMMAND", required=True)
    check_parser = hosts_commands.add_parser(
        "check",
        help="validate a hostfile (the syntax both mpirun and DeepSpeed's launcher accept)",
        description="Validate a hostfile: 'host slots=N [max_slots=M]' per line, '#' comments. "
        "slots=N is required right after the host (DeepSpeed's launcher refuses a bare host line "
        "that OpenMPI would take). Errors name FILE:LINE and the fix, and exit 2.",
        epilog="example: dscluster hosts check hosts.txt --json",
    )
    check_parser.add_argument("hostfile")
    check_parser.add_argument("--json", action="store_true", help="print the parsed hostfile as JSON")
    check_parser.set_defaults(func=check_command)


def check_command(args: argparse.Namespace) -> int:
    hostfile = parse_hostfile(args.hostfile)
    if args.json:
        print(json.dumps(hostfile.to_dict(), indent=2))
        return 0
    table = Table(title=f"{hostfile.path}: {len(hostfile.hosts)} hosts, {hostfile.total_slots} slots")
    table.add_column("line", justify="right")
    table.add_column("host")
    table.add_column("slots", justify="right")
    table.add_column("max_slots", justify="right")
    for h in hostfile.hosts:
        table.add_row(str(h.line), h.name, str(h.slots), "" if h.max_slots is None else str(h.max_slots))
    console.out.print(table)
    return 0
