"""Limits of the training config, declared on its fields, and the checks of what it points at.

A field carries its rule beside its default, so the check, its message and the tests that try
out-of-range values all read one declaration:

    lr: float = field(default=1e-3, metadata=limits(gt=0))
    precision: str = field(default="auto", metadata={"choices": ("auto", "bf16", "fp16", "fp32")})

`check_fields` enforces every such rule (ConfigValueError naming the key, the allowed range and a
value that works). `check_world` checks what the values refer to (data on disk, timm's model
names, a checkpoint to resume) so that a mistake there stops every rank before a run
directory exists, instead of inside the training loop after it was created.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

from dscluster.core.precision import amp_dtype, gradient_format
from dscluster.errors import UsageError
from dscluster.rundir import layout
from dscluster.rundir.checkpoints import resume_decision

# Metadata keys a field may declare; tests read the same keys to derive the values they try.
RULE_KEYS = ("ge", "gt", "le", "lt", "words", "length", "choices")

SMALL_IMAGE_MODEL = "vit_small_image"  # built by dscluster itself, not a timm name
CIFAR10_FILES = tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch",)


class ConfigValueError(UsageError):
    """A value out of range or inconsistent with another (found by `validate`).

    `key` is the dotted config key at fault (`also` lists others involved); load_config
    prefixes the message with where that key was set: FILE:LINE or the override.
    """

    def __init__(self, key: str, message: str, also: tuple[str, ...] = ()):
        super().__init__(message)
        self.key, self.also = key, also


def limits(*, ge: float | None = None, gt: float | None = None, le: float | None = None,
           lt: float | None = None, words: tuple[str, ...] = (), length: int | None = None) -> dict:
    """Field metadata for a number: at least `ge` / greater than `gt`, at most `le` / less than `lt`.

    `words` are strings accepted instead of a number (micro_batch: 'auto'). On a list field the
    bounds hold for every entry and `length` fixes how many entries there are."""
    rule = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt), ("length", length)) if v is not None}
    if words:
        rule["words"] = tuple(words)
    return rule


def leaf_fields(cls, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field]]:
    """(dotted key, field) of every value of a config dataclass, sections recursed."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from leaf_fields(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f


