"""`dflash-ops sim-rootfs`: build the simulated node's LXC root filesystem (once per machine)."""

from __future__ import annotations

from typing import Annotated

import typer


def sim_rootfs(
    rebuild: Annotated[bool, typer.Option("--rebuild", help="Build it again even if the current recipe's tree is there.")] = False,
) -> None:
    """Build and cache the Debian bookworm tree the simulated node's LXC containers are overlay clones of.

    As root, with Debian's `lxc` and `mmdebstrap` (apt-get install lxc mmdebstrap); about a
    minute, from the Debian mirror apt is configured with. Prints the tree's path. Until it is
    built, the simulated node's containers are directories (`dflash-ops hosts` shows the backend).
    """
    from dflash_ops.simnode import rootfs

    typer.echo(rootfs.build(force=rebuild))
    reason = rootfs.unavailable_reason()
    if reason:
        typer.echo(f"note: this machine still cannot run the LXC backend: {reason}", err=True)


def register(app: typer.Typer) -> None:
    app.command("sim-rootfs")(sim_rootfs)
