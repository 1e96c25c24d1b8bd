"""The progress bar of a training run (rank 0 only)."""

from __future__ import annotations

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from dscluster import console


class ProgressBar:
    """rich progress bar with ETA on rank 0 (nothing elsewhere)."""

    _live: list["ProgressBar"] = []

    @classmethod
    def stop_all(cls) -> None:
        for p in list(cls._live):
            p.stop()

    def __init__(self, enabled: bool, total: int, done: int):
        self.bar = None
        if enabled:
            self.bar = Progress(TextColumn("[bold]train[/bold] {task.description}"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("ETA"), TimeRemainingColumn(), console=console.err, transient=False)
            self.task = self.bar.add_task("epoch 1", total=total, completed=done)
            self.bar.start()
            ProgressBar._live.append(self)

    def advance(self, epoch: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, advance=1, description=f"epoch {epoch + 1}")

    def print(self, text: str) -> None:
        (self.bar.console if self.bar is not None else console.err).print(text)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
            if self in ProgressBar._live:
                ProgressBar._live.remove(self)
