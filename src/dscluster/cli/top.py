"""`dscluster top`: every node's GPUs, CPU, RAM and network, and a running job's ranks, live.

Parse -> call (top/watch.py takes each snapshot) -> render (rich). `--once --json` prints one
snapshot (docs/schemas.md) for scripts; `--once --svg FILE` saves the view as a picture (rich's SVG
export) to paste into an issue or a lab notebook. Keys: q or Ctrl-C quits.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
import termios
import time
import tty
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from dscluster import console
from dscluster.errors import UsageError
from dscluster.files.fsutil import atomic_write_text
from dscluster.node.hosts import parse_hostfile
from dscluster.top.watch import Watcher, node_places

HOT_C = 85
"""A GPU at or above this temperature shows red even before NVML reports thermal slowdown."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "top",
        help="live view of every node's GPUs, CPU, RAM, network and the running job's ranks",
        description="A live view of every node in the hostfile, refreshed about once a second: per GPU "
        "utilisation, memory, temperature, power and throttle reasons; per node CPU, RAM and bytes/s on "
        "check's interface; per rank of the running job its step, img/s and share of time waiting for "
        "the network. Reads the telemetry a running job's nodes write, else samples the node over SSH. "
        "Stragglers and throttling show in colour. q or Ctrl-C quits.",
        epilog="examples: dscluster top --hostfile hosts.txt; dscluster top --once --json; "
        "dscluster top --once --svg cluster.svg",
    )
    p.add_argument("--hostfile", default="hosts.txt", help="OpenMPI hostfile (default: hosts.txt)")
    p.add_argument("--run-dir", type=Path, default=None,
                   help="the job's run directory (default: the newest runs/<id> written to in the last 30 s)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1.0)")
    p.add_argument("--once", action="store_true", help="take one snapshot, print it and exit")
    p.add_argument("--json", action="store_true", help="with --once: print the snapshot as JSON")
    p.add_argument("--svg", type=Path, default=None, metavar="FILE",
                   help="with --once: save the view as an SVG picture (a new file) instead of printing it")
    p.add_argument("--no-ssh", action="store_true", help="only read telemetry files; never connect to nodes")
    p.set_defaults(func=top_command)


def top_command(args: argparse.Namespace) -> int:
    if args.json and not args.once:
        raise UsageError("--json prints one snapshot: use it with --once (dscluster top --once --json)")
    if args.svg is not None:
        check_svg_target(args)
    if not 0.2 <= args.interval <= 60:
        raise UsageError(f"--interval {args.interval:g}: choose between 0.2 and 60 seconds (default 1.0)")
    if args.run_dir is not None and not args.run_dir.is_dir():
        raise UsageError(f"--run-dir {args.run_dir}: no such run directory (pass runs/<id>)")
    watcher = Watcher(node_places(parse_hostfile(args.hostfile)), args.run_dir, ssh=not args.no_ssh)
    try:
        if args.once:
            snap = watcher.snapshot()
            if args.json:
                print(json.dumps(snap.to_dict(), indent=2))
            elif args.svg is not None:
                save_svg(render(snap), args.svg)
                console.err.print(f"dscluster top: saved the view to {args.svg}")
            else:
                console.print_whole(render(snap))  # a log or a pipe gets every figure whole
            return 0
        return live(watcher, args.interval)
    finally:
        watcher.close()


def check_svg_target(args: argparse.Namespace) -> None:
    """--svg: one snapshot, into a new file in an existing folder (nothing is written on bad input)."""
    if not args.once or args.json:
        raise UsageError("--svg saves one snapshot as a picture: use it with --once and without --json "
                         "(dscluster top --once --svg cluster.svg)")
    if args.svg.exists():
        raise UsageError(f"--svg {args.svg}: the file exists; remove it or choose another name")
    if not args.svg.parent.is_dir():
        raise UsageError(f"--svg {args.svg}: no folder {args.svg.parent}; create it or choose another path")


def save_svg(view, path: Path, width: int = 140) -> None:
    """The view as rich draws it in a terminal `width` columns wide, saved as SVG (written atomically)."""
    with open(os.devnull, "w") as sink:
        rec = Console(record=True, width=width, file=sink, force_terminal=True, color_system="truecolor")
        rec.print(view)
    atomic_write_text(path, rec.export_svg(title="dscluster top"), mode=0o644)


def live(watcher, interval: float) -> int:
    with _keys() as pressed, Live(console=console.out, screen=True, auto_refresh=False) as view:
        try:
            while True:
                view.update(render(watcher.snapshot()), refresh=True)
                deadline = time.monotonic() + interval
                while time.monotonic() < deadline:
                    if pressed(deadline - time.monotonic()) in ("q", "Q"):
                        return 0
        except KeyboardInterrupt:
            return 0


