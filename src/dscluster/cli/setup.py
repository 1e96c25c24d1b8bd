"""`dscluster setup`: passwordless SSH mesh, pinned host keys, login shell and PATH."""

from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from dscluster import console
from dscluster.bringup.setup import SetupOptions, SetupResult, result_to_dict, run_setup
from dscluster.errors import UsageError
from dscluster.files.state import known_hosts_path
from dscluster.node.hosts import parse_hostfile
from dscluster.ssh.remote import Target

PASSWORD_ENV = "DSCLUSTER_SSH_PASSWORD"
NEXT_STEP = "Next: step 4 of setup/CHECKLIST.md — dscluster check"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "setup",
        help="passwordless SSH between all nodes, pinned host keys, shell and PATH",
        description="Give every node its own ed25519 key, authorise every key on every node, pin host keys "
        "(the project's <state>/known_hosts), write a managed ~/.ssh/config block, optionally fix the login "
        "shell and PATH, then test ssh between every pair of nodes. The SSH password is read from "
        f"${PASSWORD_ENV} or prompted once (hidden); it is never taken from the command line. "
        "Exit 0 when every pair works, 1 naming each node or pair that does not, 2 for bad input.",
        epilog="example: DSCLUSTER_SSH_PASSWORD=... dscluster setup --hostfile hosts.txt --trust-new-hosts --fix-path",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--hostfile", default="hosts.txt", help="OpenMPI hostfile listing the nodes (default: hosts.txt)")
    p.add_argument("--user", default=None, help="account on the nodes (default: your user name here)")
    p.add_argument("--trust-new-hosts", action="store_true",
                   help="pin host keys seen for the first time (their fingerprints are printed); "
                   "a changed key is refused regardless")
    p.add_argument("--shell", choices=["bash", "zsh"], default=None,
                   help="change the login shell on every node (chsh) where allowed")
    p.add_argument("--fix-path", action="store_true",
                   help=f"put this venv's bin ({Path(sys.prefix) / 'bin'}) first in PATH in the startup file "
                   "the login shell reads for non-interactive ssh commands")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for each node to answer (default 10)")
    p.add_argument("--dry-run", action="store_true", help="show per node what would change; change nothing")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    p.set_defaults(func=setup_command)


def _password(user: str, interactive: bool) -> str | None:
    """From the environment, else one hidden prompt; None when there is no terminal to ask on
    (then only an existing key can log in)."""
    pw = os.environ.get(PASSWORD_ENV)
    if pw:
        return pw
    if interactive and sys.stdin.isatty():
        try:
            return getpass.getpass(f"SSH password for {user} on the nodes (same on all): ") or None
        except EOFError:
            return None
    return None


def build_options(args: argparse.Namespace) -> SetupOptions:
    if args.timeout <= 0:
        raise UsageError(f"--timeout must be positive, got {args.timeout:g}")
    hostfile = parse_hostfile(args.hostfile)
    user = args.user or getpass.getuser()
    key = Path.home() / ".ssh" / "id_ed25519"
    password = _password(user, interactive=True)
    if password is None and not key.exists():
        raise UsageError(
            f"no SSH password: set {PASSWORD_ENV} (never read from the command line) or run "
            f"`dscluster setup` in a terminal to be asked once; {key} does not exist yet"
        )
    return SetupOptions(
        targets=[Target(name=h.name, host=h.name, port=22, user=user) for h in hostfile.hosts],
        known_hosts=known_hosts_path(),
        password=password,
        key_filename=str(key) if key.exists() else None,
        trust_new_hosts=args.trust_new_hosts,
        shell=args.shell,
        fix_path=args.fix_path,
        timeout=args.timeout,
        dry_run=args.dry_run,
        venv_bin=str(Path(sys.prefix) / "bin"),
    )


def setup_command(args: argparse.Namespace) -> int:
    opts = build_options(args)
    res = run_setup(opts, show_progress=not args.json)
    if args.json:
        print(json.dumps(result_to_dict(res), indent=2))
    else:
        render(res, opts)
    return res.exit_code


def render(res: SetupResult, opts: SetupOptions) -> None:
    out = console.out
    t = Table(title="dscluster setup" + (" (dry run: nothing changed)" if res.dry_run else ""))
    for col in ("node", "hostname", "login shell", "python", "mpirun", "result"):
        t.add_column(col)
    for n in res.nodes:
        if not n.ok:
            t.add_row(n.target.name, n.hostname or "-", "-", "-", "-", f"[red]✗ {n.error_kind}")
            continue
        tc = n.toolchain
        verb = "would change" if res.dry_run else "changed"
        result = f"[green]✓[/] {len(n.changes)} {verb}" if n.changes else "[green]✓[/] up to date"
        if n.warnings:
            result += f", [yellow]{len(n.warnings)} warning(s)"
        t.add_row(n.target.name, n.hostname, n.login_shell,
                  escape(tc.get("python_version", "")) or "[red]missing",
                  escape(tc.get("mpirun_version", "")) or "[red]missing", result)
    out.print(t)
    if any(n.changes for n in res.nodes):
        out.print("would change (nothing was changed):" if res.dry_run else "changed:")
    for n in res.nodes:
        for c in n.changes:
            out.print(f"  {n.target.name}: {escape(c)}")
        for w in n.warnings:
            out.print(f"  [yellow]! {n.target.name}: {escape(w)}")
    if res.mesh:
        names = [n.target.name for n in res.nodes if n.ok]
        m = Table(title="ssh mesh (row: from, column: to; ssh -o BatchMode=yes)")
        m.add_column("from \\ to")
        for b in names:
            m.add_column(b, justify="center")
        for a in names:
            row = res.mesh.get(a, {})
            m.add_row(a, *("[green]✓" if row.get(b, (False, ""))[0] else "[red]✗" for b in names))
        out.print(m)
    if res.problems:
        out.print(f"[red]{len(res.problems)} problem(s):")
        for p in res.problems:
            out.print(f"  [red]✗[/] {escape(p)}")
        if not opts.password and any("auth" in p for p in res.problems):
            out.print(f"  no password was given: set {PASSWORD_ENV} or run in a terminal to be prompted")
        out.print("Fix the problems above and re-run dscluster setup (step 3 of setup/CHECKLIST.md)")
    elif res.dry_run:
        out.print("dry run complete; run without --dry-run to apply")
    else:
        out.print("[green]every node reaches every node without a password")
        out.print(NEXT_STEP)
