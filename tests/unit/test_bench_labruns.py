"""What bench/gpu_lab.py records per run (dscluster.bench.labruns), from a recorded run directory."""

import json
from pathlib import Path

import pytest

from dscluster.bench import labruns

RUN = Path(__file__).resolve().parents[1] / "data" / "runs" / "cpu-2node"


def test_a_run_arg_names_its_nodes_and_config_and_bad_ones_say_the_form():
    assert labruns.parse_run("b2:2:--config c.yaml max_steps=12") == ("b2", 2, "--config c.yaml max_steps=12")
    assert labruns.config_of("--config c.yaml max_steps=12") == "c.yaml"
    with pytest.raises(SystemExit, match="expected NAME:NODES:--config FILE"):
        labruns.parse_run("b2:two:--config c.yaml")


def test_the_recommendation_is_pasted_over_the_runs_own_overrides():
    words = labruns.with_recommendation("--config c.yaml max_steps=12 grad_accum=1 comm.compression=powersgd",
                                        ["grad_accum=4", "global_batch=2048"])
    assert words == ["max_steps=12", "grad_accum=4", "comm.compression=powersgd", "global_batch=2048"]


def test_a_runs_record_holds_both_img_s_figures_and_rank_0s_median_split():
    summary = {**json.loads((RUN / "summary.json").read_text()), "run_images_per_s": 24.0}
    plan = {"prediction": {"images_per_s": 27.0, "step_s": 2.37, "compute_s": 1.0, "comm_s": 1.3},
            "compute": {"seconds": 0.5}, "recommendation": {"overrides": ["grad_accum=2"]}}
    entry = labruns.run_entry("d2", 2, 2, "--config configs/digits.yaml", 0, 512.04, RUN, summary, plan)
    assert entry["images_per_s"] == summary["images_per_s"] and entry["run_images_per_s"] == 24.0
    assert entry["wall_s"] == 512.0 and entry["plan"]["predicted_images_per_s"] == 27.0
    assert entry["plan"]["recommended"] == ["grad_accum=2"] and entry["plan"]["split"]["comm_s"] == 1.3
    assert entry["median_split_rank0"] == dict.fromkeys(labruns.SPLIT_KEYS)  # recorded before steps were split


def test_the_median_split_leaves_the_warm_up_out(tmp_path):
    steps = [{"kind": "step", "compute_s": 9.0, "comm_s": 9.0}] * 5  # warm-up: compilation
    steps += [{"kind": "step", "compute_s": c, "comm_s": 0.5} for c in (0.1, 0.2, 0.3)]
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "rank-0.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    assert labruns.median_split(tmp_path) == {"compute_s": 0.2, "comm_s": 0.5, "data_s": None, "other_s": None}
    assert labruns.run_entry("d1", 1, 1, "--config c.yaml", 1, 3.0, RUN / "missing", {}, None)["plan"] is None


def test_accuracy_is_grouped_by_compression_against_none():
    runs = [{"overrides": "--config c.yaml", "accuracy": 0.9}, {"overrides": "--config c.yaml", "accuracy": 0.92},
            {"overrides": "--config c.yaml comm.compression=powersgd", "accuracy": 0.89}]
    out = labruns.accuracy_by_compression(runs)
    assert out["none"]["accuracy"] == 0.91 and out["powersgd"]["points_vs_none"] == -2.0
