"""A full disk loses nothing: on a real, small tmpfs (root; mounted for the test, unmounted after),
a checkpoint save that fails leaves the previous `latest` loadable and names the folder and its free
space, the stated rule stops the run at the second failure in a row, and JSON-lines records
(metrics, telemetry) are never torn or lost by a write that found no room.

The DeepSpeed engine is a stand-in whose save_checkpoint writes a real torch.save file where
DeepSpeed writes its model states (a real engine takes a process group and tens of seconds); the
disk, the write failures, `latest` and the JSON lines are the real ones.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from dscluster.files.fsutil import JsonlWriter, StorageFull, read_jsonl
from dscluster.rundir import checkpoints
from dscluster.train import checkpoint


@pytest.fixture
def small_disk(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


class Engine:
    """What checkpoint.save uses of a DeepSpeed engine; `numel` floats of model state per save."""

    device = torch.device("cpu")

    def __init__(self, numel: int):
        self.numel = numel

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        folder = Path(save_dir) / tag
        folder.mkdir(parents=True, exist_ok=True)
        torch.save({"module": torch.ones(self.numel), **client_state}, folder / "mp_rank_00_model_states.pt")


def fill(folder: Path) -> None:
    """Take every free byte of the filesystem."""
    with open(folder / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass


def test_a_checkpoint_the_disk_has_no_room_for_leaves_the_previous_latest_loadable(small_disk):
    ckpt = small_disk / "checkpoints"
    first = checkpoint.Position(0, 10, 10)
    ok, msg = checkpoint.save(Engine(10_000), ckpt, first, rank=0)  # 40 kB
    assert ok, msg
    ok, msg = checkpoint.save(Engine(1_000_000), ckpt, checkpoint.Position(1, 10, 20), rank=0)  # 4 MB > 2 MB disk
    assert not ok
    assert "still points to epoch0000-step00000010" in msg and f"{ckpt} has " in msg and "MB free" in msg, msg
    assert checkpoints.find_latest(ckpt) == checkpoint.tag_for(first)
    assert not (ckpt / checkpoint.tag_for(checkpoint.Position(1, 10, 20))).exists()  # the torn tag is removed
    state = torch.load(ckpt / checkpoint.tag_for(first) / "mp_rank_00_model_states.pt")
    assert state["position"] == first.to_dict() and state["module"].numel() == 10_000


def test_no_room_for_latest_itself_keeps_the_old_one(small_disk, monkeypatch):
    ckpt = small_disk / "checkpoints"
    assert checkpoint.save(Engine(1000), ckpt, checkpoint.Position(0, 5, 5), rank=0)[0]
    real_commit = checkpoint.commit_latest

    def commit_on_a_full_disk(d, tag):  # the checkpoint got the last bytes: `latest` finds none
        fill(small_disk)
        real_commit(d, tag)

    monkeypatch.setattr(checkpoint, "commit_latest", commit_on_a_full_disk)
    ok, msg = checkpoint.save(Engine(1000), ckpt, checkpoint.Position(0, 10, 10), rank=0)
    assert not ok and "writing 'latest'" in msg and "still points to epoch0000-step00000005" in msg, msg
    assert (ckpt / "latest").read_text() == "epoch0000-step00000005\n"
    assert not [p for p in ckpt.iterdir() if p.name.endswith(".tmp")]  # no half `latest` left beside it


def test_the_rule_trains_on_after_one_failed_save_and_stops_at_the_second_in_a_row(small_disk):
    failed, msg = checkpoint.after_save(False, f"checkpoint x failed; {small_disk} has 0.0 MB free", 0)
    assert failed == 1 and "training goes on without this checkpoint" in msg
    assert checkpoint.after_save(True, "saved", failed) == (0, "saved")  # a good save resets the count
    with pytest.raises(StorageFull, match=r"has 0.0 MB free; 2 checkpoint saves failed in a row: stopping.*"
                                          r"run the same command: it resumes from 'latest'") as e:
        checkpoint.after_save(False, f"checkpoint y failed; {small_disk} has 0.0 MB free", 1)
    assert e.value.exit_code == 1


def test_records_on_a_full_disk_are_whole_or_absent_and_resume_when_there_is_room(small_disk):
    path = small_disk / "metrics" / "rank-0.jsonl"
    writer = JsonlWriter(path)
    record = {"kind": "step", "loss": 0.5, "pad": "x" * 900}
    written, errors = 0, []
    while len(errors) < 3:
        try:
            writer.write({**record, "step": written + 1})
            written += 1
        except StorageFull as e:
            errors.append(str(e))
    assert f"cannot write {path} (No space left on device)" in errors[0] and "earlier records kept" in errors[0]
    assert f"{path.parent} has " in errors[0] and "MB free" in errors[0]
    lines = path.read_text().splitlines()
    assert len(lines) == written and [json.loads(l)["step"] for l in lines] == list(range(1, written + 1))

    os.truncate(path, sum(len(l) + 1 for l in lines[:-3]))  # room again: the user deleted something
    writer.write({**record, "step": "after"})
    writer.close()
    steps = [json.loads(l)["step"] for l in path.read_text().splitlines()]  # every line parses
    assert steps == list(range(1, written - 2)) + ["after"]
    assert read_jsonl(path)[-1]["step"] == "after"
