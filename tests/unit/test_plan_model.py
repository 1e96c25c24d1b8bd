"""plan's model against what the GPU lab measured (docs/gpu-lab.md, docs/plan.md).

ViT-B/16 as the lab trained it: 85.8 M parameters (10 classes), fp32 gradients (343 MB a step),
micro-batch 128, 4 ranks on 3 nodes (1+1+2 GPUs), one GPU alone ~3,000 img/s (0.0427 s per
micro-batch). Measured: 1 Gbit, check's busbw 0.119 GB/s, 4.4–4.6 s per step, 109 img/s; 10 Gbit,
busbw 1.19 GB/s (2 nodes, the sim's own test), 0.776 s steady step; one NVLink host, 4× H100,
12,066 img/s.
"""

import subprocess
import sys
from dataclasses import replace

import pytest

from dscluster.errors import UsageError
from dscluster.plan import model
from dscluster.plan import recommend as recommending
from dscluster.plan.model import Node, Scenario, predict
from dscluster.plan.recommend import recommend

VIT_B_PARAMS = 85_806_346
H200_COMPUTE_S = 128 / 3000  # one GPU alone ~3,000 img/s at micro-batch 128
RTX3070_COMPUTE_S = 0.2      # an 8 GB card, micro-batch 32
# plan's predictions hold within ±15 % of what a run measured (docs/advisor.md, "What holds")
TOLERANCE = 0.15
MEASURED_10GBIT_STEP_S = 0.776  # the 1+1+2 lab at 10 Gbit, steady step (docs/plan.md)


FP16_LADDER = ("none", "fp16")  # the recommendation before PowerSGD: what these lab figures were checked with


def vit_b_matrices(classes: int = 10) -> tuple[tuple[int, int], ...]:
    """ViT-B/16's gradients as PowerSGD views them (shape[0] × the rest): class token, position
    embedding, patch embedding, 12 blocks (norms, qkv, proj, MLP), final norm, head."""
    d, mlp = 768, 3072
    m = [(1, d), (1, 197 * d), (d, 3 * 16 * 16), (d, 1)]
    for _ in range(12):
        m += [(d, 1), (d, 1), (3 * d, d), (3 * d, 1), (d, d), (d, 1), (d, 1), (d, 1), (mlp, d), (mlp, 1),
              (d, mlp), (d, 1)]
    return tuple(m + [(d, 1), (d, 1), (classes, d), (classes, 1)])


def lab(busbw, compute_s=H200_COMPUTE_S, micro=128, accum=1, **kw):
    """The GPU lab's layout: node1 and node2 one GPU each, node3 two."""
    nodes = (Node(name="node1", compute_s=compute_s), Node(name="node2", compute_s=compute_s),
             Node(name="node3", ranks=2, compute_s=compute_s))
    kw.setdefault("grad_bytes", model.gradient_bytes(VIT_B_PARAMS))
    return Scenario(nodes=nodes, micro_batch=micro, grad_accum=accum, matrices=vit_b_matrices(), busbw_GBps=busbw,
                    **kw)


def test_ring_allreduce_time_follows_nccl_tests_definition():
    # 344 MB × 2·3/4 ÷ 0.119 GB/s: the 4.3 s docs/gpu-lab.md derives for the 1 Gbit lab
    assert model.ring_allreduce_s(344e6, 4, 0.119) == pytest.approx(344e6 * 2 * 3 / 4 / 0.119e9)
    assert model.ring_allreduce_s(344e6, 1, 0.119) == 0.0
    assert model.gradient_bytes(VIT_B_PARAMS) == 343_225_384


def test_1gbit_lab_step_time_and_throughput_match_the_measurement():
    p = predict(lab(0.119))
    assert 4.4 * 0.95 <= p.step_s <= 4.6  # measured 4.4–4.6 s per step
    assert p.images_per_s == pytest.approx(116, rel=0.03)  # 512 images per step
    assert p.images_per_s == pytest.approx(109, rel=0.10)  # the run's own img/s
    assert p.compute_s < 0.05 and p.exposed_s > 4.2  # communication-bound
    assert p.global_batch == 512