def default_of(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def value_at(cfg, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def describe(rule: dict) -> str:
    """The allowed range in words: 'at least 1', 'greater than 0 and less than 1', "… or 'auto'"."""
    parts = []
    if "ge" in rule:
        parts.append(f"at least {rule['ge']}")
    if "gt" in rule:
        parts.append(f"greater than {rule['gt']}")
    if "le" in rule:
        parts.append(f"at most {rule['le']}")
    if "lt" in rule:
        parts.append(f"less than {rule['lt']}")
    text = " and ".join(parts) or "a number"
    return text + "".join(f" or {w!r}" for w in rule.get("words", ()))


def in_range(value: float, rule: dict) -> bool:
    return (math.isfinite(value)
            and ("ge" not in rule or value >= rule["ge"]) and ("gt" not in rule or value > rule["gt"])
            and ("le" not in rule or value <= rule["le"]) and ("lt" not in rule or value < rule["lt"]))


def _fix(key: str, default: Any) -> str:
    if default is None:
        return "set it in that range, or null (the default)"
    text = f"[{', '.join(map(str, default))}]" if isinstance(default, list) else str(default)
    return f"e.g. {key}={text} (the default)"


def check_value(key: str, value: Any, rule: dict, default: Any = None) -> None:
    """Raise ConfigValueError unless `value` keeps the field's declared rule (None always passes:
    only fields typed `| None` can hold it)."""
    if value is None or not rule:
        return
    if "choices" in rule:
        if value not in rule["choices"]:
            raise ConfigValueError(key, f"{key} must be one of {', '.join(map(str, rule['choices']))}; got {value!r}")
        return
    if isinstance(value, list):
        if "length" in rule and len(value) != rule["length"]:
            raise ConfigValueError(key, f"{key} must have {rule['length']} entries, got {len(value)} ({value}); "
                                        f"{_fix(key, default)}")
        for i, item in enumerate(value):
            if not in_range(item, rule):
                raise _out_of_range(key, f"{key}[{i}]", item, rule, default)
        return
    if isinstance(value, str) and value in rule.get("words", ()):
        return
    if isinstance(value, str) or not in_range(value, rule):
        raise _out_of_range(key, key, value, rule, default)


def _out_of_range(key: str, shown: str, value: Any, rule: dict, default: Any) -> ConfigValueError:
    finite = "" if isinstance(value, str) or math.isfinite(value) else "a finite number, "
    return ConfigValueError(key, f"{shown} must be {finite}{describe(rule)}, got {value!r}; {_fix(key, default)}")


def check_fields(cfg) -> None:
    """Every declared rule of every field of `cfg` (a config dataclass), in declaration order."""
    for key, f in leaf_fields(type(cfg)):
        check_value(key, value_at(cfg, key), {k: f.metadata[k] for k in RULE_KEYS if k in f.metadata},
                    default_of(f))


# DeepSpeed's top-level config keys (DeepSpeed 0.19: runtime/config.py and the sections it hands
# on). DeepSpeed ignores a key it does not know, so `tensorbaord: {enabled: true}` would log
# nothing and say nothing: the `deepspeed:` section refuses such a key instead.
DEEPSPEED_KEYS = frozenset((
    "activation_checkpointing", "aio", "amp", "autotuning", "bf16", "bfloat16", "checkpoint", "comet",
    "comms_logger", "communication_data_type", "compile", "compression_training", "csv_monitor",
    "curriculum_learning", "data_efficiency", "data_types", "dataloader_drop_last", "datastates_ckpt",
    "disable_allgather", "disable_python_gc", "dump_state", "eigenvalue", "elasticity", "expert_parallel",
    "flops_profiler", "fp16", "gradient_accumulation_steps", "gradient_allreduce_op", "gradient_clipping",
    "gradient_predivide_factor", "hybrid_engine", "log_level", "managed_gradient_accumulation",
    "memory_breakdown", "nebula", "optimizer", "pipeline", "prescale_gradients", "progressive_layer_drop",
    "quantize_training", "scheduler", "seq_parallel_communication_data_type", "sequence_parallel_size",
    "sparse_attention", "steps_per_print", "tensor_parallel", "tensorboard", "timers", "torch_autocast",
    "train_batch_size", "train_micro_batch_size_per_gpu", "wall_clock_breakdown", "wandb",
    "weight_quantization", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "zero_optimization",
))

# What dscluster writes from its own keys, and why a second value in `deepspeed:` would break it:
# the sampler, balanced shares and images/s follow train's batch; the precision policy (one per
# cluster, from check) picks autocast or DeepSpeed's half optimizer; dscluster clips itself where it
# can (no host sync), so DeepSpeed clipping too would clip twice; DDP overlap, clipping and amp
# follow zero_stage.
DEEPSPEED_DERIVED = {
    ("train_batch_size",): "global_batch",
    ("train_micro_batch_size_per_gpu",): "micro_batch",
    ("gradient_accumulation_steps",): "grad_accum",
    ("fp16",): "precision=fp16 and the fp16.* keys",
    ("bf16",): "precision=bf16",
    ("bfloat16",): "precision=bf16",
    ("torch_autocast",): "precision and amp",
    ("gradient_clipping",): "optim.grad_clip",
    ("zero_optimization", "stage"): "zero_stage",
    ("zero_optimization", "offload_optimizer", "device"): "offload_optimizer (which also hands DeepSpeed the CPUAdam "
                                                          "that ZeRO-Offload steps with)",
    ("optimizer",): "optim.* (dscluster hands DeepSpeed its own AdamW, and DeepSpeed then ignores this section)",
}


def check_deepspeed_section(section: dict | None) -> None:
    """The `deepspeed:` mapping: only keys DeepSpeed knows, none that dscluster derives, JSON values."""
    if not section:
        return
    opt = section.get("optimizer")
    if isinstance(opt, dict) and str(opt.get("type", "")).lower() in ONE_BIT_OPTIMIZERS:
        raise ConfigValueError("deepspeed.optimizer.type", one_bit_refusal("deepspeed.optimizer.type", opt["type"]),
                               also=("deepspeed.optimizer", "deepspeed"))
    for path, instead in DEEPSPEED_DERIVED.items():
        inner: Any = section
        for name in path:
            inner = inner.get(name) if isinstance(inner, dict) else None
        if inner is not None:
            key = "deepspeed." + ".".join(path)
            raise ConfigValueError(key, f"{key} is set by dscluster from {instead}: set that instead",
                                   also=("deepspeed." + path[0], "deepspeed"))
    for name in section:
        if name not in DEEPSPEED_KEYS:
            close = sorted(k for k in DEEPSPEED_KEYS if k[:4] == str(name)[:4]) or ["tensorboard", "zero_optimization"]
            raise ConfigValueError(f"deepspeed.{name}", f"deepspeed.{name} is not a DeepSpeed config key (DeepSpeed "
                                   f"would ignore it); e.g. {', '.join(close)}", also=("deepspeed",))
    try:
        json.dumps(section, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ConfigValueError("deepspeed", f"deepspeed: a value DeepSpeed's JSON config cannot hold ({e})") from None


def check_relations(cfg) -> None:
    """The rules that tie fields together (after the field rules: some divide by them)."""
    E = ConfigValueError
    if cfg.model.name == SMALL_IMAGE_MODEL and cfg.model.embed_dim % cfg.model.num_heads:
        raise E("model.embed_dim",
                f"model.embed_dim={cfg.model.embed_dim} does not divide by model.num_heads={cfg.model.num_heads}",
                also=("model.num_heads",))
    if cfg.model.name == SMALL_IMAGE_MODEL and cfg.data.img_size % cfg.model.patch_size:
        raise E("data.img_size",
                f"data.img_size={cfg.data.img_size} does not divide by model.patch_size={cfg.model.patch_size}",
                also=("model.patch_size",))
    if cfg.data.dataset in ("cifar10", "imagefolder") and not cfg.data.path:
        raise E("data.dataset", f"data.dataset={cfg.data.dataset} needs data.path (the folder with the data)")
    if cfg.data.dataset == "fractal":
        n, frac = cfg.data.images_per_class, cfg.data.holdout_fraction
        if not 1 <= round(n * frac) < n:
            raise E("data.images_per_class", f"data.images_per_class={n} with data.holdout_fraction={frac:g} leaves "
                    f"{round(n * frac)} of each class held out and {n - round(n * frac)} for training; both need at "
                    "least one: raise data.images_per_class", also=("data.holdout_fraction",))
    if cfg.target_accuracy is not None and cfg.data.dataset == "synthetic":
        raise E("target_accuracy", "target_accuracy needs a held-out set; data.dataset=synthetic has none (use "
                "fractal, digits, cifar10 or imagefolder, or leave target_accuracy unset)", also=("data.dataset",))
    offload_conflict(cfg)
    power = cfg.fp16.initial_scale_power
    if cfg.fp16.min_loss_scale > 2.0 ** power:
        raise E("fp16.min_loss_scale",
                f"fp16.min_loss_scale={cfg.fp16.min_loss_scale:g} is above the starting scale 2^{power} = {2 ** power} "
                f"(fp16.initial_scale_power={power}): the guard would stop the run at once; lower "
                "fp16.min_loss_scale or raise fp16.initial_scale_power",
                also=("fp16.initial_scale_power",))


def offload_conflict(cfg) -> None:
    """Where offload_optimizer cannot apply: ConfigValueError naming the key, why and the fix."""
    E = ConfigValueError
    off = cfg.offload_optimizer
    key = "offload_optimizer"
    if off == "none":
        return
    if cfg.zero_stage == 0:
        raise E(key, f"{key}={off} needs zero_stage 1, 2 or 3: ZeRO-Offload moves the optimizer states ZeRO "
                     "partitions, and zero_stage=0 partitions none; set zero_stage=2 (optimizer states and "
                     f"gradients) or zero_stage=3 (the weights too), or {key}=none", also=("zero_stage",))
    if cfg.optim.fused == "true":
        raise E("optim.fused", f"optim.fused=true asks for torch's fused AdamW on the GPU, but with {key}={off} "
                               f"DeepSpeed's CPUAdam steps on the CPU; set optim.fused=auto or {key}=none",
                also=(key,))


# DeepSpeed's communication-compressing optimizers, by their config names. Why none can run here (their
# code in DeepSpeed's runtime/fp16/onebit/ and runtime/comm/, before it was removed): they asserted ZeRO stage 0,
# were validated with fp16 only, imported cupy for their nccl and mpi backends (cupy is not in
# dscluster's pinned packages, and lab GPU hosts often cannot download it), their `compressed`
# backend's packbits op was built for Intel XPU only, and freeze_step defaulted to 100000 (no
# compression before then). The DeepSpeed pinned here (0.19) no longer has them at all: DeepSpeed
# removed the three optimizers in 2026 (deepspeedai/DeepSpeed#8490) and then their backends.
ONE_BIT_OPTIMIZERS = {"onebitadam": "1-bit Adam", "zerooneadam": "0/1 Adam", "onebitlamb": "1-bit LAMB"}


def _deepspeed_version() -> str:
    try:
        return metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        return "not installed"


def one_bit_refusal(key: str, value: str) -> str:
    name = ONE_BIT_OPTIMIZERS[str(value).lower()]
    return (f"{key}={value}: DeepSpeed's {name} cannot run on this stack: the installed DeepSpeed "
            f"({_deepspeed_version()}) no longer has 1-bit Adam, 0/1 Adam or 1-bit LAMB (removed upstream in "
            "2026), and before that they needed cupy for their nccl and mpi backends (not in dscluster's "
            "packages) or an Intel XPU for the compressed one. For fewer bytes on the wire use "
            "comm.compression=powersgd (low-rank gradients with error feedback) or comm.compression=fp16")


def check_optimizer_name(name: str) -> None:
    """optim.name: a 1-bit optimizer's name gets its reason, not just the list of choices."""
    if str(name).lower() in ONE_BIT_OPTIMIZERS:
        raise ConfigValueError("optim.name", one_bit_refusal("optim.name", name))


def compression_conflict(cfg, precision: str | None) -> None:
    """Where comm.compression cannot apply: ConfigValueError naming the key, the reason and the fix.

    The one rule for it: load_config checks what the config alone decides (precision None while it
    is auto), train checks again with the precision each rank decided, before the run directory
    exists; `dscluster plan` recommends only what passes. One rank is not refused: there is nothing
    to send (train notes it)."""
    E, comp = ConfigValueError, cfg.comm.compression
    if comp == "none":
        return
    key = "comm.compression"
    if cfg.zero_stage != 0:
        raise E(key, f"{key}={comp} needs zero_stage=0: ZeRO {cfg.zero_stage} reduces gradients with DeepSpeed's "
                     "own reduce-scatter, not the DDP buckets the compression hooks act on; set zero_stage=0 or "
                     f"{key}=none", also=("zero_stage",))
    if not cfg.overlap_comm:
        raise E(key, f"{key}={comp} needs overlap_comm=true: without it DeepSpeed all-reduces the gradients "
                     f"itself after backward, and the DDP hooks never run; set overlap_comm=true or {key}=none",
                also=("overlap_comm",))
    if precision is None or comp == "powersgd":
        return
    grads = gradient_format(cfg, precision)
    if grads == comp:
        raise E(key, f"{key}={comp} has no effect: with precision={precision} and amp=false the gradients are "
                     f"{grads} already; set {key}=none (or amp=true: fp32 gradients, which {comp} compression "
                     "halves)", also=("precision", "amp"))
    if grads != "fp32":
        raise E(key, f"{key}={comp} sends no fewer bytes than the {grads} gradients of precision={precision} with "
                     f"amp=false, and rounds them to another format; set {key}=none or {key}=powersgd",
                also=("precision", "amp"))


def sync_conflict(cfg, precision: str | None) -> None:
    """Where sync.mode local_sgd / diloco cannot apply: ConfigValueError naming the key, why and the fix.
    The one rule, checked like compression_conflict: by load_config, and by train once precision is decided."""
    E = ConfigValueError
    mode = cfg.sync.mode
    key = "sync.mode"
    if mode == "every_step":
        return
    if cfg.zero_stage != 0:
        raise E(key, f"{key}={mode} needs zero_stage=0: it averages whole models, which ZeRO {cfg.zero_stage} "
                     f"partitions across ranks; set zero_stage=0 or {key}=every_step", also=("zero_stage",))
    if cfg.sync.delay_steps >= cfg.sync.period:
        raise E("sync.delay_steps", f"sync.delay_steps={cfg.sync.delay_steps} must be below sync.period="
                f"{cfg.sync.period}: an average is applied before the next one starts; set sync.delay_steps "
                f"to at most {cfg.sync.period - 1} (or raise sync.period)", also=("sync.period",))
    if cfg.comm.compression != "none":
        raise E(key, f"{key}={mode} sends no gradients between nodes after its warm-up, so "
                     f"comm.compression={cfg.comm.compression} has nothing to act on; set comm.compression=none",
                also=("comm.compression",))
    if precision is not None and precision != "fp32" and amp_dtype(cfg, precision) is None:
        raise E(key, f"{key}={mode} averages the fp32 weights the optimizer steps; with precision={precision} "
                     "and amp=false DeepSpeed keeps them inside its own optimizer; set amp=true",
                also=("amp", "precision"))


def checkpoint_dir(cfg, run_dir: Path) -> Path:
    """Where checkpoints go: checkpoint.dir, else <run dir>/checkpoints."""
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(run_dir) / layout.CHECKPOINT_DIR


def check_world(cfg) -> None:
    """What the values point at exists: the data folder, the timm model, the checkpoint to resume.

    Read-only and cheap (no data is loaded, only the top of the data folder listed), so every
    rank can run it before the run directory is created."""
    E = ConfigValueError
    if cfg.data.dataset in ("cifar10", "imagefolder") and cfg.data.path:
        root = Path(cfg.data.path)
        named, data = f"data.path {str(root)!r}", ("data.dataset",)
        fix = f"point it at the folder with the {cfg.data.dataset} data"
        if not root.exists():
            raise E("data.path", f"{named} does not exist; {fix}", data)
        if not root.is_dir():
            raise E("data.path", f"{named} is a file; {fix}", data)
        if cfg.data.dataset == "cifar10":
            batches = root / "cifar-10-batches-py" if (root / "cifar-10-batches-py").is_dir() else root
            missing = [n for n in CIFAR10_FILES if not (batches / n).is_file()]
            if missing:
                raise E("data.path", f"{named} lacks {', '.join(missing)}; it must be the cifar-10-batches-py "
                                     "folder of the CIFAR-10 python version", data)
        elif not any(p.is_dir() for p in root.iterdir()):
            raise E("data.path", f"{named} has no class folders; imagefolder data is <path>/<class>/<image> "
                                 "(or <path>/train/<class>/… beside val/)", data)
    if cfg.model.name != SMALL_IMAGE_MODEL:
        import timm  # the checks stay torch-free at load: light commands load the config with them

        if not timm.is_model(cfg.model.name):
            close = [m for m in timm.list_models("vit_*") if cfg.model.name.split("_")[0] in m][:5]
            raise E("model.name", f"model.name {cfg.model.name!r} is not a timm model; "
                                  f"e.g. {', '.join(close + [SMALL_IMAGE_MODEL])}")
    if cfg.checkpoint.dir and Path(cfg.checkpoint.dir).exists() and not Path(cfg.checkpoint.dir).is_dir():
        raise E("checkpoint.dir", f"checkpoint.dir {cfg.checkpoint.dir!r} is a file; point it at a folder "
                                  "(it is created when missing)")
    if cfg.checkpoint.resume == "true":
        try:
            resume_decision("true", checkpoint_dir(cfg, layout.run_dir()))
        except UsageError as e:
            raise E("checkpoint.resume", str(e), also=("checkpoint.dir",)) from None
