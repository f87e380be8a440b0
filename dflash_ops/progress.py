"""A byte-count progress bar on stderr for transfers (push, fetch), gone when done."""

from __future__ import annotations

from typing import Any


class ByteBar:
    """One rich progress bar fed with (bytes done, bytes in all): `on_progress=bar.update`."""

    def __init__(self, label: str, enabled: bool = True):
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

        self.label = label
        console = Console(stderr=True)
        # not on a terminal (a log, CI): no bar at all; rich would still print an empty line at the end
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                            console=console, transient=True, disable=not (enabled and console.is_terminal))
        self.task: Any = None

    def update(self, done: int, total: int) -> None:
        if self.task is None:
            self.task = self.bar.add_task(self.label, total=total)
        self.bar.update(self.task, completed=done, total=max(total, done))

    def __enter__(self) -> ByteBar:
        self.bar.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.__exit__(*exc)
