#!/usr/bin/env python3
"""Uniform vs balanced batches on ranks of unequal speed: thin entry point for `dscluster bench balanced`.

    python bench/balanced.py --ranks 5 --gpus 4     # two ranks share one GPU
"""
import sys

from dscluster.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "balanced", *sys.argv[1:]]))
