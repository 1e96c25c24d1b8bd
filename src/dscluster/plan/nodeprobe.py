"""The node side of plan's per-node probe (plan/nodes.py): `dscluster plan --measure-node FIRST:RANKS`
measures compute on the node it runs on and prints one JSON line for the head's plan.
"""

from __future__ import annotations

from dscluster.errors import UsageError


def measure_here(config: str, overrides: list[str], ranks_text: str) -> dict:
    """`dscluster plan --measure-node FIRST:COUNT`: this node's compute figure, for the head's plan
    (plan/nodes.py `parse_node_output` reads it)."""
    import socket
    import time

    from dscluster.plan.probe import fault_ms, measure_steady_compute, probe_key
    from dscluster.train.config import load_config
    from dscluster.train.shape import data_shape

    try:
        first, count = (int(x) for x in ranks_text.split(":"))
    except ValueError:
        raise UsageError(f"--measure-node {ranks_text!r}: expected FIRST_RANK:RANKS, e.g. 2:2") from None
    cfg = load_config(config, overrides)
    if cfg.micro_batch == "auto" or cfg.precision == "auto":
        raise UsageError("--measure-node needs micro_batch=N and precision=P (plan passes both)")
    import torch

    from dscluster import cpus

    if not torch.cuda.is_available():
        cpus.share_cores(count)  # the threads each of training's `count` ranks here will have
    in_chans, num_classes = data_shape(cfg)
    slow = fault_ms(first, count)
    f = measure_steady_compute(cfg, in_chans, num_classes, int(cfg.micro_batch), slow_ms=slow)
    return {"seconds": f.seconds, "device": f.device, "note": f.note, "spread": round(f.spread, 4),
            "samples": f.samples, "disturbed": f.disturbed, "warmup_extra_s": round(f.warmup_extra_s, 4),
            "compiled": f.compiled, "host": socket.gethostname(), "threads": torch.get_num_threads(),
            "fault_ms": slow, "measured_at": time.time(), "eval_s_per_image": f.eval_s_per_image,
            "probe": probe_key(cfg, int(cfg.micro_batch), cfg.precision) + (f" fault_ms={slow}" if slow else "")}

