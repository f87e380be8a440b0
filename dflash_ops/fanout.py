"""One operation on many targets: parallel across nodes, one connection per node.

Each node gets a thread that first opens the node's one connection (the transport cached by
dflash_ops.connect); then the node's targets run in parallel, one channel each over that
connection. A node that cannot be reached costs one connect attempt (one connect timeout),
not one per target, and never delays the other nodes: its targets all get that one error.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar

R = TypeVar("R")


def connect_node(transport: Any) -> None:
    """Open the transport's connection now (SSH); transports without one (local) need nothing."""
    connect = getattr(transport, "connect", None)
    if connect is not None:
        connect()


def map_by_node(
    containers: Sequence[Any],
    fn: Callable[[Any], R],
    on_error: Callable[[Any, Exception], R],
) -> list[R]:
    """fn(container) for every container, results in the order given.

    An exception from fn becomes on_error(container, exception) for that container only; an
    error while connecting (Unreachable, a refused host key, ...) becomes on_error(c, that error)
    for every container of the node, with no further attempt.
    """
    results: list[Any] = [None] * len(containers)
    by_node: dict[Any, list[int]] = {}
    for i, container in enumerate(containers):
        by_node.setdefault(container.target.node, []).append(i)

    def one(i: int) -> None:
        try:
            results[i] = fn(containers[i])
        except Exception as e:  # noqa: BLE001 - reported for that container
            results[i] = on_error(containers[i], e)

    def node_worker(indices: list[int]) -> None:
        try:
            connect_node(containers[indices[0]].transport)
        except Exception as e:  # noqa: BLE001 - the node's failure, reported on each of its targets
            for i in indices:
                results[i] = on_error(containers[i], e)
            return
        _run_all([partial(one, i) for i in indices], "fanout-target")

    _run_all([partial(node_worker, ix) for ix in by_node.values()], "fanout-node")
    return results


def map_targets(
    names: Sequence[str],
    open_container: Callable[[str], Any],
    fn: Callable[[Any, str], R],
    failed: Callable[[str, Exception, float], R],
) -> list[R]:
    """fn(container, name) for every target name, in parallel by node (map_by_node), in order.

    `open_container(name)` gives the target's Container; an error opening it or from fn becomes
    failed(name, error, seconds since the start) for that target only.
    """
    started = time.monotonic()
    results: dict[str, R] = {}
    containers: dict[str, Any] = {}
    for name in names:
        try:
            containers[name] = open_container(name)
        except Exception as e:  # noqa: BLE001 - reported per target
            results[name] = failed(name, e, time.monotonic() - started)
    opened = list(containers.values())
    done = map_by_node(opened, lambda c: fn(c, c.target.name),
                       lambda c, e: failed(c.target.name, e, time.monotonic() - started))
    results.update((c.target.name, r) for c, r in zip(opened, done))
    return [results[name] for name in names]


def _run_all(calls: list[Callable[[], None]], name: str) -> None:
    """Run the calls in threads (the last one in this thread) and wait for all of them."""
    threads = [threading.Thread(target=call, name=name, daemon=True) for call in calls[:-1]]
    for thread in threads:
        thread.start()
    if calls:
        calls[-1]()
    for thread in threads:
        thread.join()
