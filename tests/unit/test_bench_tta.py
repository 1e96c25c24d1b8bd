"""bench/gpu_lab.py --tta: the runs it makes and the results it assembles from the runs' directories."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from dscluster.bench import tta
from dscluster.core.evaluation import TimeToAccuracy
from dscluster.files.fsutil import atomic_write_json
from dscluster.rundir.writer import summary_record

ROOT = Path(__file__).resolve().parents[2]


def _run_dir(tmp_path: Path, name: str, *, seconds: float | None, accuracy: float, images_per_s: float) -> Path:
    """A run directory as train leaves it: summary.json from train's own summary writer."""
    watch = TimeToAccuracy(0.8, started=1000.0, global_batch=512)
    if seconds is not None:
        # train's start-up (20 s here) is in `seconds`, not in `training_seconds`, plan's span
        watch.reached = {"target": 0.8, "accuracy": 0.81, "seconds": seconds, "training_seconds": seconds - 20,
                         "step": 300, "epoch": 4,
                         "images": 300 * 512, "t": 1000.0 + seconds}
    run = tmp_path / name
    atomic_write_json(run / "summary.json", summary_record(status="complete", accuracy=accuracy, steps=1000,
                                                           images_per_s=images_per_s, global_batch=512,
                                                           wall_s=900.0, **watch.summary()))
    return run


def test_each_seed_runs_the_fastest_node_alone_then_the_lab_with_plans_recommendation():
    assert tta.fastest_node([1, 1, 2]) == 2 and tta.fastest_node([2, 2]) == 0
    runs = tta.runs_for("configs/vit_small_fractal.yaml", [1, 2], 0.8, ["epochs=10"], nodes=2)
    assert [(n, r) for n, r, _ in runs] == [("alone_s1", "alone"), ("lab_s1", "lab"), ("alone_s2", "alone"),
                                            ("lab_s2", "lab")]
    assert runs[1][2] == "--config configs/vit_small_fractal.yaml seed=1 target_accuracy=0.8 epochs=10 @rec"
    assert [n for n, _, _ in tta.runs_for("c.yaml", [1], 0.5, [], nodes=1)] == ["alone_s1"]


def test_results_compare_the_means_over_seeds_and_count_a_run_that_never_got_there(tmp_path):
    runs = []
    for name, role, seconds, acc, ips in [("alone_s1", "alone", 100.0, 0.85, 3000.0),
                                          ("alone_s2", "alone", 120.0, 0.87, 3100.0),
                                          ("lab_s1", "lab", 50.0, 0.84, 9000.0),
                                          ("lab_s2", "lab", None, 0.78, 8800.0)]:
        runs.append({"name": name, "role": role,
                     **tta.run_record(_run_dir(tmp_path, name, seconds=seconds, accuracy=acc, images_per_s=ips))})
    assert runs[0]["time_to_accuracy_s"] == 100.0 and runs[0]["reached_at_images"] == 300 * 512
    out = tta.summarise(runs)
    assert out["alone"] == {"runs": 2, "reached": 2, "time_to_accuracy_s": 110.0,
                            "time_to_accuracy_each_s": [100.0, 120.0], "accuracy": 0.86, "images_per_s": 3050.0,
                            "training_tta_s": 90.0}
    assert (out["lab"]["reached"], out["lab"]["time_to_accuracy_s"]) == (1, 50.0)
    assert out["speedup"] == 2.2
    assert out["accuracy_points_vs_alone"] == -5.0


def test_a_run_without_its_directory_is_missing_not_fast(tmp_path):
    rec = tta.run_record(tmp_path / "never_ran")
    assert rec["status"] == "missing" and rec["time_to_accuracy_s"] is None
    out = tta.summarise([{"role": "alone", **rec}, {"role": "lab", **rec}])
    assert out["speedup"] is None and out["lab"]["reached"] == 0


def test_dry_run_prints_the_runs_without_a_lab():
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_lab.py"), "--link", "10gbit", "--gpus", "1,1,2",
                          "--tta", "configs/vit_small_fractal.yaml", "--target", "0.8", "--seeds", "1,2", "--dry-run"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith("plan: dscluster plan --hostfile hosts3.txt --config configs/vit_small_fractal.yaml")
    assert lines[1] == ("alone_s1: node3 alone (2 rank(s)): --config configs/vit_small_fractal.yaml seed=1 "
                        "target_accuracy=0.8")
    assert lines[2].startswith("lab_s1: all 3 nodes (4 ranks): ") and lines[2].endswith(" @rec")
    assert len(lines) == 5


def test_the_measured_whole_run_holds_the_data_cache_fill_as_plans_prediction_does(tmp_path):
    # plan's whole run starts with the cache's fill, which train makes before its first step
    recs = [{"kind": "start", "t": 10.0},
            {"kind": "data_cache", "split": "training", "seconds": 8.5},
            {"kind": "data_cache", "split": "held-out", "seconds": 2.0},
            {"kind": "step", "step": 1, "t": 25.0, "step_time": 4.0},  # the first step started at 21.0
            {"kind": "step", "step": 2, "t": 26.0, "step_time": 1.0},
            {"kind": "end", "t": 71.0}]
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "rank-0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert tta.training_seconds(tmp_path) == 8.5 + 2.0 + (71.0 - 21.0)


def test_the_measured_whole_run_starts_where_the_first_log_window_began(tmp_path):
    # train writes a window's steps at its end, each with the window's mean step time: a warm-up
    # window of 5 steps at 1.88 s each began 9.4 s before its end, not 1.88 s
    recs = [{"kind": "data_cache", "split": "training", "seconds": 7.0},
            *({"kind": "step", "step": s, "t": 109.4 + s * 1e-4, "step_time": 1.88} for s in range(1, 6)),
            *({"kind": "step", "step": s, "t": 110.1 + s * 1e-4, "step_time": 0.07} for s in range(6, 16)),
            {"kind": "end", "t": 150.0}]
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "rank-0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert tta.training_seconds(tmp_path) == round(7.0 + (150.0 - (109.4 + 1e-4 - 5 * 1.88)), 2)


def test_the_results_say_whether_plans_advice_to_train_alone_held():
    def role(runs, *times):
        return {"runs": runs, "reached": len(times), "time_to_accuracy_s": sum(times) / len(times) if times else None}

    said_alone = {"recommendation": {"train_alone": True, "alone_command": "printf ... && mpirun -np 1 ...",
                                     "overrides": ["comm.compression=fp16"]}}
    # measured on two 1-GPU H200 nodes at 10 Gbit: 67.1 s alone, 98.9 s for the lab
    out = tta.advice(said_alone, {"alone": role(1, 67.1), "lab": role(1, 98.9)})
    assert out["train_alone"] and out["alone_sooner"] and out["held"]
    assert out["lab_overrides"] == ["comm.compression=fp16"] and out["alone_command"].startswith("printf")
    assert tta.advice(said_alone, {"alone": role(1, 99.0), "lab": role(1, 67.0)})["held"] is False
    assert tta.advice(said_alone, {"alone": role(2, 70.0), "lab": role(1)})["held"]  # the lab never got there
    said_lab = {"recommendation": {"train_alone": False, "overrides": ["grad_accum=2"]}}
    assert tta.advice(said_lab, {"alone": role(1), "lab": role(1, 80.0)})["held"]
    assert tta.advice(said_lab, {"alone": role(1, 60.0), "lab": role(0)})["held"] is None  # no lab run
    assert tta.advice(None, {"alone": role(1, 60.0), "lab": role(1, 70.0)}) is None  # plan gave nothing
