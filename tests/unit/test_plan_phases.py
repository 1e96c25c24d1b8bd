"""plan's whole-run model (runmodel/phases.py): a run as configured, phase by phase, and train's
end-of-run comparison for the steps a run timed (runmodel/predicted.py)."""

import json
from pathlib import Path

import pytest
from test_advice import keep_up

from dscluster.cli import main
from dscluster.core import timing
from dscluster.plan import saveprobe
from dscluster.runmodel import phases, predicted

REAL_SAVE_PROBE = saveprobe.measure  # before tests/unit/conftest.py's steady_save_rate replaces it in each test

REPO = Path(__file__).resolve().parents[2]


def costs(**kw) -> phases.RunCosts:
    base = dict(plain_step_s=4.5, step_s=0.2, start_step=200, warmup_extra_s=20.0, eval_s=3.0, save_s=2.0,
                steps_per_epoch=100, eval_every_epochs=1, checkpoint_every_epochs=1)
    return phases.RunCosts(**{**base, **kw})


def test_warmup_steps_agree_with_trainings_timing():
    assert phases.WARMUP_STEPS == timing.WARMUP_STEPS


def test_a_run_whose_first_200_steps_are_uncompressed_is_the_sum_of_its_phases():
    c = costs()
    run = phases.whole_run(c, epochs=10, max_steps=0, global_batch=2048)
    by = {p["name"]: p for p in run["phases"]}
    assert run["total_steps"] == 1000
    assert by["warm-up"]["steps"] == 5 and by["warm-up"]["seconds"] == pytest.approx(5 * 4.5 + 20.0)
    assert by["uncompressed"]["steps"] == 195 and by["uncompressed"]["seconds"] == pytest.approx(195 * 4.5)
    assert by["compressed"]["steps"] == 800 and by["compressed"]["seconds"] == pytest.approx(800 * 0.2)
    assert by["evaluation"]["seconds"] == pytest.approx(10 * 3.0)  # after every epoch
    assert by["checkpoints"]["seconds"] == pytest.approx(10 * 2.0)
    expected = 200 * 4.5 + 20.0 + 800 * 0.2 + 30.0 + 20.0
    assert run["seconds"] == pytest.approx(expected)
    assert run["images_per_s"] == pytest.approx(1000 * 2048 / expected)
    # the compressed step alone would promise 10,240 img/s; train's steady figure times steps 6..1000, their
    # 195 plain steps and the 9 epoch ends before the last among them: about 2,050; the whole run about 1,800
    assert run["step_images_per_s"] == pytest.approx(2048 / 0.2)
    assert run["steady_images_per_s"] == pytest.approx(2048 * 995 / (195 * 4.5 + 800 * 0.2 + 9 * (3.0 + 2.0)))
    assert run["images_per_s"] < run["steady_images_per_s"] < run["step_images_per_s"] / 4
    assert run["epoch_ends"] == {"count": 10, "in_steady": 9, "evaluation_s": 3.0, "save_s": 2.0,
                                 "loader_restart_s": 0.0, "source": "modelled", "seconds": 50.0,
                                 "steady_seconds": 45.0}


def test_max_steps_mid_epoch_evaluates_once_at_the_end_and_saves_no_partial_epoch():
    c = costs(start_step=None, plain_step_s=0.2, checkpoint_every_steps=30)
    run = phases.whole_run(c, epochs=10, max_steps=150, global_batch=64)
    by = {p["name"]: p for p in run["phases"]}
    assert run["total_steps"] == 150
    # evaluations after epoch 1 (step 100) and after the last step; saves at 30, 60, 90, 120, 150 and epoch 1
    assert by["evaluation"]["seconds"] == pytest.approx(2 * 3.0)
    assert by["checkpoints"]["seconds"] == pytest.approx(6 * 2.0)
    assert "uncompressed" not in by


def test_start_step_rule_moves_a_late_start_early_and_keeps_an_early_one():
    assert phases.recommended_start(200) == phases.POWERSGD_START_STEP == 30
    assert phases.recommended_start(10) is None


def entry(**kw):
    c = costs(**kw).to_dict()
    return {"images_per_s": 2048 / 0.2, "step_s": 0.2, "model_step_s": 0.18, "costs": c,
            "model_costs": {**c, "plain_step_s": 4.4, "step_s": 0.18}}


