"""`dflash-ops provision TARGET`: create or repair a GPU container (dflash_ops/provision/, docs/provision.md)."""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Annotated, Literal, Optional

import typer

from dflash_ops.cli.common import InventoryOption, fail, parse_gpus
from dflash_ops.inventory import ENV_VAR, user_inventory_path
from dflash_ops.provision.config import DeviceAccess

if TYPE_CHECKING:
    from dflash_ops.container import Container


def provision(
    target: Annotated[str, typer.Argument(help="Target name (in the inventory, or added to it with --write-inventory).")],
    gpus: Annotated[Optional[str], typer.Option("--gpus", help="all, or GPU indices 0,1: passed into the container.")] = None,
    template: Annotated[Optional[str], typer.Option("--from-template", help="OS template volid for pct create (e.g. local:vztmpl/debian-12-standard_12.7-1_amd64.tar.zst).")] = None,
    cores: Annotated[Optional[int], typer.Option("--cores", min=1, max=8192, help="CPU cores (pct --cores).")] = None,
    memory: Annotated[Optional[int], typer.Option("--memory", min=16, max=2**31, help="Memory limit in MiB (pct --memory).")] = None,
    rootfs: Annotated[Optional[str], typer.Option("--rootfs", help="STORAGE:GiB of a new container's root disk.")] = None,
    shm: Annotated[Optional[int], typer.Option("--shm", min=1, max=65536, help="/dev/shm size in GiB (default: 1, half a GiB per GPU from 2 on).")] = None,
    privileged: Annotated[bool, typer.Option("--privileged/--unprivileged", help="Create a privileged container (default: unprivileged; with --device-gid its group is mapped to the node's by lxc.idmap lines).")] = False,
    device_gid: Annotated[Optional[str], typer.Option("--device-gid", metavar="GID|GROUP", help="The group that may open the GPU device nodes in the container (gid= on every devN entry; a GROUP name is looked up in the running container).")] = None,
    device_uid: Annotated[Optional[int], typer.Option("--device-uid", min=0, max=65535, help="The owner of the GPU device nodes in the container (uid= on every devN entry).")] = None,
    device_mode: Annotated[Optional[str], typer.Option("--device-mode", metavar="MODE", help="The device nodes' mode, octal (mode= on every devN entry, e.g. 0660).")] = None,
    boot_unit: Annotated[bool, typer.Option("--boot-unit", help="Install (asks; --yes) and enable a systemd unit on the node that makes the NVIDIA device nodes at boot, before pve-guests starts the containers.")] = False,
    features: Annotated[Optional[str], typer.Option("--features", help="pct's features: of the container, e.g. nesting=1.")] = None,
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
    access = DeviceAccess(uid=device_uid, gid=_gid(container, device_gid), mode=_mode(device_mode))
    if features is not None and not re.fullmatch(r"[a-z_]+=[01](,[a-z_]+=[01])*", features):
        fail(f"--features {features!r}: pct's form, e.g. nesting=1 or nesting=1,keyctl=1", 2)
    request = Request(gpus=asked, cores=cores, memory_mib=memory, rootfs=rootfs, shm_gib=shm, template=template,
                      unprivileged=not privileged, device=access, features=features, boot_unit="install" if boot_unit else "")
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


def _mode(text: str | None) -> str | None:
    if text is None:
        return None
    if not re.fullmatch(r"0?[0-7]{3}", text):
        fail(f"--device-mode {text!r}: an octal mode such as 0660", 2)
    return text.rjust(4, "0")


def _gid(container: Container, text: str | None) -> int | None:
    """--device-gid: a number, or a group name as the container knows it (`getent group` in it: a
    name is the container's, not the node's)."""
    if text is None:
        return None
    if text.isdigit():
        if int(text) >= 65536:
            fail(f"--device-gid {text}: a gid of the container, below 65536", 2)
        return int(text)
    if not re.fullmatch(r"[a-z_][a-z0-9_-]*", text):
        fail(f"--device-gid {text!r}: a number or a group name", 2)
    found = container.exec(["getent", "group", text], timeout=60)
    if not found.ok or not found.stdout.split(":")[2:3]:
        fail(f"--device-gid {text}: no group {text!r} in CT {container.target.ctid} (is it running? "
             f"pass the number instead)", 2)
    return int(found.stdout.split(":")[2])


def register(app: typer.Typer) -> None:
    app.command("provision")(provision)
