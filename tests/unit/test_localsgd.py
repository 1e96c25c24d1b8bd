"""sync.mode local_sgd / diloco: when ranks average, with what weights, what DiLoCo's outer step does, the
loss scales agreeing, the state a checkpoint keeps, the config's refusals; buffers, a non-finite rank, a
parameter without a gradient on one rank, nodes told apart by machine, and the streamed average with a
checkpoint taken while it is in flight. The averager runs on a real gloo group of 4 processes on two
"nodes" (core/localsgd.py)."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as tdist

from _spawn import spawn_ranks
from dscluster.core import localsgd, syncmode
from dscluster.core.config import load_config
from dscluster.core.guards import TrainingAborted
from dscluster.errors import UsageError


def test_sync_points_are_step_numbers_every_rank_shares():
    at = [s for s in range(1, 51) if syncmode.is_sync_point(s, period=8, step_in_epoch=(s - 1) % 22,
                                                               steps_per_epoch=22, total=50)]
    # every 8th step, each epoch's last (22, 44) and the run's last (50)
    assert at == [8, 16, 22, 24, 32, 40, 44, 48, 50]
    with_saves = [s for s in range(1, 21) if syncmode.is_sync_point(s, period=8, step_in_epoch=s - 1,
                                                                     steps_per_epoch=100, total=100, every_steps=5)]
    assert with_saves == [5, 8, 10, 15, 16, 20]


def test_nodes_and_weights_follow_hosts_and_shares():
    hosts = ["a", "a", "b", "c"]
    assert syncmode.node_groups(hosts) == [[0, 1], [2], [3]]
    inside, whole = syncmode.weights([30, 10, 40, 20], hosts)
    assert inside == [0.75, 0.25, 1.0, 1.0]  # each rank's share of its node's samples
    assert whole == [0.3, 0.1, 0.4, 0.2]


def test_labels_key_plan_and_paste_back():
    cfg = load_config(None, ["sync.mode=diloco", "sync.period=16"])
    assert syncmode.label(cfg) == "diloco:16"
    assert syncmode.parse_label("diloco:16") == ("diloco", 16)
    assert syncmode.parse_label("powersgd") == ("every_step", 1)
    assert syncmode.paste_args("diloco:16") == ["sync.mode=diloco", "sync.period=16"]
    assert syncmode.paste_args("local_sgd:8", "fp16") == ["sync.mode=local_sgd", "sync.period=8",
                                                          "comm.compression=none"]
    assert syncmode.label(load_config(None, ["comm.compression=fp16"])) == "fp16"
    assert syncmode.paste_args("fp16") == ["comm.compression=fp16"]
    assert syncmode.paste_args("none", "local_sgd:8") == ["comm.compression=none", "sync.mode=every_step"]


@pytest.mark.parametrize("overrides, words", [
    (["sync.mode=local_sgd", "zero_stage=1"], "needs zero_stage=0"),
    (["sync.mode=diloco", "comm.compression=fp16"], "set comm.compression=none"),
    (["sync.mode=local_sgd", "precision=fp16", "amp=false"], "set amp=true"),
    (["sync.mode=local_sgd", "sync.period=1"], "sync.period"),
    (["sync.mode=hourly"], "sync.mode"),
    (["sync.mode=local_sgd", "sync.period=4", "sync.delay_steps=4"], "sync.delay_steps to at most 3"),
    (["sync.mode=local_sgd", "sync.compression=int8"], "sync.compression"),
])
def test_refused_settings_name_the_key_and_the_fix(overrides, words):
    with pytest.raises(UsageError) as e:
        load_config(None, overrides)
    assert words in str(e.value) and "override" in str(e.value)


def test_streamed_sync_points_leave_epoch_ends_and_saves_to_the_last_average():
    at = [s for s in range(1, 51) if syncmode.is_sync_point(s, period=8, step_in_epoch=(s - 1) % 22,
                                                               steps_per_epoch=22, total=50, every_steps=5, delay=2)]
    assert at == [8, 16, 24, 32, 40, 48, 50]


# --- the averager on a real process group --------------------------------------------------------------

HOSTS = ["lab", "lab", "lab", "lab"]   # four ranks of one host name: two machines cloned from one image
NODES = ["lab/m1/b1", "lab/m1/b1", "lab/m2/b2", "lab/m2/b2"]  # what dist.node_identity tells apart
SHARES = [3, 1, 2, 2]
MEAN = (1 * 3 + 2 * 1 + 3 * 2 + 4 * 2) / 8   # weights 1, 2, 3, 4 averaged by share


class _Cfg:
    def __init__(self, mode: str, *, delay: int = 0, compression: str = "none"):
        self.sync = type("S", (), {"mode": mode, "period": 2, "warmup_steps": 1, "outer_lr": 0.5,
                                   "outer_momentum": 0.5, "delay_steps": delay, "compression": compression})()
        self.checkpoint = type("C", (), {"every_steps": 0})()
        self.ddp_bucket_mb = 1


SEPARATE = ["a", "b", "c", "d"]   # one rank a node: where a scenario needs no node of two (nor its groups)


def _averager(model, rank: int, mode: str = "local_sgd", **kwargs) -> localsgd.ModelAverager:
    optimizer = kwargs.pop("optimizer", None)
    scaler = kwargs.pop("scaler", None)
    nodes = kwargs.pop("nodes", NODES)
    return localsgd.ModelAverager(model, _Cfg(mode, **kwargs), rank, nodes, SHARES, hosts=HOSTS, steps_per_epoch=100,
                                  total=100, scaler=scaler, optimizer=optimizer)


def _linear(value: float) -> torch.nn.Linear:
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(value)
    return model


SCENARIOS = ("local_sgd", "diloco", "guards", "streamed", "own_state", "overlapped")


def _worker(rank: int, world: int, port: int, tmp: str, out) -> None:
    """Every scenario in turn on one process group (four spawned interpreters are seconds of start-up). A short
    timeout: a collective that the ranks call with different tensors fails instead of hanging the suite."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    tdist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))
    try:
        seen = {}
        for name in SCENARIOS:
            where = os.path.join(tmp, name)
            if name in ("local_sgd", "diloco"):
                seen[name] = _one_mode(rank, name, where)
            else:
                seen[name] = {"guards": _guards, "streamed": _streamed, "own_state": _own_state,
                              "overlapped": _overlapped}[name](rank, where)
        out.put((rank, seen))
    finally:
        tdist.destroy_process_group()


