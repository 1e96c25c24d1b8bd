"""Held-out evaluation: rank 0 alone, between two barriers, on the bare model.

Rank 0 evaluates while the others wait at a barrier instead of racing into the next epoch's
collectives; it runs the model itself (setup_engine.bare_module), never the DDP wrapper, whose
forward may broadcast buffers to ranks that are not there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dscluster.train import dist


@torch.no_grad()
def evaluate(engine, dataset, dtype, device, channels_last: bool, batch: int = 256) -> tuple[float, float, int]:
    """(accuracy, mean loss, samples) of the model on `dataset`."""
    from dscluster.train.setup_engine import bare_module

    module = bare_module(engine)
    was_training = module.training
    module.eval()
    correct, loss_sum, n = 0, 0.0, len(dataset)
    for lo in range(0, n, batch):
        x, y = dataset.get_batch(list(range(lo, min(n, lo + batch))), device, dtype, channels_last=channels_last)
        out = module(x).float()
        loss_sum += float(F.cross_entropy(out, y, reduction="sum"))
        correct += int((out.argmax(1) == y).sum())
    module.train(was_training)
    return correct / n, loss_sum / n, n


def held_out(engine, built, cfg, device, *, primary: bool, log, progress, epoch: int, step: int) -> float | None:
    """Collective: every rank calls it; rank 0 evaluates, records it and returns the accuracy."""
    accuracy = None
    dist.barrier()
    if primary:
        acc, eloss, n = evaluate(engine, built.splits.holdout, built.dtype, device, cfg.channels_last)
        accuracy = acc
        log.record("eval", epoch=epoch, step=step, accuracy=acc, loss=eloss, samples=n)
        progress.print(f"epoch {epoch + 1}/{cfg.epochs} step {step}: held-out accuracy {acc:.1%} loss {eloss:.3f}")
    dist.barrier()
    return accuracy
