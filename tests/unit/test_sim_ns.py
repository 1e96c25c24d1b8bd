"""Lab plumbing that needs no root: process teardown and the node's anchor script."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from dscluster.sim.ns import anchor_script, kill_and_wait, pid_in_netns, pid_is_zombie

IGNORES_TERM = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print('ready', flush=True); time.sleep(60)")


def test_kill_and_wait_stops_a_process_that_ignores_sigterm():
    proc = subprocess.Popen([sys.executable, "-c", IGNORES_TERM], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        start = time.monotonic()
        left = kill_and_wait([proc.pid], grace=0.3, timeout=5)
        assert left == []
        assert time.monotonic() - start < 5
        # our own child: dead, waiting for us (not PID 1) to reap it, and not waited for
        assert pid_is_zombie(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -9


def test_a_pid_is_never_taken_for_a_node_process_without_its_namespace():
    assert not pid_in_netns(1, "dscluster-no-such-lab-node1")


def test_anchor_script_is_valid_shell_that_mounts_the_nodes_own_layers(tmp_path: Path):
    script = anchor_script(hostname="node2", nodedir=tmp_path / "node2")
    (tmp_path / "a.sh").write_text(script)
    assert subprocess.run(["sh", "-n", str(tmp_path / "a.sh")]).returncode == 0
    assert "echo node2 > /proc/sys/kernel/hostname" in script
    for layer in ("/etc", "/root"):
        assert f"lowerdir={layer}," in script
    assert f"mount --bind {tmp_path}/node2/home /home" in script
    # the pid file appears only after every mount succeeded (set -e), then the anchor sleeps
    lines = script.splitlines()
    assert lines[1] == "set -eu" and lines[-1] == "exec sleep infinity"
    assert lines.index(f"mv {tmp_path}/node2/anchor.pid.tmp {tmp_path}/node2/anchor.pid") > max(
        i for i, l in enumerate(lines) if l.startswith("mount"))


def test_anchor_sets_shared_folders_aside_before_overlays_hide_them_and_binds_them_back_after(tmp_path: Path):
    nd = tmp_path / "node1"
    mounts = [["overlay", "/tmp/tmpab12"], ["bind", "/tmp/tmpab12/clone"], ["home-bind", "/home/alice/repo"]]
    script = anchor_script(hostname="node1", nodedir=nd, mounts=mounts)
    (tmp_path / "a.sh").write_text(script)
    assert subprocess.run(["sh", "-n", str(tmp_path / "a.sh")]).returncode == 0
    lines = script.splitlines()
    aside = [f"mount --bind /tmp/tmpab12/clone {nd}/keep/1", f"mount --bind /home/alice/repo {nd}/keep/2"]
    overlay = (f"mount -t overlay dscluster-reach -o lowerdir=/tmp/tmpab12,upperdir={nd}/reach/0/upper,"
               f"workdir={nd}/reach/0/work /tmp/tmpab12")
    back = [f"mount --bind {nd}/keep/1 /tmp/tmpab12/clone", f"mount --bind {nd}/keep/2 /home/alice/repo"]
    home = f"mount --bind {nd}/home /home"
    at = {line: i for i, line in enumerate(lines)}
    assert all(at[a] < at[overlay] for a in aside) and at[aside[1]] < at[home]
    assert at[overlay] < at[back[0]] and at[home] < at[back[1]]
    assert at[f"mv {nd}/anchor.pid.tmp {nd}/anchor.pid"] > max(at[b] for b in back)
