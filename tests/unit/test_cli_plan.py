"""`dscluster plan`: inputs from check.json or flags, the JSON document, bad input → exit 2 with the fix."""

import json
import sys
from pathlib import Path

import pytest
from test_advice import keep_up

from dscluster.cli import main
from dscluster.core import probe as plan_probe
from dscluster.errors import UsageError
from dscluster.plan import calibrate as plan_calibrate
from dscluster.plan import inputs as plan_inputs

REPO = Path(__file__).resolve().parents[2]
LAB = "node1 slots=1\nnode2 slots=1\nnode3 slots=2\n"  # the GPU lab: 4 ranks on 3 nodes


@pytest.fixture
def lab(tmp_path, monkeypatch):
    """A hostfile like the GPU lab's and an empty state directory."""
    monkeypatch.setenv("DSCLUSTER_STATE", str(tmp_path / "state"))
    (tmp_path / "hosts.txt").write_text(LAB)
    return tmp_path


def write_check(state: Path, allreduce) -> Path:
    state.mkdir(parents=True, exist_ok=True)
    path = state / "check.json"
    path.write_text(json.dumps({"schema": 1, "active": {"skipped": None, "allreduce": allreduce}}))
    return path


def run_plan(lab, *extra):
    return main(["plan", "--config", str(REPO / "configs/vit_base.yaml"), "--hostfile", str(lab / "hosts.txt"),
                 *extra])


