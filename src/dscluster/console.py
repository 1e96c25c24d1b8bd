"""One rich console for human output (stderr for progress, stdout for results)."""

from rich.console import Console, RenderableType
from rich.measure import Measurement

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)
WIDEST = 10_000
"""Columns a renderable may ask for when measured (far beyond any table of ours)."""


def print_whole(renderable: RenderableType, console: Console = out) -> None:
    """Print a table whole: a terminal wraps what does not fit (columns with overflow="fold"); a log or a pipe,
    where rich assumes 80 columns and cuts cells to '…', gets the width the table needs."""
    needed = Measurement.get(console, console.options.update(max_width=WIDEST), renderable).maximum
    if console.is_terminal or needed <= console.width:
        console.print(renderable)
    else:
        Console(file=console.file, width=needed, highlight=False, soft_wrap=True).print(renderable)
