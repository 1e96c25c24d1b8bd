"""Models, FLOP counts and peak throughput the benchmarks share.

MFU = achieved model FLOP/s ÷ the card's dense bf16 peak. Training costs 3 × the forward
FLOPs (forward, plus backward ≈ 2 × forward). For ViT-B/16 at 224 the forward is ≈ 35
GFLOPs, so 105 GFLOPs per image; other ViTs use the parameter/attention estimate below.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from dscluster import core
from dscluster.errors import UsageError

# ViT sizes small enough for a CPU smoke run: "tiny" is a 0.45 M-parameter ViT (dim 96, depth 4,
# patch 4).
TINY_VITS = {
    "tiny": dict(img_size=32, patch_size=4, embed_dim=96, depth=4, num_heads=3, num_classes=10),
}

# Known training FLOPs per image (3 × forward).
TRAIN_FLOPS_PER_IMAGE = {
    "vit_base_patch16_224": 105e9,
}

# Dense bf16 tensor-core peak, FLOP/s, by a substring of torch.cuda.get_device_name().
# Most specific first. Sources: NVIDIA data sheets (dense, no sparsity).
PEAK_BF16_FLOPS = [
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),        # SXM / HBM3
    ("GH200", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("A10", 125e12),
]


@dataclass(frozen=True)
class ModelSpec:
    """What a benchmark needs to know about a model without building it."""

    name: str
    img_size: int
    num_classes: int
    train_flops_per_image: float
    flops_source: str


def _model_config(name: str):

    if name in TINY_VITS:
        kw = TINY_VITS[name]
        return core.ModelConfig(name=core.SMALL_IMAGE, patch_size=kw["patch_size"], embed_dim=kw["embed_dim"],
                           depth=kw["depth"], num_heads=kw["num_heads"])
    return core.ModelConfig(name=name)


def build_model(name: str, num_classes: int | None = None):
    """The very ViT `dscluster train` builds for the same name (dscluster.core.model)."""

    img_size, classes = _input_spec(name)
    return core.build_model(_model_config(name), in_chans=3, num_classes=num_classes or classes, img_size=img_size)


def _input_spec(name: str) -> tuple[int, int]:
    """(image size, classes) without building the model."""
    if name in TINY_VITS:
        return TINY_VITS[name]["img_size"], TINY_VITS[name]["num_classes"]
    import timm  # timm: loads only for a model the tables do not name

    if not timm.is_model(name):
        raise UsageError(f"--model {name!r}: not a timm model; use e.g. vit_base_patch16_224, or 'tiny'")
    cfg = timm.get_pretrained_cfg(name)
    return (cfg.input_size[-1], cfg.num_classes) if cfg is not None else (224, 1000)


@functools.lru_cache(maxsize=None)
def model_spec(name: str) -> ModelSpec:
    """Image size, classes and training FLOPs per image for `name`."""
    img_size, classes = _input_spec(name)
    if name in TRAIN_FLOPS_PER_IMAGE:
        return ModelSpec(name, img_size, classes, TRAIN_FLOPS_PER_IMAGE[name], "3 x 35 GFLOPs forward")
    import torch  # torch: only to count an unnamed model's parameters

    with torch.device("meta"):  # shapes only: no memory, no init time
        model = build_model(name)
    params = sum(p.numel() for p in model.parameters())
    tokens = model.patch_embed.num_patches + getattr(model, "num_prefix_tokens", 1)
    depth = len(model.blocks)
    dim = model.embed_dim
    # 6·N·T for the matmuls (2 forward + 4 backward per parameter per token) plus attention
    # scores and weighted sum: 4·T²·D forward per layer, ×3 for training.
    flops = 6 * params * tokens + 12 * depth * tokens * tokens * dim
    return ModelSpec(name, img_size, classes, float(flops), "estimate 6*N*T + 12*L*T^2*D")


def peak_bf16_flops(device_name: str | None) -> float | None:
    """The card's dense bf16 peak, or None when unknown (MFU is then not reported)."""
    if not device_name:
        return None
    for needle, peak in PEAK_BF16_FLOPS:
        if needle.lower() in device_name.lower():
            return peak
    return None
