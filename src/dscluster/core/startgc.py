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
every other rank at the next all-reduce, costs what training's own objects cost.

`release()`, at the run's end and before the process group goes, unfreezes and collects once (about 0.2 s
here): the engine and the DDP reducer in it sit in reference cycles, built before `settle()` and so frozen
with the start-up. A plain collection left them alive past the group's end, to be torn down at interpreter
exit, where a gloo rank of a finished run could abort ("terminate called without an active exception",
exit 134: once in a busy suite, the demo's 3-rank job).
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
