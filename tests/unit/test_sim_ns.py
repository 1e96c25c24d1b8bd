"""Lab plumbing that needs no root: process teardown and the node's anchor script."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from dscluster.sim_ns import anchor_script, kill_and_wait, pid_in_netns, pid_is_zombie

IGNORES_TERM = "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"


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
    assert "echo 'node2' > /proc/sys/kernel/hostname" in script
    for layer in ("/etc", "/root"):
        assert f"lowerdir={layer}," in script
    assert f"mount --bind {tmp_path}/node2/home /home" in script
    # the pid file appears only after every mount succeeded (set -e), then the anchor sleeps
    lines = script.splitlines()
    assert lines[1] == "set -eu" and lines[-1] == "exec sleep infinity"
    assert lines.index(f"mv {tmp_path}/node2/anchor.pid.tmp {tmp_path}/node2/anchor.pid") > max(
        i for i, l in enumerate(lines) if l.startswith("mount"))
