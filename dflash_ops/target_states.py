"""What state each inventory target is in (running / stopped / missing / unreachable)."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_ops import render
from dflash_ops.connect import transport_for
from dflash_ops.errors import TransportError
from dflash_ops.inventory import Inventory, Target


@dataclass(frozen=True)
class TargetState:
    target: Target
    state: str  # running | stopped | missing | unreachable | unknown
    detail: str = ""


def target_state(target: Target, timeout: float = 30.0) -> TargetState:
    command = render.node_command(render.pct_argv(target.node.pct, "status", target.ctid))
    try:
        result = transport_for(target.node).run(command, timeout=timeout)
    except TransportError as e:
        return TargetState(target, "unreachable", str(e))
    text = result.stdout.strip()
    if result.ok and text.startswith("status: "):
        return TargetState(target, text.removeprefix("status: "))
    detail = (result.stderr.strip() or text).splitlines()
    state = "missing" if detail and "does not exist" in detail[0] else "unknown"
    return TargetState(target, state, detail[0] if detail else f"exit status {result.exit_code}")


def target_states(inventory: Inventory) -> list[TargetState]:
    return [target_state(t) for t in inventory.targets.values()]
