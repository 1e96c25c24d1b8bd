"""Power loss while writing: every state file is the old one or the new one, never a mix.

For each file kind, the real writer runs in a forked child that rewrites the file over and over,
alternating two versions (each large enough that a write takes a while); the parent SIGKILLs it at a
random moment, 200 times, and after every kill reads the file with its real reader: it must parse and
be exactly one of the two versions. A control case, a plain non-atomic write under the same
treatment, must be caught torn, so the harness is shown to land kills inside writes.

The files live in memory (/dev/shm, where there is one): what a SIGKILL can tear is the same there,
and the writers' fsyncs (which are what makes the rename survive a real power loss) cost nothing, so
1,400 kills take seconds instead of a minute.

Each case runs in a fresh interpreter that imports only the writers (`in_a_small_process`): a fork costs
what the parent has mapped, and a pytest that other tests have made import torch and DeepSpeed forks in
about 17 ms instead of 0.2 ms (with the kill and the wait, 37 ms against 0.4 ms). In the whole suite the
1,400 kills took 97 s that way; alone, 10 s.
"""

from __future__ import annotations

import functools
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import paramiko
import pytest

from dscluster.check import checkfile
from dscluster.check.checkfile import CheckFile, NodeResult
from dscluster.files import state
from dscluster.rundir import checkpoints
from dscluster.runmodel import predicted
from dscluster.ssh import hostkeys
from dscluster.train import checkpoint

# Slow, and must stay so: 200 real SIGKILLs of a writer per file kind (more on a loaded machine).
pytestmark = pytest.mark.slow

ITERATIONS = 200
_CHILD = "DSCLUSTER_POWER_LOSS_CASE"


def in_a_small_process(test):
    """Run `test` in a fresh pytest that imports only this module, so that its forks are cheap."""

    @functools.wraps(test)
    def run(tmp_path):
        if os.environ.get(_CHILD) == test.__name__:
            return test(tmp_path)
        env = dict(os.environ, **{_CHILD: test.__name__})
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{__file__}::{test.__name__}"]
        p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
        assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
        assert "1 passed" in p.stdout, p.stdout[-2000:]

    return run


