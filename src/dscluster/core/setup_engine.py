"""Everything between "process group up" and "first step": data, model, batch plan, DeepSpeed engine.

Kept apart from the step loop so the loop reads top to bottom. The optimizer is a client
optimizer (torch AdamW, fused=True on GPU) so bf16/fp16/ZeRO all wrap the same kernel the
plain-PyTorch baseline uses; the schedule is a LambdaLR that DeepSpeed checkpoints with
the engine.
"""

from __future__ import annotations

import argparse
import math
import warnings
from dataclasses import dataclass, field, replace

import torch

from dscluster.core import autofit, balanced, comm, datacache, dist
from dscluster.core import data as data_mod
from dscluster.core.config import TrainConfig
from dscluster.core.ds_config import build_ds_config
from dscluster.core.localsgd import local
from dscluster.core.model import build_model, count_params
from dscluster.core.precision import input_and_autocast, torch_dtype
from dscluster.core.sampler import BalancedStepSampler, StepSampler
from dscluster.core.shape import BatchPlan, DeviceFacts, resolve
from dscluster.core.split import StepSplit
from dscluster.errors import UsageError


class OverlapDDP(torch.nn.parallel.DistributedDataParallel):
    """torch DDP as the gradient synchroniser inside a ZeRO-0 DeepSpeed engine.

    DeepSpeed's ZeRO-0 path all-reduces every gradient after backward has finished (flatten,
    all-reduce, copy back), so none of it overlaps compute: ViT-B/16 on 4x H200 lost 9% to it.
    DDP reduces its buckets (`ddp_bucket_mb`, 100 MB: 4x H200 scaled 96% against 94% with torch's
    25 MB) while backward still runs (and, compiled, dynamo's DDPOptimizer
    splits the graph at bucket boundaries so that holds there too). DeepSpeed keeps precision,
    the optimizer, the schedule and checkpoints; its own all-reduce is turned off. The state
    dict is the inner model's, so checkpoints do not depend on the rank count.
    """

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)


def overlaps_with_ddp(cfg: TrainConfig, world_size: int) -> bool:
    """ZeRO-0 with more than one rank and overlap_comm: DDP buckets instead of DeepSpeed's post-backward all-reduce."""
    return cfg.zero_stage == 0 and world_size > 1 and bool(cfg.overlap_comm) and not local(cfg)


def wrap_for_overlap(model: torch.nn.Module, device: torch.device, bucket_mb: int) -> OverlapDDP:
    # The held-out pass runs bare_module(engine), never this wrapper, whose forward may broadcast
    # buffers to ranks that are not there (rank 0 alone) or collide with the pass's own all-reduce.
    return OverlapDDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                      gradient_as_bucket_view=True, bucket_cap_mb=bucket_mb)


def bare_module(engine) -> torch.nn.Module:
    """The model itself, inside any OverlapDDP wrapper."""
    m = engine.module
    return m.module if isinstance(m, OverlapDDP) else m


@dataclass
class Built:
    engine: object
    sampler: StepSampler
    splits: data_mod.Splits
    plan: BatchPlan
    shares: list[int]
    loss_weight: float
    ds_config: dict
    dtype: torch.dtype
    params: int
    total_steps: int
    share_plan: dict | None = None
    notes: list[str] = field(default_factory=list)
    ddp: OverlapDDP | None = None
    """Set when DDP synchronises gradients: non-boundary micro-steps run under ddp.no_sync()."""
    comm: object = None
    """The DDP communication hook (comm.CommHook) where ddp is set; with sync.mode local_sgd or diloco on
    several ranks the model averager (localsgd.ModelAverager), set by the Trainer. Either keeps its
    state in checkpoints."""
    split: object = None
    """The step's time split (split.StepSplit), marked by the step and by the hook."""
    data_cache: list[dict] = field(default_factory=list)
    """What data.cache made once into memory, or why not: the run's `data_cache` records (core/datacache.py)."""
    autocast: torch.dtype | None = None
    """The half dtype training's forward autocasts to on a GPU (amp), for the evaluation; None: none."""


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """No weight decay on biases, norms, position embeddings and the class token (standard for ViTs)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "pos_embed" in name or "cls_token" in name else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def make_optimizer(cfg: TrainConfig, model: torch.nn.Module, lr: float, device: torch.device) -> torch.optim.Optimizer:
    """torch's AdamW (fused on GPU), or with offload_optimizer DeepSpeed's CPUAdam in AdamW mode: ZeRO-Offload
    steps the states in host memory, and DeepSpeed refuses any other client optimizer there. Both take the
    same groups, betas, eps and decoupled weight decay; the schedule sets either's lr."""
    groups = param_groups(model, cfg.optim.weight_decay)
    if cfg.offload_optimizer != "none":
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # deepspeed: as in `build`

        return DeepSpeedCPUAdam(groups, lr=lr, betas=tuple(cfg.optim.betas), eps=cfg.optim.eps, adamw_mode=True)
    fused = cfg.optim.fused == "true" or (cfg.optim.fused == "auto" and device.type == "cuda")
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(cfg.optim.betas), eps=cfg.optim.eps, fused=fused or None)