def test_1gbit_lab_verdict_says_slower():
    p = predict(lab(0.119))
    assert p.slower and p.speedup < 0.05
    assert p.fastest_node == "node3" and p.node_images_per_s["node3"] == pytest.approx(6000)
    assert p.verdict.startswith("adding nodes makes training SLOWER")
    assert "node3 alone" in p.verdict


def test_1gbit_fast_gpus_no_setting_within_the_limit_scales_so_train_alone():
    rec = recommend(lab(0.119), compressions=FP16_LADDER)
    assert not rec.reached
    # the best within global batch 4096: the largest accumulation with fp16 compression
    assert (rec.choice.grad_accum, rec.choice.compression) == (8, "fp16")
    assert rec.choice.prediction.global_batch == 4096
    assert rec.choice.prediction.efficiency < 0.8
    assert rec.without_compression.compression == "none" and rec.without_compression.grad_accum == 8
    # still slower than node3 alone: the advice is to train there
    assert rec.train_alone
    assert rec.needed.compression == "fp16" and rec.needed.prediction.efficiency >= 0.8
    assert rec.needed.prediction.global_batch > 4096
    assert "nothing within global batch 4,096 reaches 80%" in rec.summary
    assert "Train on node3 alone" in rec.summary


def test_1gbit_8gb_cards_recommend_accumulation_and_fp16_compression():
    s = lab(0.119, compute_s=RTX3070_COMPUTE_S, micro=32)
    assert predict(s).slower
    rec = recommend(s, compressions=FP16_LADDER)
    # the most accumulation within global batch 4,096: 32 micro-steps × 32 images × 4 ranks
    assert rec.choice.grad_accum == 32 and rec.choice.compression == "fp16"
    assert rec.choice.prediction.speedup > 1 and not rec.train_alone
    # by hand: 32 × 0.2 s of compute; fp16 halves the 343 MB all-reduce, 171.6 MB × 2·3/4 ÷ 0.119 GB/s = 2.16 s,
    # of which the last backward (2/3 of 0.2 s) hides 0.13 s: 6.4 ÷ (6.4 + 2.16 − 0.13) = 76 % of the ranks alone
    compute = 32 * RTX3070_COMPUTE_S
    allreduce = model.gradient_bytes(VIT_B_PARAMS) / 2 * 2 * 3 / 4 / 0.119e9
    hidden = 2 / 3 * RTX3070_COMPUTE_S
    assert rec.choice.prediction.efficiency == pytest.approx(compute / (compute + allreduce - hidden), rel=1e-3)
    # 80% is out of reach within 4096: the summary says so and names the best
    assert not rec.reached
    assert rec.summary.startswith("nothing within global batch 4,096 reaches 80%; the best is grad_accum")


def test_smallest_global_batch_wins_then_no_compression():
    s = lab(1.19, compute_s=RTX3070_COMPUTE_S, micro=32)
    rec = recommend(s, compressions=FP16_LADDER)
    assert rec.reached
    assert (rec.choice.grad_accum, rec.choice.compression) == (2, "fp16")
    assert rec.choice.prediction.efficiency >= 0.8
    for smaller in ((1, "none"), (1, "fp16"), (2, "none")):  # nothing with a smaller batch or less change reaches
        trial = replace(s, grad_accum=smaller[0], compression=smaller[1])
        assert predict(trial).efficiency < 0.8
    # what it takes without compression
    assert (rec.without_compression.grad_accum, rec.without_compression.compression) == (8, "none")
    assert rec.without_compression.prediction.efficiency >= 0.8


def test_10gbit_lab_step_is_compute_and_the_allreduce_less_what_backward_hides():
    """By hand, from the lab's inputs: a micro-batch of 128 at 3,000 img/s is 0.0427 s; the ring all-reduce
    of 343 MB on 4 ranks, × 2·3/4 ÷ 1.19 GB/s, 0.433 s; the last backward (2/3 of the compute, 0.028 s)
    hides that much of it. 0.447 s; with no overlap at all, 0.475 s."""
    compute = H200_COMPUTE_S
    allreduce = model.gradient_bytes(VIT_B_PARAMS) * 2 * 3 / 4 / 1.19e9
    backward = 2 / 3 * H200_COMPUTE_S
    assert predict(lab(1.19)).step_s == pytest.approx(compute + allreduce - backward, rel=1e-3)
    assert predict(lab(1.19, overlap_fraction=0.0)).step_s == pytest.approx(compute + allreduce, rel=1e-3)


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="a known miss (docs/plan.md, 10 Gbit): 0.45 s a step predicted, 0.776 s measured (-42 %), "
                   "outside the ±15 % plan holds to; no overlap assumption closes it")
