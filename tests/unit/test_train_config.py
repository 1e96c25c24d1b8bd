"""Training config: YAML with line-numbered errors, typed overrides, batch arithmetic."""

from pathlib import Path

import pytest
import torch

from dscluster.core.config import load_config, to_yaml
from dscluster.core.ds_config import build_ds_config
from dscluster.core.shape import plan_batch
from dscluster.errors import UsageError

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_unknown_key_names_file_line_and_valid_keys(tmp_path):
    p = write(tmp_path, "epochs: 3\noptim:\n  lr: 0.001\n  learning_rate: 0.1\n")
    with pytest.raises(UsageError) as e:
        load_config(p)
    msg = str(e.value)
    assert f"{p}:4:" in msg and "'optim.learning_rate'" in msg
    assert "lr, lr_reference_batch, weight_decay" in msg


def test_bad_type_names_line(tmp_path):
    p = write(tmp_path, "model:\n  depth: 4\nepochs: many\n")
    with pytest.raises(UsageError, match=r"c\.yaml:3: epochs must be a whole number"):
        load_config(p)


def test_bad_choice_and_yaml_syntax(tmp_path):
    with pytest.raises(UsageError, match=r":1: precision must be one of auto, bf16, fp16, fp32"):
        load_config(write(tmp_path, "precision: fp8\n"))
    with pytest.raises(UsageError, match=r"c\.yaml:2: not valid YAML"):
        load_config(write(tmp_path, "epochs: 3\n  bad: [\n"))


def test_overrides_are_typed_and_dotted(tmp_path):
    cfg = load_config(write(tmp_path, "epochs: 3\n"), ["optim.lr=3e-4", "epochs=7", "compile=true",
                                                       "shares=[5, 11, 16]", "micro_batch=auto"])
    assert cfg.optim.lr == pytest.approx(3e-4) and cfg.epochs == 7 and cfg.compile == "true"
    assert cfg.shares == [5, 11, 16] and cfg.micro_batch == "auto"
    with pytest.raises(UsageError, match="override 'optim.lrr=1': unknown key 'optim.lrr'; valid keys in optim"):
        load_config(None, ["optim.lrr=1"])
    with pytest.raises(UsageError, match="override 'epochs=two'"):
        load_config(None, ["epochs=two"])
    with pytest.raises(UsageError, match="expected key=value"):
        load_config(None, ["epochs"])


def test_presets_load_and_resolved_config_round_trips(tmp_path):
    for preset in ("digits", "vit_tiny", "vit_small", "vit_base", "bench_vit_base"):
        cfg = load_config(ROOT / "configs" / f"{preset}.yaml")
        again = write(tmp_path, to_yaml(cfg))
        assert load_config(again) == cfg


def test_batch_arithmetic():
    assert plan_batch(32, None, None, 2).global_batch == 64
    p = plan_batch(16, None, 256, 4)
    assert (p.micro_batch, p.grad_accum, p.global_batch) == (16, 4, 256)
    with pytest.raises(UsageError, match=r"global_batch=100 is not a multiple of micro_batch × world = 16 × 4 = 64"):
        plan_batch(16, None, 100, 4)
    with pytest.raises(UsageError, match=r"16 × 2 × 4 = 128"):
        plan_batch(16, 2, 256, 4)


def test_ds_config_per_precision():
    cfg = load_config(None, ["fp16.initial_scale_power=12", "zero_stage=2"])
    plan = plan_batch(8, 2, None, 3)
    ds = build_ds_config(cfg, plan, "fp16", on_gpu=True)
    assert ds["train_batch_size"] == 48 and ds["gradient_accumulation_steps"] == 2
    assert ds["fp16"]["initial_scale_power"] == 12 and ds["fp16"]["loss_scale"] == 0
    assert ds["zero_optimization"]["stage"] == 2 and ds["zero_optimization"]["overlap_comm"] is True
    assert "fp16" not in build_ds_config(cfg, plan, "bf16", on_gpu=True)
    # bf16 defaults to amp (DeepSpeed's torch_autocast); amp=false gives bf16 weights
    assert build_ds_config(cfg, plan, "bf16", on_gpu=True)["torch_autocast"]["dtype"] == "bfloat16"
    weights = load_config(None, ["amp=false"])
    assert build_ds_config(weights, plan, "bf16", on_gpu=True)["bf16"] == {"enabled": True}
    fp32 = build_ds_config(load_config(None), plan, "fp32", on_gpu=False)
    assert "fp16" not in fp32 and "bf16" not in fp32


