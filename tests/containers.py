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
from pathlib import Path
from typing import Iterator

from dflash_ops import render
from dflash_ops.container import Container
from dflash_ops.simnode import containers as simct
from dflash_ops.simnode.pct import Node as SimNode, lxc_init_pid


def sim_root(container: Container, default: str | Path | None = None) -> Path:
    """The stand-in state of a container's simulated node (`default`: the sshd tier's, whose node
    kind is a plain pct node that does not know it)."""
    root = getattr(container.target.node.kind, "root", None) or default
    if not root:
        raise ValueError(f"{container.target.name} is not on a simulated node")
    return Path(root)


def _ns_pid(pid: int) -> list[int]:
    """The pid of process `pid` (this machine's) in each PID namespace it is in, outermost first."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return [int(field) for field in line.split()[1:]]
    return [pid]


def _pid_namespace(root: Path, ctid: int) -> str | None:
    """The PID namespace of an LXC container (None: the container shares this machine's)."""
    if simct.backend_of(root, ctid) != "lxc":
        return None
    init = lxc_init_pid(SimNode(root), str(ctid))
    if init is None:
        raise AssertionError(f"CT {ctid} is not running")
    return os.readlink(f"/proc/{init}/ns/pid")


def host_pid(root: Path, ctid: int, pid: int) -> int | None:
    """This machine's pid of the process that the container sees as `pid` (None: no such process)."""
    namespace = _pid_namespace(root, ctid)
    if namespace is None:
        return pid if Path(f"/proc/{pid}").exists() else None
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.readlink(entry / "ns" / "pid") == namespace and _ns_pid(int(entry.name))[-1] == pid:
                return int(entry.name)
        except OSError:
            continue  # gone meanwhile
    return None


def container_pid(root: Path, ctid: int, pid: int) -> int:
    """The pid the container sees for this machine's process `pid`."""
    return pid if _pid_namespace(root, ctid) is None else _ns_pid(pid)[-1]


def host_path(root: Path, ctid: int, path: str | Path) -> Path:
    """Where the file the container has at `path` is on this machine (simct.host_path; a path
    under the test directory, bound at the same path, is itself)."""
    return simct.host_path(root, ctid, path)


@contextmanager
def process_inside(container: Container, seconds: int = 300) -> Iterator[int]:
    """A `sleep` running inside the container, detached; yields its pid as the container sees it
    (what a trainer's status.json would hold) and kills it at the end, from inside."""
    out = container.exec(render.script(["sleep", str(seconds)], background=True), check=True).stdout
    pid = int(out.split()[-1])
    try:
        yield pid
    finally:
        container.exec(["kill", "-KILL", str(pid)])

