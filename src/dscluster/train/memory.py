"""What a rank held at its fullest, for its `end` record and summary.json: GPU memory (`peak_mem_mb`) and
host memory (`peak_host_mb`, where ZeRO-Offload keeps the optimizer states and master weights).

Each rank measures its own process: under ZeRO the ranks' shares differ by little, under balanced
batching by their micro-batches, so each `end` record is that rank's truth and summary.json's is rank 0's.
"""

from __future__ import annotations

import resource
import sys

import torch


def peak_mem_mb(device: torch.device | None) -> float | None:
    """Peak GPU memory this rank allocated on its device (MiB) since the engine's start (core/setup_engine.py
    resets the counter after auto-fit's and balanced batching's probes, which try batches up to what does
    not fit); None on CPU, where there is no device pool."""
    if device is None or device.type != "cuda":
        return None
    try:
        return round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    except Exception:
        return None


def peak_host_mb() -> float | None:
    """Peak resident set size of this rank's process (MiB), start-up and data included: the host memory it
    held at its fullest, ZeRO-Offload's pinned buffers among it once written. Linux counts ru_maxrss in
    KiB, macOS in bytes."""
    try:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    except (OSError, ValueError):
        return None
    return round(rss / (2**20 if sys.platform == "darwin" else 1024), 1)


def note_peaks(record, device: torch.device | None) -> dict:
    """Both peaks into the run's RunRecord, and as the `end` record's fields."""
    record.peak_mem_mb, record.peak_host_mb = peak_mem_mb(device), peak_host_mb()
    return {"peak_mem_mb": record.peak_mem_mb, "peak_host_mb": record.peak_host_mb}
