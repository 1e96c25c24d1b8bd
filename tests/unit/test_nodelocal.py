"""Resume without a shared filesystem (train/nodelocal.py): who writes `latest`, and a resume
where the nodes see different checkpoints stops before training, naming the node."""

from __future__ import annotations

from pathlib import Path

import pytest

from dscluster.errors import UsageError
from dscluster.train.nodelocal import resume_agreement, run_dir_shared, writes_latest

CKPT = Path("/home/lab/dscluster/runs/r/checkpoints")
HOSTS = ["node1", "node2", "node2", "node3"]
TAG = "epoch0000-step00000012"


def test_every_node_commits_latest_without_a_shared_filesystem_and_only_rank_0_with_one():
    assert [writes_latest(r, lr, shared=True) for r, lr in [(0, 0), (1, 0), (2, 1)]] == [True, False, False]
    assert [writes_latest(r, lr, shared=False) for r, lr in [(0, 0), (1, 0), (2, 1)]] == [True, True, False]


def test_ranks_that_agree_resume_from_that_tag_or_start_fresh():
    assert resume_agreement([TAG] * 4, HOSTS, CKPT, shared=False) == TAG
    assert resume_agreement([""] * 4, HOSTS, CKPT, shared=False) is None


def test_a_node_without_the_checkpoint_stops_the_resume_naming_it_and_the_copy_that_fixes_it():
    with pytest.raises(UsageError) as e:
        resume_agreement([TAG, TAG, TAG, ""], HOSTS, CKPT, shared=False)
    msg = str(e.value)
    assert "node3 has no checkpoint ('latest' missing)" in msg and "node1, node2 have " + TAG in msg
    assert f"copy {CKPT}/{TAG} and {CKPT}/latest from node1 to node3" in msg and "Training did not start" in msg
    with pytest.raises(UsageError, match="node2 has epoch0000-step00000008.*storage every rank sees the same"):
        resume_agreement([TAG, "epoch0000-step00000008", "epoch0000-step00000008", TAG], HOSTS, CKPT, shared=True)


def test_a_single_process_sees_its_own_run_directory_as_shared(tmp_path):
    assert run_dir_shared(tmp_path / "run", rank=0) is True
    assert not list((tmp_path / "run").iterdir())   # the marker is gone


def test_a_run_stopped_between_two_nodes_commits_resumes_from_the_newest_checkpoint_every_node_holds():
    from dscluster.train.nodelocal import interrupted_commit, newest_held
    older, newer = "epoch0000-step00000012", "epoch0000-step00000016"
    pair = interrupted_commit([newer, older, newer])     # node2's rank was killed before it wrote `latest`
    assert pair == (newer, older)
    assert newest_held(pair, ["11", "11", "11"]) == newer   # its save had finished everywhere
    assert newest_held(pair, ["11", "01", "11"]) == older   # a node lost the newer folder: the older one
    assert newest_held(pair, ["11", "00", "11"]) is None    # neither: resume_agreement names the node
    # a node without any checkpoint, or three different ones, is not an interrupted commit
    assert interrupted_commit([newer, "", newer]) is None
    assert interrupted_commit([newer, older, "epoch0000-step00000008"]) is None
    assert interrupted_commit([newer, newer]) is None
