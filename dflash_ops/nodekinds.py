"""Node kinds: what kind of machine a node is, and what that kind owns.

A node is a Proxmox node (`pct: COMMAND`, the default `pct`), a plain host whose targets are the
node itself (`pct: none`), or the bundled simulated Proxmox node (`pct: simulated`). As
pyinfra's connectors do, each kind owns its own inventory keys (`sim_root`, `sim_containers`,
`sim_backend` for the simulated node), the pct command it runs, defaults for its targets'
`base_dir` and `python`, its start-up on first use of a target (the simulated node creates the
containers it lists) and how `dflash-ops hosts` describes a target's backend. The inventory and
the connection code only ask the kind; a new kind of node is a new entry in KINDS, not a new
special case in them.
"""

from __future__ import annotations

import shlex
from typing import Any

from dflash_ops.nodekind import Fail, KindFactory, KindKeys, NodeKind
from dflash_ops.simnode.kind import SimulatedFactory


class _NoPct(KindFactory):
    """`pct: none`: the node is the target (a plain GPU box, or the container you are in)."""

    @classmethod
    def from_inventory(cls, keys: dict[str, Any], transport: str, fail: Fail) -> NodeKind:
        return NodeKind(())


KINDS: dict[str, type[KindFactory]] = {"none": _NoPct, "simulated": SimulatedFactory}


def kind_keys() -> dict[str, type[KindKeys]]:
    """Every kind's own keys by kind name (its `pct:` value), for the inventory's checks and suggestions."""
    return {name: factory.keys for name, factory in KINDS.items() if factory.keys is not None}


def build(pct: Any, keys: dict[str, Any], transport: str, fail: Fail) -> NodeKind:
    """The kind a node's `pct:` value names, made from its own keys (already checked against its schema).

    `pct` is a command (string or list of strings: a Proxmox node), or the name of a kind in KINDS.
    """
    if isinstance(pct, str) and pct in KINDS:
        return KINDS[pct].from_inventory(keys, transport, fail)
    if isinstance(pct, str) and pct.strip():
        return NodeKind(tuple(shlex.split(pct)))
    if isinstance(pct, list) and pct and all(isinstance(p, str) and p for p in pct):
        return NodeKind(tuple(pct))
    raise fail("pct", f"pct must be a command (string or list of strings), got {pct!r}")
