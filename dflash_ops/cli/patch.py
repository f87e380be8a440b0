"""`dflash-ops patch TARGET PATCHFILE` (guarded, becomes a new release) and `dflash-ops rollback TARGET`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from dflash_ops.cli.common import InventoryOption, fail, open_target

if TYPE_CHECKING:
    from dflash_ops.patching.rollout import PatchError


def patch(
    target: Annotated[str, typer.Argument(help="Target name from the inventory.")],
    patchfile: Annotated[Path, typer.Argument(help="Unified diff, paths relative to the release root (e.g. trainer/data/batches.py).")],
    check: Annotated[bool, typer.Option("--check", help="Run every check; change nothing.")] = False,
    allow_moves: Annotated[bool, typer.Option("--allow-moves", help="Accept definitions that move or disappear (still refuses unreachable ones).")] = False,
    restart: Annotated[Optional[str], typer.Option("--restart", metavar="RUN", help="Stop RUN with a checkpoint and resume it on the new release.")] = None,
    keep: Annotated[int, typer.Option("--keep", min=1, help="Releases to keep.")] = 5,
    inventory: InventoryOption = None,
) -> None:
    """Check a patch against TARGET's current release (applies, compiles, every definition stays
    where it was and reachable, touched modules import in the container's venv), then make it a
    new release whose parent is the current one; `dflash-ops rollback TARGET` undoes it."""
    from dflash_ops.patching.rollout import PatchError, patch_target

    try:
        diff_text = patchfile.read_bytes().decode("utf-8")  # no newline translation: a lone CR is content
    except (OSError, UnicodeDecodeError) as e:
        fail(f"cannot read patch {patchfile}: {e}", 2)
    if check and restart:
        fail("--check changes nothing, so it cannot --restart a run", 2)
    container = open_target(inventory, target)
    try:
        outcome = patch_target(container, diff_text, check_only=check, allow_moves=allow_moves,
                               restart_run=restart, keep=keep, say=lambda text: typer.echo(text, err=True))
    except PatchError as e:
        _print_refusal(e)
        raise
    typer.echo(outcome.report.summary())
    _print_imports(outcome.imports)  # all ok: a failed import refuses the patch
    if outcome.checked_only:
        typer.echo(f"{target}: patch accepted against release {outcome.release_before} (--check: nothing changed)")
    else:
        typer.echo(f"{target}: release {outcome.release} (parent {outcome.release_before}) is current; "
                   f"undo with: dflash-ops rollback {target}")


def _print_refusal(error: PatchError) -> None:
    """Each refused definition (file:line: what happened) and each import failure, on stdout."""
    if error.report is not None:
        typer.echo(error.report.summary())
    _print_imports(error.imports)


def _print_imports(results: list[dict]) -> None:
    for result in results:
        if result["ok"]:
            typer.echo(f"  import {result['module']}: ok")
        else:
            where = f"{result['file']}:{result['line']}: " if result.get("file") else ""
            typer.echo(f"  import {result['module']}: FAILED: {where}{result['error']}")


def rollback(
    target: Annotated[str, typer.Argument(help="Target name from the inventory.")],
    keep: Annotated[int, typer.Option("--keep", min=1, help="Releases to keep.")] = 5,
    inventory: InventoryOption = None,
) -> None:
    """Point TARGET's `current` back at the parent of the current release, atomically."""
    from dflash_ops.patching.rollout import rollback as rollback_release

    container = open_target(inventory, target)
    before, after = rollback_release(container, keep=keep)
    typer.echo(f"{target}: current {before} -> {after}")


def register(app: typer.Typer) -> None:
    app.command("patch")(patch)
    app.command("rollback")(rollback)