@contextmanager
def _keys():
    """`pressed(timeout)`: the key typed within timeout seconds, or None. The terminal is put in
    cbreak mode (keys without Enter, Ctrl-C still a signal) and restored on the way out."""
    fd = sys.stdin.fileno() if sys.stdin.isatty() else None
    if fd is None:
        yield lambda timeout: time.sleep(max(0.0, timeout))
        return
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)

    def pressed(timeout: float) -> str | None:
        ready, _, _ = select.select([fd], [], [], max(0.0, timeout))
        return os.read(fd, 1).decode(errors="replace") if ready else None

    try:
        yield pressed
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _num(v, fmt: str = "{:.0f}", none: str = "—") -> str:
    return none if v is None else fmt.format(v)


def _bytes(v: float | None) -> str:
    if v is None:
        return "—"
    for unit in ("B/s", "KB/s", "MB/s", "GB/s"):
        if v < 1000 or unit == "GB/s":
            return f"{v:.0f} {unit}" if unit == "B/s" else f"{v:.1f} {unit}"
        v /= 1000
    return "—"


def render(snap) -> Group:
    """The snapshot as rich tables: nodes and their GPUs, then the job's ranks."""
    nodes = Table(title=f"dscluster top · {time.strftime('%H:%M:%S', time.localtime(snap.t))}"
                        + (f" · {escape(snap.run_dir)}" if snap.run_dir else " · no running job found"),
                  title_justify="left", expand=True)
    for col in ("node", "GPU", "util %", "memory", "temp °C", "power W", "throttle", "CPU %", "RAM", "network",
                "source"):
        nodes.add_column(col, no_wrap=col not in ("throttle", "source"))
    for n in snap.nodes:
        ram = (f"{_num(n.ram_used_mb and n.ram_used_mb / 1024, '{:.1f}')}/"
               f"{_num(n.ram_total_mb and n.ram_total_mb / 1024, '{:.0f}')} GiB") if n.ram_total_mb else "—"
        net = (f"{escape(n.net_iface or '?')} ↓{_bytes(n.net_rx_bytes_per_s)} ↑{_bytes(n.net_tx_bytes_per_s)}"
               if n.net_rx_bytes_per_s is not None else "—")
        source = Text(n.source if n.error is None else f"{n.source}: {n.error}",
                      style="red" if n.source == "none" else "dim")
        node_cells = [Text(n.name, style="bold"), None, None, None, None, None, None, _num(n.cpu_percent), ram, net,
                      source]
        if not n.gpus:
            nodes.add_row(*[c if c is not None else ("no GPU" if i == 1 else "") for i, c in enumerate(node_cells)])
        for k, g in enumerate(n.gpus):
            hot = g.temp_c is not None and g.temp_c >= HOT_C
            used = _num(g.mem_used_mb and g.mem_used_mb / 1024, "{:.1f}")
            mem = f"{used}/{_num(g.mem_total_mb and g.mem_total_mb / 1024, '{:.0f}')} GiB"
            row = [node_cells[0] if k == 0 else "", f"{g.index} {escape(g.name or '')}".strip(), _num(g.util_percent),
                   mem, Text(_num(g.temp_c), style="bold red" if hot else ""), _num(g.power_w),
                   Text(", ".join(g.throttle) or "—", style="bold red" if g.throttle else "dim")]
            row += node_cells[7:] if k == 0 else ["", "", "", ""]
            nodes.add_row(*row)
    parts = [nodes]
    if snap.ranks:
        ranks = Table(title="ranks", title_justify="left", expand=True)
        for col in ("rank", "host", "step", "img/s", "step s", "network wait", "status", "last record", "from"):
            ranks.add_column(col, no_wrap=True)
        for r in snap.ranks:
            style = "bold yellow" if r.straggler else ("red" if r.status.startswith("failed") else "")
            wait = _num(r.comm_share and 100 * r.comm_share, "{:.0f} %") if r.comm_share is not None else "—"
            ranks.add_row(f"{r.rank}{' straggler' if r.straggler else ''}", escape(r.host or "?"), _num(r.step, "{}"),
                          _num(r.images_per_s, "{:.1f}"), _num(r.step_time_s, "{:.3f}"),
                          Text(wait, style="red" if (r.comm_share or 0) > 0.5 else ""), r.status,
                          _num(r.age_s, "{:.0f} s ago"), Text(r.source, style="dim"), style=style)
        parts.append(ranks)
    parts.append(Text("q or Ctrl-C quits", style="dim"))
    return Group(*parts)