def test_10gbit_lab_step_is_within_the_tolerance_of_the_measured_step():
    assert predict(lab(1.19)).step_s == pytest.approx(MEASURED_10GBIT_STEP_S, rel=TOLERANCE)


def test_10gbit_lab_verdict_holds_and_the_measured_step_gives_the_bandwidth_training_reached():
    assert predict(lab(1.19)).slower  # measured 408 img/s against ~3,000 for one GPU
    # the measured step inverted by hand: 0.776 s − 0.0427 s of compute + the 0.028 s the backward hides leaves
    # 0.762 s of all-reduce: 343 MB × 2·3/4 ÷ 0.762 s = 0.68 GB/s, 57 % of check's 1.19 GB/s
    allreduce_s = MEASURED_10GBIT_STEP_S - H200_COMPUTE_S + 2 / 3 * H200_COMPUTE_S
    by_hand = model.gradient_bytes(VIT_B_PARAMS) * 2 * 3 / 4 / allreduce_s / 1e9
    assert model.implied_busbw_GBps(lab(1.19), MEASURED_10GBIT_STEP_S) == pytest.approx(by_hand, rel=1e-3)


def test_implied_busbw_at_1gbit_matches_what_check_measured():
    # 4.4–4.6 s per step means the training all-reduce ran at 0.112–0.118 GB/s: check's 0.119, within 6%
    for step in (4.4, 4.6):
        assert model.implied_busbw_GBps(lab(0.119), step) == pytest.approx(0.119, rel=0.06)
    assert model.implied_busbw_GBps(lab(0.119), 0.01) is None  # compute alone explains it


def test_one_rank_calibrated_by_its_own_run_is_all_of_itself_and_keeps_its_config():
    # digits, one CPU rank, 2026-11-29: the probe's 0.0227 s per micro-batch of 64, and the first run's steps 8.4 ms
    # longer than that (optimizer, engine): the run measured 1,900 img/s; the second plan had said 73 % of the node
    # alone and recommended grad_accum 2 (global batch 128) to amortise the overhead
    s = Scenario(nodes=(Node(name="localhost", compute_s=0.0227),), micro_batch=64, grad_bytes=4 * 228_202,
                 busbw_GBps=1.0, compression="none", calibration=(("none", 0.0084),))
    p = predict(s)
    assert p.images_per_s == pytest.approx(64 / 0.0311)
    assert p.node_images_per_s["localhost"] == pytest.approx(p.images_per_s)
    assert p.efficiency == pytest.approx(1.0) and p.verdict == "one node: 100% of its ranks' summed speed"
    rec = recommend(s)
    assert rec.reached and rec.choice.grad_accum == 1
    faster = predict(replace(s, calibration=(("none", -0.002),)))  # runs faster than the probe: the same either way
    assert faster.efficiency == pytest.approx(1.0) and faster.images_per_s == pytest.approx(64 / 0.0207)
    # on several ranks a calibration holds communication the model missed: the nodes alone stay compute alone
    two = predict(replace(s, nodes=(Node(name="localhost", ranks=2, compute_s=0.0227),)))
    assert two.node_images_per_s["localhost"] == pytest.approx(2 * 64 / 0.0227)


def test_nvlink_host_scales_and_is_not_called_slower():
    # 4x H100, one host: check-like busbw ~338 GB/s, measured 12,066 img/s for the README command
    s = Scenario(nodes=(Node(name="localhost", ranks=4, compute_s=128 / 3050),), micro_batch=128,
                 grad_bytes=model.gradient_bytes(VIT_B_PARAMS), busbw_GBps=338)
    p = predict(s)
    assert p.images_per_s == pytest.approx(12066, rel=0.05)
    assert not p.slower and p.verdict.startswith("one node")
    rec = recommend(s)
    assert rec.reached and rec.choice.grad_accum == 1 and rec.choice.compression == "none"