@pytest.fixture
def tmp_path(tmp_path):
    """A folder in memory when the machine has /dev/shm, else pytest's own."""
    if not (os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)):
        yield tmp_path
        return
    folder = Path(tempfile.mkdtemp(prefix="dscluster-power-loss-", dir="/dev/shm"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def hammer(path: Path, write: Callable[[int], None], read: Callable[[], object], versions: dict[object, int],
           iterations: int = ITERATIONS) -> dict:
    """Kill a writer alternating versions 0 and 1 at random points; every read must be one of them.
    Returns how many kills left a temp file behind (a write interrupted mid-way) and what was seen."""
    write(0)
    t0 = time.perf_counter()
    for _ in range(3):
        write(1)
        write(0)
    cycle = (time.perf_counter() - t0) / 3  # kills spread over one child's first two writes
    rng = random.Random(1234)
    seen = {0: 0, 1: 0}
    interrupted = 0
    done = 0
    # At least `iterations` kills, and on until one has landed inside a write: on a loaded machine the
    # child starts late, so each further round of `iterations` kills spreads them over a longer span.
    while done < iterations or (interrupted == 0 and done < 10 * iterations):
        span = cycle * (1 + done // iterations)
        done += 1
        pid = os.fork()
        if pid == 0:  # the writer: never returns into pytest
            try:
                while True:
                    write(1)
                    write(0)
            finally:
                os._exit(0)
        time.sleep(rng.uniform(0, span))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        got = read()
        assert got in versions, f"{path.name}: neither the old nor the new version after a kill: {str(got)[:200]}"
        seen[versions[got]] += 1
        for tmp in path.parent.glob(f".{path.name}.*.tmp"):
            interrupted += 1
            tmp.unlink()
    return {"interrupted": interrupted, "seen": seen}


def assert_hit_mid_write(stats: dict) -> None:
    assert stats["interrupted"] > 0, f"no kill landed inside a write: {stats}"


@in_a_small_process
def test_check_json(tmp_path):
    path = tmp_path / "check.json"
    docs = [CheckFile(ok=v == 0, hostfile=f"hosts-{v}.txt", np=200,
                      nodes=[NodeResult(name=f"node{i}", hostname=f"ws{i}", env={"NCCL_SOCKET_IFNAME": f"eth{v}"} )
                             for i in range(300)]) for v in (0, 1)]
    stats = hammer(path, lambda v: checkfile.write(path, docs[v]), lambda: checkfile.load(path).hostfile,
                   {"hosts-0.txt": 0, "hosts-1.txt": 1})
    assert_hit_mid_write(stats)


@in_a_small_process
def test_node_env_file(tmp_path):
    path = tmp_path / "env" / "ws1.env"
    values = [{f"DSCLUSTER_K{i}": f"value-{v}-{i}" for i in range(500)} for v in (0, 1)]
    stats = hammer(path, lambda v: state.write_env_file(path, values[v], header="check"),
                   lambda: state.read_env_file(path)["DSCLUSTER_K499"], {"value-0-499": 0, "value-1-499": 1})
    assert_hit_mid_write(stats)


@in_a_small_process
def test_deepspeed_env(tmp_path):
    path = tmp_path / ".deepspeed_env"
    path.write_text("".join(f"USER_K{i}=mine{i}\n" for i in range(500)))  # the user's own lines, kept
    ours = [{"NCCL_SOCKET_IFNAME": f"eth{v}", **{f"DSCLUSTER_K{i}": str(v) for i in range(300)}} for v in (0, 1)]

    def read():
        doc = state.read_deepspeed_env(path)
        assert doc["USER_K499"] == "mine499" and len(doc) == 500 + 301 + 1
        return doc["NCCL_SOCKET_IFNAME"]

    stats = hammer(path, lambda v: state.update_deepspeed_env(path, ours[v]), read, {"eth0": 0, "eth1": 1})
    assert_hit_mid_write(stats)


@in_a_small_process
def test_known_hosts(tmp_path):
    path = tmp_path / "known_hosts"
    keys = [paramiko.RSAKey.generate(1024), paramiko.RSAKey.generate(1024)]
    for i in range(2):
        hostkeys.pin_host_key(path, [f"other{i}"], keys[i])
    path.write_text(path.read_text() * 20)  # 40 other hosts' lines, kept byte for byte

    def read():
        found = hostkeys.load_known_hosts(path).lookup("node1")
        return found["ssh-rsa"].get_base64() if found else None

    stats = hammer(path, lambda v: hostkeys.pin_host_key(path, ["node1"], keys[v]), read,
                   {keys[0].get_base64(): 0, keys[1].get_base64(): 1})
    assert_hit_mid_write(stats)


@in_a_small_process
def test_plans_json(tmp_path):
    env = {"DSCLUSTER_STATE": str(tmp_path)}
    path = predicted.path(env)
    predicted.save({f"other-{i}": {"images_per_s": float(i), "step_s": 0.1} for i in range(300)}, env)

    def read():
        entry = predicted.lookup("mine", env)
        return entry["images_per_s"] if entry else None

    stats = hammer(path, lambda v: predicted.save({"mine": {"images_per_s": float(v), "step_s": 0.1}}, env), read,
                   {0.0: 0, 1.0: 1})
    assert_hit_mid_write(stats)


@in_a_small_process
def test_checkpoint_latest(tmp_path):
    path = tmp_path / checkpoints.LATEST
    tags = ["epoch0000-step00000010", "epoch0001-step00000020"]
    for tag in tags:
        (tmp_path / tag).mkdir()
    stats = hammer(path, lambda v: checkpoint.commit_latest(tmp_path, tags[v]),
                   lambda: checkpoints.find_latest(tmp_path), {tags[0]: 0, tags[1]: 1})
    assert sum(stats["seen"].values()) == ITERATIONS  # `latest` is tiny: kills rarely land inside its write


@in_a_small_process
def test_control_a_plain_write_is_caught_torn(tmp_path):
    """The harness can fail: an ordinary open-truncate-write of the same size is seen half-written."""
    path = tmp_path / "plain.json"
    texts = ["0" * 200_000, "1" * 200_000]
    with pytest.raises(AssertionError, match="neither the old nor the new version"):
        hammer(path, lambda v: path.write_text(texts[v]), lambda: path.read_text()[:1] + str(len(path.read_text())),
               {"0200000": 0, "1200000": 1})
