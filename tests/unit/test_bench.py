"""Bench harness: command builders (exact argv), run-directory figures, naming, FLOP maths."""

import argparse
import json
import sys

import pytest

from dscluster.bench import mixed, runner, vit
from dscluster.bench.models import model_spec, peak_bf16_flops
from dscluster.cli.bench import _gpu_counts
from dscluster.errors import UsageError
from dscluster.files.fsutil import JsonlWriter


def test_gpu_counts_n_means_the_whole_scaling_curve():
    assert _gpu_counts("4") == [1, 2, 3, 4]
    assert _gpu_counts("1,4") == [1, 4]
    with pytest.raises(argparse.ArgumentTypeError):
        _gpu_counts("four")
    with pytest.raises(argparse.ArgumentTypeError):
        _gpu_counts("0")


def test_vit_b16_costs_105_gflops_per_trained_image_and_h100_peak_is_known():
    assert model_spec("vit_base_patch16_224").train_flops_per_image == 105e9
    assert peak_bf16_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_bf16_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_bf16_flops("NVIDIA H200") == 989e12
    assert peak_bf16_flops("NVIDIA GeForce RTX 3070") is None


@pytest.mark.parametrize("model", ["tiny", "vit_base_patch16_224"])
def test_bench_overrides_are_valid_dscluster_train_keys(model):
    """The bench drives `dscluster train` only through its public keys; a renamed key fails here."""
    from dscluster.core.config import load_config

    opts = vit.VitBenchOptions(model=model, micro_batch="auto", memory_cap_gb=8, compile=True, zero=1)
    cfg = load_config(None, vit.train_overrides(opts))
    assert cfg.data.dataset == "synthetic"
    assert cfg.micro_batch == "auto" and cfg.memory_cap_gb == 8 and cfg.compile == "true" and cfg.zero_stage == 1
    assert cfg.max_steps == opts.warmup + opts.steps
    bal = load_config(None, mixed.train_overrides(mixed.MixedBenchOptions(model=model), "balanced"))
    assert bal.batching == "balanced"


def test_memory_cap_uniform_run_fits_the_small_card_and_keeps_the_global_batch():
    """Uniform batching beside an 8 GB rank: auto-fit to it, same global batch as the balanced run."""
    from dscluster.core.config import load_config

    opts = mixed.MixedBenchOptions(gpus=4, micro_batch=128, memory_cap_gb=8, scenarios=["memory-cap"])
    uni = load_config(None, mixed.train_overrides(opts, "uniform", "memory-cap"))
    bal = load_config(None, mixed.train_overrides(opts, "balanced", "memory-cap"))
    assert uni.micro_batch == "auto" and uni.global_batch == 4 * 128
    assert bal.micro_batch == 128 and bal.global_batch is None  # shares sum to 4 × 128, each within its fit
    busy = load_config(None, mixed.train_overrides(opts, "uniform", "busy-gpu"))
    assert busy.micro_batch == 128


def test_ds_command_is_torchrun_on_dscluster_train():
    opts = vit.VitBenchOptions(model="tiny", steps=3, warmup=1, config="configs/bench.yaml")
    argv = vit.ds_command(opts, 2, 29999)
    assert argv[:12] == [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                         "--master-addr", "127.0.0.1", "--master-port", "29999", "-m"]
    assert argv[12:16] == ["dscluster", "train", "--config", "configs/bench.yaml"]
    assert "max_steps=4" in argv


def test_baseline_command_uses_the_same_model_and_batch(tmp_path):
    opts = vit.VitBenchOptions(model="vit_base_patch16_224", steps=20, warmup=5, memory_cap_gb=8)
    argv = vit.baseline_command(opts, 4, 192, tmp_path / "b.json", 30001)
    tail = argv[argv.index("-m", 3) + 1:]
    assert tail == ["dscluster.bench.ddp_baseline", "--model", "vit_base_patch16_224", "--micro-batch", "192",
                    "--steps", "20", "--warmup", "5", "--precision", "bf16", "--device", "cuda",
                    "--out", str(tmp_path / "b.json"), "--compile", "--memory-cap-gb", "8"]
    assert "--nproc-per-node" in argv and argv[argv.index("--nproc-per-node") + 1] == "4"


