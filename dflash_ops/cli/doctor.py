"""`dflash-ops doctor TARGET... [--json]`: a table of checks per target, the fix on each failing line."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from dflash_ops.cli.common import InventoryOption, fail, parse_gpus
from dflash_ops.inventory import load_inventory

if TYPE_CHECKING:
    from dflash_ops.container import Container
    from dflash_ops.doctor import Report, RunPlan
    from dflash_ops.inventory import Target


def doctor(
    targets: Annotated[list[str], typer.Argument(help="Target names from the inventory.")],
    config: Annotated[Optional[Path], typer.Option("--config", help="The trainer config the run will use (sizes disk, RAM, /dev/shm; names its devices).")] = None,
    gpus: Annotated[Optional[str], typer.Option("--gpus", help="GPUs the run will hold, e.g. 0,1 (default: the target's).")] = None,
    fast: Annotated[bool, typer.Option("--fast", help="Only the fast subset `run start` runs (no NCCL all-reduce).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON document: every check and the raw facts per target.")] = False,
    fix: Annotated[bool, typer.Option("--fix", help="Apply the fixes provision knows (GPU entries, /dev/shm, limits, NVIDIA user-space), then check again.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="With --fix: restart a running container without asking.")] = False,
    inventory: InventoryOption = None,
) -> None:
    """Check that each TARGET's container can run the trainer: GPUs, torch, driver, NCCL, /dev/shm, disk, RAM, limits, clock.

    Exit status 1 when any check fails (✘); warnings (!) do not fail.
    """
    from dflash_ops.connect import open_container
    from dflash_ops.doctor import diagnose, plan_for, record_verdict, unreachable_report
    from dflash_ops.fanout import map_by_node

    if config is not None and not config.is_file():
        fail(f"--config {config}: no such file", 2)
    inv = load_inventory(inventory)
    gpu_list = parse_gpus(gpus)
    containers = [open_container(inv, name) for name in dict.fromkeys(targets)]
    plans = {id(c): plan_for(c.target, gpu_list, config) for c in containers}

    def one(container: Container) -> Report:
        report = diagnose(container, plans[id(container)], fast=fast)
        record_verdict(container.target, report)
        return report

    reports = map_by_node(containers, one, unreachable_report)
    if fix:
        reports = [_fixed(c, r, plans[id(c)], yes, fast) for c, r in zip(containers, reports)]
    if as_json:
        typer.echo(json.dumps([r.to_json() for r in reports], indent=1, sort_keys=True))
    else:
        for container, report in zip(containers, reports):
            print_report(container.target, report)
    if any(r.verdict == "fail" for r in reports):
        raise typer.Exit(1)


FIXABLE = ("gpu passthrough", "driver user-space", "/dev/shm", "memlock limit", "open files limit", "boot unit")


def _fixed(container: Container, report: Report, plan: RunPlan, yes: bool, fast: bool) -> Report:
    """provision's repair (the same code path) of a target whose fixable checks did not pass, then a new pass."""
    from dflash_ops.doctor import diagnose, record_verdict
    from dflash_ops.doctor.plan import GIB
    from dflash_ops.provision import Request, provision

    wrong = [c.name for c in report.checks if c.status != "ok" and c.name in FIXABLE]
    if not wrong or not container.target.node.pct:
        return report
    typer.echo(f"{container.target.name}: fixing {', '.join(wrong)}", err=True)
    gpus = tuple(plan.gpus) if plan.needs_gpu or container.target.gpus else ()
    request = Request(gpus=gpus, shm_gib=max(1, -(-plan.shm_needed() // GIB)) if "/dev/shm" in wrong else None,
                      boot_unit="offer" if "boot unit" in wrong else "", create=False)
    outcome = provision(container, request, yes=yes, confirm=_confirm, say=lambda line: typer.echo(line, err=True))
    for note in outcome.notes:
        typer.echo(f"note: {note}", err=True)
    typer.echo(f"{container.target.name}: {len(outcome.changes)} change(s)", err=True)
    again = diagnose(container, plan, fast=fast)
    record_verdict(container.target, again)
    for check in again.checks:
        if check.name in wrong and check.status != "ok":
            typer.echo(f"{container.target.name}: {check.name} still {check.measured}: "
                       f"{_why_unfixed(container, check.name)}", err=True)
    return again


def _confirm(question: str) -> bool:
    """A yes from the terminal; no answer (end of input) is a no."""
    try:
        return typer.confirm(question, default=False)
    except typer.Abort:
        typer.echo("", err=True)
        return False


_LIMITS = {"memlock limit": "memlock", "open files limit": "nofile"}


def _why_unfixed(container: Container, name: str) -> str:
    """Why a check provision repaired still does not pass, in one line: what the config holds now
    and what caps it beyond the config."""
    target = container.target
    if name in _LIMITS:
        key = _LIMITS[name]
        cap = target.node.kind.limit_cap(key)
        held = f"/etc/pve/lxc/{target.ctid}.conf has its lxc.prlimit.{key} line"
        return f"{held}; {cap}" if cap else (
            f"{held}; the process that starts containers on node {target.node.name} caps it: raise its limit "
            f"(systemctl edit pve-container@{target.ctid}: {'LimitMEMLOCK' if key == 'memlock' else 'LimitNOFILE'}=infinity), then restart the CT")
    return "see its fix column below"


def print_report(target: Target, report: Report, err: bool = False) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    stream = sys.stderr if err else sys.stdout
    console = Console(file=stream) if stream.isatty() else Console(file=stream, width=1000, no_color=True)
    where = f"node {target.node.name}" + (f", CT {target.ctid}" if target.node.pct else ", no pct")
    console.print(f"{target.name} ({where}): {report.verdict.upper()}" + (" (fast subset)" if report.fast else ""),
                  markup=False, highlight=False)
    table = Table("", "check", "measured", "needed", "fix", box=None, pad_edge=False)
    for check in report.checks:
        table.add_row(*(Text(cell) for cell in (check.symbol, check.name, check.measured, check.needed, check.fix)))
    console.print(table, markup=False, highlight=False)


def register(app: typer.Typer) -> None:
    app.command("doctor")(doctor)
