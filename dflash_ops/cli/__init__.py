"""The `dflash-ops` command line: a thin typer skin over the library.

Each area lives in its own module with a ``register(app)`` function; adding an area is one
line in ``_AREAS``. No command logic lives here.
"""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="dflash-ops",
    help="Deploy, run and follow DFlash training in Proxmox pct containers - argv all the way down.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

_AREAS: list[str] = [
    "hosts",
    "deploy",
    "play",
    "runs",
    "transfer",
    "patch",
    "dash",
    "doctor",
]


def _register_areas() -> None:
    for name in _AREAS:
        importlib.import_module(f"dflash_ops.cli.{name}").register(app)


_register_areas()


def main() -> None:
    app()
