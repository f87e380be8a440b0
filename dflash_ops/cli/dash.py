"""`dflash-ops dash [TARGET...]`: the live dashboard (a thin skin over dflash_ops.tui)."""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from dflash_ops.cli.common import InventoryOption
from dflash_ops.inventory import load_inventory
from dflash_ops.tui.source import DashSource

if TYPE_CHECKING:
    from dflash_ops.inventory import Target
    from dflash_ops.runs.local_notify import LocalNotifier


def inventory_source(inventory: Path | None, targets: list[str]) -> DashSource:
    """A RemoteSource over the inventory's targets (all of them when none are named).

    The inventory and the target names are checked here, up front (clean one-line errors);
    containers are opened later, in the dashboard's worker threads, with the plain library
    call, so an unreachable node shows as "disconnected: ..." on its target and is retried.
    """
    from dflash_ops.connect import open_container
    from dflash_ops.tui.remote import RemoteSource

    loaded = load_inventory(inventory)
    names = targets or sorted(loaded.targets)
    for name in names:
        loaded.target(name)
    notifiers = {name: local_notifier(loaded.target(name)) for name in names}
    return RemoteSource({name: partial(open_container, loaded, name) for name in names},
                        notifiers={name: n for name, n in notifiers.items() if n is not None})


def local_notifier(target: Target, on_error: Callable[[str], None] | None = None) -> LocalNotifier | None:
    """The follower's runner of the target's `notify: local:` commands, or None when it names none."""
    from dflash_ops.runs.local_notify import LocalNotifier

    commands = target.notify_all.local
    if not commands:
        return None
    return LocalNotifier(target.name, commands, on_error or logging.getLogger("dflash_ops.notify").warning)


def parse_local(specs: list[str]) -> dict[str, Path]:
    bases = {}
    for spec in specs:
        name, sep, base = spec.partition("=")
        if not sep or not name or not base:
            raise typer.BadParameter(f"--local wants NAME=BASE_DIR, got {spec!r}")
        bases[name] = Path(base).expanduser()
    return bases


def register(app: typer.Typer) -> None:
    @app.command("dash")
    def dash(
        targets: Annotated[Optional[list[str]], typer.Argument(help="Targets to follow (default: all)")] = None,
        inventory: InventoryOption = None,
        local: Annotated[
            Optional[list[str]],
            typer.Option("--local", help="NAME=BASE_DIR: follow BASE_DIR/runs/* on this machine (repeatable)"),
        ] = None,
        demo: Annotated[bool, typer.Option("--demo", help="Follow a simulated tiny run in a temp dir")] = False,
    ) -> None:
        """Follow live runs on many targets: runs table, plots, GPUs, log; c checkpoint, s stop."""
        from dflash_ops.tui.app import run_dash
        from dflash_ops.tui.remote import LocalDirSource

        if demo:
            _run_demo()
            return
        if local:
            source: DashSource = LocalDirSource(parse_local(local))
        else:
            source = inventory_source(inventory, targets or [])
        code = run_dash(source, targets or None)
        if code:
            raise typer.Exit(code)  # an error ended the dashboard: not a clean `q`


def _run_demo() -> None:
    from dflash_ops.tui.app import run_dash
    from dflash_ops.tui.demo import SimulatedRun
    from dflash_ops.tui.remote import LocalDirSource

    base = Path(tempfile.mkdtemp(prefix="dflash-dash-demo-"))
    stop = threading.Event()
    sim = SimulatedRun(base, "demo-tiny", total_steps=2000)
    writer = threading.Thread(target=sim.run, args=(stop, 0.3), daemon=True)
    writer.start()
    try:
        run_dash(LocalDirSource({"demo": base}))
    finally:
        stop.set()
        writer.join()
        shutil.rmtree(base, ignore_errors=True)
