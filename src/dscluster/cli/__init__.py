"""`dscluster` command line: one module per command (`dscluster.cli.<command>`), each with
`register(subparsers)` that adds its parser and sets `func` (parse -> call -> render).

Exit codes: 0 ok, 1 problems found / job failed, 2 bad input or usage.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from dscluster.errors import DsclusterError

# The command table, in `--help` order: command -> its module, loaded by `load` when the parser is
# built. A command line that names its command loads that command's module alone, so every rank's
# `dscluster train` and every node's sampler skip the others' domains (paramiko, rich tables, the lab
# and check rules). A missing module is an ImportError, never a command that quietly disappears.
COMMANDS: dict[str, str] = {
    "hosts": "dscluster.cli.hosts",
    "sim": "dscluster.cli.sim",
    "setup": "dscluster.cli.setup",
    "check": "dscluster.cli.check",
    "sync": "dscluster.cli.sync",
    "collect": "dscluster.cli.collect",
    "launch": "dscluster.cli.launch",
    "train": "dscluster.cli.train",
    "telemetry": "dscluster.cli.telemetry",
    "plot": "dscluster.cli.plot",
    "diagnose": "dscluster.cli.diagnose",
    "top": "dscluster.cli.top",
    "bench": "dscluster.cli.bench",
    "env": "dscluster.cli.env",
    "plan": "dscluster.cli.plan",
    "completion": "dscluster.cli.completion",
}


def load(module: str):
    """The one place a module of the command line loads on demand: a command's, or --version's."""
    return importlib.import_module(module)


class VersionAction(argparse.Action):
    """`--version`: the summary line of `dscluster env` (dscluster, python, torch, deepspeed),
    read from package metadata when asked, so that building the parser stays cheap."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        # only --version loads `env`'s report module: every other command line loads its own module alone
        report = load("dscluster.cli.envreport")
        print(report.versions_line(report.package_versions()))
        parser.exit()


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or of command `only` alone (its subcommand parses the same)."""
    parser = argparse.ArgumentParser(
        prog="dscluster",
        description="Turn a handful of lab GPU workstations into one DeepSpeed training cluster.",
        epilog="Typical day: dscluster setup; dscluster check; "
        "mpirun -np 5 --hostfile hosts.txt ./entry_cn.sh; python analysis/plot.py runs/<id>",
    )
    parser.add_argument("--version", action=VersionAction,
                        help="print dscluster, python, torch and deepspeed versions and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module in COMMANDS.items():
        if only is not None and name != only:
            continue
        load(module).register(sub)
        if name not in sub.choices:
            raise RuntimeError(f"{module}.register() did not add the `{name}` command")
    return parser


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    # `dscluster train ...`: train's parser alone; `dscluster --help`, `--version` or a typo: all of them.
    parser = build_parser(words[0] if words and words[0] in COMMANDS else None)
    args = parser.parse_args(words)
    try:
        return int(args.func(args) or 0)
    except DsclusterError as e:
        print(f"dscluster {args.command}: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
