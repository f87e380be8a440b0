"""`dflash-ops push TARGET SRC DEST` and `dflash-ops fetch TARGET SRC DEST`: a thin skin over dflash_ops.transfer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Callable

import typer

from dflash_ops.cli.common import InventoryOption, open_target

if TYPE_CHECKING:
    from rich.progress import TaskID

    from dflash_ops.transfer import TransferSummary

Target = Annotated[str, typer.Argument(help="Target name from the inventory.")]
Force = Annotated[bool, typer.Option("--force", help="Replace a destination (or drop files in it) that no earlier transfer wrote.")]
AsJson = Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")]


LocalSrc = Annotated[Path, typer.Argument(help="Local file or directory.")]
ContainerDest = Annotated[str, typer.Argument(help="Absolute container path SRC will have, e.g. /models/Qwen3-8B.")]
ContainerSrc = Annotated[str, typer.Argument(help="Absolute container path of a file or directory.")]
LocalDest = Annotated[Path, typer.Argument(help="Local path the copy will have.")]


def push(target: Target, src: LocalSrc, dest: ContainerDest, force: Force = False, as_json: AsJson = False,
         inventory: InventoryOption = None) -> None:
    """Copy a file or tree into the container: only changed files, sha256-verified, resumable, swapped in whole."""
    from dflash_ops.transfer import push_path

    _transfer(push_path, f"push {src.name}", inventory, target, src, dest, force, as_json)


def fetch(target: Target, src: ContainerSrc, dest: LocalDest, force: Force = False, as_json: AsJson = False,
          inventory: InventoryOption = None) -> None:
    """Copy a file or tree out of the container: only changed files, sha256-verified, resumable, swapped in whole."""
    from dflash_ops.transfer import fetch_path

    _transfer(fetch_path, f"fetch {Path(src).name}", inventory, target, src, dest, force, as_json)


def _transfer(transfer: Callable[..., TransferSummary], label: str, inventory: Path | None, target: str,
              src: str | Path, dest: str | Path, force: bool, as_json: bool) -> None:
    container = open_target(inventory, target)
    with _Bar(label, enabled=not as_json) as bar:
        summary = transfer(container, src, dest, force=force, on_progress=bar.update)
    typer.echo(json.dumps(summary.to_json(), indent=1) if as_json else summary.line())


class _Bar:
    """One rich progress bar on stderr (gone when done) fed with (bytes done, bytes in all)."""

    def __init__(self, label: str, enabled: bool):
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

        self.label = label
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                            console=Console(stderr=True), transient=True, disable=not enabled)
        self.task: TaskID | None = None

    def update(self, done: int, total: int) -> None:
        if self.task is None:
            self.task = self.bar.add_task(self.label, total=total)
        self.bar.update(self.task, completed=done, total=max(total, done))

    def __enter__(self):
        self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        return self.bar.__exit__(*exc)


def register(app: typer.Typer) -> None:
    app.command("push")(push)
    app.command("fetch")(fetch)
