"""train/stopped.py: SIGTERM reaches `then` even while the main thread waits in C code, the stacks are
dumped first, the process ends 143; after `close` SIGTERM is the default again. Real processes, real
signals (a Python process each, no torch)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from _wait import wait_until

SRC = Path(__file__).resolve().parents[2] / "src"

PROGRAM = """
import faulthandler, signal, socket, sys
sys.path.insert(0, {src!r})
from dscluster.train.stopped import OnTerminate
out = {out!r}
stop = OnTerminate()
traces = open(out + ".traces", "w")
faulthandler.register(signal.SIGTERM, file=traces, all_threads=True, chain=True)
stop.then = lambda: open(out + ".then", "w").write("then ran")
if {close}:
    faulthandler.unregister(signal.SIGTERM)
    stop.close()
a, b = socket.socketpair()
print("ready", flush=True)
a.recv(1)  # blocked in C, as a rank waiting in a collective for a peer that is gone
"""


def _run(tmp_path: Path, *, close: bool) -> tuple[int, Path]:
    out = tmp_path / "probe"
    proc = subprocess.Popen([sys.executable, "-c", PROGRAM.format(src=str(SRC), out=str(out), close=close)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    wait_until(lambda: proc.poll() is not None, 30, "the probe's end after SIGTERM")
    return proc.returncode, out


def test_sigterm_runs_then_from_a_thread_after_the_stacks_and_exits_143(tmp_path):
    rc, out = _run(tmp_path, close=False)
    assert rc == 143
    assert Path(f"{out}.then").read_text() == "then ran"
    assert "most recent call first" in Path(f"{out}.traces").read_text()


def test_after_close_sigterm_is_the_default_again(tmp_path):
    rc, out = _run(tmp_path, close=True)
    assert rc == -signal.SIGTERM
    assert not Path(f"{out}.then").exists()


def test_a_stopped_rank_0_writes_its_end_and_a_summary_only_where_the_run_has_none(tmp_path):
    import json

    from dscluster.files.fsutil import read_jsonl
    from dscluster.rundir.writer import RunLog, RunRecord
    from dscluster.train.stopped import record_stop

    record = RunRecord(run_id="r", world_size=2, hosts=["node1"], model="m", dataset="digits", epochs=1)
    for run, earlier in ((tmp_path / "bare", None), (tmp_path / "done", "complete"), (tmp_path / "failed", "failed")):
        log = RunLog(run, rank=0, host="node1")
        if earlier:  # the run's own summary (a complete run its launcher stops in its teardown; a rank's failure)
            log.write_summary({"status": earlier})
        record_stop(log, record, run, started=0.0, summary=True)()
        log.record("step", step=99)  # the main thread still stepping while the stop is written: dropped
        log.close()
        end = read_jsonl(run / "metrics" / "rank-0.jsonl")[-1]
        assert (end["kind"], end["status"]) == ("end", "stopped")
        summary = json.loads((run / "summary.json").read_text())
        if earlier:
            assert summary == {"status": earlier}
        else:
            assert summary["status"] == "failed" and summary["failed_rank"] is None
            assert summary["error"].startswith("rank 0 was stopped by SIGTERM before it learned why")
