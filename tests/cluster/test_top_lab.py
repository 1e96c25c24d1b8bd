"""`dscluster top --once --json` on a simulated 2-node lab: before a job it samples every node over
SSH (pinned host keys, the interface `check` chose); while `dscluster launch` trains, it reads the job's
telemetry and metrics and shows every node and every rank with its step, img/s and network wait."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest
from test_byo_script import set_up_and_checked
from test_launch_lab import DSCLUSTER, REPO, Cluster, explain

from _wait import wait_until
from dscluster.files.fsutil import read_jsonl

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def cluster(lab_factory) -> Cluster:
    return set_up_and_checked(lab_factory("toplab", nodes=2, slots=1), "--skip-active")


def top_json(cluster: Cluster, *extra: str) -> dict:
    res = cluster.sh(f"{DSCLUSTER} top --hostfile {cluster.hostfile} --once --json {' '.join(extra)}", timeout=120)
    assert res.returncode == 0, explain(res)
    return json.loads(res.stdout)


def test_without_a_job_every_node_is_sampled_over_ssh(cluster):
    snap = top_json(cluster)
    assert snap["run_dir"] is None and snap["ranks"] == []
    nodes = {n["name"]: n for n in snap["nodes"]}
    assert set(nodes) == {n.name for n in cluster.lab.nodes}
    for node in cluster.lab.nodes:
        seen = nodes[node.name]
        assert seen["source"] == "ssh" and seen["error"] is None, seen
        assert seen["host"] == node.hostname and seen["net_iface"] == node.iface
        assert seen["cpu_percent"] is not None and seen["ram_total_mb"] > 0
        assert seen["net_rx_bytes_per_s"] is not None


def test_a_running_job_shows_every_node_and_rank(cluster, tmp_path):
    run = cluster.runs / "top-job"
    log = tmp_path / "launch.log"
    proc = cluster.popen(f"{DSCLUSTER} launch --hostfile {cluster.hostfile} --run-id top-job -- "
                         f"--config {REPO}/configs/digits.yaml epochs=50", log)

    def every_rank_stepped_twice() -> bool:
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        files = [run / "metrics" / f"rank-{r}.jsonl" for r in (0, 1)]
        return all(f.exists() and sum(r.get("kind") == "step" for r in read_jsonl(f)) >= 2 for f in files)

    try:
        wait_until(every_rank_stepped_twice, 400, "both ranks' second training step", interval=1.0)
        snap = top_json(cluster)
        assert snap["run_dir"].endswith("runs/top-job")  # found without --run-dir: the job being written
        nodes = {n["name"]: n for n in snap["nodes"]}
        for node in cluster.lab.nodes:
            seen = nodes[node.name]
            assert seen["source"] == "telemetry", seen
            assert seen["net_iface"] == node.iface and seen["net_rx_bytes_per_s"] is not None, seen
        ranks = snap["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1]
        assert {r["host"] for r in ranks} == {n.hostname for n in cluster.lab.nodes}
        for r in ranks:
            assert r["step"] >= 2 and r["images_per_s"] > 0 and r["status"] == "running", r
            # digits trains at zero_stage 0 through DDP's hook, so the step split measures every step's network
            # wait (core/split.py), and top shows its share
            steps = [s for s in read_jsonl(run / "metrics" / f"rank-{r['rank']}.jsonl") if s.get("kind") == "step"]
            assert all(isinstance(s.get("comm_s"), (int, float)) for s in steps), steps[-1]
            assert r["comm_share"] is not None and 0 <= r["comm_share"] <= 1, r
        # Rank 0 stopped by SIGTERM, as launchers stop ranks (before it saw any failure): the run still says so
        [start] = [r for r in read_jsonl(run / "metrics" / "rank-0.jsonl") if r.get("kind") == "start"]
        os.kill(start["pid"], signal.SIGTERM)
        wait_until(lambda: proc.poll() is not None, 120, "launch's end after rank 0's SIGTERM")
        summary = json.loads((run / "summary.json").read_text())
        assert summary["status"] == "failed" and summary["failed_rank"] is None, summary
        assert summary["error"].startswith("rank 0 was stopped by SIGTERM before it learned why"), summary
        assert "most recent call first" in (run / "traces" / "rank-0.txt").read_text()  # its stacks came first
        end = read_jsonl(run / "metrics" / "rank-0.jsonl")[-1]
        assert (end["kind"], end["status"]) == ("end", "stopped"), end
        # nothing else ended the run: diagnose names rank 0, and rank 1 (whose collective then failed) only as such
        diag = cluster.sh(f"{DSCLUSTER} diagnose {run} --json", timeout=120)
        findings = json.loads(diag.stdout)["findings"]
        died = [f for f in findings if f["kind"] == "rank_died"]
        assert [f["rank"] for f in died] == [0] and "was stopped by SIGTERM" in died[0]["message"], findings
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
