"""`dflash-ops push TARGET SRC DEST` and `dflash-ops fetch TARGET SRC DEST`: a thin skin over dflash_ops.transfer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from dflash_ops.cli.common import InventoryOption, open_target
from dflash_ops.progress import ByteBar

Target = Annotated[str, typer.Argument(help="Target name from the inventory.")]
Force = Annotated[bool, typer.Option("--force", help="Replace a destination (or drop files in it) that no earlier transfer wrote.")]
AsJson = Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")]


def push(
    target: Target,
    src: Annotated[Path, typer.Argument(help="Local file or directory.")],
    dest: Annotated[str, typer.Argument(help="Absolute container path SRC will have, e.g. /models/Qwen3-8B.")],
    force: Force = False,
    as_json: AsJson = False,
    inventory: InventoryOption = None,
) -> None:
    """Copy a file or tree into the container: only changed files, sha256-verified, resumable, swapped in whole."""
    from dflash_ops.transfer import push_path

    container = open_target(inventory, target)
    with ByteBar(f"push {src.name}", enabled=not as_json) as bar:
        summary = push_path(container, src, dest, force=force, on_progress=bar.update)
    typer.echo(json.dumps(summary.to_json(), indent=1) if as_json else summary.line())


def fetch(
    target: Target,
    src: Annotated[str, typer.Argument(help="Absolute container path of a file or directory.")],
    dest: Annotated[Path, typer.Argument(help="Local path the copy will have.")],
    force: Force = False,
    as_json: AsJson = False,
    inventory: InventoryOption = None,
) -> None:
    """Copy a file or tree out of the container: only changed files, sha256-verified, resumable, swapped in whole."""
    from dflash_ops.transfer import fetch_path

    container = open_target(inventory, target)
    with ByteBar(f"fetch {Path(src).name}", enabled=not as_json) as bar:
        summary = fetch_path(container, src, dest, force=force, on_progress=bar.update)
    typer.echo(json.dumps(summary.to_json(), indent=1) if as_json else summary.line())


def register(app: typer.Typer) -> None:
    app.command("push")(push)
    app.command("fetch")(fetch)
