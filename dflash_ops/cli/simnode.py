"""The simulated node's own commands: `sim-rootfs` (its LXC root filesystem), `sim-gpus` (fixture
GPUs for provision and doctor), `sim-remake` (a container again, on the other backend)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Optional

import typer

from dflash_ops.cli.common import InventoryOption, fail

if TYPE_CHECKING:
    from dflash_ops.inventory import Inventory, Node


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


def _simulated_node(inv: Inventory, name: str | None) -> Node:
    from dflash_ops.simnode.kind import SimulatedNode

    nodes = {n: node for n, node in inv.nodes.items() if isinstance(node.kind, SimulatedNode)}
    if name is None:
        if len(nodes) != 1:
            fail(f"{inv.path}: {len(nodes)} simulated nodes ({', '.join(sorted(nodes)) or 'none'}): name one", 2)
        return next(iter(nodes.values()))
    if name not in nodes:
        fail(f"{inv.path}: no simulated node {name!r} (simulated nodes: {', '.join(sorted(nodes)) or 'none'})", 2)
    return nodes[name]


def sim_gpus(
    node: Annotated[Optional[str], typer.Argument(help="The simulated node (default: the inventory's only one).")] = None,
    count: Annotated[int, typer.Option("--count", min=0, max=64, help="How many GPUs: /dev/nvidia0..N-1.")] = 2,
    driver: Annotated[str, typer.Option("--driver", help="The NVIDIA kernel module's version.")] = "550.54.14",
    none: Annotated[bool, typer.Option("--none", help="No NVIDIA module at all (a node without GPUs).")] = False,
    driver_from: Annotated[str, typer.Option("--driver-from", help="installer: NVIDIA's .run installer on the node; "
                                             "packages: the distribution's packages (the node's dpkg lists them, "
                                             "its apt repository has them).")] = "installer",
    inventory: InventoryOption = None,
) -> None:
    """Give the simulated node fixture GPUs: the NVIDIA module's version file, /dev/nvidia* (plain
    files), /proc/devices and an installer stand-in of that version (or, --driver-from packages, the
    driver's .debs in the node's apt repository and its dpkg status listing them), so that `provision
    --gpus all` and doctor's GPU checks have a node to read (nothing can open them: docs/provision.md)."""
    import re

    from dflash_ops.inventory import load_inventory
    from dflash_ops.simnode import gpus

    if not re.fullmatch(r"\d+\.\d+(\.\d+)?", driver):
        fail(f"--driver {driver!r}: a version like 550.54.14", 2)
    if driver_from not in ("installer", "packages"):
        fail(f"--driver-from {driver_from!r}: installer or packages", 2)
    chosen = _simulated_node(load_inventory(inventory), node)
    root = chosen.kind.identity()
    try:
        gpus.install_gpus(root, count, None if none else driver, driver_from=driver_from)
    except RuntimeError as e:  # no dpkg-deb to make the packages
        fail(f"sim-gpus --driver-from packages: {e}")
    typer.echo(f"simulated node {chosen.name}: " + ("no NVIDIA module" if none else
                                                     f"{count} GPU(s), NVIDIA module {driver}") + f" (under {root}/node)")
    if driver_from == "packages" and not none:
        from dflash_ops.simnode import aptrepo

        typer.echo(f"simulated node {chosen.name}: driver packages {aptrepo.debian_version(driver)} installed on the node; "
                   f"its LXC containers reach them with the apt source `{aptrepo.SOURCE_LINE}`")


def sim_reboot(
    node: Annotated[Optional[str], typer.Argument(help="The simulated node (default: the inventory's only one).")] = None,
    inventory: InventoryOption = None,
) -> None:
    """Reboot the simulated node: its containers stop, /dev/nvidia* are gone until a boot unit makes
    them (provision --boot-unit), then the containers with onboot: 1 are started by `pct start`,
    which refuses a devN path that does not exist; a line per step."""
    from dflash_ops.inventory import load_inventory
    from dflash_ops.simnode import gpus

    chosen = _simulated_node(load_inventory(inventory), node)
    for line in gpus.reboot(chosen.kind.identity()):
        typer.echo(f"simulated node {chosen.name}: {line}")


def sim_remake(
    target: Annotated[str, typer.Argument(help="A target of a simulated node.")],
    backend: Annotated[Optional[str], typer.Option("--backend", help="lxc or directory (default: the other one).")] = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask: everything in the container is lost.")] = False,
    inventory: InventoryOption = None,
) -> None:
    """Make TARGET's simulated container again, on the other backend (or --backend): stopped,
    destroyed (its releases and runs with it) and, for a container the node creates on first use
    (sim_containers), created again; one provision made is made again by `dflash-ops provision TARGET`."""
    from dflash_ops.errors import DflashOpsError
    from dflash_ops.inventory import load_inventory
    from dflash_ops.simnode import containers as simct
    from dflash_ops.simnode.kind import SimulatedNode

    t = load_inventory(inventory).target(target)
    kind = t.node.kind
    if not isinstance(kind, SimulatedNode):
        fail(f"{target}: node {t.node.name} is not a simulated node (pct: simulated)", 2)
    now = simct.recorded_backend(kind.root, t.ctid)
    wanted = backend or ("directory" if (now or simct.pick_backend(kind.backend_choice)) == "lxc" else "lxc")
    if wanted not in simct.BACKENDS:
        fail(f"--backend {wanted!r}: lxc or directory", 2)
    if now is not None and not yes and not typer.confirm(
            f"CT {t.ctid} ({now}) and everything in it (releases, runs) is destroyed: go on?", default=False):
        fail(f"CT {t.ctid} left as it is", 1)
    try:
        done = simct.remake(kind.root, kind.pct, t.ctid, wanted, hostname=t.name, listed=t.ctid in kind.containers)
    except (DflashOpsError, OSError) as e:
        fail(f"{target}: {e}")
    except simct.sim_pct.PctError as e:
        fail(f"{target}: {str(e).strip()}")
    for line in done:
        typer.echo(f"sim-remake: {line}")
    if t.ctid not in kind.containers:
        gpus = f" --gpus {','.join(map(str, t.gpus))}" if t.gpus else ""
        typer.echo(f"{target}: destroyed; make it again as a {wanted} container: "
                   f"DFLASH_OPS_SIM_BACKEND={wanted} dflash-ops provision {target}{gpus}")
    else:
        typer.echo(f"{target}: CT {t.ctid} is a {wanted} container now")


def register(app: typer.Typer) -> None:
    app.command("sim-rootfs")(sim_rootfs)
    app.command("sim-gpus")(sim_gpus)
    app.command("sim-remake")(sim_remake)
    app.command("sim-reboot")(sim_reboot)
