"""The runs table `run list` and `run status` print (rich, one row per run)."""

from __future__ import annotations

import sys


def print_runs_table(runs, targets: list[str] | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    from dflash_ops.runs.report import STATUS_COLUMNS, status_row

    table = Table(*(("target",) if targets is not None else ()), *STATUS_COLUMNS, box=None)
    for i, info in enumerate(runs):
        table.add_row(*((targets[i],) if targets is not None else ()), *status_row(info))
    console = Console() if sys.stdout.isatty() else Console(width=1000)
    console.print(table)
