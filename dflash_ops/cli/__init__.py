"""The `dflash-ops` command line: a thin typer skin over the library.

Each area lives in its own module with a ``register(app)`` function; adding an area is one
line in ``_AREAS``. No command logic lives here; expected errors become one line in one place,
the command group around every command.
"""

from __future__ import annotations

import importlib
from typing import Any

import typer
from typer.core import TyperGroup

from dflash_ops.cli.common import fail
from dflash_ops.errors import CommandTimeout, DflashOpsError, TransportError


class _OneLineErrors(TyperGroup):
    """Expected errors become one line: DflashOpsError (RunError, PatchError, ... included),
    timeouts (exit 124) and transport failures (exit 255)."""

    def invoke(self, ctx: Any) -> Any:  # typer's vendored click.Context
        try:
            return super().invoke(ctx)
        except (CommandTimeout, TimeoutError) as e:
            fail(str(e), 124)  # like timeout(1)
        except TransportError as e:
            fail(str(e), 255)  # like ssh(1) when the connection fails
        except DflashOpsError as e:
            fail(str(e))


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
    "simnode",
]

for _name in _AREAS:
    importlib.import_module(f"dflash_ops.cli.{_name}").register(app)


def main() -> None:
    app()
