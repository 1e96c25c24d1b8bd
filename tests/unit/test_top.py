"""`dscluster top`: a snapshot of every node and rank from the files a running job writes, as the
terminal view and as `--once --json`. (The SSH path runs against a lab in tests/cluster/test_top_lab.py,
and against a lab without a shared filesystem in tests/cluster/test_no_shared_fs.py.)"""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console

from _wait import scaled
from dscluster.cli import main
from dscluster.cli.top import render
from dscluster.top.live import tail_records
from dscluster.top.watch import NodePlace, Watcher


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
    assert [(r["rank"], r["host"], r["step"], r["straggler"], r["source"]) for r in ranks] == [
        (0, "node1", 8, False, "file"), (1, "node2", 8, True, "file")]
    assert round(ranks[0]["images_per_s"], 1) == 32.0 and round(ranks[0]["comm_share"], 2) == 0.9


def test_once_into_a_pipe_prints_every_figure_whole(tmp_path, capsys):
    """A log or a pipe, where rich would assume 80 columns and cut cells to '…', gets the width the view needs."""
    run = live_run(tmp_path, time.time())
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("node1 slots=1\nnode2 slots=1\n")
    assert main(["top", "--hostfile", str(hostfile), "--run-dir", str(run), "--once", "--no-ssh"]) == 0
    out = capsys.readouterr().out
    assert "…" not in out
    assert "node1" in out and "node2" in out and "32.0" in out and "straggler" in out


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

    now = time.time()
    proc, fd = _live_top(tmp_path, now)
    try:
        _read_until(fd, "straggler", 60)
        # the job writes a step after the first frame: a later frame shows it, as a user watching sees it
        step = {"kind": "step", "t": time.time(), "rank": 0, "host": "node1", "step": 97531, "step_time": 2.0,
                "samples_per_s": 32.0, "compute_s": 0.16, "comm_s": 1.8, "data_s": 0.04}
        with open(tmp_path / "runs" / "mpi-live" / "metrics" / "rank-0.jsonl", "a") as metrics:
            metrics.write(json.dumps(step) + "\n")
        _read_until(fd, "97531", 60)
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


# --- a lab without a shared filesystem: node2's ranks are only in node2's own copy of the run ------------

def split_run(tmp_path: Path, now: float) -> tuple[Path, Path]:
    """The head's copy of a running job (rank 0 and node1's telemetry) and node2's own copy at the same
    run (rank 1, and the telemetry node2's sampler writes under this machine's hostname), as a lab
    without a shared filesystem has them while the job runs."""
    import shutil
    import socket

    whole = live_run(tmp_path / "whole", now)
    head, node = tmp_path / "head" / "mpi-live", tmp_path / "node2" / "mpi-live"
    for copy, rank, host in ((head, 0, "node1"), (node, 1, "node2")):
        (copy / "metrics").mkdir(parents=True)
        (copy / "telemetry").mkdir()
        shutil.copy(whole / "metrics" / f"rank-{rank}.jsonl", copy / "metrics")
        shutil.copy(whole / "telemetry" / f"{host}.jsonl",
                    copy / "telemetry" / f"{host if copy is head else socket.gethostname()}.jsonl")
    return head, node


def test_once_with_run_dir_sends_the_job_samplers_sample_and_the_nodes_ranks(tmp_path):
    from dscluster.top.once import sample_once

    now = time.time()
    _, node = split_run(tmp_path, now)
    rec = sample_once(None, run_dir=node)
    assert rec["job_sampler"] is True and rec["t"] == now - 1  # the job sampler's sample, not one taken now
    assert round(rec["net_rx_bytes_per_s"]) == 117_000_000 and rec["net_iface"] == "enp3s0"
    assert list(rec["ranks"]) == ["1"]
    one = rec["ranks"]["1"]
    assert [s["step"] for s in one["steps"]] == [4, 5, 6, 7, 8] and one["last"]["step"] == 8
    assert one["end"] is None and one["process"] is None
    assert set(one["steps"][0]) == {"kind", "t", "rank", "host", "step", "step_time", "samples_per_s", "comm_s"}