def lr_lambda(cfg: TrainConfig, total_steps: int):
    warm = max(0, cfg.optim.warmup_steps)
    floor = cfg.optim.min_lr_ratio

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        if cfg.optim.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warm) / max(1, total_steps - warm))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def needs_memory_fit(cfg: TrainConfig, device_type: str) -> bool:
    """Whether this rank measures its largest micro-batch before training.

    micro_batch=auto needs it; so does balanced batching on GPU whatever micro_batch says:
    the share plan gives fast ranks more than micro_batch, and each share must still fit
    its own card, so every rank's fit is the plan's cap."""
    return cfg.micro_batch == "auto" or (cfg.batching == "balanced" and device_type == "cuda")


def _auto_micro(cfg: TrainConfig, model, splits, device, dtype, notes: list[str]) -> int | None:
    """Largest micro-batch that fits this rank's GPU (None on CPU: no memory limit to find)."""
    if device.type != "cuda":
        if cfg.global_batch is None:  # with a global batch, even_split sizes the shares and says so
            notes.append("micro_batch=auto on CPU: no GPU memory to fit, using 32")
        return None

    def make(b):
        return splits.train.get_batch(list(range(b)), device, torch.float32)

    fit = autofit.largest_fit(autofit.probe_fits(model, make, dtype, device), start=1, maximum=cfg.autofit_max)
    torch.cuda.empty_cache()  # the probe's reserve block and activations go back before DeepSpeed allocates
    micro = autofit.with_margin(fit, cfg.autofit_margin)
    notes.append(f"auto-fit: largest micro-batch that fitted {fit}, using {micro} (margin {cfg.autofit_margin})")
    return micro


def compiles(setting: str, device: torch.device) -> bool:
    """Whether compile=auto|true|false compiles on this rank's device."""
    if setting == "auto":
        return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (7, 0)
    return setting == "true"


def build(cfg: TrainConfig, info: dist.RankInfo, device: torch.device, precision: str, *, evaluates: bool,
          node_local_checkpoints: bool = False, faults=None) -> Built:
    """`evaluates`: this rank runs the held-out forwards (core/evaluation.evaluates), so the data cache holds the
    held-out split here; `node_local_checkpoints`: no shared filesystem, every node saves the model states
    (train/nodelocal.py); `faults`: this rank's test-only fault hook (faults.FaultHook), None for none."""
    # deepspeed chooses its accelerator when imported: only after dist.prepare_accelerator has set it
    import deepspeed

    notes: list[str] = []
    torch.manual_seed(cfg.seed)  # identical init everywhere (DeepSpeed also broadcasts rank 0's weights)
    splits = data_mod.load(cfg.data, device, seed=cfg.seed)
    # before the probes (their prefixes read the cache) and before the loader's workers fork
    cached = datacache.cache_splits(splits, cfg.data, local_ranks=info.local_world_size, primary=evaluates,
                                    notes=notes)
    model = build_model(cfg.model, in_chans=splits.train.in_chans, num_classes=splits.train.num_classes,
                        img_size=cfg.data.img_size).to(device)
    # channels_last applies to the input batches only: DeepSpeed broadcasts parameters as byte
    # views at initialize, which fails for a channels_last (non-contiguous) patch-embedding weight.
    compute = torch_dtype(precision)  # what matmuls run in: the memory probe and speed calibration use it
    dtype, autocast = input_and_autocast(cfg, precision, device.type == "cuda")  # amp: inputs stay fp32
    autofit.set_memory_cap(cfg.memory_cap_gb, device)

    fit: int | None = None
    if needs_memory_fit(cfg, device.type):
        fit = _auto_micro(cfg, model, splits, device, compute, notes)
    smallest_fit = None
    if cfg.micro_batch == "auto" and fit is not None:
        smallest_fit = min(f[0] for f in dist.all_gather_ints([fit], device))
    facts = DeviceFacts(precision=precision, smallest_fit=smallest_fit)
    shape, share_plan = resolve(cfg, info.world_size, facts), None
    if cfg.batching == "balanced":  # the config's shares, or measured: every rank times itself
        shares, share_plan = _balanced_shares(cfg, info, shape.batch.micro_batch, fit, model, splits, device, compute)
        shape = resolve(cfg, info.world_size, replace(facts, shares=tuple(shares)))
    notes.extend(shape.notes)
    plan, shares = shape.batch, list(shape.shares)
    syncs_less = local(cfg) and info.world_size > 1
    sampler, weight = _sampler(cfg, info, shape.per_rank, shares, plan.grad_accum, len(splits.train), syncs_less)
    sampler = data_mod.with_loader(sampler, splits, cfg.data, device, info.local_world_size, notes)

    steps_per_epoch = sampler.steps_per_epoch
    total = (steps_per_epoch * cfg.epochs if cfg.max_steps <= 0
             else min(cfg.max_steps, steps_per_epoch * cfg.epochs))
    ds_cfg = build_ds_config(cfg, plan, precision, on_gpu=device.type == "cuda")
    if node_local_checkpoints:
        ds_cfg.setdefault("checkpoint", {})["use_node_local_storage"] = True
    opt = make_optimizer(cfg, model, peak_lr(cfg, plan.global_batch), device)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, total))
    # The rank's device may differ from cuda:$LOCAL_RANK (a user's CUDA_VISIBLE_DEVICES with fewer
    # GPUs than ranks), which DeepSpeed would use as the index: name the device explicitly. On CPU
    # pass nothing (device_rank=-1 would make DeepSpeed treat the job as a single process).
    ds_args = argparse.Namespace(device_rank=device.index or 0) if device.type == "cuda" else None
    ddp = wrap_for_overlap(model, device, cfg.ddp_bucket_mb) if overlaps_with_ddp(cfg, info.world_size) else None
    split = StepSplit(device, "measured" if ddp is not None or syncs_less else
                      "none" if info.world_size == 1 else "unmeasured", averages=syncs_less)
    hook = None
    if ddp is not None:
        hook = comm.install(ddp, cfg, split, faults.comm_delay_s() if faults else 0.0)
    elif cfg.comm.compression != "none":
        notes.append(f"comm.compression={cfg.comm.compression} has nothing to compress on one rank: no gradient "
                     "crosses a network")
    if device.type == "cuda":  # peak_mem_mb is training's: auto-fit's and balanced batching's probes are over
        torch.cuda.reset_peak_memory_stats(device)
    quiet_deprecated_collectives()
    engine, _, _, _ = deepspeed.initialize(args=ds_args, model=ddp or model, optimizer=opt, lr_scheduler=sched,
                                           config=ds_cfg, dist_init_required=False)
    if cfg.zero_stage == 0 and (info.world_size == 1 or ddp is not None or syncs_less):
        # DDP has reduced the gradients already; on one rank the all-reduce is the identity, but
        # DeepSpeed would still flatten, reduce and copy back every gradient after each backward.
        # Local SGD reduces what it reduces itself (localsgd.ModelAverager).
        engine.enable_backward_allreduce = False
    dist.apply_timeout_everywhere(cfg.dist.timeout_s)
    if compiles(cfg.compile, device):
        engine.compile()
    return Built(engine=engine, sampler=sampler, splits=splits, plan=plan, shares=shares, loss_weight=weight,
                 ds_config=ds_cfg, dtype=dtype, params=count_params(model), total_steps=total,
                 autocast=autocast,
                 share_plan=share_plan, notes=notes, ddp=ddp, comm=hook, split=split, data_cache=cached)


