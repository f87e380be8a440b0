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
from dflash_ops.extras import trainer_missing, trainer_module


class _OneLineErrors(TyperGroup):
    """Expected errors become one line: DflashOpsError (RunError, PatchError, ... included),
    timeouts (exit 124), transport failures (exit 255), and a trainer package this install lacks
    (the extra to install)."""

    def invoke(self, ctx: Any) -> Any:  # typer's vendored click.Context
        try:
            return super().invoke(ctx)
        except (CommandTimeout, TimeoutError) as e:
            fail(str(e), 124)  # like timeout(1)
        except TransportError as e:
            fail(str(e), 255)  # like ssh(1) when the connection fails
        except DflashOpsError as e:
            fail(str(e))
        except ImportError as e:  # a trainer package this install lacks (the `trainer` extra)
            module = trainer_module(e)
            if module is None:
                raise
            fail(str(trainer_missing(f"dflash-ops {ctx.invoked_subcommand or ''}".strip(), [module])))


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
    "exporter",
    "doctor",
    "provision",
    "simnode",
]

for _name in _AREAS:
    importlib.import_module(f"dflash_ops.cli.{_name}").register(app)


def main() -> None:
    app()
