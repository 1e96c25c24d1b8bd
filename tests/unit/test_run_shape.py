"""One run-shape resolver (core/shape.py): plan and train work out precision, micro-batch,
accumulation and per-rank shares with the same code, so what plan predicts is what train runs."""

import json
from pathlib import Path

import pytest

from dscluster.cli import main

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def state(tmp_path, monkeypatch):
    monkeypatch.setenv("DSCLUSTER_STATE", str(tmp_path / "state"))
    monkeypatch.delenv("DSCLUSTER_BATCHING", raising=False)
    monkeypatch.delenv("DSCLUSTER_PRECISION", raising=False)
    return tmp_path


def hostfile(tmp_path: Path, ranks: int) -> Path:
    path = tmp_path / f"hosts{ranks}.txt"
    path.write_text("".join(f"node{i} slots=1\n" for i in range(1, ranks + 1)))
    return path


def test_plan_refuses_the_global_batch_train_refuses(state, capsys):
    """micro_batch 32 on 4 ranks cannot make global_batch 100 in whole micro-steps: train stops
    with exit 2 before anything runs (cli/train.py), and plan must not predict a run that never starts."""
    from dscluster.cli.train import check_batch_arithmetic
    from dscluster.core.balanced import resolve_batching
    from dscluster.core.config import load_config
    from dscluster.errors import UsageError

    overrides = ["micro_batch=32", "global_batch=100"]
    cfg = load_config(REPO / "configs/digits.yaml", overrides)
    cfg.batching = resolve_batching(cfg.batching)  # as `dscluster train` does first
    with pytest.raises(UsageError, match="not a multiple of micro_batch × world") as train_says:
        check_batch_arithmetic(cfg, 4)
    rc = main(["plan", "--config", str(REPO / "configs/digits.yaml"), "--hostfile", str(hostfile(state, 4)),
               "--busbw", "1", "--compute-s", "0.01", *overrides])
    assert rc == 2
    assert str(train_says.value) in capsys.readouterr().err


PRESETS = sorted(p.name for p in (REPO / "configs").glob("*.yaml"))


def mixed_shares(cfg, world: int) -> list[str]:
    """Balanced batching with per-rank shares that differ (a fast rank beside slow ones), summing to
    the preset's global batch where it has one."""
    total = cfg.global_batch or 48 * world
    base = max(1, total // (2 * world))
    shares = [total - base * (world - 1)] + [base] * (world - 1)
    return ["batching=balanced", f"shares=[{','.join(map(str, shares))}]"]


@pytest.mark.parametrize("preset", PRESETS)
def test_plan_and_train_agree_on_the_run_shape(state, capsys, preset, probes_once):
    """For every preset on 1-5 ranks, as configured and with mixed balanced shares: the micro-batch,
    accumulation and global batch plan predicts are those train runs (core/shape.py with what a
    CPU rank knows: no memory limit), and plan's saved prediction is found under train's key."""
    from dscluster.core.balanced import resolve_batching
    from dscluster.core.config import load_config
    from dscluster.core.shape import DeviceFacts, resolve
    from dscluster.runmodel import predicted

    config = REPO / "configs" / preset
    for world in range(1, 6):
        for overrides in ([], mixed_shares(load_config(config), world)):
            rc = main(["plan", "--config", str(config), "--hostfile", str(hostfile(state, world)), "--busbw", "1",
                       "--compute-s", "0.01", "--json", *overrides])
            assert rc == 0, (preset, world, overrides, capsys.readouterr().err)
            doc = json.loads(capsys.readouterr().out)
            cfg = load_config(config, overrides)  # as `dscluster train` loads it, then resolves batching
            cfg.batching = resolve_batching(cfg.batching)
            shape = resolve(cfg, world, DeviceFacts(precision=doc["precision"]))
            where = (preset, world, overrides)
            assert (doc["micro_batch"], doc["grad_accum"], doc["global_batch"]) == \
                (max(shape.shares), shape.grad_accum, sum(shape.shares) * shape.grad_accum), where
            assert doc["prediction"]["global_batch"] == doc["global_batch"], where
            # the key train/loop.py computes at the end of that run finds plan's prediction for it
            key = predicted.key(model=cfg.model.name, micro_batch=max(shape.shares),
                                global_batch=sum(shape.shares) * shape.grad_accum, precision=doc["precision"],
                                compression=cfg.comm.compression, ranks=world)
            assert predicted.lookup(key)["setting"] == "now", where


@pytest.mark.slow
def test_a_training_start_decides_its_precision_once_and_turns_the_collector_back_on(tmp_path):
    """precision.decide_here once per start: the compression check before anything is written and the
    run itself use the same decision (made on the rank's own GPU), not two that could differ. And the
    garbage collector, off while the rank starts (core/startgc.py), is on again for training, with the
    start-up's objects frozen out of its passes: off for a whole run, cycles would pile up for days. The
    engine, frozen with them, is still freed before the process group goes (left to interpreter exit, a
    finished gloo rank aborted in teardown, exit 134)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "RANK", "DSCLUSTER_"))}
    env.update(DSCLUSTER_RUNS=str(tmp_path), DSCLUSTER_RUN_ID="once")
    code = f"""
import json, sys
from dscluster.train import loop
from dscluster.core import precision
calls = []
def counted(*args, **kwargs):
    calls.append(args)
    return precision.decide_here(*args, **kwargs)
loop.decide_here = counted
import gc, weakref
from dscluster.core import dist, setup_engine, startgc
seen = {{}}
settle, build, destroy = startgc.settle, setup_engine.build, dist.destroy
def settled():
    settle()
    seen["on"], seen["frozen"] = gc.isenabled(), gc.get_freeze_count()
def built(*args, **kwargs):
    b = build(*args, **kwargs)
    seen["engine"] = weakref.ref(b.engine)
    return b
def destroyed():
    seen["engine alive at the group's end"] = seen.pop("engine")() is not None
    destroy()
startgc.settle, setup_engine.build, dist.destroy = settled, built, destroyed
from dscluster.cli import main
rc = main(["train", "--config", {str(REPO / "configs/digits.yaml")!r}, "max_steps=1", "epochs=1",
           "checkpoint.every_epochs=0", "progress=false", "comm.compression=fp16"])
print("decide_here calls:", len(calls))
print("seen:", json.dumps(seen))
sys.exit(rc)
"""
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "decide_here calls: 1" in res.stdout
    seen = json.loads(res.stdout.split("seen:")[1].splitlines()[0])
    assert seen["on"] and seen["frozen"] > 100_000, res.stdout  # while training; torch and friends: ~410,000
    assert seen["engine alive at the group's end"] is False, res.stdout
    assert json.loads((tmp_path / "once" / "summary.json").read_text())["precision"] == "fp32"
