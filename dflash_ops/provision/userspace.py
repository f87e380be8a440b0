"""The NVIDIA user-space libraries in the container, of exactly the node's kernel-module version.

The container uses the node's kernel module through its device nodes; its own libnvidia-ml and
libcuda must be that module's version, else "Failed to initialize NVML: Driver/library version
mismatch" (after every host driver upgrade). They come from NVIDIA's installer of that version, run
inside the container with --no-kernel-module (the module is the node's); provision takes the
installer from the node (INSTALLER_DIRS), never from the network. A node that has its driver from the
distribution's packages gives the container those packages instead (driverpkgs.py).
"""

from __future__ import annotations

import posixpath
import re
from typing import TYPE_CHECKING

from dflash_ops import render
from dflash_ops.provision import driverpkgs
from dflash_ops.provision.node import NodeInfo, ProvisionError
from dflash_ops.provision.session import node_rendered

if TYPE_CHECKING:
    from dflash_ops.container import Container
    from dflash_ops.provision.session import _Session

# Where provision looks for NVIDIA-Linux-x86_64-VERSION.run on the node, in order.
INSTALLER_DIRS = ("/var/lib/dflash-ops/nvidia", "/root", "/opt/nvidia")
# the last: where Debian's nvidia-graphics-drivers packages put them (behind alternatives links)
LIB_DIRS = ("usr/lib/x86_64-linux-gnu", "usr/lib64", "usr/lib", "lib/x86_64-linux-gnu",
            "usr/lib/x86_64-linux-gnu/nvidia/current")
LIBS = ("libnvidia-ml.so", "libcuda.so")
_FIND = 'for d; do [ -d "$d" ] && ls -1 "$d"; done 2>/dev/null; exit 0'
_FOUND = 'for f; do [ -f "$f" ] && echo "$f"; done; exit 0'


def installer_name(version: str) -> str:
    return f"NVIDIA-Linux-x86_64-{version}.run"


def versions_in(names: str) -> set[str]:
    """Versions of libnvidia-ml.so.X.Y[.Z] / libcuda.so.X.Y[.Z] among file names (not the .so.1 links)."""
    found = set()
    for name in names.split():
        for lib in LIBS:
            match = re.fullmatch(re.escape(lib) + r"\.(\d+\.\d+(?:\.\d+)?)", name)
            if match:
                found.add(match.group(1))
    return found


def list_argv(root: str) -> list[str]:
    return ["sh", "-c", _FIND, "sh", *(posixpath.join(root, d) for d in LIB_DIRS)]


def container_versions(container: Container, root: str) -> set[str]:
    result = container.exec(list_argv(root), timeout=60)
    if not result.ok:
        raise ProvisionError(f"listing the NVIDIA libraries in CT {container.target.ctid} failed: {result.stderr.strip()}")
    return versions_in(result.stdout)


def ensure(s: _Session, container: Container, node: NodeInfo, root: str) -> None:
    """Install the user-space of node.module when the container has another version (or none): the
    node's packages where it has its driver from packages, else NVIDIA's installer of that version."""
    target = container.target
    if node.module and node.packages.installed:
        driverpkgs.ensure(s, container, node, root)
        return
    s.show("the container's NVIDIA libraries (read)", container.render(list_argv(root)))
    have = container_versions(container, root)
    want = node.module
    if want is None or have == {want}:
        return
    kind = target.node.kind
    candidates = [posixpath.join(d, installer_name(want)) for d in INSTALLER_DIRS]
    mapped = [kind.node_path(c) for c in candidates]
    found = s.read("the NVIDIA installer on the node", ["sh", "-c", _FOUND, "sh", *mapped]).split()
    if not found:
        raise ProvisionError(
            f"NVIDIA user-space {want} (the kernel module of node {node.name}) is needed in CT {target.ctid} "
            f"(it has {', '.join(sorted(have)) or 'none'}): no {installer_name(want)} on the node in "
            f"{', '.join(INSTALLER_DIRS)}; put that exact version's installer there "
            f"(download.nvidia.com/XFree86/Linux-x86_64/{want}/)")

    inside = posixpath.join(root, "tmp", installer_name(want))
    pct = target.node.pct
    if root != "/":  # pct push makes no parent directory
        s.quiet(container.render(["mkdir", "-p", posixpath.dirname(inside)]))
    s.change(f"copy {installer_name(want)} into CT {target.ctid}",
             node_rendered(list(render.pct_argv(pct, "push", target.ctid, found[0], inside, "--perms", "0755"))), count=False)
    argv = ["sh", inside, "--silent", "--no-kernel-module"]
    if root != "/":  # a directory container (the simulated node's): its /usr is under its root
        argv += [f"--opengl-prefix={posixpath.join(root, 'usr')}", f"--utility-prefix={posixpath.join(root, 'usr')}"]
    was = ", ".join(sorted(have)) or "none"
    s.change(f"install the NVIDIA user-space {want} without the kernel module (was: {was})",
             container.render(argv), timeout=1800)
    s.change(f"remove {inside}", container.render(["rm", "-f", inside]), count=False)
    if not s.dry_run:
        after = container_versions(container, root)
        if after != {want}:
            raise ProvisionError(f"after installing {installer_name(want)}, CT {target.ctid} has NVIDIA libraries "
                                 f"{', '.join(sorted(after)) or 'none'}, not {want}")
