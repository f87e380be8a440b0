"""`dflash-ops play PLAYBOOK TARGET...`: run a YAML playbook on targets, in parallel."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from dflash_ops.cli.common import InventoryOption, fail
from dflash_ops.inventory import load_inventory

if TYPE_CHECKING:
    from dflash_ops.container import Container
    from dflash_ops.playbook.registry import StepContext


def play(
    playbook: Annotated[Path, typer.Argument(help="Playbook YAML, e.g. playbooks/deploy.yaml.")],
    targets: Annotated[list[str], typer.Argument(help="Target names from the inventory.")],
    inventory: InventoryOption = None,
    var: Annotated[Optional[list[str]], typer.Option("--var", help="Override a playbook variable: k=v (repeatable).")] = None,
    check_only: Annotated[bool, typer.Option("--check", help="Validate the playbook; run nothing.")] = False,
) -> None:
    """Validate the whole playbook, then run its steps in order on every target."""
    from dflash_ops.connect import open_container
    from dflash_ops.fanout import map_targets
    from dflash_ops.playbook.play import PlayResult, clean_up_interrupted, load_playbook, run_playbook

    overrides = {}
    for item in var or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            fail(f"--var {item!r}: expected k=v", 2)
        overrides[key] = value
    book = load_playbook(playbook, overrides)
    if check_only:
        typer.echo(f"{playbook}: {len(book.steps)} steps OK")
        return
    inv = load_inventory(inventory)
    for name in targets:
        inv.target(name)
    lock = threading.Lock()
    contexts: list[StepContext] = []

    def play_one(container: Container, name: str) -> PlayResult:
        def say(text: str) -> None:
            with lock:
                typer.echo(f"{name}: {text}")

        kind, ctid = container.target.node.kind, container.target.ctid
        backend = kind.backend(ctid)
        if backend:  # a simulated node's container: say what it is, and why (docs/simulated-node.md)
            why = kind.backend_reason(ctid)
            say(f"CT {ctid} on simulated node {container.target.node.name!r}: "
                + ("a real LXC container" if backend == "lxc" else "a directory container")
                + (f" ({why})" if why else ""))
        return run_playbook(book, container, say=say, contexts=contexts,
                            open_target=lambda other: open_container(inv, other))

    def not_run(name: str, e: Exception, seconds: float) -> PlayResult:
        return PlayResult(target=name, error=f"{type(e).__name__}: {e}", seconds=round(seconds, 3))

    try:
        results = map_targets(targets, lambda name: open_container(inv, name), play_one, not_run)
    except KeyboardInterrupt:
        clean_up_interrupted(contexts, book.path)
        raise
    failed = 0
    for r in results:
        if r.ok:
            typer.echo(f"{r.target}: {book.name}: {r.steps_done}/{len(book.steps)} steps OK in {r.seconds:.2f}s")
        else:
            failed += 1
            typer.echo(f"{r.target}: {book.name}: FAILED: {r.error}", err=True)
    if failed:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("play")(play)