def quiet_deprecated_collectives() -> None:
    """DeepSpeed's ZeRO calls torch.distributed's all_gather_into_tensor and reduce_scatter_tensor, which torch
    deprecates with a FutureWarning. Under ZeRO-3 that warning came back on every rank at every step (two
    lines each time, thousands in a run's log) and tells the user of dscluster nothing they can act on."""
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` "
                            "is deprecated", category=FutureWarning)


def _sampler(cfg, info, per_rank: bool, shares: list[int], accum: int, n: int, syncs_less: bool):
    """(the step sampler, this rank's loss weight): balanced shares weigh each rank's mean loss so that the
    ranks' average is the global batch's mean; local SGD weighs the ranks where it averages instead
    (localsgd.weights), so each rank's loss is its own mean."""
    if not per_rank:
        return StepSampler(n, shares, accum, info.rank, cfg.seed), 1.0
    weight = 1.0 if syncs_less else balanced.loss_weight(shares[info.rank], info.world_size, sum(shares))
    return BalancedStepSampler(n, shares, accum, info.rank, cfg.seed), weight


def peak_lr(cfg: TrainConfig, global_batch: int) -> float:
    """The configured LR, scaled linearly with the global batch when lr_reference_batch is set."""
    if cfg.optim.lr_reference_batch:
        return cfg.optim.lr * global_batch / cfg.optim.lr_reference_batch
    return cfg.optim.lr


def calibration_batch(micro: int, fit: int | None) -> int:
    """Batch the speed calibration times: micro_batch, but never more than this rank's memory fit
    (an 8 GB rank beside 141 GB ones cannot run the others' micro-batch even once)."""
    return micro if fit is None else max(1, min(micro, fit))


def _balanced_shares(cfg, info, micro, fit, model, splits, device, dtype):
    """Shares from the config, or measured: each rank times local forward+backward, all agree on the plan."""
    global_micro = micro * info.world_size
    if cfg.shares is not None:
        if len(cfg.shares) != info.world_size:
            raise UsageError(f"shares has {len(cfg.shares)} entries for {info.world_size} ranks; give one per rank")
        return list(cfg.shares), {"shares": list(cfg.shares), "source": "config"}

    def step_fn(b):
        x, y = splits.train.get_batch(list(range(b)), device, torch.float32)
        with torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        model.zero_grad(set_to_none=True)

    sync = torch.cuda.synchronize if device.type == "cuda" else None
    sps = balanced.calibrate(step_fn, calibration_batch(micro, fit), steps=3, synchronize=sync)
    plan = balanced.plan_shares_distributed(sps, global_micro, fit)
    return plan.shares, {**plan.to_dict(), "source": "measured"}