@pytest.mark.parametrize("steps, plain, predicted_ips", [
    # 24 steps with PowerSGD from step 200: the 19 timed steps are all plain all-reduces
    (24, 19, 2048 / 4.5),
    # 300 steps: timed 6..300, 195 plain, 100 compressed, and the evaluations and saves after steps 100 and 200
    (300, 195, 2048 * 295 / (195 * 4.5 + 100 * 0.2 + 2 * (3.0 + 2.0))),
])
def test_trains_comparison_predicts_the_steps_that_ran(tmp_path, steps, plain, predicted_ips):
    env = {"DSCLUSTER_STATE": str(tmp_path)}
    key = predicted.key(model="m", micro_batch=128, global_batch=2048, precision="fp16", compression="powersgd",
                        ranks=4)
    predicted.save({key: entry()}, env)
    run = {"resumed_at": 0, "last": steps, "total": steps, "epochs": 10, "steps_per_epoch": 100, "start_step": 200}
    cmp = predicted.compare(key, 450.0, env, run=run)
    assert cmp["phase_aware"] and cmp["timed_steps"] == steps - 5 and cmp["timed_plain_steps"] == plain
    assert cmp["predicted_images_per_s"] == pytest.approx(predicted_ips)
    if steps == 24:  # judged against plain steps, not the compressed figure: −1 %, not −95 %
        assert abs(cmp["deviation_percent"]) < 2
        assert "−95" not in predicted.line(cmp)


def test_outcomes_of_plain_and_mixed_runs_calibrate_the_right_compression(tmp_path):
    env = {"DSCLUSTER_STATE": str(tmp_path)}
    key = predicted.key(model="m", micro_batch=128, global_batch=2048, precision="fp16", compression="powersgd",
                        ranks=4)
    predicted.save({key: entry()}, env)
    base = {"resumed_at": 0, "total": 300, "epochs": 10, "steps_per_epoch": 100, "start_step": 200}
    for last in (24, 300):
        cmp = predicted.compare(key, 450.0, env, run={**base, "last": last})
        predicted.record(cmp, model="m", precision="fp16", compression="powersgd", ranks=4, global_batch=2048,
                         run_id=f"r{last}", env=env)
    cal = predicted.calibration(model="m", precision="fp16", ranks=4, env=env)
    # the 24-step run's steps were all plain: it calibrates `none`; the mixed 300-step run calibrates nothing
    assert set(cal) == {"none"} and cal["none"]["extra_s"] == pytest.approx(2048 / 450.0 - 4.4)


def test_a_long_run_with_a_few_plain_steps_first_calibrates_its_compression(tmp_path):
    # PowerSGD from step 10 of 300: 5 of the 295 timed steps were plain, the compressed ones own the difference
    env = {"DSCLUSTER_STATE": str(tmp_path)}
    key = predicted.key(model="m", micro_batch=128, global_batch=2048, precision="fp16", compression="powersgd",
                        ranks=4)
    predicted.save({key: entry(start_step=10)}, env)
    run = {"resumed_at": 0, "total": 300, "epochs": 10, "steps_per_epoch": 100, "start_step": 10, "last": 300}
    cmp = predicted.compare(key, 8000.0, env, run=run)
    assert cmp["timed_plain_steps"] == 5
    predicted.record(cmp, model="m", precision="fp16", compression="powersgd", ranks=4, global_batch=2048,
                     run_id="long", env=env)
    cal = predicted.calibration(model="m", precision="fp16", ranks=4, env=env)
    extra = (2048 / 8000.0 - cmp["model_step_s"]) * 295 / 290
    assert set(cal) == {"powersgd"} and cal["powersgd"]["extra_s"] == pytest.approx(extra)


def test_entries_without_run_costs_compare_as_before(tmp_path):
    env = {"DSCLUSTER_STATE": str(tmp_path)}
    predicted.save({"k": {"images_per_s": 100.0, "step_s": 1.0}}, env)
    run = {"resumed_at": 0, "last": 24, "total": 24, "epochs": 1, "steps_per_epoch": 24, "start_step": None}
    assert predicted.compare("k", 90.0, env, run=run)["deviation_percent"] == -10.0


