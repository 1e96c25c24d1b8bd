"""`make test-cpu` (tests/_cpuaccount.py): a test's CPU includes processes it did not wait for, as a
lab node's ranks are (children of the node's sshd): what `time` and `--durations` cannot show."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]

BURN = '''
import os, subprocess, sys, time
from pathlib import Path

def test_a_detached_grandchild_burns_half_a_second(tmp_path):
    done = tmp_path / "done"
    burn = ("import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.5: pass\\n"
            f"open({str(done)!r}, 'w')")
    # a daemon: started by a child that exits at once, so nothing in pytest waits for it or counts it
    start = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {burn!r}], start_new_session=True)"
    subprocess.run([sys.executable, "-c", start], check=True)
    deadline = time.monotonic() + 60
    while not done.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert done.exists()

def test_nothing():
    pass
'''


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a control group: needs root")
def test_each_tests_cpu_counts_the_processes_it_started_and_did_not_wait_for(tmp_path):
    (tmp_path / "test_burn.py").write_text(BURN)
    out = tmp_path / "cpu.jsonl"
    env = {**os.environ, "DSCLUSTER_TEST_CPU": str(out), "PYTHONPATH": str(TESTS)}
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "_cpuaccount", "-p", "no:cacheprovider",
                          "test_burn.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = {r["test"].split("::")[1]: r for r in map(json.loads, out.read_text().splitlines())}
    assert rows["test_a_detached_grandchild_burns_half_a_second"]["cpu_s"] >= 0.45
    assert rows["test_nothing"]["cpu_s"] < 0.2
    report = subprocess.run([sys.executable, str(TESTS / "_cpuaccount.py"), str(out)], capture_output=True,
                            text=True, timeout=60).stdout
    assert report.startswith("2 tests,") and "test_burn.py::test_a_detached_grandchild_burns_half_a_second" in report