def test_amp_bf16_uses_deepspeed_torch_autocast_with_fp32_weights():
    cfg = load_config(None, ["amp=true"])
    plan = plan_batch(16, 1, None, 2)
    ds = build_ds_config(cfg, plan, "bf16", on_gpu=True)
    assert ds["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"}
    assert "bf16" not in ds and "fp16" not in ds
    # dscluster clips the fp32 parameters itself; DeepSpeed's clip (per-parameter kernels, host syncs) is off
    assert ds["gradient_clipping"] == 0.0 and ds["timers"]["throughput"]["enabled"] is False


def test_fp16_amp_on_zero0_uses_torch_autocast_and_deepspeed_fp16_elsewhere():
    plan = plan_batch(16, 1, None, 2)
    amp = build_ds_config(load_config(None, ["amp=true"]), plan, "fp16", on_gpu=True)
    assert amp["torch_autocast"] == {"enabled": True, "dtype": "float16"} and "fp16" not in amp
    assert amp["gradient_clipping"] == 0.0
    # ZeRO 1/2 and amp=false: DeepSpeed's fp16 optimizer with its dynamic scaler, and DeepSpeed clips
    for over in (["zero_stage=1"], ["amp=false"]):
        ds = build_ds_config(load_config(None, over + ["optim.grad_clip=0.5"]), plan, "fp16", on_gpu=True)
        assert "torch_autocast" not in ds and ds["fp16"]["enabled"] is True
        assert ds["gradient_clipping"] == 0.5
    # bf16 weights: DeepSpeed's bf16 optimizer clips its fp32 master copies
    assert build_ds_config(load_config(None, ["amp=false"]), plan, "bf16", on_gpu=True)["gradient_clipping"] == 1.0


def test_range_errors_name_the_line_or_the_override_that_set_the_value(tmp_path):
    from dscluster.core.config import ConfigValueError

    p = write(tmp_path, "seed: 1\ndata:\n  holdout_fraction: 1.5\nepochs: 3\n")
    with pytest.raises(ConfigValueError) as e:
        load_config(p)
    assert str(e.value).startswith(f"{p}:3: data.holdout_fraction must be greater than 0 and less than 1, got 1.5")
    assert e.value.key == "data.holdout_fraction" and e.value.exit_code == 2
    # an override wins over the file line it replaced
    with pytest.raises(ConfigValueError) as e:
        load_config(p, ["data.holdout_fraction=0.2", "epochs=0"])
    assert str(e.value) == "override 'epochs=0': epochs must be at least 1, got 0; e.g. epochs=20 (the default)"
    # a cross-field rule names whichever of its keys was set
    with pytest.raises(ConfigValueError) as e:
        load_config(write(tmp_path, "model:\n  num_heads: 5\n"))
    assert str(e.value).startswith(f"{p}:2: model.embed_dim=96 does not divide by model.num_heads=5")


def test_ddp_bucket_size_is_checked_and_reaches_ddp(tmp_path):
    from dscluster.core import dist
    from dscluster.core.config import ConfigValueError
    from dscluster.core.setup_engine import wrap_for_overlap

    p = write(tmp_path, "epochs: 1\nddp_bucket_mb: 0\n")
    with pytest.raises(ConfigValueError) as e:
        load_config(p)
    assert str(e.value) == f"{p}:2: ddp_bucket_mb must be at least 1, got 0; e.g. ddp_bucket_mb=100 (the default)"
    assert e.value.exit_code == 2
    assert load_config(None).ddp_bucket_mb == 100
    cfg = load_config(None, ["ddp_bucket_mb=7"])
    dist.ensure_single_process_group()
    ddp = wrap_for_overlap(torch.nn.Linear(4, 4), torch.device("cpu"), cfg.ddp_bucket_mb)
    assert ddp.bucket_bytes_cap == 7 * 1024 * 1024


