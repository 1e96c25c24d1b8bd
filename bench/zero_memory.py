#!/usr/bin/env python3
"""Peak GPU memory and img/s of ZeRO stages 0-3 and ZeRO-3 with offload_optimizer=cpu, on 1 and 2 GPUs.

    python bench/zero_memory.py             # on a GPU host: writes bench/results/<date>-<card>-zero-memory.json
    python bench/zero_memory.py --dry-run   # the README commands it runs, nothing run or written
"""
import sys

from dscluster.bench.zero_memory import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
