"""The held-out pass shared by every rank (core/evaluation.py): on 2 in-process gloo ranks with the same weights,
each evaluates only its contiguous share and one all-reduce gives rank 0 the one-rank figures; a streamed
average keeps rank 0 alone; ZeRO-3's ranks run as many forwards; plan prices the busiest rank's share."""

from __future__ import annotations

import datetime
import os
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as tdist

from _spawn import spawn_ranks
from dscluster.core import evaluation
from dscluster.core.config import load_config

REPO = Path(__file__).resolve().parents[2]
DIGITS = str(REPO / "configs/digits.yaml")
N = 101
"""Held-out samples: an odd count, so the two shares differ (50 and 51) and split over several batches."""
BATCH = 16
STREAMED = ["sync.mode=local_sgd", "sync.period=8", "sync.delay_steps=2"]


class Held:
    """A held-out set as ImageSet.get_batch serves it, noting every index it serves."""

    def __init__(self, n: int):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)
        self.served: list[int] = []

    def __len__(self) -> int:
        return len(self.y)

    def get_batch(self, idx, device, dtype, channels_last=False):
        self.served.extend(idx)
        return self.x[idx].to(device, dtype), self.y[idx].to(device)


class Log:
    def __init__(self):
        self.records: list[dict] = []

    def record(self, kind: str, **fields) -> dict:
        self.records.append({"kind": kind, **fields})
        return self.records[-1]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same weights on every rank, as after every-step training
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def _pass(cfg, rank: int) -> dict:
    """One held_out() call as the loop makes it: what rank `rank` served, returned and recorded."""
    held = Held(N)
    built = SimpleNamespace(splits=SimpleNamespace(holdout=held), dtype=torch.float32, autocast=None)
    log = Log()
    acc = evaluation.held_out(SimpleNamespace(module=_model()), built, cfg, torch.device("cpu"), primary=rank == 0,
                              log=log, progress=SimpleNamespace(print=lambda text: None), epoch=0, step=1)
    return {"served": held.served, "accuracy": acc, "records": log.records}


def _worker(rank: int, world: int, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    tdist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))
    try:
        seen = {"every_step": _pass(load_config(DIGITS, []), rank),
                "streamed": _pass(load_config(DIGITS, STREAMED), rank)}
        held = Held(N)
        forwards = []
        model = _model()
        model.register_forward_hook(lambda m, i, o: forwards.append(len(o)))
        evaluation.evaluate(SimpleNamespace(module=model), held, torch.float32, torch.device("cpu"), False,
                            batch=50, rank=rank, world=world, lockstep=True)  # shares 50 and 51: 1 and 2 batches
        seen["lockstep"] = {"served": held.served, "forwards": forwards}
        out.put((rank, seen))
    finally:
        tdist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks() -> dict[int, dict]:
    return spawn_ranks(_worker, 2, timeout=120)


def test_each_rank_evaluates_its_share_and_rank0_gets_the_one_rank_accuracy(ranks):
    alone = evaluation.evaluate(SimpleNamespace(module=_model()), Held(N), torch.float32, torch.device("cpu"),
                                False)
    got = {r: ranks[r]["every_step"] for r in (0, 1)}
    assert got[0]["served"] == list(range(50)) and got[1]["served"] == list(range(50, N))
    rec = got[0]["records"][0]
    assert round(rec["accuracy"] * N) == round(alone[0] * N)  # exactly the same correct count
    assert rec["accuracy"] == got[0]["accuracy"] == alone[0]
    assert rec["loss"] == pytest.approx(alone[1], rel=1e-6) and rec["samples"] == N == alone[2]
    assert got[1]["accuracy"] is None and got[1]["records"] == []  # rank 0 alone records


def test_a_streamed_average_keeps_rank0_evaluating_alone(ranks):
    got = {r: ranks[r]["streamed"] for r in (0, 1)}
    assert got[0]["served"] == list(range(N)) and got[1]["served"] == []
    assert got[0]["records"][0]["samples"] == N


def test_zero3_ranks_run_as_many_forwards_on_their_own_shares(ranks):
    # rank 0's 50 samples are one batch of 50, rank 1's 51 two: rank 0 runs one more forward, uncounted
    assert ranks[0]["lockstep"]["forwards"] == [50, 1] and ranks[0]["lockstep"]["served"] == [*range(50), 0]
    assert ranks[1]["lockstep"]["forwards"] == [50, 1] and ranks[1]["lockstep"]["served"] == list(range(50, N))


def test_every_rank_holds_the_held_out_split_where_the_pass_is_shared():
    every_step = load_config(DIGITS, [])
    assert evaluation.evaluates(every_step, primary=False)
    assert evaluation.evaluates(load_config(DIGITS, ["sync.mode=local_sgd", "sync.period=8"]), primary=False)
    assert not evaluation.evaluates(load_config(DIGITS, STREAMED), primary=False)
    assert evaluation.evaluates(load_config(DIGITS, STREAMED), primary=True)


def test_plan_prices_a_shared_held_out_pass_at_about_half_on_two_ranks():
    from dscluster.plan import datafeed, model, wholerun

    cfg = load_config(DIGITS, [])
    node = model.Node(name="a", compute_s=0.05)
    alone = model.Scenario(nodes=(node,), micro_batch=64, grad_bytes=4e6, busbw_GBps=1.0, latency_s=0.001)
    two = replace(alone, nodes=(node, replace(node, name="b")))
    facts = datafeed.DataFacts(train_n=40_000, holdout_n=10_000, image_bytes=3 * 224 * 224, cached_train=True,
                               cached_holdout=True)

    def eval_s(c, s) -> float:
        return wholerun.costs(c, s, model.predict(s), start=None, facts=facts, warmup_extra_s=0.0,
                              params=1_000_000).eval_s

    one_rank = eval_s(cfg, alone)
    assert eval_s(cfg, two) == pytest.approx(one_rank / 2, rel=0.02)
    streamed = replace(two, compression="local_sgd:8")
    assert eval_s(load_config(DIGITS, STREAMED), streamed) == pytest.approx(one_rank)  # rank 0 alone
