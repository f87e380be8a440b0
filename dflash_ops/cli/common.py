"""Options and helpers every CLI area shares: --inventory, one-line errors, opening a target.

Exit statuses: 1 for a dflash-ops error, 124 for a timeout, 255 when the node is unreachable
or the connection dropped; otherwise commands pass the remote exit status through.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Annotated, BinaryIO, NoReturn, Optional

import typer

from dflash_ops.container import Container
from dflash_ops.errors import DflashOpsError
from dflash_ops.inventory import ENV_VAR, load_inventory

InventoryOption = Annotated[
    Optional[Path],
    typer.Option(
        "--inventory",
        envvar=ENV_VAR,
        show_envvar=True,
        help="Inventory YAML (default: yours, $XDG_CONFIG_HOME/dflash-ops/hosts.yaml, once provision --write-inventory made it; else the packaged default, the simulated node).",
    ),
]

# Commands that take a remote argv after TARGET: everything after TARGET (or after `--`) is argv.
# Our options may stand anywhere before `--`; everything after `--` is the remote argv, untouched.
ARGV_CONTEXT = {"allow_interspersed_args": True, "ignore_unknown_options": True}


def fail(message: str, code: int = 1) -> NoReturn:
    """Print one clean error line (no traceback) and exit non-zero."""
    typer.echo(f"dflash-ops: error: {message}", err=True)
    raise typer.Exit(code)


def open_target(inventory: Path | None, target: str) -> Container:
    from dflash_ops.connect import open_container

    return open_container(load_inventory(inventory), target)


def parse_gpus(text: str | None) -> list[int] | None:
    """--gpus 0,1 -> [0, 1] (dflash_ops.runs.lifecycle.parse_gpus), a usage error (exit 2) if malformed."""
    from dflash_ops.runs.lifecycle import parse_gpus as parse

    if text is None:
        return None
    try:
        return parse(text)
    except DflashOpsError as e:
        fail(str(e), 2)


MAX_TIMEOUT_S = 1e8  # about three years; beyond, thread waits overflow the platform's time_t


def check_timeout(seconds: float | None, option: str = "--timeout") -> None:
    """A timeout is a finite number of seconds above zero (inf, nan and 0 or less are refused)."""
    if seconds is not None and not (math.isfinite(seconds) and 0 < seconds <= MAX_TIMEOUT_S):
        fail(f"{option} {seconds!r}: give a number of seconds above 0 and at most {MAX_TIMEOUT_S:g}, "
             f"e.g. {option} 30", 2)


def forwarded_stdin() -> BinaryIO | None:
    """The local stdin to forward to a remote command: binary, or None when it is a terminal
    (nothing to forward; the command reads EOF) or closed."""
    stream = sys.stdin
    if stream is None:
        return None
    try:
        if stream.isatty():
            return None
    except (OSError, ValueError):  # closed
        return None
    buffer = getattr(stream, "buffer", None)
    # The unbuffered file: a thread blocked reading it holds no lock, so the interpreter can
    # exit while it waits (a buffered reader would abort the exit: "could not acquire lock").
    return getattr(buffer, "raw", buffer)


def write_stdout(line: bytes) -> None:
    sys.stdout.buffer.write(line)
    sys.stdout.buffer.flush()


def write_stderr(line: bytes) -> None:
    sys.stderr.buffer.write(line)
    sys.stderr.buffer.flush()