def test_once_without_a_fresh_job_sample_takes_one_and_still_reads_the_ranks(tmp_path):
    from dscluster.top.once import sample_once

    now = time.time()
    _, node = split_run(tmp_path, now - 60)  # the node's sampler stopped a minute ago; its files remain
    (node / "process").mkdir()
    (node / "process" / "rank-1.json").write_text(json.dumps({"rank": 1, "host": "node2", "exit_code": 3}))
    rec = sample_once(None, window_s=0.05, run_dir=node)
    assert "job_sampler" not in rec and rec["t"] >= now and rec["cpu_percent"] is not None
    assert rec["ranks"]["1"]["process"] == {"rank": 1, "host": "node2", "exit_code": 3}


def test_once_line_stays_small_with_many_ranks_and_long_records(tmp_path):
    from dscluster.top.once import MAX_RANKS, sample_once

    now = time.time()
    for rank in range(MAX_RANKS + 6):
        big = {"config": "x" * 4000, "host": "node2", "rank": rank}
        _jsonl(tmp_path / "run" / "metrics" / f"rank-{rank}.jsonl",
               [{"kind": "start", "t": now - 30, **big}]
               + [{"kind": "step", "t": now - 20 + s, "step": s, "step_time": 1.0, **big} for s in range(50)])
    line = json.dumps(sample_once(None, window_s=0.05, run_dir=tmp_path / "run"))
    ranks = json.loads(line)["ranks"]
    assert len(ranks) == MAX_RANKS and "config" not in line
    assert len(line) < 1000 * MAX_RANKS, len(line)


def test_the_once_command_on_a_nodes_copy_adds_its_ranks_to_the_heads(tmp_path):
    """once_command's argv run as SSH runs it (a shell), its line parsed, and merged with the head's files."""
    import subprocess

    from dscluster.top.live import merge_rank_records, once_command, parse_once, rank_views, read_rank_records

    now = time.time()
    head, node = split_run(tmp_path, now)
    res = subprocess.run(["bash", "-c", once_command(iface=None, run_dir=node)], capture_output=True, text=True,
                         timeout=scaled(60), check=True)
    seen, ranks = parse_once("node2", "node2", res.stdout, time.time())
    assert seen.source == "telemetry" and seen.gpus[0].throttle == ["sw_thermal_slowdown"]
    views = rank_views(merge_rank_records(read_rank_records(head), [ranks]), time.time())
    assert [(r.rank, r.host, r.step, r.source, r.straggler) for r in views] == [(0, "node1", 8, "file", False),
                                                                             (1, "node2", 8, "ssh", True)]
    assert round(views[1].comm_share, 2) == 0.9 and round(views[1].images_per_s, 1) == 21.3


def test_the_heads_file_wins_over_a_nodes_copy_and_the_newer_node_copy_over_an_older(tmp_path):
    from dscluster.top.live import RankRecords, merge_rank_records, rank_views

    def rec(step: int, t: float, source: str) -> RankRecords:
        s = {"kind": "step", "t": t, "host": "node2", "step": step, "step_time": 1.0}
        return RankRecords(steps=[s], last=s, source=source)

    merged = merge_rank_records({1: rec(40, 100.0, "file")}, [{1: rec(39, 99.0, "ssh"), 2: rec(7, 50.0, "ssh")},
                                                              {2: rec(9, 60.0, "ssh")}])
    views = rank_views(merged, 100.0)
    assert [(r.rank, r.step, r.source) for r in views] == [(1, 40, "file"), (2, 9, "ssh")]


def test_the_view_and_json_show_where_each_ranks_records_came_from(tmp_path):
    from dscluster.top.live import Snapshot, merge_rank_records, rank_views, read_rank_records

    now = time.time()
    head, node = split_run(tmp_path, now)
    ranks = rank_views(merge_rank_records(read_rank_records(head), [read_rank_records(node, "ssh")]), now)
    snap = Snapshot(t=now, run_dir=str(head), nodes=[], ranks=ranks)
    assert [r["source"] for r in json.loads(json.dumps(snap.to_dict()))["ranks"]] == ["file", "ssh"]
    con = Console(record=True, width=160)
    con.print(render(snap))
    rows = [line for line in con.export_text().splitlines() if "node2" in line]
    assert len(rows) == 1 and "ssh" in rows[0] and "straggler" in rows[0]