def _one_mode(rank: int, mode: str, tmp: str) -> dict:
    model = _linear(1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** (10 - rank))  # rank 3 overflowed most
    scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    scaler._growth_tracker.fill_(10 + rank)
    avg = _averager(model, rank, mode, scaler=scaler)
    seen = {}
    # step 1, the warm-up: gradients averaged over all four ranks by their shares
    model.weight.grad = torch.full((1, 2), float(rank))
    avg.reduce_gradients(1)
    seen["warmup_grad"] = model.weight.grad[0, 0].item()
    # step 2: only inside the node; then every rank takes its own step, and step 2 is a sync point
    model.weight.grad = torch.full((1, 2), float(rank))
    avg.reduce_gradients(2)
    seen["node_grad"] = model.weight.grad[0, 0].item()
    with torch.no_grad():
        model.weight.fill_(1.0 + rank)  # where this rank's steps took it
    seen["averaged_at_2"] = avg.after_step(2, step_in_epoch=1)
    seen["weight"] = model.weight[0, 0].item()
    seen["scale"] = scaler._scale.item()
    seen["growth"] = scaler._growth_tracker.item()
    seen["averaged_at_3"] = avg.after_step(3, step_in_epoch=2)
    avg.save(tmp, rank, 4)
    fresh = _averager(model, rank, mode)
    seen["restore"] = fresh.restore(tmp, rank, 4, "cpu", lambda why: [why] * 4)
    seen["momentum_back"] = None if fresh.momentum is None else fresh.momentum.tolist()
    seen["momentum"] = None if avg.momentum is None else avg.momentum.tolist()
    return seen