def test_overlap_hides_at_most_the_last_backward_and_never_the_last_bucket():
    fast = lab(338)
    p = predict(fast)
    last_bucket = p.comm_s * model.DDP_BUCKET_BYTES / fast.grad_bytes
    assert p.exposed_s == pytest.approx(last_bucket)  # comm shorter than backward: only the last bucket shows
    slow = predict(lab(0.119))
    assert slow.hidden_s == pytest.approx(model.BACKWARD_SHARE * H200_COMPUTE_S)
    none = predict(lab(0.119, overlap_fraction=0.0))
    assert none.hidden_s == 0 and none.step_s == pytest.approx(none.compute_s + none.comm_s)
    # only the last micro-step's backward overlaps: accumulation adds compute, not hiding
    assert predict(lab(0.119, accum=8)).hidden_s == pytest.approx(slow.hidden_s)


def test_compression_halves_the_communication():
    a, b = predict(lab(0.119)), predict(lab(0.119, compression="fp16"))
    assert b.comm_s == pytest.approx(a.comm_s / 2)


def test_fp16_and_bf16_halve_fp32_gradients_only():
    assert predict(lab(0.119, compression="bf16")).comm_s == pytest.approx(predict(lab(0.119)).comm_s / 2)
    half = lab(0.119, grad_bytes=model.gradient_bytes(VIT_B_PARAMS, 2), grad_format="fp16")
    assert predict(replace(half, compression="fp16")).comm_s == pytest.approx(predict(half).comm_s)


def test_powersgd_sends_r_times_n_plus_m_per_matrix_and_small_tensors_whole():
    assert sum(n * m for n, m in vit_b_matrices()) == VIT_B_PARAMS
    # a 2304×768 qkv weight at rank 4: 4·(2304+768) numbers; a bias or the 1×151,296 position
    # embedding cannot be made smaller by a rank-1 factor pair: sent whole
    assert model.powersgd_elements([(2304, 768)], 4) == 4 * (2304 + 768)
    assert model.powersgd_elements([(768, 1), (1, 197 * 768)], 4) == 768 + 197 * 768
    # ViT-B by hand: the patch embedding (768×768), each block's qkv, proj, fc1 and fc2 and the head (10×768) go
    # as factor pairs; the class token, position embedding, biases and norms whole. 873,266: 1.0% of the gradients
    factored = 4 * (768 + 768) + 12 * 4 * ((2304 + 768) + (768 + 768) + (3072 + 768) + (768 + 3072)) + 4 * (10 + 768)
    whole = 768 + 197 * 768 + 768 + 12 * (4 * 768 + 2304 + 768 + 3072 + 768) + 2 * 768 + 10
    assert model.powersgd_elements(vit_b_matrices(), 4) == factored + whole
    p = predict(lab(0.119, compression="powersgd"))
    assert p.comm_s == pytest.approx(model.ring_allreduce_s((factored + whole) * 4, 4, 0.119))
    half = lab(0.119, compression="powersgd", grad_format="bf16", grad_bytes=model.gradient_bytes(VIT_B_PARAMS, 2))
    assert predict(half).comm_s == pytest.approx(p.comm_s / 2)  # factors in the gradients' own format
    with pytest.raises(UsageError, match="powersgd needs the gradient matrices"):
        replace(lab(0.119), compression="powersgd", matrices=())


