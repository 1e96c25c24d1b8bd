"""The write rate of the folder a run's checkpoints go to, measured where plan runs: one `torch.save` of a
checkpoint's bytes (phases.CHECKPOINT_BYTES_PER_PARAM a parameter, at most PROBE_MAX_BYTES) into a
temporary file there, timed to its close, without fsync, as DeepSpeed saves. A first plan prices each save
with it; a run's own saves replace it in the next plan of the setting (wholerun.FromRuns.save_s).

Why: an assumed write rate priced saves far from what runs measured, and with a save every epoch that
moved the first plan's whole-run figure by a third (docs/plan.md, "The whole run")."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from dscluster.rundir import layout

PROBE_MAX_BYTES = 1 << 30
"""A larger checkpoint is timed on its first GiB; the rate is taken to hold for the rest."""
PROBE_MIN_BYTES = 1 << 20


@dataclass(frozen=True)
class SaveRate:
    gbps: float
    """Bytes a second of the timed save, in GB/s."""
    probe_bytes: int
    folder: str
    """The folder the probe wrote in: the checkpoints' folder, or its nearest existing parent."""

    def note(self) -> str:
        size = f"{self.probe_bytes / 1e9:.2f} GB" if self.probe_bytes >= 1e9 else f"{self.probe_bytes / 1e6:.0f} MB"
        return (f"whole run: checkpoint saves at {self.gbps:.2f} GB/s, as a torch.save of {size} into {self.folder} "
                "took here")


def checkpoint_folder(cfg, env: dict[str, str] | None = None) -> Path:
    """Where the run's checkpoints go: checkpoint.dir, else the runs folder (DSCLUSTER_RUNS, else ./runs)."""
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else layout.runs_root(env)


def nearest_existing(path: Path) -> Path:
    """`path`, or its nearest parent that exists: plan makes no folder of its own."""
    p = path.absolute()
    while not p.is_dir() and p != p.parent:
        p = p.parent
    return p


def probe_bytes(nbytes: int) -> int:
    """What the probe writes for a checkpoint of `nbytes`: bounded to PROBE_MIN_BYTES..PROBE_MAX_BYTES."""
    return max(PROBE_MIN_BYTES, min(int(nbytes), PROBE_MAX_BYTES))


def measure(folder: Path, nbytes: int) -> SaveRate | None:
    """Time one torch.save of `nbytes` (bounded to PROBE_MIN_BYTES..PROBE_MAX_BYTES) of fp32 into a temporary
    file of `folder` (or its nearest existing parent), removed after; None where it cannot be written."""
    import torch  # heavy: only a real plan measures a save, never `plan --help`

    n = probe_bytes(nbytes)
    where = nearest_existing(folder)
    try:
        fd, name = tempfile.mkstemp(prefix=".dscluster-save-probe-", dir=where)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "wb") as f:
            weights = torch.empty(n // 4, dtype=torch.float32)
            t0 = time.perf_counter()
            torch.save({"weights": weights}, f)
            f.flush()
        seconds = time.perf_counter() - t0
    except OSError:
        return None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(name)
    return SaveRate(gbps=n / max(seconds, 1e-9) / 1e9, probe_bytes=n, folder=str(where))
