#!/usr/bin/env python3
"""DeepSpeed ViT path vs plain DDP, 1..N GPUs: thin entry point for `dscluster bench vit`.

    python bench/vit.py --gpus 4 --compile          # 1 and 4 GPUs, both paths, table + JSON
"""
import sys

from dscluster.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "vit", *sys.argv[1:]]))
