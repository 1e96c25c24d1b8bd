"""The command table: every command is there, and a missing module is an error, not a lost command."""

import subprocess
import sys
import types

import pytest

from dscluster import cli


def test_every_command_of_the_table_is_in_the_parser():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert list(sub.choices) == list(cli.COMMANDS)
    assert {"hosts", "sim", "setup", "check", "launch", "train", "telemetry", "plot", "diagnose", "bench", "env",
            "plan"} <= set(sub.choices)


def test_a_missing_command_module_fails_loudly(monkeypatch):
    monkeypatch.setitem(cli.COMMANDS, "nope", "dscluster.cli.nope")
    with pytest.raises(ModuleNotFoundError, match="dscluster.cli.nope"):
        cli.build_parser()


def test_a_module_that_does_not_register_its_command_is_an_error(monkeypatch):
    silent = types.ModuleType("dscluster.cli.silent")
    silent.register = lambda sub: None
    monkeypatch.setitem(sys.modules, "dscluster.cli.silent", silent)
    monkeypatch.setitem(cli.COMMANDS, "silent", "dscluster.cli.silent")
    with pytest.raises(RuntimeError, match="silent"):
        cli.build_parser()


def test_help_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "dscluster", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for name in cli.COMMANDS:
        assert f"    {name} " in out.stdout or f"    {name}\n" in out.stdout, name


def test_a_command_line_imports_its_own_command_alone_and_parses_as_with_every_command():
    # every rank's `dscluster train` and every node's sampler start this way: the other fifteen
    # modules (paramiko, the lab, check's rules) cost each process 0.4 CPU-s
    code = ("import sys\nfrom dscluster.cli import main\ntry:\n    main(['telemetry', '--help'])\n"
            "except SystemExit:\n    pass\n"
            "print(sorted(m for m in sys.modules if m.startswith('dscluster.cli.') or m == 'paramiko'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "['dscluster.cli.telemetry']"
    for argv in (["train", "--config", "configs/digits.yaml", "epochs=2"], ["plot", "runs/x", "--json"],
                 ["check", "--hostfile", "h.txt", "--skip-active"]):
        alone, every = cli.build_parser(argv[0]).parse_args(argv), cli.build_parser().parse_args(argv)
        assert vars(alone) == vars(every), argv
