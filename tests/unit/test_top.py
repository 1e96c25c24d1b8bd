"""`dscluster top`: a snapshot of every node and rank from the files a running job writes, as the
terminal view and as `--once --json`. (The SSH path runs against a lab in tests/cluster/test_top_lab.py.)"""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console

from _wait import scaled
from dscluster.cli import main
from dscluster.cli.top import render
from dscluster.telemetry.live import tail_records
from dscluster.telemetry.watch import NodePlace, Watcher


def _jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def live_run(root: Path, now: float, *, slow_rank: int = 1, throttled_host: str = "node2") -> Path:
    """Two nodes, one GPU and one rank each, written as a running job writes them up to `now`."""
    run = root / "runs" / "mpi-live"
    for i, host in enumerate(("node1", "node2")):
        samples = []
        for k, t in enumerate((now - 2, now - 1)):
            samples.append({"kind": "sample", "t": t, "host": host, "backend": "nvml", "cpu_percent": 40.0 + i,
                            "ram_used_mb": 8192.0, "ram_total_mb": 65536.0, "net_iface": ["eth0", "enp3s0"][i],
                            "net_rx_bytes": 10_000_000 + k * 117_000_000, "net_tx_bytes": 5_000_000 + k * 2_000_000,
                            "gpus": [{"index": 0, "name": "NVIDIA H100", "util_percent": 100.0, "mem_used_mb": 20480.0,
                                      "mem_total_mb": 81559.0, "temp_c": 70 + 20 * i, "power_w": 300.0,
                                      "throttle_reasons": ["gpu_idle"] + (["sw_thermal_slowdown"]
                                                                          if host == throttled_host else [])}]})
        _jsonl(run / "telemetry" / f"{host}.jsonl", [{"kind": "meta", "t": now - 30, "host": host}, *samples])
        steps = []
        for s in range(1, 9):
            st = 2.0 * (1.5 if i == slow_rank else 1.0)
            steps.append({"kind": "step", "t": now - 20 + s, "rank": i, "host": host, "step": s, "step_time": st,
                          "samples_per_s": 64 / st, "compute_s": 0.08 * st, "comm_s": 0.9 * st, "data_s": 0.02 * st})
        _jsonl(run / "metrics" / f"rank-{i}.jsonl", [{"kind": "start", "t": now - 30, "rank": i, "host": host}, *steps])
    return run


def test_once_json_has_every_node_and_rank_from_the_jobs_files(tmp_path, capsys):
    now = time.time()
    run = live_run(tmp_path, now)
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("node1 slots=1\nnode2 slots=1\n")
    assert main(["top", "--hostfile", str(hostfile), "--run-dir", str(run), "--once", "--json", "--no-ssh"]) == 0
    snap = json.loads(capsys.readouterr().out)
    assert snap["run_dir"] == str(run)
    nodes = {n["name"]: n for n in snap["nodes"]}
    assert list(nodes) == ["node1", "node2"] and {n["source"] for n in nodes.values()} == {"telemetry"}
    assert nodes["node1"]["net_iface"] == "eth0" and round(nodes["node1"]["net_rx_bytes_per_s"]) == 117_000_000
    assert nodes["node2"]["gpus"][0]["throttle"] == ["sw_thermal_slowdown"]  # gpu_idle is not a slowdown
    assert nodes["node1"]["gpus"][0]["throttle"] == []
    ranks = snap["ranks"]
    assert [(r["rank"], r["host"], r["step"], r["straggler"]) for r in ranks] == [(0, "node1", 8, False),
                                                                               (1, "node2", 8, True)]
    assert round(ranks[0]["images_per_s"], 1) == 32.0 and round(ranks[0]["comm_share"], 2) == 0.9


def test_the_view_shows_stragglers_throttling_and_network_wait(tmp_path):
    now = time.time()
    watcher = Watcher([NodePlace("node1", "node1", None), NodePlace("node2", "node2", None)],
                      live_run(tmp_path, now), ssh=False)
    con = Console(record=True, width=160)
    con.print(render(watcher.snapshot()))
    text = con.export_text()
    assert "sw_thermal_slowdown" in text and "1 straggler" in text and "90 %" in text
    assert "↓117.0 MB/s" in text


def test_a_node_without_fresh_telemetry_and_no_ssh_says_so(tmp_path):
    now = time.time()
    run = live_run(tmp_path, now - 60)  # the job's sampler stopped a minute ago
    snap = Watcher([NodePlace("node1", "node1", None)], run, ssh=False).snapshot()
    assert snap.nodes[0].source == "none" and "no fresh telemetry" in snap.nodes[0].error


