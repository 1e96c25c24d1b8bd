"""plan's whole run counts what a data set made on the host costs: the cache's fill as a phase of its
own, evaluations that make their images again when not cached, and steps the loader workers bound."""

import json
from pathlib import Path

import pytest

from dscluster.cli import main
from dscluster.plan import datafeed, phases
from dscluster.train.config import load_config

REPO = Path(__file__).resolve().parents[2]


def test_a_cached_run_pays_the_fill_once_before_its_first_step():
    c = phases.RunCosts(plain_step_s=0.06, step_s=0.06, steps_per_epoch=78, eval_s=0.36, cache_fill_s=7.1,
                        cache_images=50_000, cache_workers=14)
    run = phases.whole_run(c, epochs=15, max_steps=0, global_batch=512)
    first = run["phases"][0]
    assert first == {"name": "data cache", "steps": 0, "seconds": 7.1,
                     "note": "50,000 images made once into memory by 14 worker(s)"}
    assert run["seconds"] == pytest.approx(7.1 + 15 * 78 * 0.06 + 15 * 0.36)
    uncached = phases.whole_run(phases.RunCosts(plain_step_s=0.06, step_s=0.06, steps_per_epoch=78, eval_s=0.36),
                                epochs=15, max_steps=0, global_batch=512)
    assert "data cache" not in [p["name"] for p in uncached["phases"]]


def test_an_uncached_evaluation_costs_the_making_of_its_images_and_a_cached_one_the_forward_pass():
    # the vit_small_fractal held-out set on one H200: 10,000 images, 2 ms each, 14 workers; forward 0.36 s
    assert phases.evaluation_seconds(0.36, 10_000, 0.002, 14) == pytest.approx(10_000 * 0.002 / 14
                                                                              + phases.WORKER_START_S)
    assert phases.evaluation_seconds(0.36, 10_000, None, 14) == 0.36  # cached, or made on the device
    assert phases.evaluation_seconds(30.0, 10_000, 0.002, 14) == 30.0  # the GPU is the slower
    assert phases.fill_seconds(50_000, 0.002, 14, passes=2) == pytest.approx(50_000 * 0.002 / 14
                                                                         + 2 * phases.WORKER_START_S)
    assert phases.fill_seconds(0, 0.002, 14) == 0.0
    assert phases.feed_step_seconds(512, 0.002, 4) == pytest.approx(0.256)
    assert phases.feed_step_seconds(512, None, 4) == 0.0


def test_facts_price_only_what_is_not_cached():
    both = datafeed.DataFacts(train_n=40_000, holdout_n=10_000, s_per_image=0.002, workers=14, cached_train=True,
                              cached_holdout=True)
    assert both.cached_images == 50_000
    assert both.fill_s() == pytest.approx(50_000 * 0.002 / 14 + 2 * phases.WORKER_START_S)  # two splits
    assert both.eval_s(0.36) == 0.36 and both.feed_step_s(512) == 0.0
    none = datafeed.DataFacts(train_n=40_000, holdout_n=10_000, s_per_image=0.002, workers=14)
    assert none.fill_s() == 0.0 and none.eval_s(0.36) > 1.4 and none.feed_step_s(512) == pytest.approx(512 * 0.002 / 14)
    notes = datafeed.notes(none, 512, 0.06)
    assert any("the feed, not the GPU, bounds the step" in n for n in notes)
    assert not any("bounds the step" in n for n in datafeed.notes(both, 512, 0.06))


def test_plan_probes_rendering_and_resolves_the_cache_as_training_does(tmp_path):
    cfg = load_config(str(REPO / "configs/fractal_cpu.yaml"), [])
    facts = datafeed.data_facts(cfg, local_ranks=1)
    assert (facts.train_n, facts.holdout_n) == (2400, 600) and facts.s_per_image > 0
    assert facts.cached_train and facts.cached_holdout  # 9 MB fits any node's budget
    off = datafeed.data_facts(load_config(str(REPO / "configs/fractal_cpu.yaml"), ["data.cache=false"]), 1)
    assert not off.cached_train and off.cached_images == 0
    digits = datafeed.data_facts(load_config(str(REPO / "configs/digits.yaml"), []), 1)
    assert digits.s_per_image is None and digits.fill_s() == 0.0


def plan_doc(tmp_path, monkeypatch, capsys, *overrides) -> dict:
    monkeypatch.setenv("DSCLUSTER_STATE", str(tmp_path / "state"))
    (tmp_path / "hosts.txt").write_text("node1 slots=1\nnode2 slots=1\n")
    argv = ["plan", "--config", str(REPO / "configs/fractal_cpu.yaml"), "--hostfile", str(tmp_path / "hosts.txt"),
            "--busbw", "1.0", "--compute-s", "0.01", "--powersgd-s", "0.001", "micro_batch=32", *overrides, "--json"]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_plans_whole_run_has_the_fill_and_prices_uncached_evaluations(tmp_path, monkeypatch, capsys):
    cached = plan_doc(tmp_path, monkeypatch, capsys)["runs"]["now"]
    by = {p["name"]: p for p in cached["phases"]}
    assert by["data cache"]["seconds"] > 0 and "3,000 images made once into memory" in by["data cache"]["note"]
    forward = 600 * (0.01 / 32) * phases.FORWARD_SHARE
    assert cached["costs"]["eval_s"] == pytest.approx(forward)
    uncached = plan_doc(tmp_path, monkeypatch, capsys, "data.cache=false")["runs"]["now"]
    assert "data cache" not in [p["name"] for p in uncached["phases"]]
    assert uncached["costs"]["eval_s"] > phases.WORKER_START_S > forward
