"""plan's bandwidth from check.json: the all-reduce, or the slowest link where the all-reduce is missing
or did not run through it (plan/inputs.py `busbw_from_check`).

The check.json is a recording (tests/data/links/check-skip-active-node3-20mbit.json: the 4-node lab with
node3 shaped to 20mbit, `check --skip-active`). The all-reduce rows added to it are the GPU lab's at
10 Gbit/s (4 ranks, NVIDIA H200, bench/results/2026-11-26-nvidia-h200-lab-10gbit-4node.json); which hosts
they ran over is set per test.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dscluster.cli import main
from dscluster.errors import UsageError
from dscluster.plan.inputs import busbw_from_check

REPO = Path(__file__).resolve().parents[2]
RECORDED = REPO / "tests" / "data" / "links" / "check-skip-active-node3-20mbit.json"
NODES = ["node1", "node2", "node3", "node4"]
GPU_LAB_10GBIT = [{"algbw_GBps": 0.654, "busbw_GBps": 0.981, "bytes": 1048576, "time_us": 1602.5},
                  {"algbw_GBps": 0.791, "busbw_GBps": 1.186, "bytes": 16777216, "time_us": 21220.6},
                  {"algbw_GBps": 0.797, "busbw_GBps": 1.195, "bytes": 67108864, "time_us": 84226.9},
                  {"algbw_GBps": 0.796, "busbw_GBps": 1.194, "bytes": 268435456, "time_us": 337125.6}]
SLOWEST_GBPS = 18715143 / 8e9   # node3 → node1, the recording's slowest pair


def check_json(tmp_path: Path, hosts: list[str] | None, world: int = 4) -> Path:
    doc = json.loads(RECORDED.read_text())
    if hosts is not None:
        doc["active"].update(skipped=None, allreduce={"ok": True, "result": {
            "backend": "nccl", "world_size": world, "hosts": hosts, "results": GPU_LAB_10GBIT,
            "peak_busbw_GBps": 1.195}})
    path = tmp_path / "check.json"
    path.write_text(json.dumps(doc))
    return path


def test_without_an_allreduce_the_slowest_link_is_the_bandwidth_and_the_pair_is_named(tmp_path):
    got = busbw_from_check(check_json(tmp_path, None), NODES)
    assert got.busbw == pytest.approx(SLOWEST_GBPS) and got.world is None and got.latency == 0.0
    assert got.link == "node3 → node1"
    assert "node3 → node1 at 19 Mbit/s = 0.00234 GB/s" in got.note and "without --skip-active" in got.note


def test_an_allreduce_that_left_the_slow_node_out_gives_way_to_its_link(tmp_path):
    got = busbw_from_check(check_json(tmp_path, ["node1", "node2", "node4"], world=3), NODES)
    assert got.busbw == pytest.approx(SLOWEST_GBPS) and got.world == 3 and got.latency > 0
    assert "node3 → node1" in got.note and "under half the 1.194 GB/s its all-reduce reached over 3 ranks" in got.note


def test_an_allreduce_through_the_slow_link_already_holds_it(tmp_path):
    """Every node in the all-reduce: its figure is the ring's pace, the pair test is not used (on a fast
    network one Python TCP stream can measure less than NCCL reaches)."""
    got = busbw_from_check(check_json(tmp_path, NODES), NODES)
    assert (got.busbw, got.world, got.note, got.link) == (1.194, 4, None, None)


def test_a_slow_pair_outside_the_plans_hostfile_is_not_its_concern(tmp_path):
    got = busbw_from_check(check_json(tmp_path, ["node1", "node2", "node4"], world=3), ["node1", "node2", "node4"])
    assert (got.busbw, got.note) == (1.194, None)
    with pytest.raises(UsageError, match="no all-reduce result .* and no link speed"):
        busbw_from_check(check_json(tmp_path, None), ["node1", "node2"])


def test_a_damaged_slowest_link_is_bad_input(tmp_path):
    path = check_json(tmp_path, None)
    doc = json.loads(path.read_text())
    doc["active"]["links"]["slowest"]["bps"] = "18 Mbit"
    path.write_text(json.dumps(doc))
    with pytest.raises(UsageError, match=r"active\.links\.slowest\.bps"):
        busbw_from_check(path, NODES)


def test_plan_predicts_with_the_slow_link_and_says_why(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DSCLUSTER_STATE", str(tmp_path / "state"))
    (tmp_path / "state").mkdir()
    check_json(tmp_path / "state", ["node1", "node2", "node4"], world=3)
    (tmp_path / "hosts.txt").write_text("".join(f"{n} slots=1\n" for n in NODES))
    assert main(["plan", "--config", str(REPO / "configs/vit_base.yaml"), "--hostfile", str(tmp_path / "hosts.txt"),
                 "--compute-s", "0.0427", "micro_batch=128", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["busbw_GBps"] == pytest.approx(SLOWEST_GBPS)
    assert doc["busbw_source"].endswith("check.json (slowest link node3 → node1)")
    assert any("check's slowest link, node3 → node1" in n for n in doc["notes"])
    # ViT-B's 344 MB of fp32 gradients at 2.3 MB/s: minutes a step, not the 0.43 s the 10 Gbit all-reduce gives
    assert doc["prediction"]["step_s"] > 100
