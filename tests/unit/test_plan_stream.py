"""plan prices a streamed average (sync.delay_steps τ, sync.compression) and prints the line that trains it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dscluster import core
from dscluster.core import syncmode
from dscluster.plan import evidence, model, recommend
from dscluster.plan.model import Node, Scenario, predict

VIT_S_GRAD_BYTES = 87_000_000
COMPUTE_S = 0.0278


def vit_s_lab(busbw: float, label: str) -> Scenario:
    """Two 1-GPU nodes training the fractal preset: 0.0278 s a micro-batch of 256."""
    return Scenario(nodes=(Node(name="node1", compute_s=COMPUTE_S), Node(name="node2", compute_s=COMPUTE_S)),
                    micro_batch=256, grad_bytes=VIT_S_GRAD_BYTES, busbw_GBps=busbw, compression=label)


def test_a_streamed_average_leaves_the_step_near_compute_where_the_blocking_one_doubles_it():
    blocking = vit_s_lab(0.119, "local_sgd:16")  # 1 Gbit
    assert predict(blocking).step_s >= 2 * COMPUTE_S
    label = model.streamed(blocking)
    delay, wire = core.parse_sync_stream(label)
    assert core.parse_sync_label(label) == ("local_sgd", 16) and 1 <= delay <= 15 and wire == "fp16"
    streamed = predict(replace(blocking, compression=label))
    assert streamed.step_s <= 1.15 * COMPUTE_S
    assert streamed.comm_s == pytest.approx(predict(blocking).comm_s / 2)  # 16 bits: half the bytes


def test_only_what_tau_steps_cannot_hide_is_exposed_amortised_over_h():
    s = vit_s_lab(0.119, "local_sgd:8:3")
    p = predict(s)
    transfer = model.ring_allreduce_s(VIT_S_GRAD_BYTES, 2, 0.119)
    assert p.exposed_s == pytest.approx((transfer - 3 * COMPUTE_S) / 8)
    assert p.step_s == pytest.approx(COMPUTE_S + (transfer - 3 * COMPUTE_S) / 8)


def test_tau_zero_is_priced_as_the_blocking_average():
    for busbw in (1.19, 0.119):
        today = predict(vit_s_lab(busbw, "local_sgd:8"))
        assert predict(vit_s_lab(busbw, "local_sgd:8:0")) == today
        assert today.hidden_s == 0 and today.step_s == pytest.approx(COMPUTE_S + today.comm_s)


def test_the_pasted_line_carries_the_delay_and_the_wire():
    assert core.sync_paste_args("local_sgd:16:14:fp16", "none") == [
        "sync.mode=local_sgd", "sync.period=16", "sync.delay_steps=14", "sync.compression=fp16"]
    assert core.sync_paste_args("local_sgd:8:7", "fp16") == [
        "sync.mode=local_sgd", "sync.period=8", "sync.delay_steps=7", "comm.compression=none"]
    # back to a blocking fp32 average from a config that streams: both keys reset
    assert core.sync_paste_args("local_sgd:8", "local_sgd:8:7:bf16") == [
        "sync.mode=local_sgd", "sync.period=8", "sync.delay_steps=0", "sync.compression=none"]
    assert core.sync_paste_args("local_sgd:8", "none") == ["sync.mode=local_sgd", "sync.period=8"]


def test_a_run_label_round_trips_through_the_pasted_line():
    for text in ("local_sgd:16:14:fp16", "diloco:8:7", "local_sgd:8:0:bf16", "local_sgd:32"):
        cfg = core.load_config(None, syncmode.paste_args(text, "none") + ["zero_stage=0"])
        assert syncmode.label(cfg) == text
    for bad in ("local_sgd:8:8", "local_sgd:8:1:int8", "local_sgd:8:1:fp16:x", "local_sgd:1"):
        assert syncmode.parse_label(bad) == ("every_step", 1) and syncmode.parse_stream(bad) == (0, "none")


def test_curves_a_streamed_run_records_are_the_evidence_for_its_label():
    base = [{"points": [[100, 0.95]], "compression": "none"}]
    mine = [{"points": [[100, 0.945]], "compression": "local_sgd:16:14:fp16"}]
    kw = dict(own_label="none", own_batch=256, lr_scaled=False, curves_at=lambda gb: base + mine,
              steps_per_epoch=lambda gb: 5, family_says=lambda label: None)
    found = evidence.judge("local_sgd:16:14:fp16", 256, **kw)
    assert found.kind == evidence.TESTED and "applied 14 steps later" in found.changes
    assert evidence.judge("local_sgd:16:13:fp16", 256, **kw).kind == evidence.UNTESTED


def test_the_search_offers_each_blocking_period_then_its_streamed_variant():
    s = vit_s_lab(0.119, "none")
    tried = recommend.options(s, ("none", "local_sgd:16"), (1,), None, stream=True)
    variant = model.streamed(replace(s, compression="local_sgd:16"))
    assert [o.compression for o in tried] == ["none", "local_sgd:16", variant]
    assert tried[2].prediction.step_s < tried[1].prediction.step_s
    assert "streamed: applied" in recommend.setting_words(tried[2])
    assert [o.compression for o in recommend.options(s, ("local_sgd:16",), (1,), None)] == ["local_sgd:16"]


def test_a_streamed_run_pays_no_epoch_end_average_and_one_blocking_average_at_its_end():
    from dscluster.plan import datafeed, wholerun

    cfg = core.load_config(None, ["zero_stage=0"])
    facts = datafeed.DataFacts(train_n=256 * 2 * 50, holdout_n=0, image_bytes=3 * 224 * 224, cached_train=True)

    def costs(label: str):
        s = vit_s_lab(0.119, label)
        return wholerun.costs(cfg, s, predict(s), start=None, facts=facts, warmup_extra_s=0.0, params=1_000_000)

    blocking, streamed = costs("local_sgd:16"), costs("local_sgd:16:15")
    average = predict(vit_s_lab(0.119, "local_sgd:16")).comm_s * 16
    # 50 steps an epoch, not a multiple of 16: blocking, each epoch's end adds one average over its steps
    assert blocking.step_s == pytest.approx(predict(vit_s_lab(0.119, "local_sgd:16")).step_s + average / 50)
    assert blocking.warmup_extra_s == 0
    assert streamed.step_s == pytest.approx(predict(vit_s_lab(0.119, "local_sgd:16:15")).step_s)
    assert streamed.warmup_extra_s == pytest.approx(average)
