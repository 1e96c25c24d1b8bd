"""Hostfile parsing: valid OpenMPI syntax in, FILE:LINE errors out (exit 2)."""

import json
import os

import pytest

from dscluster.cli import main
from dscluster.errors import UsageError
from dscluster.node.hosts import parse_hostfile, parse_hostfile_text


def test_valid_hostfile_with_comments_blank_lines_and_addresses():
    hf = parse_hostfile_text(
        "# lab\n\nnode1 slots=2   # the 3070\nnode2 slots=1 max_slots=4\n10.0.0.7\tslots=1\n", "hosts.txt"
    )
    assert hf.names == ["node1", "node2", "10.0.0.7"]
    assert [h.slots for h in hf.hosts] == [2, 1, 1]
    assert hf.hosts[1].max_slots == 4
    assert hf.total_slots == 4
    assert [h.line for h in hf.hosts] == [3, 4, 5]


@pytest.mark.parametrize(
    "text, message",
    [
        ("node1 slots=1\nnode2 slots=1\nnode1 slots=2\n", "hosts.txt:3: duplicate host 'node1' (first on line 1)"),
        ("node1 slots=1\nNODE1 slots=1\n", "hosts.txt:2: duplicate host 'NODE1'"),
        ("node1 slots=0\n", "hosts.txt:1: slots must be at least 1"),
        ("node1 slots=-2\n", "hosts.txt:1: slots='-2' is not a whole number"),
        ("node1 slots=two\n", "hosts.txt:1: slots='two' is not a whole number"),
        ("node1 slots=1.5\n", "hosts.txt:1: slots='1.5' is not a whole number"),
        ("node1 slots=\n", "hosts.txt:1: slots='' is not a whole number"),
        ("node1 gpus=2\n", "hosts.txt:1: unknown key 'gpus'"),
        ("node1 slots=2 extra\n", "hosts.txt:1: unexpected 'extra'"),
        ("node1 slots=2 slots=3\n", "hosts.txt:1: slots given twice"),
        ("node_1 slots=1\n", "hosts.txt:1: invalid host name 'node_1'"),
        ("-node slots=1\n", "hosts.txt:1: invalid host name '-node'"),
        ("slots=2\n", "hosts.txt:1: line starts with 'slots=2'"),
        ("node1 slots=4 max_slots=2\n", "hosts.txt:1: max_slots=2 is below slots=4"),
        ("# only comments\n\n", "hosts.txt: no hosts"),
        ("", "hosts.txt: no hosts"),
    ],
)
def test_rejections_name_file_and_line(text, message):
    with pytest.raises(UsageError) as e:
        parse_hostfile_text(text, "hosts.txt")
    assert message in str(e.value)


def deepspeed_parse(text):
    """DeepSpeed's own hostfile parser (the launcher's), or None when DeepSpeed is not installed."""
    runner = pytest.importorskip("deepspeed.launcher.runner")
    return runner._parse_hostfile(text.splitlines())


@pytest.mark.parametrize(
    "text, message",
    [
        ("node1 slots=2\nnode3\n",
         "hosts.txt:2: host 'node3' has no slots=N (OpenMPI reads one slot, DeepSpeed's launcher refuses "
         "the line); write 'node3 slots=1'"),
        ("node3   # the old box\n", "hosts.txt:1: host 'node3' has no slots=N"),
        ("node2 max_slots=4 slots=2\n",
         "hosts.txt:1: slots=N must come right after the host name (DeepSpeed's launcher refuses the line); "
         "write 'node2 slots=2 max_slots=4'"),
        ("node2 max_slots=4\n",
         "hosts.txt:1: host 'node2' has no slots=N (DeepSpeed's launcher refuses the line); "
         "write 'node2 slots=1 max_slots=4'"),
    ],
)
def test_lines_deepspeeds_launcher_refuses_are_refused_with_the_fix(text, message, tmp_path, capsys):
    with pytest.raises(UsageError) as e:
        parse_hostfile_text(text, "hosts.txt")
    assert message in str(e.value)
    with pytest.raises(ValueError, match="bad entry"):
        deepspeed_parse(text)
    path = tmp_path / "hosts.txt"
    path.write_text(text)
    assert main(["hosts", "check", str(path)]) == 2
    assert f"{path}:" in capsys.readouterr().err


def test_accepted_lines_are_what_deepspeeds_launcher_reads():
    text = "# lab\nnode1 slots=2   # the 3070\nnode2 slots=1 max_slots=4\n10.0.0.7\tslots=3\n"
    hf = parse_hostfile_text(text, "hosts.txt")
    assert dict(deepspeed_parse(text)) == {h.name: h.slots for h in hf.hosts}


def test_missing_and_unreadable_files(tmp_path):
    with pytest.raises(UsageError, match="no such hostfile"):
        parse_hostfile(tmp_path / "nope.txt")
    with pytest.raises(UsageError, match="is a directory"):
        parse_hostfile(tmp_path)
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe\x00node1")
    with pytest.raises(UsageError, match="not a text file"):
        parse_hostfile(binary)
    if os.geteuid() != 0:  # root reads anything
        locked = tmp_path / "locked.txt"
        locked.write_text("node1 slots=1\n")
        locked.chmod(0)
        with pytest.raises(UsageError, match="permission denied"):
            parse_hostfile(locked)


def test_cli_check_prints_hosts_and_exit_codes(tmp_path, capsys):
    good = tmp_path / "hosts.txt"
    good.write_text("node1 slots=2\nnode2 slots=1\n")
    assert main(["hosts", "check", str(good), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["total_slots"] == 3
    assert [h["name"] for h in data["hosts"]] == ["node1", "node2"]

    assert main(["hosts", "check", str(good)]) == 0
    out = capsys.readouterr().out
    assert "node2" in out and "3 slots" in out

    bad = tmp_path / "bad.txt"
    bad.write_text("node1 slots=1\nnode1 slots=1\n")
    assert main(["hosts", "check", str(bad)]) == 2
    assert f"{bad}:2: duplicate host 'node1'" in capsys.readouterr().err


def test_example_hostfile_in_repo_is_valid():
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    hf = parse_hostfile(os.path.join(root, "hosts.txt"))
    assert hf.total_slots == 5
