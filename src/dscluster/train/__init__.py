"""`dscluster train`: the Trainer's loop on every rank (loop.py reads top to bottom), built on the
training core (dscluster.core): checkpointing (checkpoint.py, nodelocal.py), what a run records for
the next plan (records.py), and the run's own progress, traces and stops.

The command line calls `train.train(cfg, calibrate=...)`. The name loads loop.py (and torch) on first
use, as the core's face does, so that `import dscluster.train` stays cheap and `--help` fast.
"""

import importlib

__all__ = ["train"]


def __getattr__(name: str):
    if name != "train":
        raise AttributeError(f"module 'dscluster.train' has no attribute {name!r}")
    return importlib.import_module("dscluster.train.loop").train
