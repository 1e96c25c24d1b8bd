#!/usr/bin/env python3
"""Plain PyTorch DDP baseline (bf16, torch.compile, fused AdamW); run under torchrun.

    torchrun --nproc-per-node 4 bench/ddp_baseline.py --micro-batch 256 --compile --out base.json
"""
import sys

from dscluster.bench.ddp_baseline import main

if __name__ == "__main__":
    sys.exit(main())
