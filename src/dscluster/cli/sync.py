"""`dscluster sync`: copy the head's checkout (and check's output, and --data DIR) to every node.

For a lab without a shared filesystem: after `dscluster check` (which says whether the nodes'
checkouts differ) and before the first `mpirun ... ./entry_cn.sh`. Exit 0 every node has the
head's files, 1 a node could not be scanned or copied to (named), 2 bad input.
"""

from __future__ import annotations

import argparse
import json

from dscluster import console
from dscluster.bringup.sync import NodeSync, SyncOptions, run_sync


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sync", help="copy the checkout (and check's output, --data DIR) to every node: no shared filesystem",
        description="For labs without NFS: copy the head's checkout (git's tracked files), the env files "
        "`dscluster check` wrote for the ranks, and optionally a data folder to every node of the hostfile, "
        "at the same paths, over the SSH `dscluster setup` configured. Each node is compared first (sha256 "
        "for the checkout, size and mtime for data), so only what differs is copied and a second run copies "
        "nothing. rsync where the head and every node have it, else SFTP. Nothing is deleted.",
        epilog="example: dscluster sync --hostfile hosts.txt --data /data/cifar-10-batches-py --dry-run",
    )
    p.add_argument("--hostfile", default="hosts.txt", help="OpenMPI hostfile listing the nodes (default: hosts.txt)")
    p.add_argument("--user", default=None, help="account on the nodes (default: your user name here)")
    p.add_argument("--data", metavar="DIR", default=None,
                   help="also copy this folder (a dataset, data.path) to every node")
    p.add_argument("--dry-run", action="store_true", help="compare and say what would be copied; copy nothing")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per node for the scan and for the copy")
    p.add_argument("--json", action="store_true", help="print the result per node as JSON on stdout")
    p.set_defaults(func=sync_command)


def _size(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def _progress(node: str, done: int, files: int, done_bytes: int, total_bytes: int) -> None:
    console.err.print(f"  {node}: {done}/{files} files, {_size(done_bytes)} of {_size(total_bytes)}", markup=False)


def render(results: list[NodeSync], dry_run: bool) -> None:
    out = console.out
    for r in results:
        if r.error:
            out.print(f"[red]✗[/] {r.node}: {r.error}")
            continue
        count = sum(len(v) for v in r.to_copy.values())
        parts = ", ".join(f"{k} {len(v)}" for k, v in r.to_copy.items() if v)
        if not count:
            out.print(f"[green]✓[/] {r.node}: already the head's files, nothing to copy")
        elif dry_run:
            first = [f for v in r.to_copy.values() for f in v][:5]
            out.print(f"· {r.node}: would copy {count} file(s), {_size(r.bytes_to_copy)} ({parts}): "
                      f"{', '.join(first)}{' ...' if count > len(first) else ''}", markup=False)
        else:
            out.print(f"[green]✓[/] {r.node}: copied {r.copied_files} file(s), {_size(r.copied_bytes)} ({parts}) "
                      f"by {r.method}")
    if any(r.error for r in results):
        out.print("[red]some nodes do not have the head's files[/]: "
                  "fix the errors above and run `dscluster sync` again")
    elif not dry_run:
        out.print("Next: `dscluster check` again (it compares the checkouts), then step 5 of setup/CHECKLIST.md")


def sync_command(args: argparse.Namespace) -> int:
    opts = SyncOptions(hostfile=args.hostfile, user=args.user, data=args.data, dry_run=args.dry_run,
                       timeout=args.timeout)
    results = run_sync(opts, on_progress=None if args.json else _progress, show_progress=not args.json)
    if args.json:
        print(json.dumps({"dry_run": opts.dry_run, "nodes": [r.to_dict() for r in results]}, indent=2))
    else:
        render(results, opts.dry_run)
    return 1 if any(r.error for r in results) else 0
