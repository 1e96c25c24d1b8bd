"""The node side of plan's per-node probe (plan/nodes.py): `dscluster plan --measure-node FIRST:RANKS`
measures compute on the node it runs on and prints one JSON line for the head's plan; with
`--alone-micro M,...` a GPU also measures at the micro-batches the node would train at alone.
"""

from __future__ import annotations

import socket
import time

from dscluster import core
from dscluster.errors import UsageError
from dscluster.node import cpus


def measure_here(config: str, overrides: list[str], ranks_text: str, alone_text: str | None = None) -> dict:
    """`dscluster plan --measure-node FIRST:COUNT [--alone-micro M,...]`: this node's compute figure, for
    the head's plan (plan/nodes.py `parse_node_output` reads it)."""
    try:
        first, count = (int(x) for x in ranks_text.split(":"))
    except ValueError:
        raise UsageError(f"--measure-node {ranks_text!r}: expected FIRST_RANK:RANKS, e.g. 2:2") from None
    try:
        alone = [int(x) for x in alone_text.split(",")] if alone_text else []
    except ValueError:
        alone = [0]
    if not all(m >= 1 for m in alone):
        raise UsageError(f"--alone-micro {alone_text!r}: expected micro-batches, e.g. 512,256")
    cfg = core.load_config(config, overrides)
    if cfg.micro_batch == "auto" or cfg.precision == "auto":
        raise UsageError("--measure-node needs micro_batch=N and precision=P (plan passes both)")
    import torch  # heavy: only a node's probe needs it, never the head's `plan --help`

    if not torch.cuda.is_available():
        cpus.share_cores(count)  # the threads each of training's `count` ranks here will have
    in_chans, num_classes = core.data_shape(cfg)
    slow = core.fault_ms(first, count)
    f = core.measure_steady_compute(cfg, in_chans, num_classes, int(cfg.micro_batch), slow_ms=slow)
    return {**figure(f), "note": f.note, "host": socket.gethostname(), "threads": torch.get_num_threads(),
            "fault_ms": slow,
            "probe": core.probe_key(cfg, int(cfg.micro_batch), cfg.precision) + (f" fault_ms={slow}" if slow else ""),
            # a CPU figure is a stand-in for the GPUs, scaled linearly anyway: measured once
            "alone": measure_alone(cfg, in_chans, num_classes, alone, slow) if f.device.startswith("cuda") else []}


def measure_alone(cfg, in_chans: int, num_classes: int, micros: list[int], slow_ms: int = 0) -> list[dict]:
    """The compute figure at each of `micros` (the micro-batches a node alone trains at: a GPU is faster
    per image at a larger batch), [{micro, seconds, device, spread, samples, disturbed, warmup_extra_s,
    compiled, eval_s_per_image, measured_at}]; one that does not fit the GPU is left out (priced at
    the lab's micro-batch then). Each is compiled afresh: torch.compile would otherwise reuse the
    lab micro-batch's graphs and recompile with a dynamic batch size, which training alone does not."""
    out = []
    for m in sorted(set(micros)):
        if core.compiles_here(cfg):
            import torch  # heavy, as in measure_here

            torch._dynamo.reset()
        try:
            f = core.measure_steady_compute(cfg, in_chans, num_classes, m, slow_ms=slow_ms)
        except UsageError:  # out of memory at that micro-batch
            continue
        out.append({"micro": m, **figure(f)})
    return out


def figure(f) -> dict:
    """What the head keeps of a core/probe.py ComputeFigure measured now."""
    return {"seconds": f.seconds, "device": f.device, "spread": round(f.spread, 4), "samples": f.samples,
            "disturbed": f.disturbed, "warmup_extra_s": round(f.warmup_extra_s, 4), "compiled": f.compiled,
            "eval_s_per_image": f.eval_s_per_image, "measured_at": time.time()}