def test_linear_lr_scaling_with_the_global_batch():
    from dscluster.core.setup_engine import peak_lr

    cfg = load_config(None, ["optim.lr=0.002", "optim.lr_reference_batch=64"])
    assert peak_lr(cfg, 64) == pytest.approx(0.002)
    assert peak_lr(cfg, 96) == pytest.approx(0.003)
    assert peak_lr(load_config(None, ["optim.lr=0.002"]), 96) == pytest.approx(0.002)
    with pytest.raises(UsageError, match="override 'optim.lr_reference_batch=0'"):
        load_config(None, ["optim.lr_reference_batch=0"])


DS_SECTION = """epochs: 3
zero_stage: 2
deepspeed:
  tensorboard: {enabled: true, output_path: tb, job_name: vit}
  zero_optimization:
    round_robin_gradients: true
    reduce_bucket_size: 5000000
  wall_clock_breakdown: true
"""


def test_deepspeed_section_is_merged_last_over_ours(tmp_path):
    cfg = load_config(write(tmp_path, DS_SECTION), ["deepspeed.comms_logger.enabled=true"])
    ds = build_ds_config(cfg, plan_batch(8, 1, None, 2), "fp32", on_gpu=True)
    assert ds == {
        "train_batch_size": 16, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0, "steps_per_print": 10**9, "timers": {"throughput": {"enabled": False}},
        "zero_allow_untested_optimizer": True,
        "wall_clock_breakdown": True,                                       # theirs replaces ours
        "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                              "reduce_bucket_size": 5000000,                # theirs, beside ours
                              "allgather_bucket_size": 200_000_000, "reduce_scatter": True,
                              "round_robin_gradients": True},
        "tensorboard": {"enabled": True, "output_path": "tb", "job_name": "vit"},
        "comms_logger": {"enabled": True},                                  # from the override
    }
    # the resolved config keeps the section as given, and loads again to the same config
    assert load_config(write(tmp_path, to_yaml(cfg))) == cfg
    assert "offload_optimizer" not in build_ds_config(load_config(None), plan_batch(8, 1, None, 2), "fp32",
                                                      on_gpu=True)["zero_optimization"]


@pytest.mark.parametrize("text, key, instead", [
    ("deepspeed:\n  train_micro_batch_size_per_gpu: 4\n", "deepspeed.train_micro_batch_size_per_gpu", "micro_batch"),
    ("deepspeed:\n  zero_optimization: {stage: 3}\n", "deepspeed.zero_optimization.stage", "zero_stage"),
    ("deepspeed:\n  bf16: {enabled: true}\n", "deepspeed.bf16", "precision=bf16"),
    ("deepspeed:\n  gradient_clipping: 0.5\n", "deepspeed.gradient_clipping", "optim.grad_clip"),
])
def test_deepspeed_section_refuses_what_dscluster_derives(tmp_path, text, key, instead):
    p = write(tmp_path, "epochs: 3\n" + text)
    with pytest.raises(UsageError) as e:
        load_config(p)
    assert str(e.value).startswith(f"{p}:2: {key} is set by dscluster from {instead}")


def test_deepspeed_section_refuses_typos_and_non_mappings(tmp_path):
    with pytest.raises(UsageError,
                       match=r"c\.yaml:2: deepspeed\.tensorbaord is not a DeepSpeed config key .*tensorboard"):
        load_config(write(tmp_path, "epochs: 3\ndeepspeed:\n  tensorbaord: {enabled: true}\n"))
    with pytest.raises(UsageError, match=r"override 'deepspeed.wandbb.enabled=true': deepspeed\.wandbb is not"):
        load_config(None, ["deepspeed.wandbb.enabled=true"])
    with pytest.raises(UsageError, match=r"c\.yaml:1: deepspeed must be .*mapping"):
        load_config(write(tmp_path, "deepspeed: [1, 2]\n"))
    with pytest.raises(UsageError, match=r"deepspeed\.tensorboard is True, not a mapping"):
        load_config(None, ["deepspeed.tensorboard=true", "deepspeed.tensorboard.enabled=true"])
    assert load_config(None, ["deepspeed=null"]).deepspeed is None
