"""Node kinds: what kind of machine a node is, and what that kind owns.

A node is a Proxmox node (`pct: COMMAND`, the default `pct`), a plain host whose targets are the
node itself (`pct: none`), or the bundled simulated Proxmox node (`pct: simulated`). As
pyinfra's connectors do, each kind owns its own inventory keys (`sim_root`, `sim_containers`,
`sim_backend` for the simulated node), the pct command it runs, defaults for its targets'
`base_dir` and `python`, its start-up on first use of a target (the simulated node creates the
containers it lists) and how `dflash-ops hosts` describes a target's backend. The inventory and
the connection code only ask the kind; a new kind of node is a new entry in KINDS, not a new
special case in them.

The registry is lazy: KINDS names each kind's factory as "module:attr", and a kind's module is
imported only when a node asks for that kind (an inventory of real Proxmox nodes never imports
dflash_ops.simnode).
"""

from __future__ import annotations

import importlib
import shlex
from typing import Any

from dflash_ops.nodekinds.base import Fail, KindFactory, KindKeys, NodeKind

__all__ = ["KINDS", "Fail", "KindFactory", "KindKeys", "NodeKind", "build", "factory", "keys_of", "kind_keys"]


class NoPct(KindFactory):
    """`pct: none`: the node is the target (a plain GPU box, or the container you are in)."""

    @classmethod
    def from_inventory(cls, keys: dict[str, Any], transport: str, fail: Fail) -> NodeKind:
        return NodeKind(())


# kind name (a node's `pct:` value) -> "module:attr" of its KindFactory, imported on first use
KINDS: dict[str, str] = {
    "none": "dflash_ops.nodekinds:NoPct",
    "simulated": "dflash_ops.simnode.kind:SimulatedFactory",
}
_loaded: dict[str, type[KindFactory]] = {}


def factory(name: str) -> type[KindFactory]:
    """The factory of kind `name` (a key of KINDS), importing its module the first time."""
    if name not in _loaded:
        module, _, attr = KINDS[name].partition(":")
        _loaded[name] = getattr(importlib.import_module(module), attr)
    return _loaded[name]


def keys_of(pct: Any) -> type[KindKeys] | None:
    """The own keys of the kind `pct` names (None: not a kind's name, or a kind without keys)."""
    return factory(pct).keys if isinstance(pct, str) and pct in KINDS else None


def kind_keys() -> dict[str, type[KindKeys]]:
    """Every kind's own keys by kind name, for the inventory's checks and suggestions (imports every kind)."""
    return {name: keys for name in KINDS if (keys := factory(name).keys) is not None}


def build(pct: Any, keys: dict[str, Any], transport: str, fail: Fail) -> NodeKind:
    """The kind a node's `pct:` value names, made from its own keys (already checked against its schema).

    `pct` is a command (string or list of strings: a Proxmox node), or the name of a kind in KINDS.
    """
    if isinstance(pct, str) and pct in KINDS:
        return factory(pct).from_inventory(keys, transport, fail)
    if isinstance(pct, str) and pct.strip():
        return NodeKind(tuple(shlex.split(pct)))
    if isinstance(pct, list) and pct and all(isinstance(p, str) and p for p in pct):
        return NodeKind(tuple(pct))
    raise fail("pct", f"pct must be a command (string or list of strings), got {pct!r}")
