"""Balanced batching: share planning, the shared-order sampler, the loss weight, calibration."""

import itertools

import pytest

from dscluster.core.balanced import BalancedBatchSampler, SharePlan, calibrate, loss_weight, plan_shares
from dscluster.errors import UsageError


def test_shares_follow_speed_and_sum_exactly():
    # Two full-speed GPUs and two ranks sharing one GPU (half speed each), the mixed-speed case.
    shares = plan_shares([1000, 1000, 1000, 500, 500], 256)
    assert sum(shares) == 256
    assert shares[0] == shares[1] == shares[2]
    assert shares[3] == shares[4]
    assert abs(shares[0] - 2 * shares[3]) <= 1


def test_shares_equalise_step_time():
    speeds = [310.0, 97.0, 145.5, 1200.0]
    shares = plan_shares(speeds, 500)
    times = [b / s for b, s in zip(shares, speeds, strict=True)]
    assert sum(shares) == 500
    # Rounding moves each share by less than one sample.
    assert max(times) - min(times) <= max(1 / s for s in speeds) + 1e-12


def test_uniform_speeds_give_uniform_shares_and_weight_one():
    shares = plan_shares([50.0] * 4, 128)
    assert shares == [32, 32, 32, 32]
    assert all(loss_weight(b, 4, 128) == 1.0 for b in shares)


def test_largest_remainder_rounding_is_exact_and_deterministic():
    shares = plan_shares([1.0, 1.0, 1.0], 10)
    assert sorted(shares) == [3, 3, 4]
    assert shares == plan_shares([1.0, 1.0, 1.0], 10)


def test_memory_cap_redistributes_in_proportion_to_speed():
    # The fastest card only fits 40; what it cannot take goes to the others 2:1.
    shares = plan_shares([400, 200, 100], 160, max_micro=[40, 1000, 1000])
    assert shares[0] == 40
    assert sum(shares) == 160
    assert abs(shares[1] - 2 * shares[2]) <= 1


def test_every_rank_gets_at_least_one_sample():
    shares = plan_shares([10000, 1], 8)
    assert shares == [7, 1]


@pytest.mark.parametrize("speeds,batch,caps", [
    ([3.0, 1.0, 7.0, 2.5], 37, None),
    ([3.0, 1.0, 7.0, 2.5], 37, [5, 20, 12, 9]),
    ([1e6, 1.0, 1.0], 5, [1, 3, 3]),
    ([2.0, 2.0], 2, [1, 1]),
])
def test_invariants(speeds, batch, caps):
    shares = plan_shares(speeds, batch, caps)
    assert sum(shares) == batch
    assert all(b >= 1 for b in shares)
    if caps:
        assert all(b <= c for b, c in zip(shares, caps, strict=True))


@pytest.mark.parametrize("speeds,batch,caps,needle", [
    ([1.0, 2.0], 100, [10, 20], "sum to 30"),
    ([1.0, 2.0, 3.0], 2, None, "at least one"),
    ([1.0, 0.0], 10, None, "rank 1"),
    ([1.0, float("nan")], 10, None, "rank 1"),
    ([], 10, None, "no ranks"),
    ([1.0, 1.0], 10, [5], "2 ranks"),
])
def test_bad_input_is_a_usage_error_with_a_fix(speeds, batch, caps, needle):
    with pytest.raises(UsageError, match=needle):
        plan_shares(speeds, batch, caps)


def _all_batches(shares, n=100, seed=3, epoch=0):
    return [list(BalancedBatchSampler(n, shares, r, seed=seed, epoch=epoch)) for r in range(len(shares))]


def test_sampler_ranks_disjoint_same_length_and_form_global_batches():
    shares = [5, 11, 16]
    per_rank = _all_batches(shares, n=100)
    assert [len(b) for b in per_rank] == [3, 3, 3]  # 100 // 32, last partial batch dropped
    for r, batches in enumerate(per_rank):
        assert all(len(b) == shares[r] for b in batches)
    seen = list(itertools.chain.from_iterable(itertools.chain.from_iterable(per_rank)))
    assert len(seen) == len(set(seen)) == 96
    # Step k of all ranks, concatenated in rank order, is the k-th block of the shared order.
    order = BalancedBatchSampler(100, shares, 0, seed=3).order()
    for k in range(3):
        assert sum((per_rank[r][k] for r in range(3)), []) == order[32 * k:32 * (k + 1)]


def test_sampler_epochs_reshuffle_identically_on_every_rank():
    s0 = BalancedBatchSampler(64, [4, 4], 0, seed=1)
    s1 = BalancedBatchSampler(64, [4, 4], 1, seed=1)
    first = list(s0)
    s0.set_epoch(1)
    s1.set_epoch(1)
    assert list(s0) != first
    assert s0.order() == s1.order()
    assert set(sum(list(s0), [])).isdisjoint(sum(list(s1), []))


def test_sampler_rejects_dataset_smaller_than_a_global_batch():
    with pytest.raises(UsageError, match="smaller than one global batch"):
        BalancedBatchSampler(10, [8, 8], 0)


def test_loss_weight_makes_rank_average_the_global_mean():
    # Per-sample losses on 3 ranks; DeepSpeed averages weighted rank means over ranks.
    losses = [[1.0] * 5, [2.0] * 11, [4.0] * 16]
    b = [len(x) for x in losses]
    averaged = sum(loss_weight(b[r], 3, 32) * sum(x) / b[r] for r, x in enumerate(losses)) / 3
    assert averaged == pytest.approx(sum(sum(x) for x in losses) / 32)
    unweighted = sum(sum(x) / b[r] for r, x in enumerate(losses)) / 3
    assert unweighted != pytest.approx(averaged)


def test_calibrate_reports_samples_per_second_excluding_warmup():
    now = [0.0]
    calls = []

    def step(b):
        calls.append(b)
        now[0] += 0.5 if len(calls) == 1 else b / 100.0  # first call slow (warm-up), then 100 samples/s

    rate = calibrate(step, [8, 16], steps=3, warmup=1, clock=lambda: now[0])
    assert rate == pytest.approx(100.0)
    assert calls == [8, 8, 8, 8, 16, 16, 16, 16]


def test_share_plan_records_weights_and_step_times():
    plan = SharePlan(samples_per_s=[100.0, 50.0], max_micro=None, global_batch=30, shares=[20, 10])
    d = plan.to_dict()
    assert d["loss_weights"] == [pytest.approx(4 / 3), pytest.approx(2 / 3)]
    assert d["predicted_step_s"] == [0.2, 0.2]


def test_auto_batching_follows_the_cluster_decision_and_an_explicit_choice_wins():
    from dscluster.core.balanced import resolve_batching

    assert resolve_batching("auto", {"DSCLUSTER_BATCHING": "balanced"}) == "balanced"
    assert resolve_batching("auto", {}) == "uniform"  # no `dscluster check` on this cluster
    assert resolve_batching("uniform", {"DSCLUSTER_BATCHING": "balanced"}) == "uniform"
    with pytest.raises(UsageError, match="DSCLUSTER_BATCHING='sideways'"):
        resolve_batching("auto", {"DSCLUSTER_BATCHING": "sideways"})
