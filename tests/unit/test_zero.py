"""ZeRO stage 3 and ZeRO-Offload of the optimizer: the keys, what they map to in DeepSpeed's config, what
is refused before anything starts, and an offloaded optimizer that steps like torch's AdamW.

Multi-rank training, held-out evaluation and resume under ZeRO-3 run for real in
tests/cluster/test_zero_local.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from _childenv import RANK_VARS
from dscluster.core.config import ConfigValueError, load_config
from dscluster.core.ds_config import build_ds_config
from dscluster.core.shape import plan_batch

ISOLATE = ("DSCLUSTER_RUNS", "DSCLUSTER_RUN_ID", "DSCLUSTER_STATE", *RANK_VARS, "DSCLUSTER_FAULT")


def test_zero_stage_3_loads_and_partitions_with_deepspeeds_stage_3():
    cfg = load_config(None, ["zero_stage=3"])
    ds = build_ds_config(cfg, plan_batch(8, 1, None, 2), "fp32", on_gpu=True)["zero_optimization"]
    assert ds["stage"] == 3 and ds["overlap_comm"] is True and "offload_optimizer" not in ds
    with pytest.raises(ConfigValueError, match=r"zero_stage must be one of 0, 1, 2, 3; got 4"):
        load_config(None, ["zero_stage=4"])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_moves_the_optimizer_to_pinned_host_memory(stage):
    cfg = load_config(None, [f"zero_stage={stage}", "offload_optimizer=cpu"])
    plan = plan_batch(8, 1, None, 2)
    on_gpu = build_ds_config(cfg, plan, "fp16", on_gpu=True)
    assert on_gpu["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert on_gpu["fp16"]["enabled"] is True  # DeepSpeed's fp16 optimizer: ZeRO has no GradScaler
    # a CPU rank has nothing to pin for
    assert build_ds_config(cfg, plan, "fp32", on_gpu=False)["zero_optimization"]["offload_optimizer"] == {
        "device": "cpu", "pin_memory": False}


@pytest.mark.parametrize("overrides, message", [
    (["offload_optimizer=cpu"],
     "override 'offload_optimizer=cpu': offload_optimizer=cpu needs zero_stage 1, 2 or 3"),
    (["zero_stage=2", "offload_optimizer=cpu", "optim.fused=true"],
     "override 'optim.fused=true': optim.fused=true asks for torch's fused AdamW on the GPU, but with "
     "offload_optimizer=cpu DeepSpeed's CPUAdam steps on the CPU"),
    (["zero_stage=2", "deepspeed.zero_optimization.offload_optimizer.device=cpu"],
     "override 'deepspeed.zero_optimization.offload_optimizer.device=cpu': deepspeed.zero_optimization."
     "offload_optimizer.device is set by dscluster from offload_optimizer"),
])
def test_what_offload_cannot_do_is_refused_naming_the_key_and_the_fix(overrides, message):
    with pytest.raises(ConfigValueError) as e:
        load_config(None, overrides)
    assert str(e.value).startswith(message) and e.value.exit_code == 2
    assert "set " in str(e.value)


def test_the_command_refuses_offload_without_zero_before_writing_anything(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ISOLATE}
    env.update(HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1")
    (tmp_path / "home").mkdir()
    p = subprocess.run([sys.executable, "-m", "dscluster", "train", "offload_optimizer=cpu"], cwd=tmp_path, env=env,
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=240)
    out = p.stderr + p.stdout
    assert p.returncode == 2 and "offload_optimizer=cpu needs zero_stage 1, 2 or 3" in out, out
    assert "zero_stage=2" in out and "Traceback" not in out
    assert sorted(q.name for q in tmp_path.iterdir()) == ["home"] and not any((tmp_path / "home").iterdir())


@pytest.mark.slow  # the first run compiles DeepSpeed's CPUAdam op (minutes on 2 cores), later runs load it
def test_offloaded_optimizer_steps_like_torch_adamw():
    """ZeRO-3 with offload_optimizer=cpu, one rank: the engine dscluster builds (its DeepSpeed config, its
    CPUAdam in AdamW mode with training's parameter groups and schedule) moves the weights as torch's
    AdamW does on the same groups, step after step."""
    import copy

    import deepspeed

    from dscluster.core.dist import ensure_single_process_group
    from dscluster.core.setup_engine import make_optimizer, param_groups

    ensure_single_process_group()
    cfg = load_config(None, ["zero_stage=3", "offload_optimizer=cpu", "optim.grad_clip=0", "optim.lr=0.01",
                             "deepspeed.zero_optimization.stage3_param_persistence_threshold=0"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.LayerNorm(16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 3))
    reference = copy.deepcopy(model)
    opt = make_optimizer(cfg, model, cfg.optim.lr, torch.device("cpu"))
    assert type(opt).__name__ == "DeepSpeedCPUAdam"
    ds = build_ds_config(cfg, plan_batch(16, 1, None, 1), "fp32", on_gpu=False)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds, dist_init_required=False)
    ref_opt = torch.optim.AdamW(param_groups(reference, cfg.optim.weight_decay), lr=cfg.optim.lr,
                                betas=tuple(cfg.optim.betas), eps=cfg.optim.eps)
    for step in range(3):
        x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
        engine.backward(torch.nn.functional.cross_entropy(engine(x), y))
        engine.step()
        ref_opt.zero_grad()
        torch.nn.functional.cross_entropy(reference(x), y).backward()
        ref_opt.step()
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            for p, q in zip(engine.module.parameters(), reference.parameters(), strict=True):
                torch.testing.assert_close(p.detach().clone(), q.detach(), rtol=1e-5, atol=1e-6,
                                           msg=f"step {step + 1}")