def _guards(rank: int, tmp: str) -> dict:
    """A parameter without a gradient on one rank, BatchNorm's statistics, then a rank gone non-finite."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0)
    avg = _averager(model, rank)
    seen = {}
    for p in model.parameters():
        p.grad = torch.full_like(p, rank + 1.0)
    if rank == 1:
        model[0].bias.grad = None  # unused in this rank's forward
    avg.reduce_gradients(2)
    seen["bias_grad"] = model[0].bias.grad[0].item()
    model[1].running_mean.fill_(float(rank))
    avg.after_step(2, step_in_epoch=1)
    seen["running_mean"] = model[1].running_mean[0].item()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(2.0 + rank)
        if rank == 3:
            model[0].weight[0, 0] = float("nan")
    avg.after_step(4, step_in_epoch=3)  # the average of step 4: decided on the device, read on the host later
    seen["weight_after_average"] = model[0].weight[0, 1].item()
    try:
        avg.after_step(5, step_in_epoch=4)
        seen["stopped"] = None
    except TrainingAborted as e:
        seen["stopped"] = (str(e), e.failed_ranks, e.failed_hosts)
    seen["weight_after_stop"] = model[0].weight[0, 1].item()
    return seen


def _streamed(rank: int, tmp: str) -> dict:
    """τ = 1: started at step 2, applied at step 3 with each rank's own progress kept; a checkpoint taken while
    it is in flight resumes into the same result. And the change in bf16 on the wire."""
    model = _linear(1.0)
    avg = _averager(model, rank, delay=1, nodes=SEPARATE)
    model.weight.grad = torch.zeros(1, 2)
    avg.reduce_gradients(2)  # the period's start: 1.0 everywhere
    with torch.no_grad():
        model.weight.fill_(1.0 + rank)
    seen = {"started_at_2": avg.after_step(2, step_in_epoch=1), "weight_at_2": model.weight[0, 0].item()}
    avg.save(tmp, rank, 4)
    again = _linear(1.0)  # what DeepSpeed loads on every rank: rank 0's weights
    resumed = _averager(again, rank, delay=1, nodes=SEPARATE)
    seen["restore"] = resumed.restore(tmp, rank, 4, "cpu", lambda why: [why] * 4)
    with torch.no_grad():
        for m in (model, again):
            m.weight.add_(10.0)  # step 3's own progress
    seen["applied_at_3"] = avg.after_step(3, step_in_epoch=2)
    resumed.after_step(3, step_in_epoch=2)
    seen["weight"] = model.weight[0, 0].item()
    seen["resumed_weight"] = again.weight[0, 0].item()
    half = _linear(1.0)
    wire = _averager(half, rank, compression="bf16", nodes=SEPARATE)
    half.weight.grad = torch.zeros(1, 2)
    wire.reduce_gradients(2)
    with torch.no_grad():
        half.weight.fill_(1.0 + rank / 64)
    wire.after_step(2, step_in_epoch=1)
    seen["bf16_weight"] = half.weight[0, 0].item()
    return seen


class _Moments:
    """What the averager asks of an optimizer: its state as a dict, and that dict back (the first step of a
    torch optimizer imports torch._dynamo: seconds in each of four processes; the cluster tests resume real
    AdamW)."""

    def __init__(self, exp_avg: torch.Tensor | None = None):
        self.state = {} if exp_avg is None else {0: {"exp_avg": exp_avg}}

    def state_dict(self) -> dict:
        return {"state": self.state, "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0]}]}

    def load_state_dict(self, saved: dict) -> None:
        self.state = saved["state"]


def _own_state(rank: int, tmp: str) -> dict:
    """Each rank's optimizer moments come back as its own, not the ones DeepSpeed's rank-0 file holds."""
    model = _linear(1.0)
    mine = _Moments(torch.full((1, 2), rank + 1.0))
    _averager(model, rank, optimizer=mine, nodes=SEPARATE).save(tmp, rank, 4)
    fresh = _Moments()
    _averager(_linear(1.0), rank, optimizer=fresh, nodes=SEPARATE).restore(tmp, rank, 4, "cpu",
                                                                           lambda why: [why] * 4)
    return {"saved": mine.state[0]["exp_avg"].tolist(),
            "back": fresh.state[0]["exp_avg"].tolist() if fresh.state else None}


def _overlapped(rank: int, tmp: str) -> dict:
    """The in-node reduction starts while backward runs (one bucket a parameter here), and rank 1, whose
    forward leaves the first layer's bias out, still ends with its node's gradients."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    avg = _averager(model, rank)
    avg.buckets = [[i] for i in reversed(range(len(avg.params)))]  # 1 MB holds them all: a bucket each instead
    avg.bucket_of = {i: b for b, bucket in enumerate(avg.buckets) for i in bucket}
    x = torch.full((1, 2), rank + 1.0)
    avg.arm(2)
    first = model[0]
    hidden = torch.nn.functional.linear(x, first.weight) if rank == 1 else first(x)
    model[1](hidden).sum().backward()
    seen = {"sent_in_backward": len(avg.sent), "buckets": len(avg.buckets)}
    avg.reduce_gradients(2)
    seen["grads"] = [p.grad.flatten().tolist() for p in model.parameters()]
    return seen