def test_pasted_recommendation_includes_the_start_step_and_the_whole_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DSCLUSTER_STATE", str(tmp_path / "state"))
    (tmp_path / "hosts.txt").write_text("node1 slots=1\nnode2 slots=1\nnode3 slots=2\n")
    words = ["micro_batch=128", "data.dataset=synthetic", "data.synthetic_samples=50000", "precision=fp16"]
    argv = ["plan", "--config", str(REPO / "configs/vit_base.yaml"), "--hostfile", str(tmp_path / "hosts.txt"),
            "--busbw", "1.19", "--compute-s", "0.043", "--powersgd-s", "0.02", *words]
    keep_up(tmp_path / "state", str(REPO / "configs/vit_base.yaml"), words, "powersgd")  # it learns as plain runs do
    assert main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    ovr = doc["recommendation"]["overrides"]
    assert ovr == ["comm.compression=powersgd", "comm.powersgd_start_step=30"]
    choice = doc["runs"]["choice"]
    names = [p["name"] for p in choice["phases"]]
    assert names[:3] == ["warm-up", "uncompressed", "compressed"]
    assert choice["costs"]["start_step"] == 30
    assert choice["seconds"] == pytest.approx(sum(p["seconds"] for p in choice["phases"]))
    # the config as given (plain all-reduces at 10 Gbit) takes minutes; the recommendation less than node3 alone
    assert doc["runs"]["now"]["seconds"] > doc["runs"]["alone"]["seconds"] > choice["seconds"]
    saved = json.loads((tmp_path / "state" / "plans.json").read_text())["plans"]
    assert any(e["setting"] == "choice" and e["costs"]["plain_step_s"] > e["costs"]["step_s"] for e in saved.values())
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "comm.powersgd_start_step=30" in text and "start-step rule" in text
    assert "whole run as configured" in text and "whole run with the recommendation" in text
    assert "whole run on node3 alone" in text


def test_the_compute_figure_is_cached_per_host_device_and_config_and_its_first_step_cost_is_the_warmup(
        tmp_path, monkeypatch, capsys):
    from dscluster.core import probe

    monkeypatch.setenv("DSCLUSTER_STATE", str(tmp_path / "state"))
    (tmp_path / "hosts.txt").write_text("node1 slots=1\nnode2 slots=1\n")
    calls = []

    def measured(cfg, in_chans, num_classes, micro, measure=None, slow_ms=0):
        calls.append(micro)
        return probe.ComputeFigure(seconds=0.05, device="cuda (test GPU)", note="compiled, as training runs it",
                                   spread=0.01, samples=10, warmup_extra_s=12.0, compiled=True)

    monkeypatch.setattr(probe, "measure_steady_compute", measured)
    argv = ["plan", "--config", str(REPO / "configs/digits.yaml"), "--hostfile", str(tmp_path / "hosts.txt"),
            "--busbw", "1.0", "--powersgd-s", "0.001", "--json"]
    assert main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["compute"]["source"] == "measured" and first["compute"]["compiled"] is True
    warm = first["runs"]["now"]["phases"][0]
    assert warm["name"] == "warm-up" and warm["seconds"] >= 12.0
    assert main(argv) == 0  # the same host, device and config: the figure is used again, not measured
    again = json.loads(capsys.readouterr().out)
    # the lab's micro-batch, then each node's alone (the global batch on its one GPU)
    alone = first["global_batch"]
    assert calls == [first["micro_batch"], alone]
    assert again["compute"]["source"] == "cached" and again["compute"]["seconds"] == 0.05
    assert again["runs"]["now"]["seconds"] == pytest.approx(first["runs"]["now"]["seconds"])
    assert main([*argv, "--no-calibration"]) == 0  # measures again
    assert calls == [first["micro_batch"], alone] * 2


def test_the_probe_compiles_only_where_training_compiles():
    from dscluster.core import probe
    from dscluster.core.config import load_config

    cfg = load_config(str(REPO / "configs/vit_tiny.yaml"), [])
    assert cfg.compile == "auto" and probe.compiles_here(cfg) is False  # no GPU here: eager, as training
    assert "compile=auto" in probe.probe_key(cfg, 32, "fp16")


def test_a_resumed_run_is_not_charged_the_evaluation_its_predecessor_ran():
    c = costs(start_step=None, plain_step_s=0.2)
    # resumed at step 100, the end of epoch 1: that epoch's evaluation and save ran before the resume
    assert phases.timed_mean_step(c, 101, 103, total=1000, epochs=10, resumed_at=100) == pytest.approx(0.2)
    # a fresh run's steps 96..110 hold the evaluation and save after step 100
    assert phases.timed_mean_step(c, 96, 110, total=1000, epochs=10) == pytest.approx((15 * 0.2 + 5.0) / 15)


