"""Which floating-point format this rank trains in, and why.

The cluster-wide decision is `dscluster check`'s (DSCLUSTER_PRECISION in the per-node env):
every rank must use the same format, and one Pascal card in a lab of Ampere cards means
fp16 for all. Without it, each rank decides from its own GPU: bf16 needs compute
capability 8.0 (Ampere), fp16 tensor cores 7.0 (Volta); anything else, and CPU, is fp32.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from dscluster.errors import UsageError

FORMATS = ("bf16", "fp16", "fp32")


@dataclass(frozen=True)
class PrecisionDecision:
    precision: str
    reason: str


def decide(requested: str, *, cluster: str | None, cuda: bool,
           capability: tuple[int, int] | None) -> PrecisionDecision:
    """Pure policy: the requested format, else the cluster's, else what this device supports."""
    if requested not in ("auto",) + FORMATS:
        raise UsageError(f"precision must be auto, bf16, fp16 or fp32; got {requested!r}")
    if requested != "auto":
        if not cuda and requested != "fp32":
            raise UsageError(
                f"precision={requested} needs a GPU; this rank has none (use precision=fp32 or precision=auto)"
            )
        if cuda and requested == "bf16" and capability is not None and capability < (8, 0):
            raise UsageError(
                f"precision=bf16 needs compute capability 8.0+, this GPU is {capability[0]}.{capability[1]} "
                "(use precision=fp16)"
            )
        return PrecisionDecision(requested, "asked for in the config")
    if cluster:
        cluster = cluster.strip().lower()
        if cluster not in FORMATS:
            raise UsageError(f"environment: DSCLUSTER_PRECISION={cluster!r} is not one of {', '.join(FORMATS)}")
        if not cuda and cluster != "fp32":
            return PrecisionDecision("fp32", f"cluster decided {cluster} but this rank has no GPU")
        return PrecisionDecision(cluster, "cluster-wide decision of `dscluster check` (DSCLUSTER_PRECISION)")
    if not cuda:
        return PrecisionDecision("fp32", "no GPU: CPU trains in fp32")
    cap = capability or (0, 0)
    if cap >= (8, 0):
        return PrecisionDecision("bf16", f"GPU compute capability {cap[0]}.{cap[1]} supports bf16")
    if cap >= (7, 0):
        return PrecisionDecision("fp16", f"GPU compute capability {cap[0]}.{cap[1]}: fp16 (no bf16 before 8.0)")
    return PrecisionDecision("fp32", f"GPU compute capability {cap[0]}.{cap[1]}: no fast half precision")


def decide_here(requested: str, device: int | None = None) -> PrecisionDecision:
    """`decide` with this process's environment and device (`device`: a CUDA index, else the current one)."""
    import torch  # the rules above stay torch-free at load: plan and check decide with them

    cuda = torch.cuda.is_available()
    cap = torch.cuda.get_device_capability(device) if cuda else None
    return decide(requested, cluster=os.environ.get("DSCLUSTER_PRECISION"), cuda=cuda, capability=cap)


def torch_dtype(precision: str):
    import torch  # as in decide_here

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]


def input_and_autocast(cfg, precision: str, on_gpu: bool):
    """(the dtype a batch enters the model in, the dtype its forward autocasts to or None): under amp the
    inputs stay fp32 and autocast casts (on a GPU); with DeepSpeed's half weights, and in fp32, the inputs
    are in the precision itself. Training (setup_engine.build) and plan's evaluation probe both use it."""
    compute = torch_dtype(precision)
    amp = amp_dtype(cfg, precision) is not None
    return (torch_dtype("fp32") if amp else compute), (compute if amp and on_gpu else None)


def amp_dtype(cfg, precision: str) -> str | None:
    """DeepSpeed torch_autocast dtype for this run, or None when DeepSpeed holds half weights."""
    if not cfg.amp:
        return None
    if precision == "bf16":
        return "bfloat16"
    if precision == "fp16" and cfg.zero_stage == 0:
        return "float16"  # ZeRO 1-3 with autocast fp16 has no GradScaler in DeepSpeed: keep its fp16 optimizer
    return None


def gradient_format(cfg, precision: str) -> str:
    """What the gradients DDP reduces are: fp32 under autocast (fp32 weights) and in fp32 training;
    the half format itself where DeepSpeed holds half weights (amp=false)."""
    return "fp32" if precision == "fp32" or amp_dtype(cfg, precision) is not None else precision
