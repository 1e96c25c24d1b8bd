#!/usr/bin/env python3
"""Training img/s from an ImageFolder of generated JPEGs vs synthetic data, one GPU (at most 5 minutes).

    python bench/imagefolder.py          # writes bench/results/<date>-<card>-imagefolder.json
"""
import sys

from dscluster.bench.imagefolder import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
