"""`dflash-ops push TARGET SRC DEST` and `dflash-ops fetch TARGET SRC DEST`: a thin skin over dflash_ops.transfer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Callable

import typer

from dflash_ops.cli.common import InventoryOption, open_target
from dflash_ops.progress import ByteBar

if TYPE_CHECKING:
    from dflash_ops.transfer import TransferSummary

Target = Annotated[str, typer.Argument(help="Target name from the inventory.")]
Force = Annotated[bool, typer.Option("--force", help="Replace a destination (or drop files in it) that no earlier transfer wrote.")]
AsJson = Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")]


LocalSrc = Annotated[Path, typer.Argument(help="Local file or directory.")]
ContainerDest = Annotated[str, typer.Argument(help="Container path SRC will have: absolute (/models/Qwen3-8B), or "
                                                   "relative to the target's base_dir (data/prompts.jsonl).")]
ContainerSrc = Annotated[str, typer.Argument(help="Container path of a file or directory: absolute, or relative to "
                                                  "the target's base_dir.")]
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
    with ByteBar(label, enabled=not as_json) as bar:
        summary = transfer(container, src, dest, force=force, on_progress=bar.update)
    typer.echo(json.dumps(summary.to_json(), indent=1) if as_json else summary.line())


def register(app: typer.Typer) -> None:
    app.command("push")(push)
    app.command("fetch")(fetch)