def test_a_probe_taken_again_keeps_the_first_steps_cost_that_only_the_first_try_saw():
    # the second try reuses the process's compiled graphs: its first step costs nothing extra
    from dscluster.core import probe

    tries = iter([(0.9, 29.0), (0.1, 0.007)])  # (spread, warm-up extra): disturbed, then steady

    def measure(cfg, in_chans, num_classes, micro):
        spread, extra = next(tries)
        return probe.ComputeFigure(seconds=0.02, device="cuda (test GPU)", note="compiled", spread=spread,
                                   samples=5, warmup_extra_s=extra, compiled=True)

    f = probe.measure_steady_compute(None, 3, 10, 128, measure=measure)
    assert f.tries == 2 and f.spread == 0.1 and f.warmup_extra_s == 29.0


RESULTS = REPO / "bench" / "results"


def recorded_h200() -> tuple[dict, list[dict]]:
    """One H200, configs/vit_small_fractal.yaml at fp16: plan's probe of the node alone (micro-batch 512,
    compiled) and the runs of that node alone, as bench/results keeps them."""
    tta = json.loads((RESULTS / "2026-11-27-2xh200-tta-10gbit-1-1-fp16.json").read_text())
    probe = tta["runs"][2]["plan"]["calibration"]["none"]["compute"]
    sync = json.loads((RESULTS / "2026-11-28-2xh200-sync-local-sgd.json").read_text())
    return probe, [r for r in sync["runs"] if r["role"] == "node1 alone"]


def test_the_first_plans_steady_figure_on_one_h200_holds_the_epoch_ends_train_times():
    # Found on one H200: the first plan's steady img/s read 19-25 % above what train reported, the
    # evaluation, the copy of the held-out set to the GPU and the loader's restart at each epoch end
    # being left out (train's steady windows hold them). From the recorded probe, the epoch ends are
    # priced within 10 % of the held-out pass each run measured, and steady img/s within 8 %.
    from dscluster.core.config import load_config
    from dscluster.plan import datafeed, model, wholerun

    probe, runs = recorded_h200()
    cfg = load_config(str(REPO / "configs/vit_small_fractal.yaml"), ["precision=fp16"])
    s = model.Scenario(nodes=(model.Node(name="localhost", compute_s=probe["seconds"]),), micro_batch=512,
                       grad_bytes=4 * 22_000_000, busbw_GBps=1.0)
    facts = datafeed.DataFacts(train_n=40_000, holdout_n=10_000, name="fractal", s_per_image=0.00012, start_s=1.5,
                               workers=14, prefetch=cfg.data.prefetch, image_bytes=3 * 224 * 224, cached_train=True,
                               cached_holdout=True)
    run = wholerun.setting_run(cfg, s, model.predict(s), facts, start=None, params=22_000_000,
                               runs=wholerun.FromRuns(probe["warmup_extra_s"], "modelled"),
                               eval_s_per_image=probe["eval_s_per_image"])
    ends = run["epoch_ends"]
    assert (ends["count"], ends["in_steady"]) == (15, 14) and run["total_steps"] == 1170
    boundary = ends["evaluation_s"] + ends["loader_restart_s"] + ends["save_s"]
    for r in runs:
        assert boundary == pytest.approx(r["fixed_costs_s"]["evaluation_each"], rel=0.10)
        assert run["steady_images_per_s"] == pytest.approx(r["images_per_s_steady"], rel=0.08)
        assert run["step_images_per_s"] > 1.2 * r["images_per_s_steady"]  # what plan printed before
    assert [p["name"] for p in run["phases"]][-2:] == ["evaluation", "loader restarts"]


