"""What state each inventory target is in (running / stopped / missing / unreachable)."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_ops import render
from dflash_ops.connect import open_container
from dflash_ops.errors import TransportError
from dflash_ops.fanout import map_by_node
from dflash_ops.inventory import Inventory, Target
from dflash_ops.transport.base import Transport


@dataclass(frozen=True)
class TargetState:
    target: Target
    state: str  # running | stopped | missing | unreachable | unknown
    detail: str = ""


def target_state(target: Target, transport: Transport, timeout: float = 30.0) -> TargetState:
    """One `pct status` on the target's node (for `pct: none`, whether the node answers)."""
    pct = target.node.pct  # `pct: none`: the target is the node; reachable means running
    argv = render.pct_argv(pct, "status", target.ctid) if pct else ("true",)
    try:
        result = transport.run(render.node_command(argv), timeout=timeout)
    except TransportError as e:
        return TargetState(target, "unreachable", str(e))
    text = result.stdout.strip()
    if not target.node.pct and result.ok:
        return TargetState(target, "running", "no pct")
    if result.ok and text.startswith("status: "):
        return TargetState(target, text.removeprefix("status: "))
    detail = (result.stderr.strip() or text).splitlines()
    state = "missing" if detail and "does not exist" in detail[0] else "unknown"
    return TargetState(target, state, detail[0] if detail else f"exit status {result.exit_code}")


def target_states(inventory: Inventory, names: list[str] | None = None, timeout: float = 30.0) -> list[TargetState]:
    """Every target's state (or those named), parallel by node: a dead node costs one connect timeout."""
    containers = [open_container(inventory, name) for name in (names or list(inventory.targets))]
    return map_by_node(
        containers,
        lambda c: target_state(c.target, c.transport, timeout),
        lambda c, e: TargetState(c.target, "unreachable" if isinstance(e, TransportError) else "unknown", str(e)),
    )
