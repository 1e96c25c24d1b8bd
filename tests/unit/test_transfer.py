"""transfer.py's rules: a copy stays inside its folder, and the rsync command it builds."""

from __future__ import annotations

import pytest

from dscluster.errors import UsageError
from dscluster.ssh.transfer import rsync_argv, safe_rel


@pytest.mark.parametrize("bad", ["../etc/passwd", "/etc/passwd", "a/../../b", ".", ".."])
def test_a_path_that_leaves_the_folder_is_refused(bad):
    with pytest.raises(UsageError, match="not a path inside the folder"):
        safe_rel(bad)


def test_a_path_inside_is_kept_normalised():
    assert safe_rel("src/./dscluster/x.py") == "src/dscluster/x.py"


def test_rsync_copies_the_listed_files_between_the_same_root_and_never_deletes():
    push = rsync_argv("/home/lab/dscluster", "lab@node2", "/home/lab/dscluster")
    assert push == ["rsync", "-a", "--from0", "--files-from=-", "-e", "ssh -o BatchMode=yes",
                    "/home/lab/dscluster/", "lab@node2:/home/lab/dscluster/"]
    pull = rsync_argv("/r/runs/x", "lab@node3", "/r/runs/x", push=False)
    assert pull[-2:] == ["lab@node3:/r/runs/x/", "/r/runs/x/"]
    assert not any(a.startswith("--delete") for a in push + pull)


def test_sync_and_collect_refuse_bad_input_with_exit_2_and_write_nothing(tmp_path, monkeypatch, capsys):
    from dscluster.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / ".dscluster").mkdir()
    (tmp_path / ".dscluster" / "known_hosts").write_text("")
    (tmp_path / "h.txt").write_text("node1 slots=1\n")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert main(["sync", "--hostfile", "h.txt", "--data", "nope"]) == 2
    assert "--data nope: no such folder on this machine (the head)" in capsys.readouterr().err
    assert main(["sync", "--hostfile", "missing.txt"]) == 2
    assert main(["collect", "runs/none"]) == 2
    assert "runs/none: no such run directory here (the head)" in capsys.readouterr().err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
