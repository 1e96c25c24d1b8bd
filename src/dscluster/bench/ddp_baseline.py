"""The plain-PyTorch baseline dscluster's training path is measured against.

One process per GPU under torchrun, the fastest simple recipe people actually use: DistributedDataParallel,
bf16 autocast, torch.compile, fused AdamW, synthetic data made once on the GPU, no host sync inside the
timed loop; same model, micro-batch and image size as the DeepSpeed run it is compared with. Rank 0
writes one JSON object (images_per_s over all ranks, peak memory, …) to --out.

    torchrun --nproc-per-node 4 -m dscluster.bench.ddp_baseline --model vit_base_patch16_224 \
        --micro-batch 256 --precision bf16 --compile --out result.json
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from datetime import timedelta

from dscluster.bench.models import build_model, model_spec
from dscluster.files.fsutil import atomic_write_json


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dscluster.bench.ddp_baseline", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="vit_base_patch16_224")
    p.add_argument("--micro-batch", type=int, required=True, help="images per rank per step")
    p.add_argument("--steps", type=int, default=30, help="timed steps")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first (compile, allocator, autotune)")
    p.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--compile", action="store_true", help="torch.compile the DDP model")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--memory-cap-gb", type=float, default=None, help="per-process GPU memory cap")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--out", required=True, help="JSON result written by rank 0")
    return p.parse_args(argv)


def _amp(device_type: str, precision: str):
    import torch  # torch: loads only in the rank, never for --help or the argv tests

    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device_type, dtype=dtype)


def _this_rank_device(args: argparse.Namespace, local_rank: int):
    """This rank's GPU (capped and with TF32 on, as the DeepSpeed run it is compared with), or the CPU."""
    import torch  # torch: as in _amp

    if args.device != "cuda":
        return torch.device("cpu")
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device())
    if args.memory_cap_gb:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_cap_gb * 2**30 / total), device)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return device


def _result(args: argparse.Namespace, world: int, cuda: bool, gathered: list[list[float]]) -> dict:
    """The result from every rank's [seconds, peak MB, loss]: the slowest rank's time is the run's time."""
    seconds_max = max(s[0] for s in gathered)
    return {
        "path": "ddp_baseline",
        "model": args.model,
        "world_size": world,
        "micro_batch": args.micro_batch,
        "global_batch": args.micro_batch * world,
        "precision": args.precision,
        "compile": bool(args.compile),
        "fused_adamw": cuda,
        "memory_cap_gb": args.memory_cap_gb,
        "steps": args.steps,
        "warmup": args.warmup,
        "seconds": seconds_max,
        "images_per_s": args.micro_batch * world * args.steps / seconds_max,
        "peak_mem_mb": max(s[1] for s in gathered) if cuda else None,
        "final_loss": gathered[0][2],
    }


def run(args: argparse.Namespace) -> dict:
    import torch  # torch: as in _amp
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    cuda = args.device == "cuda"
    device = _this_rank_device(args, local_rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                            timeout=timedelta(minutes=10), **({"device_id": device} if cuda else {}))
    try:
        spec = model_spec(args.model)
        torch.manual_seed(0)
        model = build_model(args.model).to(device)
        ddp = DDP(model, device_ids=[device.index] if cuda else None, gradient_as_bucket_view=True)
        step_model = torch.compile(ddp) if args.compile else ddp
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=cuda)
        scaler = torch.amp.GradScaler("cuda", enabled=cuda and args.precision == "fp16")
        g = torch.Generator(device=device).manual_seed(1234 + rank)
        x = torch.randn(args.micro_batch, 3, spec.img_size, spec.img_size, device=device, generator=g)
        y = torch.randint(0, spec.num_classes, (args.micro_batch,), device=device, generator=g)

        def step() -> torch.Tensor:
            with _amp(device.type, args.precision):
                loss = torch.nn.functional.cross_entropy(step_model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        sync = torch.cuda.synchronize if cuda else (lambda: None)
        for _ in range(args.warmup):
            step()
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            loss = step()
        sync()
        dist.barrier()
        seconds = time.perf_counter() - t0
        peak_mb = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else 0.0
        stats = torch.tensor([seconds, peak_mb, float(loss)], dtype=torch.float64, device=device)
        gathered = [torch.zeros_like(stats) for _ in range(world)]
        dist.all_gather(gathered, stats)
        result = _result(args, world, cuda, [[float(v) for v in s] for s in gathered])
        if rank == 0:
            atomic_write_json(args.out, result)
        return result
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