def test_1gbit_lab_powersgd_reaches_80_percent_where_fp16_cannot():
    rec = recommend(lab(0.119))
    assert rec.reached and rec.choice.compression == "powersgd"
    assert rec.choice.prediction.efficiency >= 0.8 and rec.choice.prediction.global_batch <= 4096
    # the smallest global batch that reaches it: one accumulation step less does not
    smaller = replace(lab(0.119), grad_accum=rec.choice.grad_accum // 2, compression="powersgd")
    assert rec.choice.grad_accum == 1 or predict(smaller).efficiency < 0.8
    assert rec.without_compression.compression == "none" and rec.without_compression.prediction.speedup < 1


def test_ladder_starts_at_the_configs_compression_and_keeps_only_what_training_allows():
    local = ("local_sgd:4", "local_sgd:8", "local_sgd:16", "local_sgd:32", "local_sgd:64")
    assert recommending.ladder("none") == ("none", "fp16", "powersgd", *local)
    assert recommending.ladder("bf16") == ("bf16", "powersgd", *local)
    assert recommending.ladder("powersgd") == ("powersgd", *local)
    assert recommending.ladder("local_sgd:16") == local[2:]
    assert recommending.ladder("none", allowed=lambda c: c != "fp16") == ("none", "powersgd", *local)
    assert recommending.ladder("none", allowed=lambda c: False) == ("none",)


def test_slowest_node_sets_the_pace():
    s = Scenario(nodes=(Node(name="fast", compute_s=0.1), Node(name="pascal", compute_s=0.3)), micro_batch=32,
                 grad_accum=2, grad_bytes=4e6, busbw_GBps=100)
    p = predict(s)
    assert p.compute_s == pytest.approx(0.6)
    assert p.fastest_node == "fast" and p.node_images_per_s["pascal"] == pytest.approx(32 / 0.3)


def test_one_rank_has_no_communication():
    p = predict(Scenario(nodes=(Node(name="a", compute_s=0.1),), micro_batch=8, grad_bytes=4e8, busbw_GBps=0.1))
    assert p.comm_s == 0 and p.speedup == pytest.approx(1) and not p.slower


def test_an_uneven_global_batch_trains_its_own_images_at_the_largest_shares_pace():
    # 500 images on 4 ranks of micro-batch 128 (shares 128, 124, 124, 124): the step of a 128 share
    even, uneven = lab(1.194), lab(1.194, samples_per_step=500)
    pe, pu = predict(even), predict(uneven)
    assert pu.step_s == pe.step_s and pu.global_batch == 500
    assert pu.images_per_s == pytest.approx(pe.images_per_s * 500 / 512)
    # what it recommends is stated in full (micro × accum × ranks), so it splits evenly
    options = [recommend(uneven).choice, recommend(uneven).without_compression]
    assert all(o.prediction.global_batch == 128 * o.grad_accum * 4 for o in options if o is not None)
    assert any(o is not None for o in options)


def test_no_option_when_micro_batch_times_ranks_exceeds_the_limit():
    rec = recommend(lab(0.119), max_global_batch=256)
    assert rec.choice is None and "lower micro_batch" in rec.summary


@pytest.mark.parametrize("change, word", [
    (dict(busbw=0), "busbw_GBps"), (dict(busbw=1, compute_s=0), "compute time"),
    (dict(busbw=1, compression="int8"), "compression"), (dict(busbw=1, overlap_fraction=1.5), "overlap_fraction"),
    (dict(busbw=1, accum=0), "grad_accum"), (dict(busbw=1, samples_per_step=513), "samples_per_step"),
])
def test_bad_inputs_say_which(change, word):
    with pytest.raises(UsageError, match=word):
        lab(**change)


def test_bad_target_or_limit():
    with pytest.raises(UsageError, match="target"):
        recommend(lab(1), target=0)
    with pytest.raises(UsageError, match="global batch"):
        recommend(lab(1), max_global_batch=0)


def test_to_dict_is_json_ready():
    import json

    rec = recommend(lab(0.119), compressions=FP16_LADDER)
    doc = json.loads(json.dumps({"p": predict(lab(0.119)).to_dict(), "r": rec.to_dict()}))
    assert doc["r"]["choice"]["global_batch"] == 4096 and doc["p"]["slower"] is True


def test_the_model_does_not_import_torch():
    code = "import sys, dscluster.plan.model; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# check's all-reduce on the 4-node GPU lab at 10 Gbit (NCCL over sockets, H100s)
CHECK_10GBIT_4_NODES = [{"bytes": 1048576, "time_us": 1734.7, "busbw_GBps": 0.907},
                        {"bytes": 16777216, "time_us": 21139.1, "busbw_GBps": 1.19},
                        {"bytes": 67108864, "time_us": 84436.0, "busbw_GBps": 1.192},
                        {"bytes": 268435456, "time_us": 337180.1, "busbw_GBps": 1.194}]


def test_startup_latency_is_what_the_smallest_message_took_beyond_its_bytes():
    # 1 MiB over 4 ranks at 1.194 GB/s is 1.317 ms of bytes: 1.735 ms measured leaves 0.42 ms
    assert model.startup_latency_s(CHECK_10GBIT_4_NODES, 4) == pytest.approx(0.000417, abs=2e-6)
    assert model.startup_latency_s(CHECK_10GBIT_4_NODES, 1) == 0.0
    assert model.startup_latency_s(CHECK_10GBIT_4_NODES[-1:], 4) == 0.0  # one size: nothing to separate
    fast_small = [dict(CHECK_10GBIT_4_NODES[0], time_us=1000.0)] + CHECK_10GBIT_4_NODES[1:]
    assert model.startup_latency_s(fast_small, 4) == 0.0  # never negative


# check on the 4-node lab (H200s) at 10 and 1 Gbit with its 64 KiB message, 2026-11-26
CHECK_64K = {"10gbit": [{"bytes": 65536, "time_us": 373.0, "busbw_GBps": 0.264},
                        {"bytes": 1048576, "time_us": 1227.5, "busbw_GBps": 1.281},
                        {"bytes": 268435456, "time_us": 337127.0, "busbw_GBps": 1.194}],
             "1gbit": [{"bytes": 65536, "time_us": 487.8, "busbw_GBps": 0.202},
                       {"bytes": 1048576, "time_us": 13154.5, "busbw_GBps": 0.12},
                       {"bytes": 268435456, "time_us": 3390873.8, "busbw_GBps": 0.119}]}


def test_startup_latency_takes_the_link_rate_from_the_largest_message_not_a_burst():
    # 1 MiB burst through the shaper above the 10 Gbit rate (1.281 GB/s): the rate is the 256 MiB
    # message's; 64 KiB of bytes at 1.194 GB/s over 4 ranks is 82 us of the 373 us
    assert model.startup_latency_s(CHECK_64K["10gbit"], 4) == pytest.approx(373.0e-6 - 82.3e-6, abs=1e-6)
    # at 1 Gbit the 64 KiB message passed faster than the rate allows: no start-up time to separate
    assert model.startup_latency_s(CHECK_64K["1gbit"], 4) == 0.0


def test_every_bucket_pays_the_startup_latency_and_powersgd_three_times_plus_its_own_work():
    plain = lab(1.19, latency_s=0.002, overlap_fraction=0.0)
    assert plain.allreduces == 4  # 343 MB of fp32 gradients in 100 MiB buckets
    base = predict(replace(plain, latency_s=0.0))
    assert predict(plain).comm_s == pytest.approx(base.comm_s + 4 * 0.002)
    psgd = replace(plain, compression="powersgd", powersgd_s=0.015)
    assert psgd.allreduces == 12
    p, p0 = predict(psgd), predict(replace(psgd, latency_s=0.0, powersgd_s=0.0))
    assert p.hook_s == 0.015 and p.step_s == pytest.approx(p0.step_s + 0.015 + 12 * 0.002)
    one = replace(psgd, nodes=psgd.nodes[:1])  # one rank: training installs no hook, sends nothing
    assert one.allreduces == 0 and predict(one).hook_s == 0 and predict(one).comm_s == 0


def test_calibration_adds_seconds_to_the_step_of_its_own_compression_only():
    s = lab(1.19, compression="powersgd", powersgd_s=0.016, calibration=(("powersgd", 0.02),))
    p, raw = predict(s), predict(replace(s, calibration=()))
    assert p.model_step_s == pytest.approx(raw.step_s) and p.calibration_s == 0.02
    assert p.step_s == pytest.approx(raw.step_s + 0.02)
    assert p.images_per_s == pytest.approx(s.global_batch / (raw.step_s + 0.02))
    plain = predict(replace(s, compression="none"))
    assert plain.calibration_s == 0.0 and plain.step_s == plain.model_step_s
    # runs faster than the model: the step comes down by what they measured, below the compute figure
    # too (that figure was too slow: a disturbed probe); a correction beyond the whole step leaves the compute
    faster = predict(replace(s, calibration=(("powersgd", -0.8 * raw.step_s),)))
    assert faster.step_s == pytest.approx(0.2 * raw.step_s) and faster.step_s < faster.compute_s
    fast = predict(replace(s, calibration=(("powersgd", -10.0),)))
    assert fast.step_s == pytest.approx(fast.compute_s)
    with pytest.raises(UsageError, match="calibration"):
        replace(s, calibration=(("powersgd", float("nan")),))


def four_node_lab(accum: int, compute_s: float, powersgd_s: float, **kw) -> Scenario:
    """plan's inputs on the 4-node GPU lab (one H200 per node, 10 Gbit, 2026-11-26): ViT-B/16 fp16,
    check's busbw 1.194 GB/s and start-up latency 0.29 ms (from its 1 MiB message)."""
    nodes = tuple(Node(name=f"node{i}", compute_s=compute_s) for i in range(1, 5))
    return Scenario(nodes=nodes, micro_batch=128, grad_accum=accum, matrices=vit_b_matrices(), busbw_GBps=1.194,
                    grad_bytes=model.gradient_bytes(VIT_B_PARAMS), compression="powersgd", powersgd_s=powersgd_s,
                    latency_s=0.000286, **kw)


MEASURED_FIRST_POWERSGD_IMAGES_PER_S = 5912.1  # the 4-node lab's first PowerSGD run, the README command


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="a known miss (docs/plan.md, docs/advisor.md): a first PowerSGD run on 4 ranks measured "
                   "23 % below the model alone, outside the ±15 % plan holds to; calibration mends it")
