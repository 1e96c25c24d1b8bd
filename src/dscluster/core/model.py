"""The ViT: timm's VisionTransformer, either a small-image preset or a named timm model.

timm's attention uses torch's scaled_dot_product_attention (flash / memory-efficient
kernels on GPU) whenever it is available; `fused_attention()` reports what was used.
"""

from __future__ import annotations

import timm
import torch
from timm.layers import use_fused_attn
from timm.models.vision_transformer import VisionTransformer

from dscluster.core.config import ModelConfig
from dscluster.errors import UsageError

SMALL_IMAGE = "vit_small_image"


def build_model(cfg: ModelConfig, *, in_chans: int, num_classes: int, img_size: int) -> torch.nn.Module:
    """pretrained=False always: the cluster trains offline and the point is the training."""
    if cfg.name == SMALL_IMAGE:
        return VisionTransformer(
            img_size=img_size, patch_size=cfg.patch_size, in_chans=in_chans, num_classes=num_classes,
            embed_dim=cfg.embed_dim, depth=cfg.depth, num_heads=cfg.num_heads, mlp_ratio=cfg.mlp_ratio,
            drop_path_rate=cfg.drop_path, global_pool="token",
        )
    if not timm.is_model(cfg.name):
        close = [m for m in timm.list_models("vit_*") if cfg.name.split("_")[0] in m][:5]
        raise UsageError(f"model.name {cfg.name!r} is not a timm model (e.g. {', '.join(close)} or {SMALL_IMAGE})")
    return timm.create_model(cfg.name, pretrained=False, num_classes=num_classes, in_chans=in_chans,
                             img_size=img_size, drop_path_rate=cfg.drop_path)


def fused_attention() -> bool:
    return bool(use_fused_attn())


def count_params(model: torch.nn.Module) -> int:
    """Parameters of the whole model, also once ZeRO-3 has partitioned it (each rank then holds a share;
    DeepSpeed keeps the full count on the parameter as ds_numel)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
