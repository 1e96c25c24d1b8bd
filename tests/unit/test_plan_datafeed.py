"""plan's whole run counts what a data set made on the host costs: the cache's fill as a phase of its
own, evaluations that make their images again when not cached, and steps the loader workers bound."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dscluster.cli import main
from dscluster.core.config import load_config
from dscluster.core.data import load
from dscluster.plan import datafeed
from dscluster.runmodel import phases

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
    # the vit_small_fractal held-out set on one H200: 10,000 images at 0.2 ms each by 14 workers in
    # parallel, 1.5 s to start them; forward 0.36 s
    assert phases.evaluation_seconds(0.36, 10_000, 0.0002, 1.5) == pytest.approx(10_000 * 0.0002 + 1.5)
    assert phases.evaluation_seconds(0.36, 10_000, None, 1.5) == 0.36  # cached, or made on the device
    assert phases.evaluation_seconds(30.0, 10_000, 0.0002, 1.5) == 30.0  # the GPU is the slower
    assert phases.fill_seconds(50_000, 0.0002, 1.5, passes=2) == pytest.approx(50_000 * 0.0002 + 2 * 1.5)
    assert phases.fill_seconds(0, 0.0002, 1.5) == 0.0
    assert phases.feed_step_seconds(512, 0.0005) == pytest.approx(0.256)  # persistent workers: no start
    assert phases.feed_step_seconds(512, None) == 0.0


def test_facts_price_only_what_is_not_cached_at_the_workers_parallel_rate():
    both = datafeed.DataFacts(train_n=40_000, holdout_n=10_000, s_per_image=0.0002, start_s=1.5, workers=14,
                              cached_train=True, cached_holdout=True)
    assert both.cached_images == 50_000
    assert both.fill_s() == pytest.approx(50_000 * 0.0002 + 2 * 1.5)  # two splits, each starts its workers
    assert both.eval_s(0.36) == 0.36 and both.feed_step_s(512) == 0.0
    none = datafeed.DataFacts(train_n=40_000, holdout_n=10_000, s_per_image=0.0002, start_s=1.5, workers=14)
    assert none.fill_s() == 0.0 and none.eval_s(0.36) == pytest.approx(10_000 * 0.0002 + 1.5)
    assert none.feed_step_s(512) == pytest.approx(512 * 0.0002)
    notes = datafeed.notes(none, 512, 0.06)
    assert any("the feed, not the GPU, bounds the step" in n for n in notes)
    assert not any("bounds the step" in n for n in datafeed.notes(both, 512, 0.06))


def test_an_earlier_runs_measured_fill_wins_over_the_probe():
    probed = datafeed.DataFacts(train_n=40_000, holdout_n=10_000, s_per_image=0.0002, start_s=1.5, workers=14,
                                cached_train=True, cached_holdout=True)
    assert replace(probed, measured_fill_s=9.9).fill_s() == 9.9
    assert replace(probed, measured_fill_s=9.9, cached_train=False, cached_holdout=False).fill_s() == 0.0


def fractal_train(*overrides):
    cfg = load_config(str(REPO / "configs/fractal_cpu.yaml"), list(overrides))
    return cfg, load(cfg.data, "cpu", cfg.seed).train


def test_the_fill_probe_runs_trains_fill_with_two_workers_and_leaves_the_split_as_training_reads_it():
    cfg, train = fractal_train()
    _, fresh = fractal_train()
    rng = torch.get_rng_state()
    rate = datafeed.fill_rate(train, 2, cfg.data.prefetch, datafeed.render_seconds(train))
    assert rate.s_per_image > 0 and rate.start_s > 0 and rate.workers == 2
    assert 0 < rate.images <= len(train)
    assert train.cached is None and train.feed is None  # no cache, no feed left behind
    assert torch.equal(torch.get_rng_state(), rng)  # model init and dropout draw what they would have
    idx = list(range(100, 164))
    for seed in (None, 7):
        got, want = train.prepare(idx, seed), fresh.prepare(idx, seed)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    x, y = train.get_batch(idx, torch.device("cpu"))
    x0, y0 = fresh.get_batch(idx, torch.device("cpu"))
    assert torch.equal(x, x0) and torch.equal(y, y0)


def test_the_probe_sample_is_whole_waves_of_one_item_a_worker_within_the_split():
    for workers, cpus in ((14, 16), (14, 2), (2, 2), (0, 2)):
        n, chunk = datafeed.probe_sample(40_000, workers, 0.0015, cpus)
        w = max(1, workers)
        assert n % (w * chunk) == 0 and n // (w * chunk) >= datafeed.PROBE_WAVES
        assert n <= datafeed.PROBE_MAX_IMAGES + w * chunk
    assert datafeed.probe_sample(100, 14, 0.0015, 16)[0] <= 100  # a small split: within it
    assert datafeed.probe_sample(10, 14, 0.0015, 16) == (10, 1)


def test_plan_probes_the_fill_and_resolves_the_cache_as_training_does(tmp_path):
    cfg = load_config(str(REPO / "configs/fractal_cpu.yaml"), [])
    facts = datafeed.data_facts(cfg, local_ranks=1)
    assert (facts.train_n, facts.holdout_n) == (2400, 600) and facts.s_per_image > 0 and facts.probe_images > 0
    assert facts.cached_train and facts.cached_holdout  # 9 MB fits any node's budget
    note = datafeed.notes(facts, 32, 1.0)[0]
    assert f"{facts.probe_images:,} fractal images made here by {facts.workers} loader worker(s)" in note
    inline = datafeed.data_facts(load_config(str(REPO / "configs/fractal_cpu.yaml"), ["data.workers=0"]), 1)
    assert inline.workers == 0 and inline.s_per_image > 0  # the loader in plan's own process
    assert "images made here in-process (train's fill, data.workers=0)" in datafeed.notes(inline, 32, 1.0)[0]
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
    share = 600 // 2  # every-step training on two ranks: each evaluates half of the 600 held-out images
    forward = share * (0.01 / 32) * phases.FORWARD_SHARE
    copy = share * 3 * 32 * 32 / (phases.HOST_TO_DEVICE_GBps * 1e9)  # --compute-s: GPU ranks, the cache copied there
    assert cached["costs"]["eval_s"] == pytest.approx(forward + copy)
    uncached = plan_doc(tmp_path, monkeypatch, capsys, "data.cache=false")["runs"]["now"]
    assert "data cache" not in [p["name"] for p in uncached["phases"]]
    assert uncached["costs"]["eval_s"] > forward  # its share's images made again by freshly started workers
