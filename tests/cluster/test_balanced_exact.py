"""Balanced batching is exact: 3 DeepSpeed ranks on gloo with shares 5/11/16, each rank's loss
scaled by loss_weight, end with the parameters of one process trained on the whole batch.

Three localhost processes (torchrun-style RANK/WORLD_SIZE/MASTER_* environment), a real
DeepSpeed engine (fp32, ZeRO 0, SGD), CPU only: no root and no lab needed. The same file is
the worker: `python test_balanced_exact.py OUT_DIR` with the rank environment set.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dscluster.bench.runner import free_port

SHARES = [5, 11, 16]
IN, HIDDEN, CLASSES = 8, 16, 4
DATASET = 160
SEED = 7

# (name, gradient_accumulation_steps, optimizer steps, weighted, gradient clipping, momentum)
SCENARIOS = [
    ("one_step", 1, 1, True, 0.0, 0.0),
    ("one_step_unweighted", 1, 1, False, 0.0, 0.0),
    ("accum2_two_steps", 2, 2, True, 0.0, 0.9),
    ("accum2_two_steps_unweighted", 2, 2, False, 0.0, 0.9),
    ("one_step_clipped", 1, 1, True, 0.05, 0.0),
]
# The same through dscluster's ZeRO-0 overlap path: torch DDP reduces inside the engine
# (DeepSpeed's all-reduce off, no_sync on non-boundary micro-steps, dscluster clips).
DDP_SCENARIOS = ["one_step", "accum2_two_steps", "one_step_clipped"]
LR = 0.5


def make_model():
    import torch

    torch.manual_seed(SEED)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, CLASSES))


def make_data():
    import torch

    g = torch.Generator().manual_seed(SEED + 1)
    x = torch.randn(DATASET, IN, generator=g)
    y = torch.randint(0, CLASSES, (DATASET,), generator=g)
    return x, y


def reference(accum: int, steps: int, clip: float, momentum: float) -> tuple[dict[str, list], list[float]]:
    """One process, plain torch: each optimizer step on the mean loss of the concatenated batch.
    Returns the final parameters and the gradient norm of every step."""
    import torch

    from dscluster.core.balanced import BalancedBatchSampler

    model = make_model()
    x, y = make_data()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum)
    order = BalancedBatchSampler(DATASET, SHARES, 0, seed=SEED).order()
    per_step = sum(SHARES) * accum
    norms = []
    for step in range(steps):
        idx = order[step * per_step:(step + 1) * per_step]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))
        norms.append(float(norm))
        opt.step()
    return {k: v.tolist() for k, v in model.state_dict().items()}, norms


def worker(out_dir: Path) -> None:
    """One rank: run every scenario through a DeepSpeed engine and save the parameters."""
    import deepspeed
    import torch

    from dscluster.core.balanced import BalancedBatchSampler, loss_weight
    from dscluster.core.dist import skip_cpu_shm_build

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    skip_cpu_shm_build()  # as training does: the op is unused there and took a minute to build on a fresh clone
    deepspeed.init_distributed(dist_backend="gloo")
    import contextlib

    from dscluster.core.config import load_config
    from dscluster.core.optstep import StepBoundary
    from dscluster.core.setup_engine import wrap_for_overlap

    x, y = make_data()
    results = {}
    runs = [(s, False) for s in SCENARIOS] + [(_scenario(n), True) for n in DDP_SCENARIOS]
    for (name, accum, steps, weighted, clip, momentum), ddp in runs:
        model = make_model()
        b = SHARES[rank]
        ds_config = {
            # Per-rank micro-batch: the engine only checks train = micro * accum * world locally.
            "train_micro_batch_size_per_gpu": b,
            "gradient_accumulation_steps": accum,
            "train_batch_size": b * accum * world,
            "gradient_clipping": 0.0 if ddp else clip,
            "zero_optimization": {"stage": 0},
            "steps_per_print": 10**9,
        }
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum)
        cfg = load_config(None, ["precision=fp32", f"optim.grad_clip={clip}"])
        wrapped = wrap_for_overlap(model, torch.device("cpu"), cfg.ddp_bucket_mb) if ddp else None
        engine, _, _, _ = deepspeed.initialize(model=wrapped or model, optimizer=opt, config=ds_config)
        norms: list[float] = []
        if ddp:
            engine.enable_backward_allreduce = False
            step_boundary = StepBoundary(engine, cfg, "fp32")
            assert step_boundary.own_clip
        sampler = BalancedBatchSampler(DATASET, SHARES, rank, seed=SEED)
        batches = iter(sampler)
        weight = loss_weight(b, world, sum(SHARES)) if weighted else 1.0
        for micro in range(steps * accum):
            idx = next(batches)
            boundary = (micro + 1) % accum == 0
            with wrapped.no_sync() if ddp and not boundary else contextlib.nullcontext():
                loss = torch.nn.functional.cross_entropy(engine(x[idx]), y[idx]) * weight
                engine.backward(loss)
            if ddp and boundary:
                # dscluster's step boundary clips after DDP reduced the gradients
                step_boundary.before_step(want_norm=True)
            engine.step()
            if ddp and boundary:
                norms.append(step_boundary.after_step()[0].item())
        key = name + (":ddp" if ddp else "")
        results[key] = {k: v.tolist() for k, v in engine.module.state_dict().items()}
        results[key + ":global_steps"] = engine.global_steps
        if ddp:
            results[key + ":norms"] = norms
    (out_dir / f"rank-{rank}.json").write_text(json.dumps(results))
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Run the 3 ranks once for the module; return each rank's saved parameters."""
    from _wait import scaled  # here, not at the top: the ranks run this file as a script
    out = tmp_path_factory.mktemp("balanced_exact")
    port = free_port()
    procs = []
    for rank in range(len(SHARES)):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(len(SHARES)),
                   LOCAL_WORLD_SIZE=str(len(SHARES)), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
        log = open(out / f"rank-{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, __file__, str(out)], env=env, stdout=log,
                                       stderr=subprocess.STDOUT), log))
    try:
        for p, _ in procs:
            p.wait(timeout=scaled(300))
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    for rank, (p, _) in enumerate(procs):
        assert p.returncode == 0, f"rank {rank} failed:\n" + (out / f"rank-{rank}.log").read_text()[-4000:]
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(len(SHARES))]


