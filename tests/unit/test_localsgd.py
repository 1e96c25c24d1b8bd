"""sync.mode local_sgd / diloco: when ranks average, with what weights, what DiLoCo's outer step does, the
loss scales agreeing, the state a checkpoint keeps, and the config's refusals. The averager runs on a real
gloo group of 4 processes on two "hosts" (train/localsgd.py)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as tdist

from _spawn import spawn_ranks
from dscluster import syncmode
from dscluster.errors import UsageError
from dscluster.train import localsgd
from dscluster.train.config import load_config


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
])
def test_refused_settings_name_the_key_and_the_fix(overrides, words):
    with pytest.raises(UsageError) as e:
        load_config(None, overrides)
    assert words in str(e.value) and "override" in str(e.value)


# --- the averager on a real process group --------------------------------------------------------------

HOSTS = ["hostA", "hostA", "hostB", "hostB"]
SHARES = [3, 1, 2, 2]


class _Cfg:
    def __init__(self, mode: str):
        self.sync = type("S", (), {"mode": mode, "period": 2, "warmup_steps": 1, "outer_lr": 0.5,
                                   "outer_momentum": 0.5})()
        self.checkpoint = type("C", (), {"every_steps": 0})()


def _worker(rank: int, world: int, port: int, modes: tuple[str, ...], tmp: str, out) -> None:
    """Each mode in turn on one process group (four spawned interpreters are seconds of start-up)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    tdist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out.put((rank, {mode: _one_mode(rank, mode, os.path.join(tmp, mode)) for mode in modes}))
    finally:
        tdist.destroy_process_group()


def _one_mode(rank: int, mode: str, tmp: str) -> dict:
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** (10 - rank))  # rank 3 overflowed most
    scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    scaler._growth_tracker.fill_(10 + rank)
    avg = localsgd.ModelAverager(model, _Cfg(mode), rank, HOSTS, SHARES, steps_per_epoch=100, total=100,
                                 scaler=scaler)
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
    seen["scale"], seen["growth"] = scaler._scale.item(), scaler._growth_tracker.item()
    seen["averaged_at_3"] = avg.after_step(3, step_in_epoch=2)
    avg.save(tmp, rank, 4)
    fresh = localsgd.ModelAverager(model, _Cfg(mode), rank, HOSTS, SHARES, steps_per_epoch=100, total=100)
    seen["restore"] = fresh.restore(tmp, rank, 4, "cpu", lambda why: [why] * 4)
    seen["momentum_back"] = None if fresh.momentum is None else fresh.momentum.tolist()
    seen["momentum"] = None if avg.momentum is None else avg.momentum.tolist()
    return seen


@pytest.fixture(scope="module")
def averaged(tmp_path_factory) -> dict[str, dict[int, dict]]:
    """{mode: {rank: what it saw}} for local_sgd and diloco, from one run of four ranks."""
    got = spawn_ranks(_worker, 4, ("local_sgd", "diloco"), str(tmp_path_factory.mktemp("avg")), timeout=120)
    return {mode: {r: got[r][mode] for r in got} for mode in ("local_sgd", "diloco")}


def test_local_sgd_hierarchy_average_scale_agreement_and_state(averaged):
    got = averaged["local_sgd"]
    for r in range(4):
        s = got[r]
        # warm-up: the global batch mean, every rank's gradient weighted by its share (3,1,2,2 of 8)
        assert s["warmup_grad"] == pytest.approx((0 * 3 + 1 * 1 + 2 * 2 + 3 * 2) / 8)
        # after it, inside the node only: hostA's ranks 0,1 (shares 3:1), hostB's ranks 2,3 (2:2)
        assert s["node_grad"] == pytest.approx(0.25 if r < 2 else 2.5)
        # the models' average by share: weights 1,2,3,4
        assert s["averaged_at_2"] and not s["averaged_at_3"]
        assert s["weight"] == pytest.approx((1 * 3 + 2 * 1 + 3 * 2 + 4 * 2) / 8)
        # fp16: every rank goes on at the smallest scale and growth count any rank had
        assert (s["scale"], s["growth"]) == (2.0 ** 7, 10)
        assert s["restore"].startswith("sync state restored (local_sgd")


def test_diloco_outer_nesterov_step_and_its_momentum_survive_a_checkpoint(averaged):
    got = averaged["diloco"]
    start, mean = 1.0, (1 * 3 + 2 * 1 + 3 * 2 + 4 * 2) / 8
    delta = start - mean            # the outer gradient
    momentum = delta                # the first step: m = 0.5·0 + Δ
    expected = start - 0.5 * (delta + 0.5 * momentum)  # Nesterov, outer_lr 0.5, momentum 0.5
    for r in range(4):
        assert got[r]["weight"] == pytest.approx(expected)
        assert got[r]["momentum"] == pytest.approx([momentum, momentum])
        assert got[r]["momentum_back"] == pytest.approx([momentum, momentum])
