"""A busy neighbour: keeps one GPU's SMs busy with bf16 matrix products until it is stopped.

Ranks of one NCCL communicator cannot share a GPU (NCCL ≥ 2.5 rejects it: "Duplicate GPU
detected"), so a rank at about half speed is made the way it happens in a shared lab:
another user's job on the same card. The GPU time-slices between the two processes.

    CUDA_VISIBLE_DEVICES=3 python -m dscluster.bench.gpu_load --seconds 600
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dscluster.bench.gpu_load", description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=3600.0, help="stop by itself after this long")
    p.add_argument("--size", type=int, default=8192, help="square matrix side")
    args = p.parse_args(argv)
    import torch  # torch: after the arguments, so --help answers at once

    if not torch.cuda.is_available():
        print("gpu_load: no GPU visible", file=sys.stderr)
        return 2
    a = torch.randn(args.size, args.size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(args.size, args.size, device="cuda", dtype=torch.bfloat16)
    print("gpu_load: running", flush=True)
    end = time.monotonic() + args.seconds
    c = torch.empty_like(a)
    while time.monotonic() < end:
        for _ in range(20):
            torch.mm(a, b, out=c)
        torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
