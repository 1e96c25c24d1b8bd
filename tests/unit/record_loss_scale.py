"""Record the fp16 loss-scale sequence the guard tests replay (run: python tests/unit/record_loss_scale.py).

fp16 training needs a GPU, so on a CPU-only machine the sequence is recorded like this:
the digits ViT trains in fp32 on real batches; at every step the loss is multiplied by
the current scale, and the step counts as an overflow when any scaled gradient is not
finite or exceeds fp16's largest value (65504) - exactly when fp16 gradients would hold
inf. These real overflow flags drive DeepSpeed's own DynamicLossScaler (the class its fp16
optimizer uses), which picks the next scale; overflowed steps are skipped, as in DeepSpeed.
Phase 2 raises the learning rate far too high so the model diverges, as a run that the
guard must stop does.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

FP16_MAX = 65504.0


def record(steps_ok: int = 60, steps_bad: int = 60, start_power: int = 16) -> list[dict]:
    from dscluster.core import data
    from dscluster.core.config import load_config
    from dscluster.core.losscale import make_dynamic_scaler
    from dscluster.core.model import build_model

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "digits.yaml")
    torch.manual_seed(0)
    splits = data.load(cfg.data, "cpu")
    model = build_model(cfg.model, in_chans=1, num_classes=10, img_size=cfg.data.img_size)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr)
    scaler = make_dynamic_scaler(init_power=start_power, window=20, hysteresis=2, min_scale=1.0)
    g = torch.Generator().manual_seed(0)
    out = []
    for step in range(steps_ok + steps_bad):
        if step == steps_ok:
            for group in opt.param_groups:
                group["lr"] = 5.0  # diverge on purpose
        idx = torch.randint(0, len(splits.train), (64,), generator=g).tolist()
        x, y = splits.train.get_batch(idx, "cpu")
        scale = float(scaler.cur_scale)
        opt.zero_grad()
        (F.cross_entropy(model(x), y) * scale).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        overflow = any(not torch.isfinite(gr).all() or gr.abs().max() > FP16_MAX for gr in grads)
        if not overflow:
            for gr in grads:
                gr.div_(scale)
            opt.step()
        out.append({"step": step + 1, "scale": scale, "overflow": bool(overflow)})
        scaler.update_scale(overflow)
    return out


if __name__ == "__main__":
    seq = record()
    path = Path(__file__).parent / "data" / "fp16_scale_sequence.json"
    path.write_text(json.dumps({"source": "tests/unit/record_loss_scale.py (real gradients of the digits ViT, "
                                          "DeepSpeed DynamicLossScaler; see its docstring)",
                                "points": seq}, indent=0) + "\n")
    print(f"{sum(p['overflow'] for p in seq)} overflows in {len(seq)} steps -> {path}", file=sys.stderr)
