#!/usr/bin/env python3
"""A plain DeepSpeed training script, written the way DeepSpeed's own examples are: nothing from dscluster.

    mpirun -np 2 --hostfile hosts.txt ./entry_cn.sh python examples/ds_train_plain.py --steps 20
    python analysis/plot.py runs/<id>

entry_cn.sh records every rank's start, end, exit code, host and GPU (process/rank-R.json) and
summary.json says how the job ended. The loss and learning rate reach the report through
DeepSpeed's own csv_monitor, whose output_path is the run directory entry_cn.sh exports
(DSCLUSTER_RUN_DIR; any directory inside the run directory works). Same task as
examples/ds_train.py (a small MLP imitating a fixed random teacher), which adds dscluster.userlog
for per-step timing. Walkthrough: docs/byo-script.md.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    # DeepSpeed picks its accelerator when imported: tell it there is no GPU first.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch.distributed as dist  # noqa: E402

if not torch.cuda.is_available():
    # DeepSpeed's CPU backend compiles a shared-memory all-reduce op at start-up that only inference
    # uses (minutes on a small machine): a CPU-only run leaves it out. On a GPU nothing changes.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--monitor-dir", default=os.environ.get("DSCLUSTER_RUN_DIR", "monitor"),
                   help="where DeepSpeed's csv_monitor writes (default: the run directory)")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    teacher = torch.randn(args.dim, 10)
    model = torch.nn.Sequential(torch.nn.Linear(args.dim, 4 * args.dim), torch.nn.GELU(),
                                torch.nn.Linear(4 * args.dim, 10))
    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10,
        "csv_monitor": {"enabled": True, "output_path": args.monitor_dir, "job_name": "deepspeed"},
    }
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
    for step in range(1, args.steps + 1):
        g = torch.Generator().manual_seed(step * 1000 + rank)
        x = torch.randn(args.micro_batch, args.dim, generator=g)
        y = (x @ teacher).argmax(dim=1)
        loss = F.cross_entropy(engine(x.to(engine.device)), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        # DeepSpeed's engine logs the learning rate itself; the loss is the script's to log.
        engine.monitor.write_events([("Train/Samples/train_loss", loss.item(), engine.global_samples)])
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    # Free the engine (it sits in reference cycles) while the process group exists, then the group:
    # left to interpreter exit, a gloo rank could abort in teardown after training had finished
    # ("terminate called without an active exception", exit 134), once in a few runs on a busy machine.
    del engine, opt, model
    gc.collect()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
