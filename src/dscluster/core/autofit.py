"""Micro-batch auto-fit: the largest micro-batch whose real forward+backward fits in GPU memory.

8 GB cards OOM'd in the field at 64 images per GPU. The search runs real steps (binary
search between a size that fits and one that does not, catching torch.OutOfMemoryError
and emptying the cache), keeps a margin for fragmentation and the optimizer state, and the
global batch is then kept by gradient accumulation. `largest_fit` is pure so the search
logic is unit-tested with a plain `fits(b)` function.
"""

from __future__ import annotations

from typing import Callable

from dscluster.errors import JobFailed

OPTIMIZER_BYTES_PER_PARAM = 16


def largest_fit(fits: Callable[[int], bool], *, start: int = 1, maximum: int = 1024) -> int:
    """Largest b in [start, maximum] with fits(b), assuming fits is monotone; 0 if even start fails.

    Doubling from `start` finds an upper bound in log2 steps, then bisection; each probe is
    one real step, so the number of probes matters more than anything else here.
    """
    if start < 1 or maximum < start:
        raise ValueError(f"need 1 <= start <= maximum, got {start}, {maximum}")
    if not fits(start):
        return 0
    good, bad = start, None
    while bad is None:
        nxt = min(good * 2, maximum)
        if nxt == good:
            return good
        if fits(nxt):
            good = nxt
        else:
            bad = nxt
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good


def with_margin(fit: int, margin: float) -> int:
    return max(1, int(fit * margin))


def choose_micro_batch(max_micro: int, world: int, global_batch: int | None) -> tuple[int, int]:
    """(micro, grad_accum): micro ≤ max_micro and, when a global batch is set, micro × accum × world = global."""
    if max_micro < 1:
        raise JobFailed("auto-fit: not even one sample per micro-batch fits in GPU memory")
    if global_batch is None:
        return max_micro, 1
    if global_batch % world:
        raise JobFailed(f"global_batch={global_batch} does not divide by world size {world}")
    per_rank = global_batch // world
    for micro in range(min(max_micro, per_rank), 0, -1):
        if per_rank % micro == 0:
            return micro, per_rank // micro
    return 1, per_rank


def set_memory_cap(cap_gb: float | None, device) -> float | None:
    """Cap this process's share of the GPU (e.g. 8 GB on an 80 GB card); returns the fraction used."""
    import torch  # the search rules above stay torch-free at load: the run's shape (shape.py) uses them

    if cap_gb is None or device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    frac = min(1.0, cap_gb * 1024**3 / total)
    torch.cuda.set_per_process_memory_fraction(frac, device)
    return frac


def probe_fits(model, make_batch: Callable[[int], tuple], dtype, device) -> Callable[[int], bool]:
    """fits(b) for this model: one real forward+backward at batch b under autocast, OOM → False.

    The optimizer state is stood in for by a reserved block of the same size; the margin
    covers fragmentation.
    """
    import torch  # as in set_memory_cap

    # What training holds besides activations: fp32 master weights, two AdamW moments and
    # gradients (16 bytes per parameter with a half-precision model, a bit less in fp32).
    # Held on the device during the search so that the fit leaves room for it.
    n_params = sum(p.numel() for p in model.parameters())
    reserve = torch.empty(n_params * OPTIMIZER_BYTES_PER_PARAM, dtype=torch.uint8, device=device)

    def fits(b: int) -> bool:
        assert reserve.numel() > 0
        try:
            x, y = make_batch(b)
            with torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype != torch.float32):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            return True
        except torch.OutOfMemoryError:
            return False
        finally:
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()

    return fits
