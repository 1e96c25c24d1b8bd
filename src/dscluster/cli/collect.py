"""`dscluster collect RUN_DIR`: bring every node's part of a run to the head (no shared filesystem).

`dscluster launch` and the README's mpirun do it when a job ends; run it by hand after a crash
or a node that came back. Exit 0 every node answered, 1 a node could not be reached (named), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from dscluster import console
from dscluster.check import checkfile
from dscluster.errors import UsageError
from dscluster.files import state
from dscluster.launch.collect import push, timed_pull
from dscluster.rundir.agree import split_message


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "collect", help="bring every node's part of runs/<id>/ to the head (no shared filesystem)",
        description="Without a shared filesystem each node writes its ranks' metrics, env records, telemetry "
        "and traces into its own copy of RUN_DIR (same path). Fetch what the head's copy lacks from every "
        "node of the hostfile over SSH (SFTP); a file is taken where it is missing here or has grown there. "
        "Nothing is deleted. With --push HEAD, send this node's part to HEAD instead.",
        epilog="example: dscluster collect runs/mpi-1234 --hostfile hosts.txt",
    )
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--hostfile", default=None,
                   help="nodes to collect from (default: the hostfile the last `dscluster check` used, else hosts.txt)")
    p.add_argument("--user", default=None, help="account on the nodes (default: your user name here)")
    p.add_argument("--push", metavar="HEAD", default=None,
                   help="send this node's part to HEAD instead (what entry_cn.sh does when its ranks end)")
    p.add_argument("--check-json", metavar="PATH", default=None,
                   help="with --push: send only when this check.json says the nodes do not share the run directory")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per node (default 300)")
    p.add_argument("--json", action="store_true", help="print what came from each node as JSON")
    p.set_defaults(func=collect_command)


def default_hostfile() -> str:
    try:
        return checkfile.load(state.check_json_path()).hostfile or "hosts.txt"
    except (FileNotFoundError, checkfile.CheckFileError):
        return "hosts.txt"


def _runs_not_shared(path: str) -> bool:
    try:
        return checkfile.load(path).shared_runs() is False
    except (FileNotFoundError, checkfile.CheckFileError):
        return False


def collect_command(args: argparse.Namespace) -> int:
    if args.push:
        if args.check_json and not _runs_not_shared(args.check_json):
            return 0   # a shared run directory (or no check saying otherwise): nothing to send
        t0 = time.monotonic()
        got = push(args.run_dir, args.push, timeout=args.timeout)
        console.err.print(f"dscluster collect: sent {len(got.files)} file(s), {got.bytes} bytes of "
                          f"{args.run_dir} to {args.push} in {time.monotonic() - t0:.2f} s", markup=False)
        return 0
    if not Path(args.run_dir).is_dir():
        raise UsageError(f"{args.run_dir}: no such run directory here (the head)")
    hostfile = args.hostfile or default_hostfile()
    results, seconds = timed_pull(args.run_dir, hostfile, user=args.user, timeout=args.timeout,
                                  show_progress=not args.json)
    if args.json:
        print(json.dumps({"run_dir": os.path.abspath(args.run_dir), "seconds": round(seconds, 3),
                          "nodes": [r.to_dict() for r in results]}, indent=2))
    else:
        for r in results:
            if r.split_into:
                console.out.print(f"[red]✗[/] {split_message(r.node, r.split_into, Path(args.run_dir))}", markup=False)
            if r.error:
                console.out.print(f"[red]✗[/] {r.node}: {r.error}")
            else:
                console.out.print(f"[green]✓[/] {r.node}: {len(r.files)} file(s), {r.bytes} bytes")
        console.out.print(f"collected in {seconds:.2f} s into {args.run_dir}")
    return 1 if any(r.error or r.split_into for r in results) else 0