def test_the_first_powersgd_run_is_within_the_tolerance_of_the_model_alone():
    first = predict(four_node_lab(1, 0.04901, 0.01516))
    assert first.images_per_s == pytest.approx(MEASURED_FIRST_POWERSGD_IMAGES_PER_S, rel=TOLERANCE)


def test_calibration_from_the_lab_first_powersgd_run_predicts_its_recommended_run():
    # the first run, PowerSGD at grad_accum 1, measured 5,912 img/s: what its step took beyond the model's
    first = predict(four_node_lab(1, 0.04901, 0.01516))
    extra = 512 / MEASURED_FIRST_POWERSGD_IMAGES_PER_S - first.model_step_s  # 20 ms a step the model did not see
    # the recommended run, grad_accum 8 (global 4,096): 9,436 img/s measured. Seconds per step
    # carry over (+0.5 %); a factor (1.30×) would have scaled the compute too and said 7,641 (-19 %)
    rec = predict(four_node_lab(8, 0.04920, 0.01599, calibration=(("powersgd", extra),)))
    assert rec.images_per_s == pytest.approx(9436.1, rel=0.02)
    assert rec.efficiency >= 0.8


def test_a_node_alone_is_priced_at_the_micro_batch_it_trains_at_alone():
    """The 4×H100 lab, fractal ViT-S fp16 compiled, global batch 512 with micro_batch auto: the probe read
    0.0226 s per micro-batch of 128 (the lab's 4 ranks); node1 alone trains at micro 512 and ran 8,164
    img/s, node3 (2 GPUs) at 256, where a probe read 0.0316 s. Priced at the lab's micro-batch, each
    node alone was 25-30 % too slow and every speed-up flattered the lab."""
    at_lab = (Node(name="node1", compute_s=0.0226), Node(name="node2", compute_s=0.0226),
              Node(name="node3", ranks=2, compute_s=0.0226))
    s = Scenario(nodes=at_lab, micro_batch=128, grad_bytes=model.gradient_bytes(21_700_000), busbw_GBps=1.19)
    alone = {"node1": (512, 512 / 8164), "node2": (512, 512 / 8164), "node3": (256, 0.0316)}
    own = replace(s, nodes=tuple(replace(n, alone_micro=alone[n.name][0], alone_compute_s=alone[n.name][1])
                                 for n in at_lab))
    before, after = predict(s), predict(own)
    at_lab_node3, own_node3 = 2 * 128 / 0.0226, 2 * 256 / 0.0316  # node3's two GPUs: 11,327 and 16,203 img/s
    assert before.node_images_per_s["node3"] == pytest.approx(at_lab_node3)
    assert after.node_images_per_s == pytest.approx({"node1": 8164, "node2": 8164, "node3": own_node3})
    assert after.fastest_node == "node3" and after.images_per_s == before.images_per_s  # the lab's step is its own
    assert after.speedup == pytest.approx(before.speedup * at_lab_node3 / own_node3)
    assert after.efficiency == pytest.approx(before.efficiency * (4 * 128 / 0.0226) / (2 * 8164 + own_node3))
    # the recommendation judges every option against the same nodes alone
    rec = recommend(own, compressions=FP16_LADDER)
    assert rec.choice.prediction.node_images_per_s == after.node_images_per_s
    with pytest.raises(UsageError, match="node3: alone micro-batch 256"):
        replace(own, nodes=(*own.nodes[:2], replace(own.nodes[2], alone_compute_s=0.0)))


