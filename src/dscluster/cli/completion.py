"""`dscluster completion bash|zsh`: a shell completion script generated from the real parser.

The script is made by shtab from the same argparse parser `dscluster` parses with, so every
command and option, including ones added later, completes without anyone editing a script.
Options that name a file or a folder complete paths (FILE_DESTS / DIR_DESTS, by argparse dest).
"""

from __future__ import annotations

import argparse

import shtab

from dscluster.cli import build_parser

SHELLS = ("bash", "zsh")
FILE_DESTS = {"hostfile", "config", "script", "out"}
"""Options and arguments whose value is a file (a hostfile, a YAML preset, an output file)."""
DIR_DESTS = {"run_dir", "run_dirs", "work_dir"}
"""...and those whose value is a folder (run directories)."""

EPILOG = """enable it:
  bash:  echo 'eval "$(dscluster completion bash)"' >> ~/.bashrc
  zsh:   echo 'eval "$(dscluster completion zsh)"' >> ~/.zshrc    # after compinit
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "completion",
        help="print a bash or zsh completion script for dscluster",
        description="Print a completion script for dscluster's commands and options, made from its own "
        "command-line parser (so it always matches this version).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("shell", choices=SHELLS, help="the shell to complete in")
    p.set_defaults(func=completion_command)


def _mark_paths(parser: argparse.ArgumentParser, shtab) -> None:
    """Tell shtab which values are paths (it reads `action.complete`), in every subcommand."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):  # aliases map to the same parser
                _mark_paths(child, shtab)
        elif action.dest in FILE_DESTS:
            action.complete = shtab.FILE
        elif action.dest in DIR_DESTS:
            action.complete = shtab.DIRECTORY


def completion_script(shell: str) -> str:
    parser = build_parser()
    _mark_paths(parser, shtab)
    return shtab.complete(parser, shell=shell)


def completion_command(args: argparse.Namespace) -> int:
    print(completion_script(args.shell))
    return 0
