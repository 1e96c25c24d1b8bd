"""Python's cyclic garbage collector while a rank starts, and after.

Importing PyTorch, torch._dynamo, timm and DeepSpeed leaves about 410,000 objects tracked by the collector,
and on the way the collector made some 900 young, 80 middle and 6 full passes over them, which found 9,600
objects to free: about a CPU-second of a rank's start-up on a 2-core CPU host. Reference counting frees
everything else as it goes, collector or not.

`start_up()` turns the collector off around `dscluster train` (and `plan`, whose compute probe imports what
training imports), and puts it back as it was when the command ends, however it ends (commands also run
inside other programs, through `dscluster.cli.main`). `settle()`, once every import has happened
and the engine is built, collects once (the start-up's cycles are freed, none is kept), moves every object
alive then into the permanent generation (`gc.freeze`) and turns the collector back on: it runs as before on
what training makes, but never walks the start-up's objects again. So a full pass during a step, which holds
every other rank at the next all-reduce, and the full collection train/loop.py runs at teardown (the engine
sits in reference cycles) cost what training's own objects cost (0.23 s → 0 for that last one here).
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