def test_json_for_the_digits_preset_parses(lab, capsys):
    assert main(["plan", "--config", str(REPO / "configs/digits.yaml"), "--busbw", "0.119", "--compute-s", "0.05",
                 "--hostfile", str(lab / "hosts.txt"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == 1 and doc["model"] == "vit_small_image" and doc["params"] == 228_202
    assert doc["world_size"] == 4 and doc["micro_batch"] == 16 and doc["global_batch"] == 64
    assert doc["busbw_GBps"] == 0.119 and doc["busbw_source"] == "--busbw"
    c = doc["compute"]
    assert (c["seconds"], c["source"], c["device"], c["note"]) == (0.05, "--compute-s", None, None)
    assert c["measured_at"] is None and c["probe"] is None  # nothing measured here
    pred = doc["prediction"]
    assert pred["step_s"] == pytest.approx(pred["compute_s"] + pred["exposed_s"])
    assert set(doc["recommendation"]) >= {"choice", "overrides", "pending", "summary", "reached"}


def test_no_busbw_and_no_check_json_names_the_fix(lab, capsys):
    assert run_plan(lab, "--compute-s", "0.05") == 2
    err = capsys.readouterr().err
    assert "check.json" in err and "run `dscluster check`" in err and "--busbw" in err


def test_one_rank_needs_no_bandwidth_and_says_so(lab, capsys):
    (lab / "one.txt").write_text("localhost slots=1\n")
    assert main(["plan", "--config", str(REPO / "configs/digits.yaml"), "--hostfile", str(lab / "one.txt"),
                 "--compute-s", "0.05", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["busbw_source"] == "one rank: no all-reduce, this figure is not used"
    assert doc["prediction"]["comm_s"] == 0 and doc["prediction"]["step_s"] == pytest.approx(0.05)


def test_check_without_allreduce_names_the_fix(lab, capsys):
    write_check(lab / "state", None)
    assert run_plan(lab, "--compute-s", "0.05") == 2
    assert "without --skip-active" in capsys.readouterr().err


def test_busbw_comes_from_checks_largest_allreduce(lab, capsys):
    rows = [{"bytes": 1 << 20, "busbw_GBps": 0.05}, {"bytes": 256 << 20, "busbw_GBps": 0.119},
            {"bytes": 64 << 20, "busbw_GBps": 0.118}]
    path = write_check(lab / "state", {"ok": True, "result": {"results": rows, "peak_busbw_GBps": 0.119,
                                                               "world_size": 4}})
    assert run_plan(lab, "--compute-s", "0.0427", "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["busbw_GBps"] == 0.119 and doc["busbw_source"] == str(path)
    # the 1 Gbit GPU lab: 4.3 s a step, slower than node3 alone; nothing shown to learn as the config does
    # finishes sooner than node3 alone (issue 55: PowerSGD at global batch 1,024 was advised here untested)
    assert doc["prediction"]["step_s"] == pytest.approx(4.34, abs=0.05)
    rec = doc["recommendation"]
    assert doc["prediction"]["slower"] and rec["train_alone"] and rec["overrides"] == [] and rec["choice"] is None
    assert rec["alone_command"].startswith("printf '%s\\n' 'node3 slots=2' > hosts-node3.txt && mpirun -np 2")
    assert rec["pending"] == []
    assert not any("check measured" in n for n in doc["notes"])
    # --busbw wins over check.json
    assert run_plan(lab, "--compute-s", "0.0427", "--busbw", "1.19", "--json") == 0
    assert json.loads(capsys.readouterr().out)["busbw_GBps"] == 1.19


def test_table_says_slower_and_to_train_alone_with_the_command(lab, capsys):
    assert run_plan(lab, "--compute-s", "0.0427", "--busbw", "0.119") == 0
    out = capsys.readouterr().out
    assert "adding nodes makes training SLOWER" in out and "paste after" not in out
    assert ("train on node3 alone, its README command:\n    printf '%s\\n' 'node3 slots=2' > hosts-node3.txt && "
            f"mpirun -np 2 --hostfile hosts-node3.txt ./entry_cn.sh --config {REPO / 'configs/vit_base.yaml'}\n") in out
    assert "recommendation: train on node3 alone: no setting shown to learn as the config does finishes sooner" in out
    # where training cannot compress (ZeRO 2) the table says why, once
    assert run_plan(lab, "--compute-s", "0.0427", "--busbw", "0.119", "zero_stage=2") == 0
    out = capsys.readouterr().out
    assert "train on node3 alone" in out and out.count("needs zero_stage=0") == 1


@pytest.mark.parametrize("flags, words", [
    (["--busbw", "0"], "--busbw"),
    (["--busbw", "1", "--compute-s", "fast"], "--compute-s"),
    (["--busbw", "1", "--compute-s", "node1=0.1,node2=0.1"], "no time for node3"),
    (["--busbw", "1", "--compute-s", "node9=0.1"], "not a host of the hostfile"),
    (["--busbw", "1", "--compute-s", "0.1", "--max-global-batch", "0"], "--max-global-batch"),
    (["--busbw", "1", "--compute-s", "0.1", "epochs=zero"], "epochs"),
])
def test_bad_input_exits_2_with_the_fix(lab, capsys, flags, words):
    assert run_plan(lab, *flags) == 2
    assert words in capsys.readouterr().err


def test_per_node_compute_times_slowest_sets_the_step(lab, capsys):
    assert run_plan(lab, "--busbw", "100", "--compute-s", "node1=0.05,node2=0.05,node3=0.2", "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["prediction"]["compute_s"] == pytest.approx(0.2)
    assert doc["prediction"]["fastest_node"] == "node1"  # 128/0.05 beats node3's 2 × 128/0.2


def test_batch_shape_follows_the_trainer():
    from dscluster.core.config import load_config

    cfg = load_config(REPO / "configs/vit_base.yaml")
    shape, note = plan_inputs.batch_shape(cfg, 4)
    assert (shape.micro_batch, shape.grad_accum) == (128, 1) and "auto" in note  # global batch 512 ÷ 4 ranks
    cfg = load_config(REPO / "configs/vit_base.yaml", ["micro_batch=32"])
    shape, note = plan_inputs.batch_shape(cfg, 4)
    assert (shape.micro_batch, shape.grad_accum, note) == (32, 4, None)  # accumulation keeps global batch 512


def test_busbw_from_a_broken_check_json(tmp_path):
    path = tmp_path / "check.json"
    path.write_text("{not json")
    with pytest.raises(UsageError, match="run `dscluster check`"):
        plan_inputs.busbw_from_check(path)


def test_measures_compute_on_this_machine():
    """No GPU in unit tests: a few CPU steps of the small digits ViT, scaled and labelled as CPU."""
    import torch

    from dscluster.core.config import load_config

    cfg = load_config(REPO / "configs/digits.yaml")
    f = plan_probe.measure_compute(cfg, 1, 10, 8)
    assert f.seconds > 0 and f.samples >= 3 and f.spread >= 0
    if not torch.cuda.is_available():
        assert f.device == "cpu" and "measured on CPU" in f.note and "--compute-s" in f.note
        # digits is cheap: the real micro-batch is measured, not 4 samples scaled up, unless a busy
        # machine made 4 samples take more than CPU_FULL_BATCH_S for 8
        assert "steps of 8:" in f.note or "steps of 4 scaled to 8:" in f.note


def test_the_whole_run_prices_evaluation_with_trains_own_evaluation_as_measured(tmp_path, monkeypatch, capsys):
    # the probe runs core/evaluation.py's `evaluate`; the whole run's evaluation is the held-out
    # images × that figure, not a third of the training step's compute
    calls = []
    from dscluster.core import evaluation

    real = evaluation.evaluate

    def counted(*args, **kwargs):
        calls.append(kwargs.get("batch"))
        return real(*args, **kwargs)

    monkeypatch.setattr(evaluation, "evaluate", counted)
    monkeypatch.setenv("DSCLUSTER_STATE", str(tmp_path / "state"))
    (tmp_path / "hosts.txt").write_text("localhost slots=1\n")
    assert main(["plan", "--config", str(REPO / "configs/digits.yaml"), "--hostfile", str(tmp_path / "hosts.txt"),
                 "--busbw", "1.0", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    per_image = doc["compute"]["eval_s_per_image"]
    # a warm pass and a timed one per measurement (a disturbed probe is taken again), at the probe's batch:
    # the micro-batch, or on a busy CPU a smaller one the probe scales from
    assert len(calls) in (2, 4) and calls[0::2] == calls[1::2] and per_image > 0
    assert all(0 < b <= doc["micro_batch"] for b in calls)
    assert doc["runs"]["now"]["costs"]["eval_s"] == pytest.approx(359 * per_image)  # digits' held-out images


def test_out_of_memory_while_measuring_names_the_fix(monkeypatch):
    """On an H100, micro_batch=100000 ran out of memory allocating the batch: exit 2, not a traceback."""
    import torch

    from dscluster.core.config import load_config

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 56.08 GiB")

    monkeypatch.setattr(torch, "randn", oom)
    with pytest.raises(UsageError, match="does not fit this GPU.*--compute-s"):
        plan_probe.measure_compute(load_config(REPO / "configs/digits.yaml"), 1, 10, 100000)


def test_check_on_another_rank_count_is_noted(lab, capsys):
    rows = [{"bytes": 256 << 20, "busbw_GBps": 1.19}]
    write_check(lab / "state", {"ok": True, "result": {"results": rows, "world_size": 2}})
    assert run_plan(lab, "--compute-s", "0.0427", "--json") == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert any("over 2 ranks, this plan has 4" in n and "dscluster check --hostfile" in n for n in notes)


def test_the_config_as_given_is_saved_for_train_under_the_key_it_looks_up(lab, capsys, monkeypatch):
    from dscluster.runmodel import predicted

    monkeypatch.setenv("DSCLUSTER_PRECISION", "bf16")  # what `dscluster check` decided for the cluster
    assert run_plan(lab, "--compute-s", "0.0427", "--busbw", "0.119", "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["precision"] == "bf16" and doc["grad_format"] == "fp32"  # amp: fp32 weights and gradients
    assert doc["saved_to"] == str(lab / "state" / "plans.json")
    # (an advised setting's key: tests/unit/test_advice.py)
    now = predicted.lookup(predicted.key(model="vit_base_patch16_224", micro_batch=128, global_batch=512,
                                         precision="bf16", compression="none", ranks=4))
    assert now["images_per_s"] == pytest.approx(doc["prediction"]["images_per_s"]) and now["setting"] == "now"


def test_half_gradients_are_not_offered_half_precision_compression(lab, capsys):
    assert run_plan(lab, "--compute-s", "0.0427", "--busbw", "1.19", "--powersgd-s", "0.02", "precision=fp16",
                    "amp=false", "data.dataset=synthetic", "data.synthetic_samples=50000", "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["grad_format"] == "fp16" and doc["grad_bytes"] == 2 * doc["params"]
    offered = {u["compression"] for u in doc["recommendation"]["untested"]}
    assert "powersgd" in offered and "fp16" not in offered
    assert [p for p in doc["recommendation"]["pending"] if "comm.compression=fp16 has no effect" in p]


def test_saved_prediction_against_the_measured_figure(tmp_path):
    from dscluster.runmodel import predicted

    env = {"DSCLUSTER_STATE": str(tmp_path / "state")}
    k = predicted.key(model="m", micro_batch=32, global_batch=64, precision="fp32", compression="powersgd", ranks=2)
    predicted.save({k: {"images_per_s": 400.0, "step_s": 0.16, "setting": "now"}}, env)
    predicted.save({"other": {"images_per_s": 1.0, "step_s": 1.0}}, env)  # a second plan keeps the first
    cmp = predicted.compare(k, 436.0, env)
    assert cmp["predicted_images_per_s"] == 400.0 and cmp["deviation_percent"] == 9.0
    assert predicted.line(cmp) == "plan predicted 400 img/s, measured 436 img/s (+9%)"
    assert predicted.compare(k.replace("ranks=2", "ranks=3"), 436.0, env) is None  # another config: no claim
    (tmp_path / "state" / "plans.json").write_text("{torn")  # damaged: named, never taken for "no plan"
    with pytest.raises(predicted.PlansFileError, match="plans.json: unreadable"):
        predicted.compare(k, 436.0, env)


def test_powersgd_work_is_measured_with_trainings_hook_and_latency_comes_from_checks_smallest_message(lab, capsys):
    rows = [{"bytes": 1048576, "time_us": 1734.7, "busbw_GBps": 0.907, "algbw_GBps": 0.605},
            {"bytes": 268435456, "time_us": 337180.1, "busbw_GBps": 1.194, "algbw_GBps": 0.796}]
    write_check(lab / "state", {"ok": True, "result": {"world_size": 4, "results": rows}})
    assert main(["plan", "--config", str(REPO / "configs/digits.yaml"), "--hostfile", str(lab / "hosts.txt"),
                 "comm.compression=powersgd", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["latency_s"] == pytest.approx(0.000417, abs=2e-6) and doc["busbw_GBps"] == 1.194
    p = doc["prediction"]
    assert doc["powersgd_s"] is not None and doc["powersgd_s"] >= 0 and p["hook_s"] == doc["powersgd_s"]
    assert p["step_s"] == pytest.approx(p["compute_s"] + p["hook_s"] + p["exposed_s"])
    # one bucket of digits' 2 MB of gradients: three all-reduces, each with its start-up
    assert p["comm_s"] >= 3 * doc["latency_s"]
    assert any(n.startswith("PowerSGD: its own work") and "measured here" in n for n in doc["notes"])


# What the 2-node GPU lab (one H100 per node, 10 Gbit) measured on 2026-11-26: ViT-B/16 fp16,
# micro-batch 128, PowerSGD at global 256 and at 512 (grad_accum 2): the model's step and
# the measured one (bench/results/2026-11-26-2node-gpu-lab-binding-advisor.json).
LAB_10GBIT = dict(busbw="1.194", compute="0.053", powersgd="0.0163")
LAB_OUTCOMES = [(256, 0.0808, 256 / 2839.5), (512, 0.1231, 512 / 3615.0)]


LAB_2_NODES = ["precision=fp16", "micro_batch=128", "global_batch=256", "data.dataset=synthetic",
               "data.synthetic_samples=50000"]


def plan_2_nodes(lab, capsys, *extra):
    (lab / "two.txt").write_text("node1 slots=1\nnode2 slots=1\n")
    assert main(["plan", "--config", str(REPO / "configs/vit_base.yaml"), "--hostfile", str(lab / "two.txt"),
                 "--busbw", LAB_10GBIT["busbw"], "--compute-s", LAB_10GBIT["compute"],
                 "--powersgd-s", LAB_10GBIT["powersgd"], "--json", "--every-step", *LAB_2_NODES, *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_runs_measured_against_their_plan_correct_the_next_recommendation(lab, capsys):
    from dscluster.runmodel import predicted

    # curves show PowerSGD learning as every-step training does at these batches: plan may advise it
    keep_up(lab / "state", str(REPO / "configs/vit_base.yaml"), LAB_2_NODES, "powersgd", batches=(256, 512, 1024),
            base=256)
    first = plan_2_nodes(lab, capsys)
    choice = first["recommendation"]["choice"]
    assert (choice["grad_accum"], choice["compression"]) == (2, "powersgd")  # what the lab was told
    assert first["calibration"] == {}
    assert any(n.startswith("PowerSGD is not calibrated on 2 ranks yet") for n in first["notes"])
    # the two PowerSGD runs end: train records each against the model step plan saved for it
    for gb, model_step, measured_step in LAB_OUTCOMES:
        k = predicted.key(model="vit_base_patch16_224", micro_batch=128, global_batch=gb, precision="fp16",
                          compression="powersgd", ranks=2)
        predicted.save({k: {"images_per_s": gb / model_step, "step_s": model_step, "model_step_s": model_step}})
        cmp = predicted.compare(k, gb / measured_step)
        predicted.record(cmp, model="vit_base_patch16_224", precision="fp16", compression="powersgd", ranks=2,
                         global_batch=gb, run_id=f"psgd-{gb}")
    again = plan_2_nodes(lab, capsys)
    cal = again["calibration"]["powersgd"]
    # 9.4 and 18.5 ms a step more than the model gave
    assert cal["runs"] == 2 and cal["extra_s"] == pytest.approx((0.0094 + 0.0185) / 2, abs=0.0005)
    choice = again["recommendation"]["choice"]
    # 77 % measured at grad_accum 2: the corrected model moves on to grad_accum 4
    assert (choice["grad_accum"], choice["compression"]) == (4, "powersgd")
    assert choice["prediction"]["efficiency"] >= 0.8
    assert any(n.startswith("calibrated by 2 earlier run(s)") for n in again["notes"])
    assert not any("not calibrated" in n for n in again["notes"])
    # saved for the next run: the model's own step, so corrections do not compound
    saved = json.loads((lab / "state" / "plans.json").read_text())
    entry = next(v for v in saved["plans"].values() if v["setting"] == "choice")
    assert entry["step_s"] == pytest.approx(entry["model_step_s"] + cal["extra_s"])
    assert plan_2_nodes(lab, capsys, "--no-calibration")["recommendation"]["choice"]["grad_accum"] == 2


def test_calibrate_with_no_calibration_is_refused_before_anything_runs(lab, capsys):
    assert run_plan(lab, "--busbw", "1.2", "--compute-s", "0.05", "--calibrate", "--no-calibration") == 2
    err = capsys.readouterr().err
    assert "--calibrate" in err and "--no-calibration" in err and "pass one of them" in err
    assert not (lab / "state" / "plans.json").exists()


def test_calibrate_without_powersgd_in_play_runs_nothing(lab, capsys, monkeypatch):
    monkeypatch.setattr(plan_calibrate, "argv", lambda *a: pytest.fail("a calibration run was started"))
    # 100 GB/s: plain data parallelism scales, nothing recommends PowerSGD
    assert run_plan(lab, "--busbw", "100", "--compute-s", "0.05", "--json", "--calibrate", "precision=fp16") == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["calibration_runs"] == [] and doc["calibration"] == {}
    assert any(n.startswith("--calibrate: nothing to measure (neither the config nor the recommendation")
               for n in doc["notes"])


def test_a_failed_calibration_run_exits_1_and_leaves_the_plan_uncalibrated(lab, capsys, monkeypatch):
    # the run itself fails (a real process that exits 3, as launch does when a rank fails)
    monkeypatch.setattr(plan_calibrate, "argv", lambda *a: [sys.executable, "-c", "import sys; sys.exit(3)"])
    monkeypatch.chdir(lab)
    assert run_plan(lab, "--busbw", "1.2", "--compute-s", "0.05", "--powersgd-s", "0.015", "--json", "--calibrate",
                    "precision=fp16", "comm.compression=powersgd") == 1
    doc = json.loads(capsys.readouterr().out)
    [run] = doc["calibration_runs"]
    assert run["exit_code"] == 3 and run["images_per_s"] is None and run["run_id"].startswith("calibrate-powersgd-")
    assert doc["calibration"] == {} and doc["prediction"]["calibration_s"] == 0
    assert any("exited 3: the plan above is not calibrated" in n for n in doc["notes"])
    # its setting stays saved, so a run of it later is measured against the model all the same
    saved = json.loads((lab / "state" / "plans.json").read_text())["plans"]
    [entry] = [v for k, v in saved.items() if "global_batch=512 precision=fp16 compression=powersgd ranks=4" in k]
    assert entry["setting"] == "calibration" and entry["model_step_s"] == doc["prediction"]["model_step_s"]


def test_a_global_batch_the_ranks_cannot_split_evenly_is_saved_under_trains_key(lab, capsys):
    from dscluster.runmodel import predicted

    (lab / "three.txt").write_text("node1 slots=1\nnode2 slots=1\nnode3 slots=1\n")
    assert main(["plan", "--config", str(REPO / "configs/digits.yaml"), "--hostfile", str(lab / "three.txt"),
                 "--busbw", "1", "--compute-s", "0.01", "--json", "global_batch=64"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["micro_batch"] == 22  # 22, 21, 21: train keeps 64, with 22 the largest micro-batch
    # what train looks up at the end of that run (train/loop.py: max share, the config's global batch)
    k = predicted.key(model=doc["model"], micro_batch=22, global_batch=64, precision=doc["precision"],
                      compression="none", ranks=3)
    assert predicted.lookup(k)["setting"] == "now"
    # and its img/s counts the 64 images a step trains, at the pace of the largest share (22)
    p = doc["prediction"]
    assert doc["global_batch"] == p["global_batch"] == 64
    assert p["images_per_s"] == pytest.approx(64 / p["step_s"]) and p["compute_s"] == pytest.approx(0.01)


def test_calibrate_without_an_mpirun_to_start_says_so_and_exits_1(lab, capsys, monkeypatch):
    monkeypatch.setattr(plan_calibrate, "argv", lambda *a: [str(lab / "no-such-mpirun"), "-np", "4"])
    monkeypatch.chdir(lab)
    assert run_plan(lab, "--busbw", "1.2", "--compute-s", "0.05", "--powersgd-s", "0.015", "--json", "--calibrate",
                    "precision=fp16", "comm.compression=powersgd") == 1
    out = capsys.readouterr()
    assert "could not start" in out.err and "no-such-mpirun" in out.err
    assert json.loads(out.out)["calibration_runs"][0]["exit_code"] == 127


def stand_in_probe(monkeypatch, seconds: list[float], spreads=(0.1,), device="cpu", per_sample=0.0):
    """The compute probe replaced by one that returns `seconds[0]` (a list, so a test can slow it
    down) + `per_sample` × the micro-batch, on `device`, with the given spreads in turn; PowerSGD's
    probe by a fixed 4 ms."""
    taken = []

    def measure(cfg, in_chans, num_classes, micro):
        taken.append(micro)
        return plan_probe.ComputeFigure(seconds=seconds[0] + per_sample * micro, device=device,
                                        note="stand-in probe", samples=5,
                                        spread=spreads[min(len(taken), len(spreads)) - 1])

    monkeypatch.setattr(plan_probe, "measure_compute", measure)
    monkeypatch.setattr(plan_probe, "measure_powersgd", lambda *a: 0.004)
    return taken


def plan_digits_on_two(lab, capsys, *extra):
    (lab / "two.txt").write_text("node1 slots=1\nnode2 slots=1\n")
    assert main(["plan", "--config", str(REPO / "configs/digits.yaml"), "--hostfile", str(lab / "two.txt"),
                 "--busbw", "1", "--json", "comm.compression=powersgd", "global_batch=64", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_calibrated_plan_keeps_its_compute_figure_when_the_probe_turns_5x_slower(lab, capsys, monkeypatch):
    """issue 33: a busy head node made the probe 26x slower and the calibrated prediction 26x off."""
    from dscluster.runmodel import predicted

    seconds = [0.02]
    stand_in_probe(monkeypatch, seconds)
    first = plan_digits_on_two(lab, capsys)
    assert first["compute"]["source"] == "measured" and first["compute"]["seconds"] == 0.02
    assert first["calibration"] == {}
    # a PowerSGD run of that setting ends: train records it against the model step plan saved for it
    measured = 64 / (first["prediction"]["model_step_s"] + 0.015)  # 15 ms a step more than the model
    k = predicted.key(model=first["model"], micro_batch=32, global_batch=64, precision=first["precision"],
                      compression="powersgd", ranks=2)
    predicted.record(predicted.compare(k, measured), model=first["model"], precision=first["precision"],
                     compression="powersgd", ranks=2, global_batch=64, run_id="psgd")
    seconds[0] = 0.1  # the host is busy now: the probe reads 5x slower
    again = plan_digits_on_two(lab, capsys)
    assert again["calibration"]["powersgd"]["runs"] == 1
    assert again["prediction"]["images_per_s"] == pytest.approx(measured, rel=1e-9)
    # it says which figure it used, and when that was measured
    c = again["compute"]
    assert c["source"] == "calibration" and c["seconds"] == 0.02
    assert c["measured_at"] == first["compute"]["measured_at"] and c["powersgd_s"] == 0.004
    assert any("used again, not measured now" in n and "0.0200 s" in n for n in again["notes"])
    # without the calibration the probe is measured now, and really is 5x slower
    fresh = plan_digits_on_two(lab, capsys, "--no-calibration")
    assert fresh["compute"]["source"] == "measured" and fresh["compute"]["seconds"] == 0.1


def test_a_disturbed_compute_probe_is_measured_again_and_reported(lab, capsys, monkeypatch):
    taken = stand_in_probe(monkeypatch, [0.02], spreads=(0.9, 0.7))
    doc = plan_digits_on_two(lab, capsys)
    assert len(taken) == 2  # measured again once
    assert doc["compute"]["disturbed"] is True and doc["compute"]["spread"] == 0.7  # the steadier of the two
    assert any(n.startswith("the compute probe was disturbed: its 5 samples spread 70% around their median twice")
               and "--compute-s" in n for n in doc["notes"])
    # a probe that settles the second time is used as it is, without a note
    taken = stand_in_probe(monkeypatch, [0.02], spreads=(0.9, 0.1))
    doc = plan_digits_on_two(lab, capsys, "--no-calibration")
    assert len(taken) == 2 and doc["compute"]["disturbed"] is False
    assert not any("disturbed" in n for n in doc["notes"])
    # a steady one is measured once
    taken = stand_in_probe(monkeypatch, [0.02], spreads=(0.05,))
    plan_digits_on_two(lab, capsys, "--no-calibration")
    assert len(taken) == 1


def test_a_calibration_faster_than_the_compute_figure_wins_and_is_reported(lab, capsys, monkeypatch):
    """A probe slower than the whole measured step (a busy head node): the measured step is the better
    evidence, and the plan says the figure was too slow."""
    from dscluster.runmodel import predicted

    stand_in_probe(monkeypatch, [0.5])
    first = plan_digits_on_two(lab, capsys)
    k = predicted.key(model=first["model"], micro_batch=32, global_batch=64, precision=first["precision"],
                      compression="powersgd", ranks=2)
    predicted.record(predicted.compare(k, 64 / 0.05), model=first["model"], precision=first["precision"],
                     compression="powersgd", ranks=2, global_batch=64, run_id="psgd")  # 50 ms a step
    again = plan_digits_on_two(lab, capsys)
    assert again["prediction"]["step_s"] == pytest.approx(0.05) and again["prediction"]["compute_s"] == 0.5
    assert any("less than the 500.0 ms of compute the compute figure (0.5000 s a micro-batch) gives alone" in n
               for n in again["notes"])


def test_with_a_target_accuracy_the_recommendation_keeps_the_configs_global_batch(lab, capsys):
    """Measured on two H100 nodes at 10 Gbit: plan's pasted global_batch=2048 (4× the preset's) gave 152
    optimizer steps in 8 epochs under a 200-step warm-up and 11% held-out accuracy where one GPU alone
    reached 94%. With target_accuracy set, plan only changes what keeps the optimisation."""
    assert run_plan(lab, "--compute-s", "0.0427", "--busbw", "0.119", "--json", "data.dataset=fractal",
                    "target_accuracy=0.9") == 0
    doc = json.loads(capsys.readouterr().out)
    rec = doc["recommendation"]
    weighed = [o for o in [rec["choice"], *rec["untested"], *rec["left_out"]] if o]
    assert all(o["global_batch"] == 512 for o in weighed) and rec["max_global_batch"] == 512
    assert rec["judged_by"] == "whole run"  # no recorded curve of this run: judged by its whole run
    assert any("target_accuracy is set" in n and "--max-global-batch" in n for n in doc["notes"])
    # the user may allow a larger batch, as the note says
    assert run_plan(lab, "--compute-s", "0.0427", "--busbw", "0.119", "--json", "--max-global-batch", "4096",
                    "data.dataset=fractal", "target_accuracy=0.9") == 0
    assert json.loads(capsys.readouterr().out)["recommendation"]["max_global_batch"] == 4096


def test_each_node_alone_is_priced_at_its_own_micro_batch_on_a_gpu_measured_here(lab, capsys, monkeypatch):
    """A node alone splits the global batch over its own ranks (micro_batch auto), and a GPU is faster
    per image at a larger batch: on the 4×H100 lab, plan priced node1 alone at the lab's micro-batch
    (5,665 img/s) where it trained at 512 and ran 8,164."""
    taken = stand_in_probe(monkeypatch, [0.0136], device="cuda (Stand-in H100)", per_sample=0.00007)
    doc = plan_digits_on_two(lab, capsys, "--probe-here")
    assert taken == [32, 64]  # the lab's micro-batch (64 ÷ 2 ranks), then each node's alone (64 ÷ 1), once
    alone_s = 0.0136 + 0.00007 * 64
    assert doc["compute"]["nodes"]["node1"]["alone_micro"] == 64
    assert doc["compute"]["nodes"]["node1"]["alone_seconds"] == pytest.approx(alone_s)
    assert (doc["nodes"][0]["alone_micro"], doc["nodes"][0]["alone_compute_s"]) == (64, pytest.approx(alone_s))
    p = doc["prediction"]
    assert p["node_images_per_s"] == pytest.approx({"node1": 64 / alone_s, "node2": 64 / alone_s})
    assert p["speedup"] == pytest.approx(p["images_per_s"] / (64 / alone_s))
    assert p["speedup"] < p["images_per_s"] / (32 / (0.0136 + 0.00007 * 32))  # less flattering than before
    # cached as the lab's figure is: the next plan measures nothing, and says at which micro-batch
    (lab / "two.txt").write_text("node1 slots=1\nnode2 slots=1\n")
    assert main(["plan", "--config", str(REPO / "configs/digits.yaml"), "--hostfile", str(lab / "two.txt"),
                 "--busbw", "1", "--probe-here", "comm.compression=powersgd", "global_batch=64"]) == 0
    assert taken == [32, 64]
    assert f"each node alone, img/s: node1 {64 / alone_s:,.0f} (micro 64)" in " ".join(capsys.readouterr().out.split())


def test_a_cpu_probe_measures_once_and_scales_each_node_alone(lab, capsys, monkeypatch):
    """CI's CPU machine: the plan takes no longer; a node alone is the lab's figure scaled, as before."""
    taken = stand_in_probe(monkeypatch, [0.02])
    doc = plan_digits_on_two(lab, capsys, "--probe-here")
    assert taken == [32] and "nodes" not in doc["compute"]
    assert doc["prediction"]["node_images_per_s"] == {"node1": 32 / 0.02, "node2": 32 / 0.02}
    assert doc["nodes"][0]["alone_micro"] is None


def test_each_nodes_probe_is_asked_for_its_micro_batch_alone(lab, capsys, monkeypatch):
    """The per-node probes (plan/nodes.py), SSH stood in: the probe's line as a GPU node prints it, with
    the lab's figures (fractal ViT-S fp16 on H100: 0.0226 s at 128, node1 alone 8,164 img/s at 512, a
    probe at 256 0.0316 s)."""
    from dscluster.plan import nodes

    asked = []

    def over_ssh(hostfile, config, overrides, micro, precision, *, only, alone, **kw):
        asked.append((micro, alone))
        line = nodes.parse_node_output(json.dumps({"seconds": 0.0226, "device": "cuda (H100)", "alone": [
            {"micro": 512, "seconds": 512 / 8164}, {"micro": 256, "seconds": 0.0316}]}), "node1")
        return {n: nodes.member_figure(line, "node1", alone.get(n)) for n in only}, {}

    monkeypatch.setattr(nodes, "measure_nodes", over_ssh)
    args = ("--busbw", "1.19", "--powersgd-s", "0.01", "precision=fp16")
    assert run_plan(lab, "--json", *args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert asked == [(128, {"node1": 512, "node2": 512, "node3": 256})]  # global batch 512 over 1, 1 and 2 ranks
    assert doc["compute"]["nodes"]["node3"]["alone_micro"] == 256
    assert doc["prediction"]["node_images_per_s"] == pytest.approx({"node1": 8164, "node2": 8164,
                                                                    "node3": 2 * 256 / 0.0316})
    assert doc["prediction"]["fastest_node"] == "node3"
    # each node's figure alone is cached with it
    assert run_plan(lab, *args) == 0 and len(asked) == 1
    assert "node3 16,203 (micro 256)" in " ".join(capsys.readouterr().out.split())


def test_the_fastest_node_alones_time_to_accuracy_is_priced_at_its_own_micro_batch(lab, capsys, monkeypatch):
    """runmodel/accuracy.py prices the fastest node alone with the whole-run model at the step its figure
    alone gives (global batch ÷ its img/s at its own micro-batch)."""
    from dataclasses import replace

    from dscluster.plan import nodes
    from dscluster.runmodel import accuracy, phases

    def over_ssh(hostfile, config, overrides, micro, precision, *, only, alone, **kw):
        line = {"seconds": 0.0226, "device": "cuda (H100)", "alone": [{"micro": 256, "seconds": 0.0316}]}
        return {n: nodes.member_figure(line, "node1", alone.get(n)) for n in only}, {}

    monkeypatch.setattr(nodes, "measure_nodes", over_ssh)
    assert main(["plan", "--config", str(REPO / "configs/vit_small_fractal.yaml"), "--hostfile", str(lab / "hosts.txt"),
                 "--busbw", "1.19", "--powersgd-s", "0.01", "--json", "precision=fp16", "epochs=8",
                 "data.cache=true"]) == 0  # cached: no loader bounds a step on this machine
    doc = json.loads(capsys.readouterr().out)
    alone = doc["time_to_accuracy"]["runs"]["alone"]
    assert alone["node"] == "node3"
    assert doc["prediction"]["node_images_per_s"]["node3"] == pytest.approx(2 * 256 / 0.0316)
    step_s = 512 / (2 * 256 / 0.0316)  # node3's step alone: two micro-batches of 256 at once
    costs = replace(phases.RunCosts(**doc["runs"]["now"]["costs"]), plain_step_s=step_s, step_s=step_s, start_step=None)
    assert doc["runs"]["alone"]["costs"] == costs.to_dict()  # the node alone's run, as the advice judges it
    assert alone["seconds"] == pytest.approx(accuracy.seconds_to(costs, alone["step"], epochs=8, max_steps=0), abs=0.1)