def test_a_second_plan_prices_the_warmup_as_the_run_of_its_setting_measured_it(tmp_path, monkeypatch, capsys,
                                                                               steady_save_rate):
    # Found on one H200: the probe's first step paid a cold compile (26 s); the run after it found the
    # compile cache warm and measured 9 s; the second plan still priced 26 s (the larger of the two) and
    # its whole run read +25 %. Now the newest run of the same setting sets it, and plan says so.
    from dscluster.core import probe

    monkeypatch.setenv("DSCLUSTER_STATE", str(tmp_path / "state"))
    (tmp_path / "hosts.txt").write_text("localhost slots=1\n")
    steady_save_rate(0.1)  # a slow disk, so that the digits model's 3.7 MB save shows in the epoch-end line (0.04 s)

    def measured(cfg, in_chans, num_classes, micro, measure=None, slow_ms=0):
        return probe.ComputeFigure(seconds=0.05, device="cuda (test GPU)", note="compiled, as training runs it",
                                   spread=0.01, samples=10, warmup_extra_s=26.0, compiled=True, eval_s_per_image=1e-4)

    monkeypatch.setattr(probe, "measure_steady_compute", measured)
    argv = ["plan", "--config", str(REPO / "configs/digits.yaml"), "--hostfile", str(tmp_path / "hosts.txt")]
    assert main([*argv, "--json"]) == 0
    first = json.loads(capsys.readouterr().out)["runs"]["now"]
    assert first["warmup"]["source"].startswith("modelled: the probe's first step 26.0 s")
    assert first["warmup"]["seconds"] == pytest.approx(26.0 + 5 * 0.05)
    assert first["epoch_ends"]["source"] == "modelled" and first["epoch_ends"]["evaluation_s"] < 0.1
    assert first["startup"] == {"seconds": None, "source": None}  # no run yet: not predicted
    # the run of this setting: train's comparison at its end keeps its warm-up (9 s to the end of step 5) and
    # its held-out pass (0.5 s, the median of its passes)
    key = predicted.key(model="vit_small_image", micro_batch=64, global_batch=64, precision="fp32",
                        compression="none", ranks=1)
    total, epochs = first["total_steps"], first["epochs"]
    run = {"resumed_at": 0, "last": total, "total": total, "epochs": epochs, "steps_per_epoch": total // epochs,
           "start_step": None, "warmup_s": 9.0, "eval_s": 0.5, "startup_s": 12.0}
    measured = 0.8 * first["steady_images_per_s"]
    cmp = predicted.compare(key, measured, run=run)
    predicted.record(cmp, model="vit_small_image", precision="fp32", compression="none", ranks=1, global_batch=64,
                     run_id="a1")
    assert main([*argv, "--json"]) == 0
    second = json.loads(capsys.readouterr().out)["runs"]["now"]
    step = 64 / measured
    assert second["warmup"] == {"seconds": pytest.approx(9.0 - 5 * step + 5 * second["costs"]["step_s"], abs=1e-3),
                                "extra_s": pytest.approx(9.0 - 5 * step, abs=1e-3), "source": "measured in run a1",
                                "run_id": "a1"}
    ends = second["epoch_ends"]
    assert ends["source"] == "measured in run a1" and ends["evaluation_s"] == 0.5
    assert second["startup"] == {"seconds": 12.0, "source": "measured in run a1"}  # beside the whole run, not in it
    # the step calibrated against the model with the run's own epoch ends: the steady figure is the run's, and
    # the step alone keeps what is left (not the epoch ends' miss spread over every step)
    assert second["steady_images_per_s"] == pytest.approx(measured, rel=1e-6)
    assert second["step_images_per_s"] > measured
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "warm-up 5 steps" in text and "(measured in run a1)" in text and "before them, start-up 12.0 s" in text
    assert "images/s steady (after 5 warm-up steps, as train reports it" in text
    assert (f"epoch ends: {epochs}, each up to 0.54 s (held-out pass 0.50 s, checkpoint save 0.04 s; "
            "measured in run a1)" in text)