def test_a_recorded_run_is_shown_as_it_was(tmp_path):
    now = time.time()
    run = live_run(tmp_path, now - 3600)
    snap = Watcher([NodePlace("node1", "node1", None)], run, ssh=False).snapshot(now=now - 3600)
    assert snap.nodes[0].source == "telemetry" and snap.ranks[0].age_s == 12.0


def test_the_newest_running_job_is_found_without_run_dir(tmp_path, monkeypatch):
    now = time.time()
    live_run(tmp_path, now)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DSCLUSTER_RUNS", raising=False)
    snap = Watcher([NodePlace("node1", "node1", None)], None, ssh=False).snapshot()
    assert snap.run_dir == str(Path("runs") / "mpi-live") and len(snap.ranks) == 2


def test_tail_skips_a_torn_last_line_and_a_cut_first_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"i": i, "pad": "x" * 50}) + "\n" for i in range(100)) + '{"i": 10')
    recs = tail_records(path, max_bytes=500)
    assert recs[-1]["i"] == 99 and all(set(r) == {"i", "pad"} for r in recs) and len(recs) < 10


def test_bad_options_exit_2(tmp_path, capsys):
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("node1 slots=1\n")
    assert main(["top", "--hostfile", str(hostfile), "--json"]) == 2
    assert main(["top", "--hostfile", str(hostfile), "--once", "--run-dir", str(tmp_path / "nope")]) == 2
    assert main(["top", "--hostfile", str(tmp_path / "missing.txt"), "--once"]) == 2
    err = capsys.readouterr().err
    assert "--once" in err and "nope" in err and "missing.txt" in err


def _controlling_terminal() -> None:
    """In the child: a session of its own whose controlling terminal is the pty (its stdin), so that
    Ctrl-C typed there is a SIGINT, as in a user's terminal."""
    import fcntl
    import os
    import termios

    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def _live_top(tmp_path, now):
    """`dscluster top` in a pseudo-terminal, as a user starts it; returns (process, the terminal's fd)."""
    import os
    import pty
    import subprocess
    import sys

    run = live_run(tmp_path, now)
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("node1 slots=1\nnode2 slots=1\n")
    main_fd, child_fd = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "dscluster", "top", "--hostfile", str(hostfile), "--run-dir",
                             str(run), "--no-ssh", "--interval", "0.2"], stdin=child_fd, stdout=child_fd,
                            stderr=child_fd, env={**os.environ, "TERM": "xterm", "COLUMNS": "160"},
                            preexec_fn=_controlling_terminal)
    os.close(child_fd)
    return proc, main_fd


def _read_until(fd, text: str, seconds: float) -> str:
    import os
    import select

    from _wait import Deadline

    seen, deadline = b"", Deadline(seconds)
    while text.encode() not in seen:
        assert not deadline.passed(), f"{text!r} not shown; the terminal got {seen[-2000:]!r}"
        if select.select([fd], [], [], 0.2)[0]:
            try:
                seen += os.read(fd, 65536)
            except OSError:
                break
    return seen.decode(errors="replace")


def test_the_live_view_refreshes_and_quits_on_q(tmp_path):
    import os

    proc, fd = _live_top(tmp_path, time.time())
    try:
        _read_until(fd, "straggler", 60)
        os.write(fd, b"q")
        assert proc.wait(timeout=scaled(20)) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(fd)


def test_the_live_view_quits_on_ctrl_c(tmp_path):
    import os

    proc, fd = _live_top(tmp_path, time.time())
    try:
        _read_until(fd, "straggler", 60)
        os.write(fd, b"\x03")  # the terminal turns it into SIGINT
        assert proc.wait(timeout=scaled(20)) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(fd)


def test_once_svg_saves_the_view_as_a_picture_and_refuses_an_existing_file(tmp_path, capsys):
    run = live_run(tmp_path, time.time())
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("node1 slots=1\nnode2 slots=1\n")
    svg = tmp_path / "top.svg"
    args = ["top", "--hostfile", str(hostfile), "--run-dir", str(run), "--once", "--no-ssh", "--svg", str(svg)]
    assert main(args) == 0
    text = svg.read_text()
    assert text.startswith("<svg") and "node1" in text and "node2" in text and "straggler" in text
    before = svg.read_bytes()
    assert main(args) == 2  # the picture already there is kept, not overwritten
    assert svg.read_bytes() == before
    assert main(["top", "--hostfile", str(hostfile), "--svg", str(tmp_path / "new.svg")]) == 2  # needs --once
    assert main(["top", "--hostfile", str(hostfile), "--once", "--svg", str(tmp_path / "no" / "x.svg")]) == 2
    assert not (tmp_path / "new.svg").exists() and not (tmp_path / "no").exists()
    err = capsys.readouterr().err
    assert "exists" in err and "--once" in err and "no folder" in err
