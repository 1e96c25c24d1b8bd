#!/usr/bin/env python3
"""Is the fractal data set learnable by ViT-S/16 at 224 px in minutes, and can loader workers feed a GPU?

Plain PyTorch on one GPU, no DeepSpeed or timm (so it runs on a bare GPU host with torch and
torchvision): torchvision's VisionTransformer in the ViT-S/16 shape (12 blocks, width 384, 6 heads),
the settings of configs/vit_small_fractal.yaml (AdamW 1e-3 at batch 512, 200 warm-up steps, cosine,
weight decay 0.05, clip 1, bf16 autocast), the fractal set rendered by DataLoader workers exactly as
`dscluster train` renders it (dscluster.core.fractal). It first times the workers alone, then trains
until --seconds have passed, evaluating the held-out set every epoch.

    python bench/fractal_torch.py --seconds 400 --workers 14 --out fractal_torch.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torchvision.models.vision_transformer import VisionTransformer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from dscluster.core.fractal import MEAN, STD, FractalRenderer  # noqa: E402


class Batches(torch.utils.data.Dataset):
    """Item = one batch of indices -> rendered uint8 images and labels (class = i % C, image first + i // C)."""

    def __init__(self, renderer, classes: int, first: int, batches: list[np.ndarray]):
        self.renderer = renderer
        self.classes = classes
        self.first = first
        self.batches = batches

    def __len__(self):
        return len(self.batches)

    def __getitem__(self, k):
        idx = self.batches[k]
        labels = idx % self.classes
        images = self.renderer.render(labels.tolist(), (self.first + idx // self.classes).tolist())
        return images, torch.from_numpy(labels)


def loader(renderer, classes, first, n, batch, workers, shuffle_seed=None):
    order = np.random.default_rng(shuffle_seed).permutation(n) if shuffle_seed is not None else np.arange(n)
    batches = [order[i:i + batch] for i in range(0, n - (batch - 1 if shuffle_seed is not None else 0), batch)]
    return torch.utils.data.DataLoader(Batches(renderer, classes, first, batches), batch_size=None, shuffle=False,
                                       num_workers=workers, pin_memory=True, prefetch_factor=4 if workers else None)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--classes", type=int, default=50)
    p.add_argument("--per-class", type=int, default=1000)
    p.add_argument("--img", type=int, default=224)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--epochs", type=int, default=15, help="the cosine schedule's length")
    p.add_argument("--seconds", type=float, default=400, help="stop after the first epoch ending past this")
    p.add_argument("--workers", type=int, default=14)
    p.add_argument("--out", type=Path, default=Path("fractal_torch.json"))
    p.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a smoke test)")
    args = p.parse_args()

    device = torch.device(args.device)
    t_setup = time.time()
    renderer = FractalRenderer(0, args.classes, args.img)
    n_hold = round(args.per_class * 0.2) * args.classes
    n_train = args.per_class * args.classes - n_hold
    doc = {"gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
           "args": vars(args) | {"out": str(args.out)},
           "n_train": n_train, "n_holdout": n_hold, "class_setup_s": round(time.time() - t_setup, 2), "epochs": []}
    t = time.time()
    seen = 0
    for x, _ in loader(renderer, args.classes, 0, 64 * 200, 64, args.workers, 0):
        seen += len(x)
    doc["loader_images_per_s"] = round(seen / (time.time() - t), 1)
    print(f"loader alone: {doc['loader_images_per_s']} img/s with {args.workers} workers", flush=True)
    model = VisionTransformer(image_size=args.img, patch_size=16, num_layers=12, num_heads=6, hidden_dim=384,
                              mlp_dim=1536, num_classes=args.classes).to(device).to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05, fused=device.type == "cuda")
    steps_per_epoch = n_train // args.batch
    total = steps_per_epoch * args.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup) * (
        0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, max(0, s - args.warmup) / max(1, total - args.warmup))))))
    mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1) * 255
    std = torch.tensor(STD, device=device).view(1, 3, 1, 1) * 255
    prep = lambda x: ((x.to(device, non_blocking=True).float() - mean) / std).contiguous(  # noqa: E731
        memory_format=torch.channels_last)
    start = time.time()
    images = 0
    step = 0
    for epoch in range(args.epochs):
        model.train()
        epoch_start = time.time()
        loss_sum = torch.zeros((), device=device)
        for x, y in loader(renderer, args.classes, 0, n_train, args.batch, args.workers, 1000 + epoch):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = F.cross_entropy(model(prep(x)), y.to(device, non_blocking=True))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            loss_sum += loss.detach()
            step += 1
            images += len(y)
        float(loss_sum)  # the device has finished the epoch
        train_s = time.time() - epoch_start
        model.eval()
        correct = 0
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
            for x, y in loader(renderer, args.classes, n_train // args.classes, n_hold, 500, args.workers):
                correct += int((model(prep(x)).argmax(1).cpu() == y).sum())
        rec = {"epoch": epoch + 1, "step": step, "images": images, "seconds": round(time.time() - start, 1),
               "train_images_per_s": round(steps_per_epoch * args.batch / train_s, 1),
               "loss": round(float(loss_sum) / steps_per_epoch, 4), "holdout_accuracy": correct / n_hold}
        doc["epochs"].append(rec)
        print(json.dumps(rec), flush=True)
        args.out.write_text(json.dumps(doc, indent=1))
        if time.time() - start > args.seconds:
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
