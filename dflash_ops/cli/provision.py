"""`dflash-ops provision TARGET`: create or repair a GPU container (dflash_ops/provision/, docs/provision.md)."""

from __future__ import annotations

import os
from typing import Annotated, Literal, Optional

import typer

from dflash_ops.cli.common import InventoryOption, fail, parse_gpus
from dflash_ops.inventory import ENV_VAR, user_inventory_path


def provision(
    target: Annotated[str, typer.Argument(help="Target name (in the inventory, or added to it with --write-inventory).")],
    gpus: Annotated[Optional[str], typer.Option("--gpus", help="all, or GPU indices 0,1: passed into the container.")] = None,
    template: Annotated[Optional[str], typer.Option("--from-template", help="OS template volid for pct create (e.g. local:vztmpl/debian-12-standard_12.7-1_amd64.tar.zst).")] = None,
    cores: Annotated[Optional[int], typer.Option("--cores", help="CPU cores (pct --cores).")] = None,
    memory: Annotated[Optional[int], typer.Option("--memory", help="Memory limit in MiB (pct --memory).")] = None,
    rootfs: Annotated[Optional[str], typer.Option("--rootfs", help="STORAGE:GiB of a new container's root disk.")] = None,
    shm: Annotated[Optional[int], typer.Option("--shm", help="/dev/shm size in GiB (default: 1, half a GiB per GPU from 2 on).")] = None,
    privileged: Annotated[bool, typer.Option("--privileged", help="Create a privileged container (default unprivileged).")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print every node command and the config diff; change nothing.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Restart a running container without asking.")] = False,
    write_inventory: Annotated[bool, typer.Option("--write-inventory", help="Add TARGET to the inventory when it is not there: the file of --inventory, else yours ($XDG_CONFIG_HOME/dflash-ops/hosts.yaml, made from the default the first time), edited in place (comments, order, mode kept).")] = False,
    node: Annotated[Optional[str], typer.Option("--node", help="With --write-inventory: the node of a new target.")] = None,
    ctid: Annotated[Optional[int], typer.Option("--ctid", help="With --write-inventory: the CTID of a new target.")] = None,
    inventory: InventoryOption = None,
) -> None:
    """Create TARGET's container when it does not exist, or repair it: GPUs, /dev/shm, limits, python, NVIDIA user-space.

    A rerun changes nothing and says so. It asks before restarting a running container (--yes for
    scripts) and refuses while a run of ours is live in it, or while the container is locked.
    """
    from dflash_ops.connect import transport_for
    from dflash_ops.container import Container
    from dflash_ops.inventory import load_inventory, writable_inventory_path
    from dflash_ops.provision import Request
    from dflash_ops.provision import provision as run_provision
    from dflash_ops.provision.inventory_file import add_target, set_gpus, with_target

    asked: Literal["all"] | tuple[int, ...] = "all" if gpus == "all" else tuple(parse_gpus(gpus) or ())
    inv = load_inventory(inventory)
    added = False
    if target not in inv.targets:
        if not write_inventory:
            inv.target(target)  # the inventory's own error, with a suggestion
        if node is None or ctid is None:
            fail(f"{target} is not in {inv.path}: --write-inventory needs --node NODE and --ctid N", 2)
        if node not in inv.nodes:
            fail(f"{inv.path}: no node {node!r} (nodes: {', '.join(sorted(inv.nodes))})", 2)
        listed = asked if isinstance(asked, tuple) else ()
        # a real node's kind gives its targets no base_dir: the container layout's usual one (docs/container-layout.md)
        base_dir = None if inv.nodes[node].kind.target_defaults(ctid).get("base_dir") else "/opt/dflash"
        if dry_run:
            # planned against the inventory as it would be written; the user's file stays as it is
            text = with_target(inv.path.read_text(), inv.path, target, node, ctid, listed, base_dir) or inv.path.read_text()
            where = inv.path if inventory or os.environ.get(ENV_VAR) else user_inventory_path()
            typer.echo(f"# would add {target} (node {node}, ctid {ctid}) to {where}")
            inv = load_inventory(where, text=text)
        else:
            path, seeded = writable_inventory_path(inventory)
            if seeded:
                typer.echo(f"provision: created your inventory {path} from the default {inv.path}")
            added = add_target(path, target, node, ctid, listed, base_dir)
            typer.echo(f"provision: added {target} to {path}")
            inv = load_inventory(path)
    t = inv.target(target)
    container = Container(t, transport_for(t.node))
    request = Request(gpus=asked, cores=cores, memory_mib=memory, rootfs=rootfs, shm_gib=shm, template=template,
                      unprivileged=not privileged)
    outcome = run_provision(container, request, dry_run=dry_run, yes=yes,
                            confirm=lambda q: typer.confirm(q, default=False), say=typer.echo)
    if dry_run:
        typer.echo("# config diff" + ("" if outcome.diff else ": none"))
        for line in outcome.diff:
            typer.echo(line)
    for note in outcome.notes:
        typer.echo(f"note: {note}", err=True)
    if added and outcome.gpus and not t.gpus and set_gpus(inv.path, target, outcome.gpus):
        typer.echo(f"provision: {target} holds GPU {','.join(map(str, outcome.gpus))} in {inv.path}")
    verb = "would change" if dry_run else "changed"
    n = len(outcome.changes)
    typer.echo(f"provision {target}: {n} change{'s' if n != 1 else ''}" + (f" ({verb}: " + "; ".join(outcome.changes) + ")"
                                                                            if n else " (as wanted already)"))


def register(app: typer.Typer) -> None:
    app.command("provision")(provision)
