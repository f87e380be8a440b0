"""From an inventory target to a Container, reusing one transport (one SSH connection) per node."""

from __future__ import annotations

import threading

from dflash_ops.container import Container
from dflash_ops.inventory import Inventory, Node
from dflash_ops.transport.base import Transport

_transports: dict[Node, Transport] = {}
_lock = threading.Lock()


def transport_for(node: Node) -> Transport:
    """The cached transport of `node`; created on first use (SSH connects lazily)."""
    with _lock:
        transport = _transports.get(node)
        if transport is None:
            if node.transport == "ssh":
                from dflash_ops.transport.ssh import SSHTransport

                transport = SSHTransport(node)
            else:
                from dflash_ops.transport.local import LocalTransport

                transport = LocalTransport()
            _transports[node] = transport
        return transport


def open_container(inventory: Inventory, target_name: str) -> Container:
    """The target's Container; its node's kind starts what it must on first use (nodekinds.base.NodeKind.start)."""
    target = inventory.target(target_name)
    transport = transport_for(target.node)
    target.node.kind.start(target.ctid, target.name, transport)
    return Container(target, transport)


def close_all() -> None:
    with _lock:
        for transport in _transports.values():
            transport.close()
        _transports.clear()
