"""Training configuration: typed dataclasses loaded from YAML, with `key=value` overrides.

Every rank of a job loads the same file, so a typo must stop all of them before any
collective starts: unknown keys and badly typed values raise UsageError naming FILE:LINE
(from PyYAML's node marks) and the valid keys. Every number and choice declares its allowed
range on its field (`limits(...)`, `choices`; enforced by config_checks), and a value out of it
names the same FILE:LINE or override. The resolved config (file + overrides + defaults) is
what gets written into the run directory, so a run can be repeated exactly. Reading YAML nodes and
overrides into typed fields is config_yaml's; this module owns the fields and what a load checks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dscluster.core.config_checks import (
    SMALL_IMAGE_MODEL,
    ConfigValueError,
    check_deepspeed_section,
    check_fields,
    check_optimizer_name,
    check_relations,
    check_world,
    compression_conflict,
    limits,
    sync_conflict,
)
from dscluster.core.config_yaml import apply_override, from_node
from dscluster.errors import UsageError
from dscluster.files import paths


@dataclass
class ModelConfig:
    name: str = SMALL_IMAGE_MODEL
    """'vit_small_image' (a small ViT built from timm's VisionTransformer for small inputs
    such as digits) or any timm model name, e.g. vit_base_patch16_224."""
    patch_size: int = field(default=4, metadata=limits(ge=1))
    """Patch size of the small-image ViT (timm names carry their own)."""
    embed_dim: int = field(default=96, metadata=limits(ge=1))
    """Token width of the small-image ViT."""
    depth: int = field(default=4, metadata=limits(ge=1))
    """Transformer blocks of the small-image ViT."""
    num_heads: int = field(default=3, metadata=limits(ge=1))
    """Attention heads of the small-image ViT (embed_dim must divide by it)."""
    mlp_ratio: float = field(default=4.0, metadata=limits(gt=0))
    """MLP hidden width / embed_dim of the small-image ViT."""
    drop_path: float = field(default=0.0, metadata=limits(ge=0, lt=1))
    """Stochastic depth rate (any ViT)."""


@dataclass
class DataConfig:
    dataset: str = field(default="digits", metadata={"choices": ("digits", "cifar10", "imagefolder", "synthetic",
                                                                 "fractal")})
    """digits (scikit-learn, offline), cifar10 (python-format folder), imagefolder
    (class-per-folder images), synthetic (random images made on the device, benchmarks), fractal
    (one random iterated function system per class, rendered from a seed by the loader workers:
    learnable at any img_size, no download)."""
    path: str | None = None
    """Folder of cifar10 (cifar-10-batches-py) or imagefolder data; unused otherwise."""
    img_size: int = field(default=16, metadata=limits(ge=1))
    """Side of the square images the model sees (data is resized to it)."""
    holdout_fraction: float = field(default=0.2, metadata=limits(gt=0, lt=1))
    """Share of digits/imagefolder/fractal samples kept out of training for the accuracy figure."""
    limit: int | None = field(default=None, metadata=limits(ge=1))
    """Use only the first N training samples (quick runs, odd sizes in tests)."""
    augment: bool = True
    """Random ±1-pixel shifts of training images (imagefolder, cifar10: in the loader workers; digits: on
    the device)."""
    workers: int | None = field(default=None, metadata=limits(ge=0, le=64))
    """Loader worker processes per rank that decode, resize and augment imagefolder/cifar10 batches ahead
    of the step; null: the node's CPUs divided among its ranks, at most 8; 0: in the training process."""
    prefetch: int = field(default=2, metadata=limits(ge=1, le=64))
    """Batches each loader worker keeps ready (DataLoader prefetch_factor)."""
    cache: str = field(default="auto", metadata={"choices": ("auto", "true", "false")})
    """imagefolder, fractal: make each split's images once, before training, into memory (the loader
    workers then only read and augment them; evaluation is a GPU pass). auto: when the rank's splits fit
    25 % of the node's available memory shared by its ranks, at most 16 GiB a rank; true: always (refused
    when it cannot fit); false: made again every epoch."""
    synthetic_samples: int = field(default=4096, metadata=limits(ge=1))
    """Number of synthetic images per epoch."""
    num_classes: int = field(default=10, metadata=limits(ge=2))
    """Classes of the synthetic and fractal data sets (real data sets know their own); a classifier needs two."""
    images_per_class: int = field(default=1000, metadata=limits(ge=2))
    """Fractal: images per class, training and held-out together (holdout_fraction of them held out)."""
    fractal_points: int | None = field(default=None, metadata=limits(ge=64))
    """Fractal: chaos-game points drawn per image; null: img_size²/5, at least 2,048 (fewer: sparser
    shapes, faster rendering)."""
    fractal_seed: int = field(default=0, metadata=limits(ge=0, le=2**32 - 1))
    """Fractal: seed of the classes and of every image (not the training seed: runs with other seeds
    see the same data set). The same on every node, so no node needs a shared folder."""


