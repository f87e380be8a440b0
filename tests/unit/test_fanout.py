"""map_by_node: parallel across nodes, one connect per node, a dead node's targets share its error."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from dflash_ops.errors import RemoteCommandError, Unreachable
from dflash_ops.fanout import map_by_node


class Transport:
    def __init__(self, name: str, barrier: threading.Barrier, dead: bool = False):
        self.name, self.barrier, self.dead = name, barrier, dead
        self.connects = 0
        self.ran: list[str] = []

    def connect(self) -> None:
        self.connects += 1
        self.barrier.wait()  # every node connects at the same time, or this breaks
        if self.dead:
            raise Unreachable(f"node {self.name!r}: cannot connect: timed out after 2s")


def fleet(nodes: int, per_node: int, dead: set[int]):
    barrier = threading.Barrier(nodes, timeout=10)
    transports = [Transport(f"n{i}", barrier, dead=i in dead) for i in range(nodes)]
    containers = [SimpleNamespace(target=SimpleNamespace(name=f"n{i}-{200 + k}", node=f"n{i}"), transport=transports[i])
                  for k in range(per_node) for i in range(nodes)]
    return transports, containers


def test_dead_nodes_cost_one_connect_and_every_node_connects_at_once():
    transports, containers = fleet(8, 2, dead={1, 5, 6})

    def status(c) -> str:
        c.transport.ran.append(c.target.name)
        return "running"

    results = map_by_node(containers, status, lambda c, e: f"unreachable: {e}")
    assert [t.connects for t in transports] == [1] * 8
    for c, result in zip(containers, results):
        dead = c.transport.dead
        assert result == ("unreachable: node %r: cannot connect: timed out after 2s" % c.target.node if dead else "running")
    assert sorted(name for t in transports for name in t.ran) == sorted(
        c.target.name for c in containers if not c.transport.dead)


def test_a_failing_target_does_not_stop_its_node_neighbours():
    transports, containers = fleet(2, 3, dead=set())
    targets_on_n0 = [c for c in containers if c.target.node == "n0"]
    inside = threading.Barrier(len(targets_on_n0), timeout=10)

    def fn(c):
        if c.target.node == "n0":
            inside.wait()  # the node's targets run at the same time over its one connection
        if c.target.name == "n0-201":
            raise RemoteCommandError(["x"], 3, "boom")
        return c.target.name

    results = map_by_node(containers, fn, lambda c, e: type(e).__name__)
    assert results == [c.target.name if c.target.name != "n0-201" else "RemoteCommandError" for c in containers]


@pytest.mark.parametrize("n", [0, 1])
def test_empty_and_single(n):
    transports, containers = fleet(1, n, dead=set()) if n else ([], [])
    assert map_by_node(containers, lambda c: c.target.name, lambda c, e: None) == [c.target.name for c in containers]
