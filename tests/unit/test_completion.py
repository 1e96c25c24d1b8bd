"""`dscluster completion bash|zsh`: the printed script completes in a real shell, from the real parser."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dscluster.cli import build_parser


def completion(shell: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dscluster", "completion", shell], capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def bash_script(tmp_path_factory) -> Path:
    res = completion("bash")
    assert res.returncode == 0, res.stderr
    path = tmp_path_factory.mktemp("completion") / "dscluster.bash"
    path.write_text(res.stdout)
    return path


def complete_in_bash(script: Path, line: str) -> list[str]:
    """What <TAB> offers after `line` in bash: the function `complete -p dscluster` names, called
    with COMP_WORDS/COMP_CWORD as bash sets them (the word under the cursor is the last one)."""
    words = line.split(" ")
    program = f"""
source {script}
fn=$(complete -p dscluster | sed -n 's/.*-F \\([^ ]*\\) dscluster$/\\1/p')
[ -n "$fn" ] || {{ echo "no completion function registered for dscluster" >&2; exit 3; }}
COMP_WORDS=({' '.join(repr(w) for w in words)})
COMP_CWORD={len(words) - 1}
COMP_LINE={line!r}
COMP_POINT=${{#COMP_LINE}}
"$fn" dscluster {words[-1]!r} {words[-2]!r}
printf '%s\\n' "${{COMPREPLY[@]}}"
"""
    res = subprocess.run(["bash", "--norc", "--noprofile", "-c", program], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return [w.strip() for w in res.stdout.splitlines() if w.strip()]


def test_bash_completes_a_command_from_its_first_letters(bash_script):
    assert complete_in_bash(bash_script, "dscluster la") == ["launch"]
    assert complete_in_bash(bash_script, "dscluster comp") == ["completion"]


def test_bash_lists_a_commands_own_options_and_choices(bash_script):
    options = complete_in_bash(bash_script, "dscluster launch --")
    assert {"--hostfile", "--launcher", "--dry-run", "--np"} <= set(options)
    assert "--config" not in options  # train's option, not launch's
    assert complete_in_bash(bash_script, "dscluster launch --launcher ") == ["mpirun", "deepspeed", "torchrun",
                                                                               "slurm"]


def test_bash_completes_a_hostfile_option_with_paths(bash_script, tmp_path, monkeypatch):
    (tmp_path / "hosts-lab.txt").write_text("node1 slots=1\n")
    monkeypatch.chdir(tmp_path)
    assert complete_in_bash(bash_script, "dscluster check --hostfile hosts-") == ["hosts-lab.txt"]


def test_every_command_of_the_parser_completes(bash_script):
    """The script comes from the parser itself: a command added to the CLI needs no script edit."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(complete_in_bash(bash_script, "dscluster ")) >= set(sub.choices)


def test_zsh_script_is_a_compdef_for_dscluster_with_its_commands():
    res = completion("zsh")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("#compdef dscluster")
    assert "launch" in res.stdout and "--hostfile" in res.stdout and "--launcher" in res.stdout
    zsh = shutil.which("zsh")
    if zsh:  # where zsh is installed: it loads into zsh's completion system as dscluster's completer
        load = subprocess.run([zsh, "-f", "-c", 'autoload -U compinit && compinit -u -D && eval "$(cat)" && '
                               'print -r -- "completer=${_comps[dscluster]}"'],
                              input=res.stdout, capture_output=True, text=True, timeout=60)
        assert load.returncode == 0 and not load.stderr, load.stderr
        assert load.stdout.strip().startswith("completer=_"), load.stdout


def test_unknown_shell_is_a_usage_error():
    res = completion("fish")
    assert res.returncode == 2 and "invalid choice: 'fish'" in res.stderr and not res.stdout