# --- local SGD every H steps (sync.mode; docs/ethernet-labs.md) -----------------------------------------

VIT_S_GRAD_BYTES = model.gradient_bytes(21_743_000)  # fractal ViT-S/16, fp32: the weights averaged, too


def vit_s_lab(busbw: float, nodes: int = 2, label: str = "none") -> Scenario:
    """Two 1-GPU H200 nodes training the fractal preset: 0.0278 s a micro-batch of 256 (measured)."""
    return Scenario(nodes=tuple(Node(name=f"node{i + 1}", compute_s=0.0278) for i in range(nodes)),
                    micro_batch=256, grad_bytes=VIT_S_GRAD_BYTES, busbw_GBps=busbw, compression=label)


def test_local_sgd_prices_one_blocking_average_of_the_weights_every_h_steps():
    for busbw, measured_average_s in ((1.19, 0.071), (0.119, 0.730)):  # median average_s of the H200 runs
        p = predict(vit_s_lab(busbw, label="local_sgd:8"))
        assert p.hidden_s == 0  # the average blocks the step it ends
        assert p.comm_s * 8 == pytest.approx(measured_average_s, rel=0.05)
        assert p.step_s == pytest.approx(0.0278 + p.comm_s)
    every = predict(vit_s_lab(1.19))
    assert predict(vit_s_lab(1.19, label="diloco:8")).step_s == pytest.approx(
        predict(vit_s_lab(1.19, label="local_sgd:8")).step_s)  # the same bytes, once a period
    # the measured steady step between averages was 0.038 s at H=8 (10 Gbit), every-step's 0.099 s
    assert predict(vit_s_lab(1.19, label="local_sgd:8")).step_s == pytest.approx(0.038, rel=0.05)
    assert every.step_s == pytest.approx(0.099, rel=0.1)


