"""What state each inventory target is in (running / stopped / missing / unreachable)."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_ops import render
from dflash_ops.connect import open_container
from dflash_ops.errors import TransportError
from dflash_ops.extras import ExtraMissing
from dflash_ops.fanout import map_by_node
from dflash_ops.inventory import Inventory, Target
from dflash_ops.transport.base import Transport


@dataclass(frozen=True)
class TargetState:
    target: Target
    state: str  # running | stopped | missing | unreachable | unknown
    detail: str = ""


def read_pct_status(stdout: str, stderr: str, exit_code: int) -> tuple[str, str]:
    """`pct status`'s answer as (state, detail): `status: running` is running; a CT that does
    not exist is missing; anything else is unknown, with the first line pct said."""
    text = stdout.strip()
    if text.startswith("status: "):
        return text.removeprefix("status: ").splitlines()[0].strip(), ""
    said = (stderr.strip() or text).splitlines()
    state = "missing" if said and "does not exist" in said[0] else "unknown"
    return state, said[0] if said else f"exit status {exit_code}"


def target_state(target: Target, transport: Transport, timeout: float = 30.0) -> TargetState:
    """One `pct status` on the target's node (for `pct: none`, whether the node answers)."""
    pct = target.node.pct  # `pct: none`: the target is the node; reachable means running
    argv = render.pct_argv(pct, "status", target.ctid) if pct else ("true",)
    try:
        result = transport.run(render.node_command(argv), timeout=timeout)
    except TransportError as e:
        return TargetState(target, "unreachable", str(e))
    if not target.node.pct and result.ok:
        return TargetState(target, "running", "no pct")
    return TargetState(target, *read_pct_status(result.stdout, result.stderr, result.exit_code))


def target_states(inventory: Inventory, names: list[str] | None = None, timeout: float = 30.0) -> list[TargetState]:
    """Every target's state (or those named), parallel by node: a dead node costs one connect timeout."""
    containers, uncreated = [], {}
    for name in names or list(inventory.targets):
        try:
            containers.append(open_container(inventory, name))
        except ExtraMissing as e:  # a simulated container this install cannot create (yet)
            uncreated[name] = TargetState(inventory.target(name), "missing", str(e))
    found = map_by_node(
        containers,
        lambda c: target_state(c.target, c.transport, timeout),
        lambda c, e: TargetState(c.target, "unreachable" if isinstance(e, TransportError) else "unknown", str(e)),
    )
    by_name = {s.target.name: s for s in found} | uncreated
    return [by_name[name] for name in names or list(inventory.targets)]
