"""The `dflash-ops` command line: a thin typer skin over the library.

Each area lives in its own module with a ``register(app)`` function; adding an area is one
line in ``_AREAS``. No command logic lives here; expected errors become one line in one place,
the command group around every command (common.clean_errors).
"""

from __future__ import annotations

import importlib
from typing import Any

import typer
from typer.core import TyperGroup

from dflash_ops.cli.common import clean_errors


class _OneLineErrors(TyperGroup):
    def invoke(self, ctx: Any) -> Any:  # typer's vendored click.Context
        with clean_errors():
            return super().invoke(ctx)


app = typer.Typer(
    cls=_OneLineErrors,
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
