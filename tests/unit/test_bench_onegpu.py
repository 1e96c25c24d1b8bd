"""bench/plan_onegpu.py: the commands it runs as a user pastes them, and what it reads back from the
plans and the runs after them (dscluster.bench.onegpu)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dscluster.bench import onegpu
from dscluster.rundir.writer import RunLog, summary_record
from dscluster.runmodel import phases

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_prints_the_four_commands_as_typed_and_runs_nothing(tmp_path):
    work = tmp_path / "work"
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "plan_onegpu.py"), "--dry-run", "--work", str(work)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    lines = [ln for ln in res.stdout.splitlines() if ln.split(":")[0] in dict(onegpu.STEPS)]
    hosts = work / "hosts.txt"
    preset = "--config configs/vit_small_fractal.yaml precision=fp16"
    assert lines == [
        f"first_plan: dscluster plan --hostfile {hosts} {preset} --json > {work / 'first_plan.json'}",
        f"first_run: DSCLUSTER_RUN_ID=first mpirun -np 1 --hostfile {hosts} ./entry_cn.sh {preset} "
        "[what the first plan recommends] progress=false",
        f"second_plan: dscluster plan --hostfile {hosts} {preset} --json > {work / 'second_plan.json'}",
        f"second_run: DSCLUSTER_RUN_ID=second mpirun -np 1 --hostfile {hosts} ./entry_cn.sh {preset} "
        "[what the second plan recommends] progress=false"]
    # a new user's first plan: the work folder's own state, runs and (empty) compile caches
    assert f"export TORCHINDUCTOR_CACHE_DIR={work / 'compile-cache' / 'inductor'}" in res.stdout
    assert f"export DSCLUSTER_STATE={work / 'state'}" in res.stdout
    assert "plan-onegpu.json" in res.stdout and not work.exists()
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "plan_onegpu.py"), "--dry-run", "--set", "epochz=3"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "epochz" in bad.stderr


def recorded_run(run_dir: Path) -> None:
    """A 2-epoch run of 10 steps each as train's writers leave it: a 9.7 s cache fill, a 5-step warm-up window
    of 9 s, steady windows of 5 steps at 0.05 s, held-out passes of 1.2 and 1.1 s, global batch 64."""
    log = RunLog(run_dir, 0, "localhost")
    t = 1000.0
    log.record("data_cache", split="training", seconds=9.7, t=t)
    windows = [(range(1, 6), 1.8)] + [(range(s, s + 5), 0.05) for s in (6, 11, 16)]
    for steps, each in windows:
        t += each * len(steps)
        for s in steps:
            log.record("step", step=s, epoch=(s - 1) // 10, step_time=each, samples=64, t=t)
        if steps[-1] % 10 == 0:
            t += 1.2 if steps[-1] == 10 else 1.1
            log.record("eval", epoch=(steps[-1] - 1) // 10, step=steps[-1], accuracy=0.5, loss=1.0, samples=100,
                       seconds=1.2 if steps[-1] == 10 else 1.1, t=t)
    log.record("end", status="complete", error=None, peak_mem_mb=None, t=t + 0.1)
    log.close()
    log.write_summary(summary_record(status="complete", steps=20, images_per_s=64 * 15 / (15 * 0.05 + 1.2),
                                     global_batch=64, wall_s=40.0))


def test_each_plan_is_set_against_the_run_after_it_figure_by_figure(tmp_path):
    recorded_run(tmp_path / "first")
    got = onegpu.measured(tmp_path / "first")
    # the span plan predicts: the fill, then from the first step's start (9 s before the warm-up window's end)
    assert got["whole_run_s"] == pytest.approx(9.7 + 9.0 + 15 * 0.05 + 1.2 + 1.1 + 0.1)
    assert got["warmup_s"] == pytest.approx(9.0) and got["cache_fill_s"] == 9.7
    # an epoch end: the held-out pass before the last (the last has no next epoch's refill under it)
    assert got["epoch_end_s"] == pytest.approx(1.2) and got["steady_images_per_s"] == pytest.approx(960 / 1.95)
    c = phases.RunCosts(plain_step_s=0.05, step_s=0.05, steps_per_epoch=10, warmup_extra_s=26.0, eval_s=0.8,
                        restart_s=0.4, cache_fill_s=6.0)
    plan = {"runs": {"now": {**phases.whole_run(c, epochs=2, max_steps=0, global_batch=64,
                                                warmup_source="modelled: the probe's first step 26.0 s")}}}
    cmp = onegpu.comparison(plan, tmp_path / "first")["figures"]
    assert cmp["warmup_s"] == {"predicted": pytest.approx(26.25), "measured": pytest.approx(9.0),
                               "error_percent": pytest.approx(191.7),
                               "source": "modelled: the probe's first step 26.0 s"}
    assert cmp["epoch_end_s"]["predicted"] == pytest.approx(1.2) and cmp["epoch_end_s"]["error_percent"] == 0.0
    # the steady figure: 15 timed steps at 0.05 s and the one epoch end among them, as train reports it
    assert cmp["steady_images_per_s"]["predicted"] == pytest.approx(64 * 15 / (15 * 0.05 + 1.2))
    assert cmp["steady_images_per_s"]["error_percent"] == 0.0
    missing = onegpu.comparison(None, tmp_path / "second")  # a plan or a run that failed: nothing to compare
    assert missing["figures"]["whole_run_s"] == {"predicted": None, "measured": None, "error_percent": None}
    assert missing["run"]["status"] == "missing"
    assert onegpu.results_name("cuda (NVIDIA H200)", "2026-11-28") == "2026-11-28-nvidia-h200-plan-onegpu.json"
