#!/usr/bin/env python3
"""Plain DeepSpeed training that dscluster runs and measures: no dscluster trainer, no framework.

    mpirun -np 2 --hostfile hosts.txt ./entry_cn.sh python examples/ds_train.py --steps 20
    dscluster launch --hostfile hosts.txt -- python examples/ds_train.py --steps 20
    python analysis/plot.py runs/<id>

entry_cn.sh gives every rank its node's env from `dscluster check` (interface, P2P), all of the
node's GPUs, RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, the node's telemetry sampler and
DSCLUSTER_RUN_DIR; this script only adds three dscluster.userlog calls so that `plot` and
`diagnose` read its steps. The task is a fixed random "teacher" network that a small MLP learns
to imitate on random inputs, so the loss falls without a data set. Walkthrough: docs/byo-script.md.
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    # DeepSpeed picks its accelerator when imported: tell it there is no GPU first.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dscluster import userlog  # noqa: E402
from dscluster.core.dist import skip_cpu_shm_build  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--micro-batch", type=int, default=32, help="samples per rank per step")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--zero-stage", type=int, default=0, choices=(0, 1, 2, 3))
    return p.parse_args()


def batch(step: int, rank: int, n: int, dim: int, teacher: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    # Each rank its own samples (seeded by rank and step): data parallelism, no loader needed.
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(n, dim, generator=g)
    return x.to(device), (x @ teacher).argmax(dim=1).to(device)


def main() -> int:
    args = parse_args()
    on_gpu = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if on_gpu:
        # Every rank sees all of its node's GPUs (torchrun's convention): take the local-rank-th.
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    else:
        # DeepSpeed's CPU backend compiles a shared-memory all-reduce op at start-up that only
        # inference uses (80-100 s per start on a busy 2-core machine): leave it out.
        skip_cpu_shm_build()
    # RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from the launcher via entry_cn.sh.
    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    try:
        torch.manual_seed(0)  # the same initial weights and teacher on every rank
        teacher = torch.randn(args.dim, 10)
        model = torch.nn.Sequential(torch.nn.Linear(args.dim, 4 * args.dim), torch.nn.GELU(),
                                    torch.nn.Linear(4 * args.dim, 10))
        ds_config = {
            "train_micro_batch_size_per_gpu": args.micro_batch,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": args.zero_stage},
            "steps_per_print": 10**9,  # dscluster's records replace DeepSpeed's console lines
        }
        # A torch optimizer: DeepSpeed's own Adam would compile a CUDA/CPU op on first use.
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
        params = sum(p.numel() for p in model.parameters())
        with userlog.open_run(device=str(device), precision="fp32", micro_batch=args.micro_batch,
                              global_batch=args.micro_batch * world, params=params) as log:
            for step in range(1, args.steps + 1):
                x, y = batch(step, rank, args.micro_batch, args.dim, teacher, engine.device)
                loss = F.cross_entropy(engine(x), y)
                engine.backward(loss)
                engine.step()
                # .item() waits for the device (and this step's all-reduce): the step's wall-clock time is real.
                rec = log.step(step, loss.item(), samples=args.micro_batch, lr=opt.param_groups[0]["lr"])
                if rank == 0 and (step % 10 == 0 or step == args.steps):
                    print(f"step {step}/{args.steps} loss {rec['loss']:.4f} {rec['samples_per_s']:.0f} samples/s",
                          flush=True)
        if rank == 0:
            print(f"run directory: {log.path}", flush=True)
    finally:
        # DeepSpeed's engine sits in reference cycles: free it while the process group exists, then
        # the group. Left to interpreter exit, a rank could abort in teardown ("terminate called
        # without an active exception", exit 134) after training had finished.
        engine = model = opt = None  # noqa: F841
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
