"""The `run` commands on a run across hosts (dflash_ops.runs.group): one row per member.

cli/runs.py hands over here when `run start` names several targets, or when the run a command
names on one target has a group.json (then every member is acted on).
"""

from __future__ import annotations

from pathlib import Path

import typer

from dflash_ops.cli.common import fail, open_target


def opener(inventory: Path | None):
    from dflash_ops.connect import open_container
    from dflash_ops.inventory import load_inventory

    loaded = load_inventory(inventory)
    return lambda name: open_container(loaded, name)


def members_or_raise(inventory: Path | None, target: str, run_id: str):
    from dflash_ops.runs.group import members

    return members(opener(inventory), target, run_id)


def group_members(inventory: Path | None, target: str, run_id: str):
    return members_or_raise(inventory, target, run_id)


def start(inventory: Path | None, targets: list[str], config: Path, name: str | None, gpus: list[int] | None,
          preflight) -> str:
    """`preflight(container)` runs the doctor's fast checks on each member first."""
    from dflash_ops.runs.group import check_members, start_group

    check_members(targets)
    containers = [open_target(inventory, t) for t in targets]
    for c in containers:
        preflight(c)
    return start_group(containers, targets, config, name=name, gpus=gpus)


def print_members(group_members, group: dict) -> None:
    from dflash_ops.cli.tables import print_runs_table
    from dflash_ops.runs.report import status_detail

    shown = [m for m in group_members if m.info is not None]
    print_runs_table([m.info for m in shown], targets=[f"{m.target} (rank {m.rank if m.rank is not None else '?'})"
                                                   for m in shown])
    typer.echo(f"group: {len(group_members)} hosts, rendezvous {group.get('endpoint')}")
    for m in group_members:
        if m.info is None:
            typer.echo(f"{m.target}: cannot ask: {m.error}", err=True)
            continue
        for line in status_detail(m.info):
            if not line.startswith("log tail") and not line.startswith("  "):
                typer.echo(f"{m.target}: {line}")
    for m in group_members:
        if m.info is not None and m.info.effective_state == "failed" and m.info.log_tail:
            typer.echo(f"{m.target} log tail:")
            for line in m.info.log_tail.rstrip("\n").splitlines()[-8:]:
                typer.echo("  " + line)


def stop(group_members, run_id: str, now: bool, kill: bool, wait: bool, timeout: float) -> None:
    from dflash_ops.runs.group import stop_group

    infos = stop_group(group_members, run_id, now=now, kill=kill, wait=wait, timeout=timeout)
    for m, info in zip(group_members, infos):
        typer.echo(f"{m.target}: {info.run_id}: {info.effective_state} at step "
                   f"{info.step if info.step is not None else '-'}; last checkpoint {info.last_checkpoint or 'none'}")
    if any(i.effective_state == "failed" for i in infos) and not kill:
        raise typer.Exit(1)


def checkpoint(group_members, run_id: str, wait: bool, timeout: float) -> None:
    from dflash_ops.runs.group import checkpoint_group

    w, request_id, path = checkpoint_group(group_members, run_id, wait=wait, timeout=timeout)
    if path is None:
        typer.echo(f"checkpoint requested on {w.target} (rank {w.rank}, the writer) ({request_id}); wait with --wait")
    else:
        typer.echo(f"checkpoint {path} written on {w.target} (request {request_id})")


def resume(group_members, run_id: str, from_step: int | None, gpus: list[int] | None) -> None:
    from dflash_ops.runs.group import resume_group

    resume_group(group_members, run_id, from_step=from_step, gpus=gpus)
    typer.echo(run_id)
    names = " ".join(m.target for m in group_members)
    typer.echo(f"resumed {run_id} on {names}; see it: dflash-ops run status {group_members[0].target} {run_id}",
               err=True)


def pull(group_members, run_id: str, step: str, dest: Path) -> Path:
    from dflash_ops.runs.group import pull_group

    m, local = pull_group(group_members, run_id, step, dest)
    typer.echo(f"from {m.target}:", err=True)
    return local


def rank_target(inventory: Path | None, target: str, run_id: str, rank: int) -> str:
    """The member target of `rank` (logs --rank)."""
    from dflash_ops.runs.group import member_of_rank

    found, group = group_members(inventory, target, run_id)
    if group is None:
        if rank != 0:
            fail(f"run {run_id} on {target} runs on one host: it has rank 0 only", 2)
        return target
    return member_of_rank(found, rank).target
