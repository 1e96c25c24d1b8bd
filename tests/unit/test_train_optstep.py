"""The optimizer-step boundary: dscluster's own gradient clipping on a real DeepSpeed engine (CPU, gloo)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from dscluster.core.config import load_config
from dscluster.core.dist import ensure_single_process_group
from dscluster.core.ds_config import build_ds_config
from dscluster.core.optstep import StepBoundary, decode, dscluster_clips
from dscluster.core.shape import plan_batch


@pytest.fixture(scope="module")
def one_rank_group():
    ensure_single_process_group()


def _engine(model, cfg, micro):
    import deepspeed

    ds = build_ds_config(cfg, plan_batch(micro, 1, None, 1), "fp32", on_gpu=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds, dist_init_required=False)
    return engine, ds


@pytest.mark.parametrize("clip", [0.05, 0.0])
def test_clipped_step_equals_torch_clip_and_the_norm_comes_back(one_rank_group, clip):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    reference = copy.deepcopy(model)
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    cfg = load_config(None, ["precision=fp32", f"optim.grad_clip={clip}"])
    engine, ds = _engine(model, cfg, 16)
    assert dscluster_clips(cfg, "fp32") and ds["gradient_clipping"] == 0.0  # DeepSpeed does not clip here

    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    torch.nn.functional.cross_entropy(reference(x), y).backward()
    ref_norm = float(torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]))
    if clip:
        torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
    ref_opt.step()

    boundary = StepBoundary(engine, cfg, "fp32")
    engine.backward(torch.nn.functional.cross_entropy(engine(x), y))
    boundary.before_step(want_norm=True)
    engine.step()
    norm, scale, overflow = decode(boundary.after_step().tolist())

    assert ref_norm > 0.05 * 4  # the clip really bites in the clipped case
    assert norm == pytest.approx(ref_norm, rel=1e-6)
    assert scale is None and overflow is False  # no loss scaling in fp32
    for p, q in zip(engine.module.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_a_fused_optimizer_clips_inside_its_kernel_with_the_same_update(one_rank_group):
    """torch's fused AdamW (the GPU default; fused also runs on CPU) takes the clip divisor as its
    grad_scale: three clipped steps land where clip_grad_norm_ + a plain AdamW puts them."""
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    reference = copy.deepcopy(model)
    cfg = load_config(None, ["precision=fp32", "optim.grad_clip=0.05"])
    ds = build_ds_config(cfg, plan_batch(16, 1, None, 1), "fp32", on_gpu=False)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds, dist_init_required=False)
    boundary = StepBoundary(engine, cfg, "fp32")
    assert boundary.fused_clip
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01, foreach=False)
    for _step in range(3):
        x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
        ref_opt.zero_grad()
        torch.nn.functional.cross_entropy(reference(x), y).backward()
        ref_norm = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05))
        ref_opt.step()
        engine.backward(torch.nn.functional.cross_entropy(engine(x), y))
        boundary.before_step(want_norm=False)  # the clip needs the norm on every step anyway
        engine.step()
        norm, _, _ = decode(boundary.after_step().tolist())
        assert ref_norm > 0.05 * 4 and norm == pytest.approx(ref_norm, rel=1e-5)
        assert not hasattr(opt, "grad_scale")  # never left over for a step it was not computed for
        for p, q in zip(engine.module.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_no_norm_is_computed_off_the_log_steps_when_nothing_clips(one_rank_group):
    model = torch.nn.Linear(4, 2)
    cfg = load_config(None, ["precision=fp32", "optim.grad_clip=0"])
    engine, _ = _engine(model, cfg, 4)
    boundary = StepBoundary(engine, cfg, "fp32")
    engine.backward(engine(torch.randn(4, 4)).sum())
    boundary.before_step(want_norm=False)
    engine.step()
    norm, _, _ = decode(boundary.after_step().tolist())
    assert norm is None


def test_decode_reads_an_overflow_from_a_lowered_scale():
    assert decode([1.5, 1024.0, 512.0]) == (1.5, 1024.0, True)
    assert decode([1.5, 1024.0, 2048.0]) == (1.5, 1024.0, False)   # grown after a clean window
    assert decode([math.nan, 1024.0, 1024.0]) == (None, 1024.0, False)
    assert decode([2.0, math.nan, math.nan]) == (2.0, None, False)  # no GradScaler: host scale or none


def test_fp16_amp_skips_an_overflowing_step_halves_the_scale_and_checkpoints_it(one_rank_group):
    """fp16 on ZeRO-0 runs through DeepSpeed's torch_autocast with torch's GradScaler (here on CPU,
    where autocast and GradScaler also work): an overflow leaves the weights alone, halves the scale,
    and is read back as an overflow step; the scale travels with the checkpoint."""
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    cfg = load_config(None, ["fp16.initial_scale_power=8", "optim.grad_clip=1.0"])
    ds = build_ds_config(cfg, plan_batch(16, 1, None, 1), "fp16", on_gpu=False)
    assert ds["torch_autocast"]["dtype"] == "float16" and "fp16" not in ds
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                                           config=ds, dist_init_required=False)
    boundary = StepBoundary(engine, cfg, "fp16")
    assert boundary.device_scale and engine.torch_autocast_z0_gradscaler is boundary.scaler
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))

    def step(factor: float):
        engine.backward(torch.nn.functional.cross_entropy(engine(x).float(), y) * factor)
        boundary.before_step(want_norm=True)
        engine.step()
        return decode(boundary.after_step().tolist())

    before = [p.detach().clone() for p in engine.module.parameters()]
    norm, scale, overflow = step(1.0)
    assert (scale, overflow) == (256.0, False) and 0 < norm < float("inf")
    assert any(not torch.equal(p, q) for p, q in zip(engine.module.parameters(), before, strict=True))

    before = [p.detach().clone() for p in engine.module.parameters()]
    norm, scale, overflow = step(float("inf"))  # every gradient inf: the step must be skipped
    assert (scale, overflow) == (256.0, True)
    assert all(torch.equal(p, q) for p, q in zip(engine.module.parameters(), before, strict=True))
    assert boundary.scaler.get_scale() == 128.0

    saved = boundary.state_dict()
    fresh = StepBoundary(engine, cfg, "fp16")
    assert fresh.scaler.get_scale() == 256.0
    fresh.load_state_dict(saved)
    assert fresh.scaler.get_scale() == 128.0