def test_the_recommendation_takes_the_shortest_period_that_scales_and_only_across_nodes():
    fast = recommend(vit_s_lab(1.19))
    assert fast.choice.compression == "local_sgd:16" and fast.reached and not fast.train_alone
    assert "local sgd, the models averaged every 16 steps" in fast.summary
    slow = recommend(vit_s_lab(0.119))
    assert slow.choice.compression == "local_sgd:64" and not slow.train_alone
    assert slow.choice.prediction.speedup > 1.3
    # one node's ranks average every step anyway: never recommended there
    one = Scenario(nodes=(Node(name="node1", ranks=2, compute_s=0.0278),), micro_batch=256,
                   grad_bytes=VIT_S_GRAD_BYTES, busbw_GBps=0.119)
    assert all(":" not in o for o in [recommend(one).choice.compression])
    # compressions only, as plan --every-step asks
    only = recommend(vit_s_lab(0.119), compressions=recommending.ladder("none", allowed=lambda c: c == "fp16"))
    assert only.train_alone and ":" not in only.choice.compression


def test_one_rank_is_never_told_to_compress_or_average():
    """One GPU has no all-reduce: whatever its step costs beyond the model, no compression can save it."""
    one = Scenario(nodes=(Node(name="node1", compute_s=0.0278),), micro_batch=256, grad_bytes=VIT_S_GRAD_BYTES,
                   busbw_GBps=0.119, calibration=(("none", 0.014),), matrices=((384, 384),))
    rec = recommend(one)
    assert rec.choice.compression == "none" and rec.without_compression is None
    assert "compression" not in rec.summary and "local sgd" not in rec.summary
