"""Python's cyclic garbage collector while a rank starts, and after.

Importing the training stack leaves hundreds of thousands of objects that the collector walks again and
again: `start_up()` turns it off around `dscluster train` and `plan` (restored however the command ends),
`settle()` collects once when the engine is built and freezes what is alive (`gc.freeze`), so a full pass
during a step never walks the start-up's objects, and `release()` unfreezes and collects before the
process group goes, since the engine sits in reference cycles. Measurements and the incident behind
`release`: docs/performance.md, "The garbage collector at start-up".
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def start_up() -> Iterator[None]:
    """The collector off until `settle()` or the end of the block, then as it was before."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def settle() -> None:
    """Start-up is over: free its cycles, freeze what is alive (modules, model, engine), collect again from here."""
    gc.collect()
    gc.freeze()
    gc.enable()


def release() -> None:
    """The run is over: what `settle()` froze back under the collector, and one full collection, so that the
    engine's cycles are freed now, while its process group still exists, not at interpreter exit."""
    gc.unfreeze()
    gc.collect()
