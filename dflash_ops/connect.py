"""From an inventory target to a Container, reusing one transport (one SSH connection) per node."""

from __future__ import annotations

import threading

from dflash_ops.container import Container
from dflash_ops.errors import TransportError
from dflash_ops.extras import require_trainer
from dflash_ops.inventory import Inventory, Node
from dflash_ops.render import node_command
from dflash_ops.simnode.containers import create_argv, is_created
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
    target = inventory.target(target_name)
    container = Container(target, transport_for(target.node))
    if target.node.sim_root and target.ctid in target.node.sim_containers:
        _create_sim_container(container)
    return container


def _create_sim_container(container: Container) -> None:
    """First use of a simulated node's listed container: `pct create` it, as an admin would.

    Only the ctids the node lists under `sim_containers` (the embedded default's 200): any
    other ctid gets pct's "does not exist", as on a real node.
    """
    target = container.target
    sim_root = target.node.sim_root
    assert sim_root is not None
    with _lock:
        if is_created(sim_root, target.ctid):
            return
        require_trainer(f"simulated CT {target.ctid} (its python links them from this one)")
        result = container.transport.run(node_command(create_argv(target.node.pct, target.ctid, hostname=target.name)))
        if not is_created(sim_root, target.ctid):
            raise TransportError(f"creating simulated CT {target.ctid} failed: {result.stderr.strip()[-500:]}")


def close_all() -> None:
    with _lock:
        for transport in _transports.values():
            transport.close()
        _transports.clear()
