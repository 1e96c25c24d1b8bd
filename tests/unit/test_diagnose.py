"""`dscluster diagnose`: the rank that died, the rank missing from a collective, env mismatches."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from _analysis_runs import make_run, write_flight_recorder

from dscluster.analysis.diagnose import diagnose, read_trace
from dscluster.analysis.load import load_run

ROOT = Path(__file__).resolve().parents[2]


def _diag_cli(run: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dscluster", "diagnose", str(run), *extra], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def _kinds(result: dict) -> set[tuple[str, int | None]]:
    return {(f["kind"], f["rank"]) for f in result["findings"]}


def test_healthy_run_exits_0_with_no_findings(tmp_path):
    run = make_run(tmp_path, world=3)
    out = _diag_cli(run, "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["healthy"] and doc["findings"] == []
    assert [r["last_step"] for r in doc["ranks"]] == [12, 12, 12]


def test_dead_rank_is_named_with_host_and_last_step(tmp_path):
    run = make_run(tmp_path, world=3, dead_rank=2)
    out = _diag_cli(run)
    assert out.returncode == 1
    assert "rank 2 on node3 has no end record" in out.stdout
    assert "last step 6" in out.stdout


def test_rank_behind_the_others_is_the_one_missing_from_the_collective(tmp_path):
    # Ranks 0 and 2 finished step 9 and wait in the next all-reduce; rank 1 stopped after step 5.
    run = make_run(tmp_path, "hang", world=3, stop_at={0: 9, 1: 5, 2: 9}, steps=12)
    result = diagnose(load_run(run))
    behind = [f for f in result["findings"] if f["kind"] == "rank_behind"]
    assert [(f["rank"], f["host"]) for f in behind] == [(1, "node2")]
    assert "missing from the collective of step 6" in behind[0]["message"]


def test_rank_that_skipped_a_collective_and_ran_ahead_is_named(tmp_path):
    run = make_run(tmp_path, world=3, stop_at={0: 7, 1: 7, 2: 9})
    result = diagnose(load_run(run))
    assert ("rank_ahead", 2) in _kinds(result)
    assert ("rank_behind", 0) not in _kinds(result)


def test_two_ranks_out_of_step_name_the_one_behind(tmp_path):
    run = make_run(tmp_path, world=2, stop_at={0: 10, 1: 4})
    assert ("rank_behind", 1) in _kinds(diagnose(load_run(run)))


def test_failed_end_record_carries_the_error_text(tmp_path):
    run = make_run(tmp_path, world=2)
    f = run / "metrics" / "rank-1.jsonl"
    lines = f.read_text().splitlines()
    end = json.loads(lines[-1])
    end.update(status="failed", error="RuntimeError: Connection closed by peer")
    f.write_text("\n".join(lines[:-1] + [json.dumps(end)]) + "\n")
    result = diagnose(load_run(run))
    (fail,) = [x for x in result["findings"] if x["kind"] == "rank_failed"]
    assert fail["rank"] == 1 and "Connection closed by peer" in fail["message"]


def test_rank_without_any_metrics_file_is_reported(tmp_path):
    run = make_run(tmp_path, world=3)
    (run / "metrics" / "rank-2.jsonl").unlink()
    (run / "summary.json").unlink()
    assert ("rank_missing", 2) in _kinds(diagnose(load_run(run)))


def test_master_port_mismatch_is_an_error_but_interface_names_may_differ(tmp_path):
    run = make_run(tmp_path, world=3, env_overrides={2: {"MASTER_PORT": "29501"}})
    result = diagnose(load_run(run))
    (mm,) = [f for f in result["findings"] if f["kind"] == "env_mismatch"]
    assert mm["rank"] == 2 and "MASTER_PORT" in mm["message"] and "'29501'" in mm["message"]
    assert not any("GLOO_SOCKET_IFNAME" in f["message"] for f in result["findings"])


def test_library_version_mismatch_between_ranks_is_named(tmp_path):
    run = make_run(tmp_path, world=2, env_overrides={1: {"versions": {"torch": "2.13.0", "deepspeed": "0.19.8"}}})
    msgs = [f["message"] for f in diagnose(load_run(run))["findings"]]
    assert any("versions.torch differs" in m and "2.13.0" in m for m in msgs)


@pytest.mark.parametrize("fmt", ["pickle", "json"])
def test_flight_recorder_dump_names_the_rank_missing_from_a_collective(tmp_path, fmt):
    run = make_run(tmp_path, world=3, stop_at={0: 5, 1: 5, 2: 5})
    write_flight_recorder(run, {0: 11, 1: 10, 2: 11}, fmt=fmt)
    result = diagnose(load_run(run))
    (tr,) = [f for f in result["findings"] if f["kind"] == "trace_missing_collective"]
    assert tr["rank"] == 1 and "missing from collective #11" in tr["message"]
    assert {t["rank"] for t in result["traces"]} == {0, 1, 2}


def test_trace_pickle_that_would_run_code_is_refused(tmp_path):
    evil = tmp_path / "nccl_trace_rank_0"
    evil.write_bytes(pickle.dumps({"entries": [Path("/")]}))  # needs a class: must not be loaded
    assert read_trace(evil) is None


def test_unknown_trace_files_are_listed_not_fatal(tmp_path):
    run = make_run(tmp_path, world=2)
    (run / "traces").mkdir()
    (run / "traces" / "rank0.log").write_text("some torch debug output\n")
    out = _diag_cli(run)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "traces/rank0.log: not a format dscluster reads" in out.stdout


def test_bad_run_dir_is_exit_2(tmp_path):
    out = _diag_cli(tmp_path / "nope")
    assert out.returncode == 2 and "nope" in out.stderr


def test_real_gloo_flight_recorder_dumps_name_the_rank_that_skipped(tmp_path):
    run = make_run(tmp_path, world=2, stop_at={0: 3, 1: 3})
    real = ROOT / "tests" / "data" / "runs" / "fr-gloo-skip" / "nccl_trace"
    (run / "nccl_trace").mkdir()
    for f in real.iterdir():
        (run / "nccl_trace" / f.name).write_bytes(f.read_bytes())
    out = _diag_cli(run, "--json")
    assert out.returncode == 1
    doc = json.loads(out.stdout)
    (tr,) = [f for f in doc["findings"] if f["kind"] == "trace_missing_collective"]
    assert tr["rank"] == 1 and "missing from collective #4" in tr["message"]
    assert {t["rank"]: t["entries"] for t in doc["traces"]} == {0: 4, 1: 3}


def test_a_vanished_node_is_named_and_the_ranks_stopped_with_it_are_only_warnings(tmp_path):
    # What the lab left when node3's cable was pulled: every rank stopped at step 8; mpirun
    # killed rank 1 on node2 (no end record), rank 0 failed and found node3 silent.
    run = make_run(tmp_path, world=3, stop_at={0: 8, 1: 8, 2: 8})
    f = run / "metrics" / "rank-0.jsonl"
    f.write_text(f.read_text() + json.dumps({"kind": "end", "t": 1_700_000_100.0, "rank": 0, "host": "node1",
                                             "status": "failed", "error": "node3 did not answer"}) + "\n")
    (run / "summary.json").write_text(json.dumps({
        "status": "failed", "world_size": 3, "failed_rank": None, "failed_host": "node3",
        "vanished_hosts": ["node3"], "error": "a collective failed"}))
    out = _diag_cli(run, "--json")
    assert out.returncode == 1
    findings = json.loads(out.stdout)["findings"]
    (gone,) = [f for f in findings if f["kind"] == "host_vanished"]
    assert (gone["host"], gone["rank"], gone["severity"]) == ("node3", 2, "error")
    assert "node3 vanished" in gone["message"] and "rank 2 lost" in gone["message"]
    assert findings[0]["kind"] == "host_vanished"  # the cause comes first
    (stopped,) = [f for f in findings if f["kind"] == "rank_died" and f["rank"] == 1]
    assert stopped["severity"] == "warning" and "after node3 vanished" in stopped["message"]
    assert not [f for f in findings if f["kind"] == "run_failed"]  # said once, by host_vanished
    assert "node3 vanished" in _diag_cli(run).stdout


RECORDED = ROOT / "tests" / "data" / "runs"


def test_a_first_collective_that_never_connects_is_named_as_the_data_path_with_checks_columns():
    # Recorded: the README command on a 3-node lab where node2's firewall leaves only ssh and the
    # master port open (tests/data/runs/README.md, firewall-3node).
    result = diagnose(load_run(RECORDED / "firewall-3node"))
    [f] = [f for f in result["findings"] if f["kind"] == "data_path_blocked"]
    assert f["severity"] == "error" and result["findings"][0] == f
    assert "all 3 ranks reached the rendezvous" in f["message"] and "Timed out waiting 10000ms" in f["message"]
    assert "firewall" in f["message"] and "(columns port, mtu, nic)" in f["message"]


def test_a_timeout_after_steps_completed_is_not_blamed_on_the_data_path(tmp_path):
    # The same recorded failure, but rank 0 had completed a step: the connections worked then.
    import shutil
    run = tmp_path / "run"
    shutil.copytree(RECORDED / "firewall-3node", run)
    rank0 = run / "metrics" / "rank-0.jsonl"
    step = {"kind": "step", "t": 1.0, "rank": 0, "host": "node1", "step": 1, "epoch": 0, "loss": 2.3}
    rank0.write_text(json.dumps(step) + "\n" + rank0.read_text())
    assert not [f for f in diagnose(load_run(run))["findings"] if f["kind"] == "data_path_blocked"]