def _max_diff(a: dict, b: dict) -> float:
    import torch

    return max((torch.tensor(a[k]) - torch.tensor(b[k])).abs().max().item() for k in a)


def _scenario(name):
    return next(s for s in SCENARIOS if s[0] == name)


pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", ["one_step", "accum2_two_steps", "one_step_clipped"])
def test_weighted_ranks_match_one_process_on_the_concatenated_batch(ranks, name):
    _, accum, steps, _, clip, momentum = _scenario(name)
    want, _ = reference(accum, steps, clip, momentum)
    for rank, got in enumerate(ranks):
        assert got[name + ":global_steps"] == steps
        assert _max_diff(got[name], want) < 1e-6, f"rank {rank} differs from the single-process reference"


@pytest.mark.parametrize("name", DDP_SCENARIOS)
def test_the_ddp_overlap_path_gives_the_same_exact_update(ranks, name):
    _, accum, steps, _, clip, momentum = _scenario(name)
    want, want_norms = reference(accum, steps, clip, momentum)
    for rank, got in enumerate(ranks):
        assert got[name + ":ddp:global_steps"] == steps
        assert set(got[name + ":ddp"]) == set(want)  # checkpoint keys are the model's, no "module." prefix
        assert _max_diff(got[name + ":ddp"], want) < 1e-6, f"rank {rank} (DDP path) differs from the reference"
        # the norm logged (and clipped with) is the global batch's
        assert got[name + ":ddp:norms"] == pytest.approx(want_norms, rel=1e-5)


@pytest.mark.parametrize("name", ["one_step_unweighted", "accum2_two_steps_unweighted"])
def test_without_the_weight_the_update_is_not_the_global_mean(ranks, name):
    _, accum, steps, _, clip, momentum = _scenario(name)
    want, _ = reference(accum, steps, clip, momentum)
    # Ranks still agree with each other (DeepSpeed averaged), but not with the global-batch mean.
    assert _max_diff(ranks[0][name], ranks[2][name]) < 1e-6
    assert _max_diff(ranks[0][name], want) > 1e-3


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
