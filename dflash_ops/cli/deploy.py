"""`dflash-ops deploy TARGET...`: releases, helpers and venvs into containers, in parallel."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from dflash_ops.cli.common import InventoryOption
from dflash_ops.inventory import load_inventory

if TYPE_CHECKING:
    from rich.progress import TaskID

    from dflash_ops.container import ContainerAPI
    from dflash_ops.deploy.push import DeploySummary, ProgressCallback


def deploy(
    targets: Annotated[list[str], typer.Argument(help="Target names from the inventory.")],
    inventory: InventoryOption = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan; change nothing.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summaries as JSON.")] = False,
    keep: Annotated[Optional[int], typer.Option("--keep", min=1, help="Releases to keep (default: inventory, else 5).")] = None,
    extra: Annotated[Optional[list[Path]], typer.Option("--extra", help="Extra file or directory to ship (repeatable).")] = None,
    no_venv: Annotated[bool, typer.Option("--no-venv", help="Ship code only; runs use the target's python.")] = False,
) -> None:
    """Make each target's code, helpers and venv exact: only changed files travel, `current` swaps atomically."""
    from dflash_ops.connect import open_container
    from dflash_ops.deploy.push import deploy_many, deploy_target, target_options

    inv = load_inventory(inventory)
    for name in targets:
        inv.target(name)
    progress = _Progress(enabled=not as_json)

    def run(container: ContainerAPI, name: str) -> DeploySummary:
        options = target_options(container.target, extra_paths=extra or (), keep=keep, no_venv=no_venv)
        return deploy_target(container, dry_run=dry_run, on_progress=progress.callback(name), **options)

    with progress.bar:
        summaries = deploy_many(targets, lambda name: open_container(inv, name), run)
    if as_json:
        typer.echo(json.dumps([s.to_json() for s in summaries], indent=1))
    else:
        _print_summaries(summaries)
    if not all(s.ok for s in summaries):
        raise typer.Exit(1)


class _Progress:
    """A rich progress bar per target while its tar streams (stderr, gone when done)."""

    def __init__(self, enabled: bool) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                            console=Console(stderr=True), transient=True, disable=not enabled)
        self.tasks: dict[str, TaskID] = {}

    def callback(self, name: str) -> ProgressCallback:
        def on_progress(phase: str, n: int, total: int) -> None:
            if name not in self.tasks:
                self.tasks[name] = self.bar.add_task(f"{name}: {phase}", total=total)
            self.bar.advance(self.tasks[name], n)

        return on_progress


def _print_summaries(summaries: list[DeploySummary]) -> None:
    for s in summaries:
        if not s.ok:
            typer.echo(f"{s.target}: FAILED after {s.seconds:.2f}s: {s.error}", err=True)
            continue
        verb = "would send" if s.dry_run else "sent"
        what = {"none": "nothing to send, already current", "switch": "switch current to an existing release",
                "build": f"send {s.files_sent}/{s.files_total} files"}[s.action]
        typer.echo(f"{s.target}: release {s.release} ({'plan: ' if s.dry_run else ''}{what})")
        typer.echo(f"  previous {s.previous or '-'}; {verb} {s.bytes_sent} bytes, {s.helpers_sent} helper(s)")
        typer.echo(f"  venv {s.venv or '-'}: {s.venv_action or 'none'}"
                   + (f"; pruned {', '.join(s.pruned)}" if s.pruned else ""))
        typer.echo(f"  {s.seconds:.2f}s, {s.pct_calls} pct invocation(s)")


def register(app: typer.Typer) -> None:
    app.command("deploy")(deploy)