@dataclass
class OptimConfig:
    lr: float = field(default=1e-3, metadata=limits(gt=0))
    """Peak learning rate of AdamW (at lr_reference_batch, when that is set)."""
    lr_reference_batch: int | None = field(default=None, metadata=limits(ge=1))
    """Linear LR scaling (Goyal et al. 2017): the peak LR is lr × global_batch / lr_reference_batch,
    so one preset learns alike on 2 or 5 ranks. None: lr as given."""
    weight_decay: float = field(default=0.05, metadata=limits(ge=0))
    """AdamW decoupled weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999], metadata=limits(ge=0, lt=1, length=2))
    """AdamW betas (first and second moment decay); torch rejects values outside [0, 1)."""
    eps: float = field(default=1e-8, metadata=limits(gt=0))
    """AdamW epsilon."""
    warmup_steps: int = field(default=50, metadata=limits(ge=0))
    """Linear warm-up steps before the schedule."""
    schedule: str = field(default="cosine", metadata={"choices": ("cosine", "constant")})
    """Learning-rate schedule after warm-up."""
    min_lr_ratio: float = field(default=0.05, metadata=limits(ge=0, le=1))
    """Cosine floor as a fraction of lr."""
    grad_clip: float = field(default=1.0, metadata=limits(ge=0))
    """Global gradient-norm clip (0 disables)."""
    fused: str = field(default="auto", metadata={"choices": ("auto", "true", "false")})
    """Fused AdamW kernel: auto = on GPU only (CPU has none)."""
    name: str = field(default="adamw", metadata={"choices": ("adamw",)})
    """torch's AdamW. DeepSpeed's onebitadam, zerooneadam, onebitlamb are refused with the reason."""


@dataclass
class Fp16Config:
    initial_scale_power: int = field(default=10, metadata=limits(ge=0, le=24))
    """Dynamic loss scale starts at 2^this. Field experience: 2^16 (DeepSpeed's default)
    overflowed on every step on small cards; 2^10 was stable. `--calibrate-loss-scale` measures it.
    fp16 tops out at 65504 (about 2^16): a start far above that only burns steps on overflows."""
    loss_scale_window: int = field(default=100, metadata=limits(ge=1))
    """Overflow-free steps before the scale is doubled (GradScaler's growth_interval with amp)."""
    hysteresis: int = field(default=2, metadata=limits(ge=1))
    """Overflows tolerated before the scale is halved (DeepSpeed's fp16 optimizer only: with amp,
    GradScaler halves on every overflow)."""
    min_loss_scale: float = field(default=1.0, metadata=limits(gt=0))
    """Floor of the dynamic scale (at most the starting scale 2^initial_scale_power)."""
    guard_window: int = field(default=50, metadata=limits(ge=1))
    """Steps over which the overflow guard measures the overflow rate."""
    guard_max_overflow_rate: float = field(default=0.5, metadata=limits(ge=0, le=1))
    """Stop the run when more than this share of the last guard_window steps overflowed."""
    guard_min_scale_steps: int = field(default=20, metadata=limits(ge=1))
    """Stop the run when the scale has sat at min_loss_scale this many steps in a row."""
    calibrate_steps: int = field(default=40, metadata=limits(ge=1))
    """Steps of a loss-scale calibration run (starts at 2^16)."""


@dataclass
class CheckpointConfig:
    every_epochs: int = field(default=1, metadata=limits(ge=0))
    """Save a DeepSpeed checkpoint every N epochs (0: never)."""
    every_steps: int = field(default=0, metadata=limits(ge=0))
    """Also save every N optimizer steps mid-epoch (0: never); resume skips the batches done."""
    resume: str = field(default="auto", metadata={"choices": ("auto", "true", "false")})
    """auto: resume when a complete checkpoint exists; true: must resume (error if none); false: fresh."""
    dir: str | None = None
    """Checkpoint folder; default <run dir>/checkpoints."""


@dataclass
class DistConfig:
    timeout_s: float = field(default=120.0, metadata=limits(gt=0, le=86400))
    """Process-group timeout: a collective that waits longer fails instead of hanging
    (PyTorch's 30 min default hides bring-up problems). At most a day: longer is a hang."""
    backend: str = field(default="auto", metadata={"choices": ("auto", "nccl", "gloo")})
    """auto: nccl on GPU, gloo on CPU."""


@dataclass
class CommConfig:
    compression: str = field(default="none", metadata={"choices": ("none", "fp16", "bf16", "powersgd")})
    """Gradients on the wire (ZeRO-0, several ranks; DDP hooks, comm.py): none (fp32), fp16/bf16 (half
    the bytes), powersgd (low-rank factors with error feedback). Needs zero_stage=0, overlap_comm."""
    powersgd_rank: int = field(default=4, metadata=limits(ge=1))
    """PowerSGD: rank r of the factors; an n×m gradient matrix is sent as r·(n+m) numbers."""
    powersgd_start_step: int | str = field(default="auto", metadata=limits(ge=2, words=("auto",)))
    """PowerSGD: steps reduced uncompressed first (torch's start_powerSGD_iter, at least 2).
    auto: optim.warmup_steps, at least 2."""


@dataclass
class SyncConfig:
    mode: str = field(default="every_step", metadata={"choices": ("every_step", "local_sgd", "diloco")})
    """How often the ranks' models meet (core/localsgd.py, docs/ethernet-labs.md). every_step: the gradients
    are all-reduced every optimizer step (data parallelism). local_sgd: post-local SGD (Lin et al. 2020):
    after sync.warmup_steps of every-step reduction each node steps on its own gradients (a node's own
    GPUs still average theirs every step) and the models are averaged every sync.period steps. diloco
    (Douillard et al. 2023): as local_sgd, and the averaged change of each period is applied by an outer
    Nesterov step (sync.outer_lr, sync.outer_momentum). Needs zero_stage=0 and, for fp16, amp=true."""
    period: int = field(default=8, metadata=limits(ge=2, le=10000))
    """local_sgd, diloco: optimizer steps between two averages across nodes (H). Also averaged at every
    epoch's end (evaluation and checkpoints see the average) and at checkpoint.every_steps saves."""
    warmup_steps: int = field(default=0, metadata=limits(ge=0))
    """local_sgd, diloco: optimizer steps whose gradients are all-reduced across every rank first. 0: local
    steps from the start; the learning rate's warm-up instead trained no better on digits and would cost
    every one of its steps a whole all-reduce on Ethernet (docs/ethernet-labs.md has the evidence)."""
    delay_steps: int = field(default=0, metadata=limits(ge=0))
    """local_sgd, diloco: τ, steps the average across nodes streams behind (Streaming DiLoCo): started at a
    sync point, it crosses the network while the next τ steps compute, and is applied after them. 0: the
    average blocks its step, and every epoch's end and checkpoint.every_steps save is a sync point too.
    Below sync.period."""
    compression: str = field(default="none", metadata={"choices": ("none", "fp16", "bf16")})
    """local_sgd, diloco: the period's change on the wire in 16 bits (half the bytes of fp32). The change
    of a period is small and tolerates it; the weights themselves stay fp32."""
    outer_lr: float = field(default=1.0, metadata=limits(gt=0, le=2))
    """diloco: outer learning rate on the averaged change of a period (1 with outer_momentum 0 is local_sgd)."""
    outer_momentum: float = field(default=0.3, metadata=limits(ge=0, lt=1))
    """diloco: Nesterov momentum of the outer step."""


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    """Which ViT."""
    data: DataConfig = field(default_factory=DataConfig)
    """Which data set."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """AdamW and learning-rate schedule."""
    fp16: Fp16Config = field(default_factory=Fp16Config)
    """fp16 dynamic loss scaling and its guard."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """When to save and whether to resume."""
    dist: DistConfig = field(default_factory=DistConfig)
    """Process-group settings."""
    comm: CommConfig = field(default_factory=CommConfig)
    """Gradient communication: compression on the ZeRO-0 DDP path."""
    sync: SyncConfig = field(default_factory=SyncConfig)
    """How often the ranks synchronise: every step, or local SGD / DiLoCo every sync.period steps."""
    epochs: int = field(default=20, metadata=limits(ge=1))
    """Passes over the training set."""
    max_steps: int = field(default=0, metadata=limits(ge=0))
    """Stop after this many optimizer steps in total (0: no cap); benchmarks and calibration."""
    micro_batch: int | str = field(default=32, metadata=limits(ge=1, words=("auto",)))
    """Samples per rank per forward/backward, or 'auto' (largest that fits the GPU, see autofit)."""
    grad_accum: int | None = field(default=None, metadata=limits(ge=1))
    """Micro-steps per optimizer step; default derived from global_batch, else 1."""
    global_batch: int | None = field(default=None, metadata=limits(ge=1))
    """Samples per optimizer step over all ranks; must equal micro_batch × grad_accum × world."""
    precision: str = field(default="auto", metadata={"choices": ("auto", "bf16", "fp16", "fp32")})
    """auto: DSCLUSTER_PRECISION from `dscluster check`, else what the local GPU supports, CPU fp32."""
    zero_stage: int = field(default=0, metadata={"choices": (0, 1, 2, 3)})
    """DeepSpeed ZeRO stage: what each rank keeps only its 1/world share of. 1: the optimizer states;
    2: and the gradients; 3: and the parameters (each layer's are all-gathered for its forward and
    backward; every rank then runs the held-out evaluation's forwards, rank 0 records it)."""
    offload_optimizer: str = field(default="none", metadata={"choices": ("none", "cpu")})
    """ZeRO-Offload: cpu keeps this rank's share of the optimizer states and fp32 master weights in host
    memory (pinned on a GPU) and steps them there with DeepSpeed's CPUAdam (compiled once on first use);
    the GPU keeps the weights the forward runs with, the gradients and the activations. Needs
    zero_stage 1, 2 or 3."""
    deepspeed: dict[str, Any] | None = None
    """DeepSpeed config merged last over dscluster's (mappings key by key, yours winning): monitors,
    comms_logger, flops_profiler, zero_optimization.stage3_param_persistence_threshold, ... Refused,
    naming the key to use: what dscluster derives (batch sizes, zero_optimization.stage and
    offload_optimizer.device, fp16/bf16/torch_autocast, gradient_clipping) and keys DeepSpeed does not
    know (it would ignore a typo). One value: an override deepspeed.tensorboard.enabled=true."""
    compile: str = field(default="false", metadata={"choices": ("auto", "true", "false")})
    """Compile the model through DeepSpeed's engine.compile() (torch.compile). auto: on GPUs that
    torch.compile's Triton kernels support (compute capability 7.0 and newer: not Pascal), where it
    made ViT-B/16 steps faster; never on CPU ranks, where compiling costs more than a demo saves."""
    amp: bool = True
    """bf16, and fp16 on ZeRO-0: DeepSpeed's torch_autocast (fp32 weights and optimizer, half-precision
    matmuls, as torch AMP; fp16 with torch's GradScaler) instead of half weights with fp32 master
    copies. Same maths as a plain DDP+autocast baseline, and faster: ViT-B/16, micro-batch 256,
    1x H200: bf16 3,587 img/s, fp16 3,453 (0 overflows); bf16 weights 2,622, DeepSpeed fp16 2,581."""
    channels_last: bool = False
    """Keep image batches in channels_last memory format (faster convs on GPU)."""
    log_every: int = field(default=1, metadata=limits(ge=1))
    """Read loss/scale back to the host every N steps (GPU: fewer host syncs)."""
    eval_every_epochs: int = field(default=1, metadata=limits(ge=1))
    """Held-out evaluation every N epochs (and always at the end)."""
    target_accuracy: float | None = field(default=None, metadata=limits(gt=0, le=1))
    """Held-out accuracy (0-1) whose first reaching is recorded as the run's time to accuracy
    (seconds, step, epoch, images seen: a `target` record in metrics, `time_to_accuracy` in
    summary.json); null: not recorded. Training does not stop there."""
    seed: int = field(default=0, metadata=limits(ge=0, le=2**32 - 1))
    """Seed of model init, data order and augmentation (same on every rank); numpy takes 32 bits."""
    memory_cap_gb: float | None = field(default=None, metadata=limits(gt=0))
    """Cap this process's GPU memory (per-process fraction), e.g. 8 to act like an 8 GB card."""
    autofit_margin: float = field(default=0.9, metadata=limits(gt=0, le=1))
    """Auto-fit keeps this fraction of the largest micro-batch that fitted."""
    autofit_max: int = field(default=1024, metadata=limits(ge=1))
    """Largest micro-batch auto-fit tries."""
    batching: str = field(default="auto", metadata={"choices": ("auto", "uniform", "balanced")})
    """uniform: every rank takes micro_batch; balanced: rank shares from measured speed; auto:
    DSCLUSTER_BATCHING from `dscluster check` (balanced on a cluster of mixed GPUs), else uniform."""
    shares: list[int] | None = field(default=None, metadata=limits(ge=1))
    """Per-rank micro-batch sizes for balanced batching (sum = global micro batch)."""
    overlap_comm: bool = True
    """Overlap gradient reduction with backward: ZeRO 1-3 through DeepSpeed's overlap_comm; ZeRO-0 on
    several ranks through torch DDP's bucketed all-reduce inside the engine (DeepSpeed's own ZeRO-0
    all-reduce starts after backward: 4x H200 ViT-B/16 lost 9% to it)."""
    bucket_size_mb: int = field(default=200, metadata=limits(ge=1))
    """All-reduce / reduce-scatter bucket size in MB of elements."""
    ddp_bucket_mb: int = field(default=100, metadata=limits(ge=1))
    """ZeRO-0 on several ranks: size in MB of the DDP gradient buckets that are all-reduced while
    backward runs (torch's bucket_cap_mb). Larger buckets mean fewer all-reduces and, compiled,
    fewer graph breaks; smaller ones start reducing earlier."""
    progress: bool = True
    """Rich progress bar with ETA on rank 0."""
    sync_debug: str = field(default="off", metadata={"choices": ("off", "warn", "error")})
    """GPU: after warm-up, watch each training step for implicit host synchronisations (torch's CUDA
    sync debug mode). warn: list every call site at the end and in metrics (`host_sync` records);
    error: fail at the first one. For "the GPU idles between steps"."""
    calibrate_loss_scale: bool = False
    """Run the fp16 loss-scale calibration instead of training."""


def load_config(path: str | Path | None, overrides: list[str] = (), *, world: bool = False) -> TrainConfig:
    """Load a YAML preset (or the defaults when path is None), apply overrides, validate.

    world=True also checks what the config points at (`check_world`: data folder, timm model,
    checkpoint to resume); training asks for it, --print-config does not. Range and world errors
    name where the value came from: FILE:LINE of its key, or the override."""
    origin: dict[str, str] = {}
    if path is None:
        cfg = TrainConfig()
    else:
        path = str(path)
        try:
            text = paths.config_path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise UsageError(f"{path}: no such config (presets live in configs/, e.g. configs/digits.yaml)") from None
        except (IsADirectoryError, PermissionError, UnicodeDecodeError) as e:
            raise UsageError(f"{path}: cannot read config ({e})") from None
        try:
            node = yaml.compose(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            line = f":{mark.line + 1}" if mark else ""
            raise UsageError(f"{path}{line}: not valid YAML ({getattr(e, 'problem', e)})") from None
        lines: dict[str, int] = {}
        cfg = TrainConfig() if node is None else from_node(TrainConfig, node, path, "", lines)
        origin.update({k: f"{path}:{n}" for k, n in lines.items()})
    for ov in overrides:
        key = apply_override(cfg, ov)
        origin[key] = f"override {ov!r}"
    try:
        validate(cfg)
        if world:
            check_world(cfg)
    except ConfigValueError as e:
        where = next((origin[k] for k in (e.key, *e.also) if k in origin), None)
        if where is None and path is not None:
            where = f"{path} (default of {e.key})"
        raise ConfigValueError(e.key, f"{where}: {e}" if where else str(e), e.also) from None
    return cfg


def validate(cfg: TrainConfig) -> None:
    """Every field's declared range or choices, then the rules that tie fields together
    (ConfigValueError). Field rules come first: the cross-field ones divide by some of them."""
    check_optimizer_name(cfg.optim.name)  # before the choices: a known name deserves its reason
    check_fields(cfg)
    check_deepspeed_section(cfg.deepspeed)
    check_relations(cfg)
    compression_conflict(cfg, None if cfg.precision == "auto" else cfg.precision)
    sync_conflict(cfg, None if cfg.precision == "auto" else cfg.precision)


def to_dict(cfg: TrainConfig) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: TrainConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)