def test_memory_cap_scenario_caps_only_one_rank_through_an_mpmd_context(monkeypatch):
    monkeypatch.setattr(runner, "is_root", lambda: True)
    opts = mixed.MixedBenchOptions(model="tiny", gpus=4, memory_cap_gb=8, capped_rank=0,
                                   scenarios=["memory-cap"])
    argv, env = mixed.command(opts, "memory-cap", "balanced", 31000)
    assert "--allow-run-as-root" in argv
    assert env == {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    blocks = " ".join(argv).split(" : ")
    assert len(blocks) == 2
    assert "-np 1 " in blocks[0] and "memory_cap_gb=8" in blocks[0]
    assert "-np 3 " in blocks[1] and "memory_cap_gb" not in blocks[1]
    assert all("batching=balanced" in b and "MASTER_PORT=31000" in b for b in blocks)


def test_share_scenario_on_cpu_runs_more_ranks_than_devices(monkeypatch):
    monkeypatch.setattr(runner, "is_root", lambda: False)
    opts = mixed.MixedBenchOptions(ranks=5, gpus=1, device="cpu", scenarios=["share-gpu"])
    mixed.validate(opts, None)
    argv, env = mixed.command(opts, "share-gpu", "uniform", 31001)
    assert "--allow-run-as-root" not in argv
    assert argv[argv.index("-np") + 1] == "5" and ":" not in argv
    assert env == {}


def test_two_ranks_on_one_gpu_is_refused_with_the_alternative():
    # NCCL rejects two ranks of one communicator on one GPU ("Duplicate GPU detected").
    with pytest.raises(UsageError, match="busy-gpu"):
        mixed.validate(mixed.MixedBenchOptions(ranks=5, gpus=4, scenarios=["share-gpu"]), device_count=4)


def test_busy_gpu_scenario_is_one_rank_per_gpu(monkeypatch):
    monkeypatch.setattr(runner, "is_root", lambda: True)
    opts = mixed.MixedBenchOptions(gpus=4)
    mixed.validate(opts, device_count=4)
    argv, env = mixed.command(opts, "busy-gpu", "balanced", 31002)
    assert argv[argv.index("-np") + 1] == "4" and env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"


def test_validation_names_the_fix():
    with pytest.raises(UsageError, match="has 2 GPU"):
        vit.validate(vit.VitBenchOptions(gpu_counts=[1, 4]), device_count=2)
    with pytest.raises(UsageError, match="auto"):
        vit.validate(vit.VitBenchOptions(micro_batch="big"), device_count=8)
    with pytest.raises(UsageError, match="--memory-cap-gb"):
        mixed.validate(mixed.MixedBenchOptions(scenarios=["memory-cap"]), device_count=4)


def test_repeats_report_the_median_run_and_never_hide_a_failure():
    runs = [{"status": "complete", "images_per_s": v, "run": i} for i, v in enumerate([3390.0, 3350.0, 3420.0])]
    med = vit.median_run(runs)
    assert (med["images_per_s"], med["run"], med["repeats"]) == (3390.0, 0, [3390.0, 3350.0, 3420.0])
    assert vit.median_run(runs[:2])["images_per_s"] == 3350.0  # even count: the lower middle, not a flattering mean
    failed = vit.median_run(runs + [{"status": "failed", "images_per_s": None, "error": "OOM"}])
    assert failed["status"] == "failed" and failed["error"] == "OOM"
    assert "repeats" not in vit.median_run(runs[:1])
    with pytest.raises(UsageError, match="--repeat"):
        vit.validate(vit.VitBenchOptions(repeat=0), device_count=1)



def test_repeats_alternate_the_two_paths_and_keep_every_pair(tmp_path, monkeypatch):
    # --repeat 2 on one GPU count: dscluster, baseline, dscluster, baseline (a drift of the host hits both alike),
    # each its own run directory or result file; the median run of each path and both pairs' ratios are reported.
    # The processes themselves run in unit/test_bench_cpu.py (one repeat there).
    calls = []

    def ds_run(opts, gpus, work, run_id):
        calls.append(run_id)
        return {"status": "complete", "images_per_s": {"ds-g1": 120.0, "ds-g1-r2": 100.0}[run_id], "micro_batch": 8}

    def baseline_run(opts, gpus, micro, work, name):
        calls.append(f"{name}@{micro}")
        return {"status": "complete", "images_per_s": {"baseline-g1": 150.0, "baseline-g1-r2": 125.0}[name]}

    monkeypatch.setattr(vit, "_ds_run", ds_run)
    monkeypatch.setattr(vit, "_baseline_run", baseline_run)
    doc, path = vit.run(vit.VitBenchOptions(model="tiny", device="cpu", repeat=2, out=str(tmp_path / "results"),
                                            work_dir=str(tmp_path / "work")))
    assert calls == ["ds-g1", "baseline-g1@8", "ds-g1-r2", "baseline-g1-r2@8"]
    (row,) = doc["results"]
    assert row["dscluster"]["images_per_s"] == 100.0 and row["dscluster"]["repeats"] == [120.0, 100.0]
    assert row["baseline"]["images_per_s"] == 125.0 and row["baseline"]["repeats"] == [150.0, 125.0]
    assert row["ratios"] == [120.0 / 150.0, 100.0 / 125.0] and row["ratio"] == 100.0 / 125.0
    assert json.loads(path.read_text())["results"] == doc["results"]

def _fake_run(run_dir, step_times, world=2, micro=8, status="complete", summary=None):
    """A run directory as `dscluster train` writes it (metrics contract): step i took step_times[i] s."""
    for rank in range(world):
        with JsonlWriter(run_dir / "metrics" / f"rank-{rank}.jsonl") as w:
            w.write({"kind": "start", "t": 0.0, "rank": rank, "host": "h", "world_size": world, "local_rank": rank,
                     "device": "cpu", "precision": "fp32", "micro_batch": micro, "grad_accum": 1,
                     "global_batch": micro * world, "pid": 1})
            t = 10.0
            for i, step_time in enumerate(step_times, start=1):
                t += step_time
                w.write({"kind": "step", "t": t, "rank": rank, "host": "h", "step": i, "epoch": 0,
                         "loss": 3.0 - 0.1 * i, "lr": 1e-3, "loss_scale": None, "overflow": i == 2,
                         "step_time": step_time, "samples": micro, "samples_per_s": micro / step_time,
                         "grad_norm": None})
            w.write({"kind": "end", "t": t + 1, "rank": rank, "host": "h", "status": status,
                     "error": None, **({"peak_mem_mb": 1000.0 + rank} if rank else {})})
    (run_dir / "summary.json").write_text(json.dumps({"status": status, "error": None, **(summary or {})}))


def test_throughput_without_a_summary_figure_is_the_trainers_definition(tmp_path):
    # A run that ended before rank 0 wrote images_per_s: core/timing.py's rule on the step records,
    # the 5 warm-up steps (slow: compile) left out; steps 6..8 take 0.5 s each for 16 images.
    _fake_run(tmp_path, [3.0, 1.0, 1.0, 1.0, 1.0, 0.5, 0.5, 0.5], status="failed")
    fig = runner.read_train_run(tmp_path)
    assert fig.images_per_s == pytest.approx(16 * 3 / 1.5)
    assert fig.timed_steps == 3
    assert fig.status == "failed" and fig.world_size == 2 and fig.micro_batches == [8, 8]
    assert fig.overflow_steps == 1
    assert fig.peak_mem_mb == 1001.0
    assert fig.final_loss == pytest.approx(2.2)
    assert [s for s, _, _ in fig.losses] == [1, 2, 3, 4, 5, 6, 7, 8]


def test_the_runs_own_figure_is_the_bench_figure(tmp_path):
    _fake_run(tmp_path, [1.0] * 8, summary={"images_per_s": 99.5, "timed_steps": 3})
    fig = runner.read_train_run(tmp_path)
    assert (fig.images_per_s, fig.timed_steps) == (99.5, 3)


def test_loss_curve_is_the_sample_weighted_global_batch_loss():
    recs = [[{"kind": "step", "step": 1, "t": 5.0, "loss": 1.0, "samples": 3}],
            [{"kind": "step", "step": 1, "t": 5.1, "loss": 3.0, "samples": 1}]]
    assert runner.global_losses(recs, 4.0) == [(1, 1.0, 1.5)]


def test_missing_metrics_is_reported_not_crashed(tmp_path):
    fig = runner.read_train_run(tmp_path / "nothing")
    assert fig.images_per_s is None and "no metrics" in fig.error


def test_time_to_loss_uses_a_running_mean():
    losses = [(i, float(i), loss) for i, loss in enumerate([5, 4, 1, 4, 3, 2, 2, 2])]
    assert runner.time_to_loss(losses, 2.5, window=3) == 6.0
    assert runner.time_to_loss(losses, 0.5, window=3) is None


def test_result_files_are_named_by_date_and_device_and_never_overwritten(tmp_path):
    p1 = runner.result_path(tmp_path, "2026-01-02", "NVIDIA H100 80GB HBM3")
    assert p1.name == "2026-01-02-nvidia-h100-80gb-hbm3.json"
    p1.write_text("{}")
    assert runner.result_path(tmp_path, "2026-01-02", "NVIDIA H100 80GB HBM3").name == \
        "2026-01-02-nvidia-h100-80gb-hbm3-2.json"


def test_scaling_efficiency_and_mfu():
    f = vit._rates({"images_per_s": 11600.0}, 4, 3000.0, 105e9, 989e12)
    assert f["images_per_s_per_gpu"] == 2900.0
    assert f["scaling_efficiency"] == pytest.approx(11600 / 12000)
    assert f["mfu"] == pytest.approx(11600 * 105e9 / (4 * 989e12))


def test_balanced_comparison_reports_speedup_and_time_to_common_loss():
    curve = [(i, i * 1.0, 3.0 - 0.05 * i) for i in range(1, 41)]
    fast = [(s, t / 1.3, loss) for s, t, loss in curve]
    runs = {"uniform": ({"images_per_s": 100.0, "smoothed_final_loss": 1.1}, curve),
            "balanced": ({"images_per_s": 130.0, "smoothed_final_loss": 1.1}, fast)}
    out = mixed.compare("share-gpu", (5, 4), runs, None)
    assert out["speedup"] == pytest.approx(1.3)
    assert out["time_to_target_ratio"] == pytest.approx(1.3)
    assert out["loss_curve_max_abs_diff"] == pytest.approx(0.0)


def test_analysis_and_bench_give_one_throughput(tmp_path):
    from dscluster.analysis import load_run
    from dscluster.analysis.stats import summary_row

    _fake_run(tmp_path, [2.0] * 5 + [0.25] * 4, status="failed")
    assert summary_row(load_run(tmp_path))["images_per_s"] == runner.read_train_run(tmp_path).images_per_s == 64.0


def test_bench_log_window_divides_warmup_and_steps():
    assert vit.log_every(vit.VitBenchOptions(warmup=10, steps=30)) == 10
    assert vit.log_every(vit.VitBenchOptions(warmup=1, steps=3)) == 1
    assert vit.log_every(vit.VitBenchOptions(warmup=4, steps=6)) == 2