@pytest.fixture(scope="module")
def averaged(tmp_path_factory) -> dict[str, dict[int, dict]]:
    """{scenario: {rank: what it saw}}, from one run of four ranks."""
    got = spawn_ranks(_worker, 4, str(tmp_path_factory.mktemp("avg")), timeout=120)
    return {name: {r: got[r][name] for r in got} for name in SCENARIOS}


def test_local_sgd_hierarchy_average_scale_agreement_and_state(averaged):
    got = averaged["local_sgd"]
    for r in range(4):
        s = got[r]
        # warm-up: the global batch mean, every rank's gradient weighted by its share (3,1,2,2 of 8)
        assert s["warmup_grad"] == pytest.approx((0 * 3 + 1 * 1 + 2 * 2 + 3 * 2) / 8)
        # after it, inside the node only: one host name, but machine m1's ranks 0,1 (shares 3:1), m2's 2,3 (2:2)
        assert s["node_grad"] == pytest.approx(0.25 if r < 2 else 2.5)
        assert s["averaged_at_2"] and not s["averaged_at_3"]
        assert s["weight"] == pytest.approx(MEAN)
        # fp16: every rank goes on at the smallest scale and growth count any rank had
        assert (s["scale"], s["growth"]) == (2.0 ** 7, 10)
        assert s["restore"].startswith("sync state restored (local_sgd")


def test_diloco_outer_nesterov_step_and_its_momentum_survive_a_checkpoint(averaged):
    got = averaged["diloco"]
    start = 1.0
    delta = start - MEAN            # the outer gradient
    momentum = delta                # the first step: m = 0.5·0 + Δ
    expected = start - 0.5 * (delta + 0.5 * momentum)  # Nesterov, outer_lr 0.5, momentum 0.5
    for r in range(4):
        assert got[r]["weight"] == pytest.approx(expected)
        assert got[r]["momentum"] == pytest.approx([momentum, momentum])
        assert got[r]["momentum_back"] == pytest.approx([momentum, momentum])


def test_no_gradient_on_one_rank_buffers_averaged_and_a_non_finite_rank_stops_all(averaged):
    got = averaged["guards"]
    for r in range(4):
        s = got[r]
        # rank 1 had no gradient for the bias: zero in its node's mean (m1: 1·3/4), no hang; m2: (3+4)/2
        assert s["bias_grad"] == pytest.approx(0.75 if r < 2 else 3.5)
        assert s["running_mean"] == pytest.approx((0 * 3 + 1 * 1 + 2 * 2 + 3 * 2) / 8)  # weighted as the weights
        # the next step stops every rank, naming the average; nothing of it was applied, on any rank
        message, ranks, hosts = s["stopped"]
        assert ranks == [3] and hosts == ["lab"] and "rank 3 on lab" in message and "nothing was averaged" in message
        assert "the average of step 4" in message
        assert s["weight_after_average"] == s["weight_after_stop"] == 2.0 + r


def test_streamed_average_applies_later_keeps_own_progress_and_resumes_in_flight(averaged):
    got = averaged["streamed"]
    for r in range(4):
        s = got[r]
        assert s["started_at_2"] and s["weight_at_2"] == 1.0 + r  # started, not applied: training goes on
        assert s["applied_at_3"]
        assert s["weight"] == pytest.approx(MEAN + 10.0)  # the average of step 2, plus step 3's own progress
        assert s["resumed_weight"] == s["weight"]  # the checkpoint held the average in flight: sent again
        assert s["restore"].startswith("sync state restored (local_sgd")
        assert s["bf16_weight"] == pytest.approx(1.0 + (0 * 3 + 1 * 1 + 2 * 2 + 3 * 2) / 8 / 64, rel=1e-3)


def test_each_rank_resumes_its_own_optimizer_moments(averaged):
    got = averaged["own_state"]
    assert got[0]["saved"] != got[1]["saved"]
    for r in range(4):
        assert got[r]["back"] == got[r]["saved"]


def test_a_nodes_gradients_go_out_while_backward_runs_and_meet_every_rank_of_it(averaged):
    got = averaged["overlapped"]
    # 4 buckets: rank 1 sends the last layer's two while backward runs, and the rest after (no gradient for
    # the first layer's bias, whose bucket comes before the first layer's weight's); every other rank all four
    assert [got[r]["sent_in_backward"] for r in range(4)] == [4, 2, 4, 4]
    assert got[0]["grads"] == got[1]["grads"] and got[2]["grads"] == got[3]["grads"]
    assert got[0]["grads"] != got[2]["grads"]
