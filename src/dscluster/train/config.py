"""Training configuration: typed dataclasses loaded from YAML, with `key=value` overrides.

Every rank of a job loads the same file, so a typo must stop all of them before any
collective starts: unknown keys and badly typed values raise UsageError naming FILE:LINE
(from PyYAML's node marks) and the valid keys. The resolved config (file + overrides +
defaults) is what gets written into the run directory, so a run can be repeated exactly.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dscluster.errors import UsageError


class ConfigValueError(UsageError):
    """A value out of range or inconsistent with another (found by `validate`).

    `key` is the dotted config key at fault (`also` lists others involved); load_config
    prefixes the message with where that key was set: FILE:LINE or the override.
    """

    def __init__(self, key: str, message: str, also: tuple[str, ...] = ()):
        super().__init__(message)
        self.key, self.also = key, also


@dataclass
class ModelConfig:
    name: str = "vit_small_image"
    """'vit_small_image' (a small ViT built from timm's VisionTransformer for small inputs
    such as digits) or any timm model name, e.g. vit_base_patch16_224."""
    patch_size: int = 4
    """Patch size of the small-image ViT (timm names carry their own)."""
    embed_dim: int = 96
    """Token width of the small-image ViT."""
    depth: int = 4
    """Transformer blocks of the small-image ViT."""
    num_heads: int = 3
    """Attention heads of the small-image ViT (embed_dim must divide by it)."""
    mlp_ratio: float = 4.0
    """MLP hidden width / embed_dim of the small-image ViT."""
    drop_path: float = 0.0
    """Stochastic depth rate (any ViT)."""


@dataclass
class DataConfig:
    dataset: str = field(default="digits", metadata={"choices": ("digits", "cifar10", "imagefolder", "synthetic")})
    """digits (scikit-learn, offline), cifar10 (python-format folder), imagefolder
    (class-per-folder images), synthetic (random images made on the device, benchmarks)."""
    path: str | None = None
    """Folder of cifar10 (cifar-10-batches-py) or imagefolder data; unused otherwise."""
    img_size: int = 16
    """Side of the square images the model sees (data is resized to it)."""
    holdout_fraction: float = 0.2
    """Share of digits/imagefolder samples kept out of training for the accuracy figure."""
    limit: int | None = None
    """Use only the first N training samples (quick runs, odd sizes in tests)."""
    augment: bool = True
    """Random ±1-pixel shifts of training images (cheap, on the device)."""
    synthetic_samples: int = 4096
    """Number of synthetic images per epoch."""
    num_classes: int = 10
    """Classes of the synthetic data set (real data sets know their own)."""


@dataclass
class OptimConfig:
    lr: float = 1e-3
    """Peak learning rate of AdamW (at lr_reference_batch, when that is set)."""
    lr_reference_batch: int | None = None
    """Linear LR scaling (Goyal et al. 2017): the peak LR is lr × global_batch / lr_reference_batch,
    so one preset learns alike on 2 or 5 ranks. None: lr as given."""
    weight_decay: float = 0.05
    """AdamW decoupled weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    warmup_steps: int = 50
    """Linear warm-up steps before the schedule."""
    schedule: str = field(default="cosine", metadata={"choices": ("cosine", "constant")})
    """Learning-rate schedule after warm-up."""
    min_lr_ratio: float = 0.05
    """Cosine floor as a fraction of lr."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    fused: str = field(default="auto", metadata={"choices": ("auto", "true", "false")})
    """Fused AdamW kernel: auto = on GPU only (CPU has none)."""


@dataclass
class Fp16Config:
    initial_scale_power: int = 10
    """Dynamic loss scale starts at 2^this. Field experience: 2^16 (DeepSpeed's default)
    overflowed on every step on small cards; 2^10 was stable. `--calibrate-loss-scale` measures it."""
    loss_scale_window: int = 100
    """Overflow-free steps before the scale is doubled (GradScaler's growth_interval with amp)."""
    hysteresis: int = 2
    """Overflows tolerated before the scale is halved (DeepSpeed's fp16 optimizer only: with amp,
    GradScaler halves on every overflow)."""
    min_loss_scale: float = 1.0
    """Floor of the dynamic scale."""
    guard_window: int = 50
    """Steps over which the overflow guard measures the overflow rate."""
    guard_max_overflow_rate: float = 0.5
    """Stop the run when more than this share of the last guard_window steps overflowed."""
    guard_min_scale_steps: int = 20
    """Stop the run when the scale has sat at min_loss_scale this many steps in a row."""
    calibrate_steps: int = 40
    """Steps of a loss-scale calibration run (starts at 2^16)."""


@dataclass
class CheckpointConfig:
    every_epochs: int = 1
    """Save a DeepSpeed checkpoint every N epochs (0: never)."""
    every_steps: int = 0
    """Also save every N optimizer steps mid-epoch (0: never); resume skips the batches done."""
    resume: str = field(default="auto", metadata={"choices": ("auto", "true", "false")})
    """auto: resume when a complete checkpoint exists; true: must resume (error if none); false: fresh."""
    dir: str | None = None
    """Checkpoint folder; default <run dir>/checkpoints."""


@dataclass
class DistConfig:
    timeout_s: float = 120.0
    """Process-group timeout: a collective that waits longer fails instead of hanging
    (PyTorch's 30 min default hides bring-up problems)."""
    backend: str = field(default="auto", metadata={"choices": ("auto", "nccl", "gloo")})
    """auto: nccl on GPU, gloo on CPU."""


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
    epochs: int = 20
    """Passes over the training set."""
    max_steps: int = 0
    """Stop after this many optimizer steps in total (0: no cap); benchmarks and calibration."""
    micro_batch: int | str = 32
    """Samples per rank per forward/backward, or 'auto' (largest that fits the GPU, see autofit)."""
    grad_accum: int | None = None
    """Micro-steps per optimizer step; default derived from global_batch, else 1."""
    global_batch: int | None = None
    """Samples per optimizer step over all ranks; must equal micro_batch × grad_accum × world."""
    precision: str = field(default="auto", metadata={"choices": ("auto", "bf16", "fp16", "fp32")})
    """auto: DSCLUSTER_PRECISION from `dscluster check`, else what the local GPU supports, CPU fp32."""
    zero_stage: int = field(default=0, metadata={"choices": (0, 1, 2)})
    """DeepSpeed ZeRO stage."""
    compile: bool = False
    """Compile the model through DeepSpeed's engine.compile() (torch.compile)."""
    amp: bool = True
    """bf16, and fp16 on ZeRO-0: DeepSpeed's torch_autocast (fp32 weights and optimizer, half-precision
    matmuls, as torch AMP; fp16 with torch's GradScaler) instead of half weights with fp32 master
    copies. Same maths as a plain DDP+autocast baseline, and faster: ViT-B/16, micro-batch 256,
    1x H200: bf16 3,587 img/s, fp16 3,453 (0 overflows); bf16 weights 2,622, DeepSpeed fp16 2,581."""
    channels_last: bool = False
    """Keep image batches in channels_last memory format (faster convs on GPU)."""
    log_every: int = 1
    """Read loss/scale back to the host every N steps (GPU: fewer host syncs)."""
    eval_every_epochs: int = 1
    """Held-out evaluation every N epochs (and always at the end)."""
    seed: int = 0
    """Seed of model init, data order and augmentation (same on every rank)."""
    memory_cap_gb: float | None = None
    """Cap this process's GPU memory (per-process fraction), e.g. 8 to act like an 8 GB card."""
    autofit_margin: float = 0.9
    """Auto-fit keeps this fraction of the largest micro-batch that fitted."""
    autofit_max: int = 1024
    """Largest micro-batch auto-fit tries."""
    batching: str = field(default="auto", metadata={"choices": ("auto", "uniform", "balanced")})
    """uniform: every rank takes micro_batch; balanced: rank shares from measured speed; auto:
    DSCLUSTER_BATCHING from `dscluster check` (balanced on a cluster of mixed GPUs), else uniform."""
    shares: list[int] | None = None
    """Per-rank micro-batch sizes for balanced batching (sum = global micro batch)."""
    overlap_comm: bool = True
    """Overlap gradient reduction with backward: ZeRO 1/2 through DeepSpeed's overlap_comm; ZeRO-0 on
    several ranks through torch DDP's bucketed all-reduce inside the engine (DeepSpeed's own ZeRO-0
    all-reduce starts after backward: 4x H200 ViT-B/16 lost 9% to it)."""
    bucket_size_mb: int = 200
    """All-reduce / reduce-scatter bucket size in MB of elements."""
    ddp_bucket_mb: int = 100
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


def _choices(f: dataclasses.Field) -> tuple | None:
    return f.metadata.get("choices") if f.metadata else None


def _fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(value: Any, tp: Any, where: str, key: str, f: dataclasses.Field | None = None) -> Any:
    """Convert a YAML/override value to the field's declared type, or raise UsageError."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, where, key, f)
            except UsageError as e:
                errors.append(str(e))
        names = " or ".join("null" if a is type(None) else getattr(a, "__name__", str(a)) for a in args)
        raise UsageError(f"{where}: {key} must be {names}, got {value!r}")
    if origin is list:
        (inner,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise UsageError(f"{where}: {key} must be a list such as [1, 2], got {value!r}")
        return [_coerce(v, inner, where, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            out = value
        elif isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "on", "off", "1", "0"):
            out = value.lower() in ("true", "yes", "on", "1")
        else:
            raise UsageError(f"{where}: {key} must be true or false, got {value!r}")
    elif tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise UsageError(f"{where}: {key} must be a whole number, got {value!r}")
        try:
            out = int(value)
        except ValueError:
            raise UsageError(f"{where}: {key} must be a whole number, got {value!r}") from None
    elif tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise UsageError(f"{where}: {key} must be a number, got {value!r}")
        try:
            out = float(value)
        except ValueError:
            raise UsageError(f"{where}: {key} must be a number, got {value!r}") from None
    elif tp is str:
        if isinstance(value, (dict, list)) or value is None:
            raise UsageError(f"{where}: {key} must be a string, got {value!r}")
        out = str(value).lower() if isinstance(value, bool) else str(value)
    else:
        raise UsageError(f"{where}: {key}: unsupported type {tp}")
    choices = _choices(f) if f is not None else None
    if choices is not None and out not in choices:
        raise UsageError(f"{where}: {key} must be one of {', '.join(map(str, choices))}; got {value!r}")
    return out


def _from_node(cls, node: yaml.Node, path: str, section: str, lines: dict[str, int] | None = None):
    """Build dataclass `cls` from a YAML mapping node, checking every key against its fields.

    `lines` collects dotted key → line number, so later range checks can say where."""
    lines = {} if lines is None else lines
    if not isinstance(node, yaml.MappingNode):
        raise UsageError(f"{path}:{node.start_mark.line + 1}: {section or 'the config'} must be a mapping of key: value")
    fields, hints = _fields(cls), _hints(cls)
    kwargs: dict[str, Any] = {}
    seen: dict[str, int] = {}
    for knode, vnode in node.value:
        key = knode.value
        line = knode.start_mark.line + 1
        where = f"{path}:{line}"
        dotted = f"{section}.{key}" if section else key
        if key not in fields:
            raise UsageError(
                f"{where}: unknown key {dotted!r}; valid keys{' in ' + section if section else ''}: "
                f"{', '.join(fields)}"
            )
        if key in seen:
            raise UsageError(f"{where}: {dotted!r} given twice (first on line {seen[key]})")
        seen[key] = line
        lines[dotted] = line
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _from_node(tp, vnode, path, dotted, lines)
        else:
            value = yaml.safe_load(yaml.serialize(vnode))
            kwargs[key] = _coerce(value, tp, where, dotted, fields[key])
    return cls(**kwargs)


def load_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    """Load a YAML preset (or the defaults when path is None), apply overrides, validate.

    Range errors name where the value came from: FILE:LINE of its key, or the override."""
    origin: dict[str, str] = {}
    if path is None:
        cfg = TrainConfig()
    else:
        path = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
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
        cfg = TrainConfig() if node is None else _from_node(TrainConfig, node, path, "", lines)
        origin.update({k: f"{path}:{n}" for k, n in lines.items()})
    for ov in overrides:
        key = apply_override(cfg, ov)
        origin[key] = f"override {ov!r}"
    try:
        validate(cfg)
    except ConfigValueError as e:
        where = next((origin[k] for k in (e.key, *e.also) if k in origin), None)
        if where is None and path is not None:
            where = f"{path} (default of {e.key})"
        raise ConfigValueError(e.key, f"{where}: {e}" if where else str(e), e.also) from None
    return cfg


def apply_override(cfg: TrainConfig, text: str) -> str:
    """Apply one `dotted.key=value` override (value parsed as YAML, then typed); returns the dotted key."""
    where = f"override {text!r}"
    if "=" not in text:
        raise UsageError(f"{where}: expected key=value, e.g. optim.lr=0.0005 or epochs=5")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    obj: Any = cfg
    for i, part in enumerate(parts):
        fields = _fields(type(obj))
        if part not in fields:
            prefix = ".".join(parts[:i])
            raise UsageError(
                f"{where}: unknown key {key!r}; valid keys{' in ' + prefix if prefix else ''}: {', '.join(fields)}"
            )
        tp = _hints(type(obj))[part]
        if dataclasses.is_dataclass(tp):
            if i == len(parts) - 1:
                raise UsageError(f"{where}: {key!r} is a section; set one of its keys, e.g. {key}.{next(iter(_fields(tp)))}=...")
            obj = getattr(obj, part)
            continue
        if i != len(parts) - 1:
            raise UsageError(f"{where}: {'.'.join(parts[:i + 1])!r} is not a section")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        setattr(obj, part, _coerce(value, tp, where, key, fields[part]))
    return ".".join(parts)


def validate(cfg: TrainConfig) -> None:
    """Range and cross-field rules that a single field's type cannot express (ConfigValueError)."""
    E = ConfigValueError
    if isinstance(cfg.micro_batch, str) and cfg.micro_batch != "auto":
        raise E("micro_batch", f"micro_batch must be a positive whole number or 'auto', got {cfg.micro_batch!r}")
    if isinstance(cfg.micro_batch, int) and cfg.micro_batch < 1:
        raise E("micro_batch", f"micro_batch must be at least 1, got {cfg.micro_batch}")
    for name in ("epochs", "log_every", "ddp_bucket_mb"):
        if getattr(cfg, name) < 1:
            raise E(name, f"{name} must be at least 1, got {getattr(cfg, name)}")
    if cfg.grad_accum is not None and cfg.grad_accum < 1:
        raise E("grad_accum", f"grad_accum must be at least 1, got {cfg.grad_accum}")
    if cfg.global_batch is not None and cfg.global_batch < 1:
        raise E("global_batch", f"global_batch must be at least 1, got {cfg.global_batch}")
    if cfg.optim.lr_reference_batch is not None and cfg.optim.lr_reference_batch < 1:
        raise E("optim.lr_reference_batch", f"optim.lr_reference_batch must be at least 1, got {cfg.optim.lr_reference_batch}")
    if cfg.dist.timeout_s <= 0:
        raise E("dist.timeout_s", f"dist.timeout_s must be a positive number of seconds, got {cfg.dist.timeout_s}")
    if cfg.model.name == "vit_small_image" and cfg.model.embed_dim % cfg.model.num_heads:
        raise E("model.embed_dim",
                f"model.embed_dim={cfg.model.embed_dim} does not divide by model.num_heads={cfg.model.num_heads}",
                also=("model.num_heads",))
    if cfg.model.name == "vit_small_image" and cfg.data.img_size % cfg.model.patch_size:
        raise E("data.img_size",
                f"data.img_size={cfg.data.img_size} does not divide by model.patch_size={cfg.model.patch_size}",
                also=("model.patch_size",))
    if cfg.data.dataset in ("cifar10", "imagefolder") and not cfg.data.path:
        raise E("data.dataset", f"data.dataset={cfg.data.dataset} needs data.path (the folder with the data)")
    if not 0.0 < cfg.data.holdout_fraction < 1.0:
        raise E("data.holdout_fraction",
                f"data.holdout_fraction must be between 0 and 1, got {cfg.data.holdout_fraction}")
    if cfg.batching == "balanced" and cfg.shares is not None and any(s < 1 for s in cfg.shares):
        raise E("shares", f"shares must all be at least 1, got {cfg.shares}")


def to_dict(cfg: TrainConfig) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: TrainConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)
