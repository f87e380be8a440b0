"""A simulated container's processes and files as this machine sees them, for either backend.

A directory container shares this machine's PID namespace and paths. A real LXC container has a
PID namespace of its own (a pid its helpers record is not this machine's pid of that process) and
a root of its own (its test directory is bound at the same path; anything else it wrote is in its
overlay's upper directory). Tests of the tiers that run in both (marked lxc_tier) ask here instead
of reading a container pid or path as this machine's.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from dflash_ops import render
from dflash_ops.container import Container
from dflash_ops.simnode import containers as simct
from dflash_ops.simnode.pct import Node as SimNode
from dflash_ops.simnode.pct import lxc_init_pid
from tests import procs


def sim_root(container: Container) -> Path:
    """The stand-in state of a container on a `pct: simulated` node (the sshd tier's node is a
    plain pct node: its SshdNode.sim_root says it)."""
    root = getattr(container.target.node.kind, "root", None)
    if not root:
        raise ValueError(f"{container.target.name} is not on a simulated node")
    return Path(root)


def _ns_pids(pid: int | str) -> list[int]:
    """The pid of this machine's process `pid` in each PID namespace it is in, outermost first."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return [int(field) for field in line.split()[1:]]
    return [int(pid)]


@dataclass(frozen=True)
class ContainerProcs:
    """tests/procs.py for the processes of container `ctid` of the stand-in state `root`, by the
    pids the container sees (what its helpers record)."""

    root: Path
    ctid: int

    def _namespace(self) -> str | None:
        """The container's PID namespace (None: it shares this machine's)."""
        if simct.backend_of(self.root, self.ctid) != "lxc":
            return None
        init = lxc_init_pid(SimNode(Path(self.root)), str(self.ctid))
        if init is None:
            raise AssertionError(f"CT {self.ctid} is not running")
        return os.readlink(f"/proc/{init}/ns/pid")

    def host_pid(self, pid: int) -> int | None:
        """This machine's pid of the container's process `pid` (None: there is none)."""
        namespace = self._namespace()
        if namespace is None:
            return pid if procs.proc_stat(pid) is not None else None
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and os.readlink(entry / "ns" / "pid") == namespace \
                        and _ns_pids(entry.name)[-1] == pid:
                    return int(entry.name)
            except OSError:
                continue  # gone meanwhile
        return None

    def alive(self, pid: int) -> bool:
        host = self.host_pid(pid)
        return host is not None and procs.alive(host)

    def start_ticks(self, pid: int) -> int:
        host = self.host_pid(pid)
        assert host is not None, f"pid {pid} is gone from CT {self.ctid}"
        return procs.start_ticks(host)

    def session_members(self, sid: int) -> list[int]:
        """The live processes of the container's session `sid`, by their pids there."""
        host = self.host_pid(sid)
        if host is None:
            return []
        return [_ns_pids(member)[-1] for member in procs.session_members(host)]


@contextmanager
def process_inside(container: Container, argv: list[str] | None = None) -> Iterator[int]:
    """`argv` (default: a long sleep) running detached inside the container, a session leader;
    yields its pid as the container sees it (what a trainer's status.json would hold) and kills it
    at the end, from inside: its whole process group (the pid is the shell that runs argv, whose
    child outlived a kill of the pid alone by its 300 s)."""
    out = container.exec(render.script(argv or ["sleep", "300"], background=True), check=True).stdout
    pid = int(out.split()[-1])
    try:
        yield pid
    finally:
        container.exec(["kill", "-KILL", "--", f"-{pid}"])