def test_a_run_whose_checkpoints_saved_faster_than_modelled_does_not_calibrate_the_step_down(tmp_path, monkeypatch):
    # Found on one H200 (ViT-B/16 fp16, 40 steps, a save at each 32-step epoch end): plan modelled each save at
    # its assumed disk speed (2.7 s), the run's saves took 0.8-1.4 s, and the whole miss was put on the
    # step: the next plan's steady figure was 13,074 img/s against the 2,611 measured. The run's own saves
    # now stand in the model the step is calibrated against, as its held-out passes do.
    monkeypatch.setenv("DSCLUSTER_STATE", str(tmp_path / "state"))
    step, modelled_save, real_save, spe, total = 0.073, 2.7, 0.8, 32, 40
    costs = phases.RunCosts(plain_step_s=step, step_s=step, save_s=modelled_save, steps_per_epoch=spe,
                            checkpoint_every_epochs=1).to_dict()
    key = predicted.key(model="vit_base_patch16_224", micro_batch=128, global_batch=256, precision="fp16",
                        compression="none", ranks=1)
    predicted.save({key: {"images_per_s": 256 / step, "step_s": step, "model_step_s": step, "costs": costs,
                          "model_costs": costs, "setting": "now"}})
    run = {"resumed_at": 0, "last": total, "total": total, "epochs": 10, "steps_per_epoch": spe, "start_step": None,
           "save_s": real_save, "warmup_s": 5.0}
    first, last = phases.timed_steps(0, total)
    measured = 256 / ((last - first + 1) * step + real_save) * (last - first + 1)   # what train reports
    cmp = predicted.compare(key, measured, run=run)
    assert cmp["measured_save_s"] == real_save
    assert cmp["model_step_s"] == pytest.approx(256 / measured, rel=1e-6)   # the model, with the real save, is the run
    predicted.record(cmp, model="vit_base_patch16_224", precision="fp16", compression="none", ranks=1,
                     global_batch=256, run_id="r40")
    extra = predicted.calibration(model="vit_base_patch16_224", precision="fp16", ranks=1)["none"]["extra_s"]
    assert extra == pytest.approx(0.0, abs=1e-6)   # nothing left to put on the step
    # without the run's own saves the modelled 2.7 s would have been the step's miss: a step far too fast
    cmp_old = predicted.compare(key, measured, run={**run, "save_s": None})
    assert cmp_old["model_step_s"] - 256 / measured > 0.04
    # and the next plan of this setting prices a save as the run measured it, not at the assumed disk speed
    from dscluster.plan import wholerun
    found = predicted.startup(model="vit_base_patch16_224", precision="fp16", ranks=1, plan_key=key)
    runs = wholerun.from_runs(0.0, "no data facts", found)
    assert found["save_s"] == real_save and runs.save_s == real_save and runs.epoch_end_source == "measured in run r40"
    assert any("checkpoint save as run r40 measured it, 0.80 s" in n for n in runs.notes)


def test_a_first_plan_prices_each_save_at_the_write_rate_of_the_checkpoints_folder(tmp_path, monkeypatch, capsys):
    # Found on one H200 (ViT-B/16 fp16, a save every epoch): the assumed 0.5 GB/s priced a save at 2.75 s where
    # the run's took 1.0 s, and the first plan's steady figure read 1,662 img/s against 2,540 measured.
    runs = tmp_path / "runs"
    runs.mkdir()
    monkeypatch.setenv("DSCLUSTER_RUNS", str(runs))
    monkeypatch.setenv("DSCLUSTER_STATE", str(tmp_path / "state"))
    (tmp_path / "hosts.txt").write_text("localhost slots=1\n")
    timed = []

    def measure(folder, nbytes):
        timed.append((folder, nbytes, REAL_SAVE_PROBE(folder, nbytes)))
        return timed[-1][2]

    monkeypatch.setattr(saveprobe, "measure", measure)
    argv = ["plan", "--config", str(REPO / "configs/digits.yaml"), "--hostfile", str(tmp_path / "hosts.txt"),
            "--compute-s", "0.01", "--json"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    [(folder, nbytes, rate)] = timed
    assert folder == runs and nbytes == doc["params"] * phases.CHECKPOINT_BYTES_PER_PARAM
    assert rate.probe_bytes == max(nbytes, saveprobe.PROBE_MIN_BYTES) == saveprobe.probe_bytes(nbytes)
    assert rate.folder == str(runs)
    ends = doc["runs"]["now"]["epoch_ends"]
    assert ends["save_s"] == pytest.approx(nbytes / (rate.gbps * 1e9))
    assert rate.note() in doc["notes"] and not any("assumed at" in n for n in doc["notes"])
    assert list(runs.iterdir()) == []   # the probe's file is gone
    # no checkpoints, nothing to time; a folder that cannot be written: assumed, and said so
    assert main([*argv[:-1], "checkpoint.every_epochs=0", "--json"]) == 0
    capsys.readouterr()
    assert len(timed) == 1
    monkeypatch.setattr(saveprobe, "measure", lambda folder, nbytes: None)
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert any(f"checkpoint saves assumed at {phases.CHECKPOINT_WRITE_GBps} GB/s" in n for n in doc["notes"])
    assert doc["runs"]["now"]["epoch_ends"]["save_s"] == pytest.approx(
        doc["params"] * phases.CHECKPOINT_BYTES_PER_PARAM / (phases.CHECKPOINT_WRITE_GBps * 1e9))
