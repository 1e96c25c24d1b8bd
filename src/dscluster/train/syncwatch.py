"""`sync_debug`: find the host synchronisations inside the training step (GPU only).

A call that makes the host wait for the GPU (`.item()`, `.tolist()`, a blocking copy from
pageable memory, a data-dependent shape) stops the host from queueing the next kernels, so the
GPU idles between steps. After the warm-up steps, each step runs under torch's CUDA sync debug
mode: `warn` records every call site (metrics record `host_sync`: step, count, the stack) and
prints them on rank 0 at the end; `error` fails the run at the first one, with its traceback.
The once-per-log-window read-back of the loss is dscluster's one intended sync and is not
watched; neither are evaluation, checkpoints and the equal-step check between epochs.
"""

from __future__ import annotations

import contextlib
import traceback
import warnings
from dataclasses import dataclass, field

import torch

SYNC_WARNING = "called a synchronizing CUDA operation"
_OWN_FRAMES = ("warnings.py", "syncwatch.py", "contextlib.py")


@dataclass
class SyncSite:
    stack: list[str]
    first_step: int
    count: int = 0


@dataclass
class SyncWatch:
    mode: str = "off"
    sites: dict[tuple, SyncSite] = field(default_factory=dict)
    _step: int = 0

    @property
    def enabled(self) -> bool:
        return self.mode != "off"  # the loop passes "off" on a rank without a GPU

    @contextlib.contextmanager
    def step(self, global_step: int, armed: bool):
        """Watch the body (one training step) when `armed` (past the warm-up)."""
        if not (armed and self.enabled):
            yield
            return
        self._step = global_step
        with warnings.catch_warnings():
            warnings.filterwarnings("always", message=f".*{SYNC_WARNING}")
            shown = warnings.showwarning

            def record(message, category, filename, lineno, file=None, line=None):
                if SYNC_WARNING not in str(message):
                    return shown(message, category, filename, lineno, file, line)
                self._record()

            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode(self.mode)
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode("default")

    def _record(self) -> None:
        frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.endswith(_OWN_FRAMES)]
        stack = [f"{_short(f.filename)}:{f.lineno} in {f.name}" for f in frames[-8:]]
        key = tuple(stack)
        site = self.sites.setdefault(key, SyncSite(stack=stack, first_step=self._step))
        site.count += 1

    def records(self) -> list[dict]:
        """One metrics record per distinct call site, most frequent first."""
        return [{"first_step": s.first_step, "count": s.count, "stack": s.stack}
                for s in sorted(self.sites.values(), key=lambda s: -s.count)]

    def summary(self, steps_watched: int) -> str | None:
        if not self.enabled:
            return None
        if not self.sites:
            return f"sync_debug: no host synchronisation in {steps_watched} watched steps"
        lines = [f"sync_debug: {sum(s.count for s in self.sites.values())} host synchronisations in "
                 f"{steps_watched} watched steps, {len(self.sites)} call site(s):"]
        for s in sorted(self.sites.values(), key=lambda s: -s.count):
            lines.append(f"  {s.count}x, first at step {s.first_step}: {s.stack[-1]}")
            lines += [f"      from {frame}" for frame in reversed(s.stack[-4:-1])]
        return "\n".join(lines)


def _short(path: str) -> str:
    """A file path from the package root (site-packages/x/y.py → x/y.py)."""
    for marker in ("site-packages/", "dist-packages/", "/src/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path
