"""What provision reads from the node before it changes anything: its PVE version, the NVIDIA kernel
module, device nodes and driver packages, and the container's raw config file. Read-only, two round trips."""

from __future__ import annotations

import re
from dataclasses import dataclass

from dflash_ops import render
from dflash_ops.doctor.node import (
    DPKG_MARKER,
    MODULE_VERSION,
    DriverPackages,
    node_dpkg_argv,
    parse_dpkg,
    parse_module_version,
)
from dflash_ops.errors import DflashOpsError
from dflash_ops.nodekinds.base import NodeKind
from dflash_ops.transport.base import Transport

# pve-container gained devN passthrough entries in PVE 8.1 (pve-devel, "Add a dev[n] argument to the
# container config"): older nodes get lxc.cgroup2.devices.allow + lxc.mount.entry lines instead.
DEVN_SINCE = (8, 1)

# Prints each file after a marker line; a missing file prints nothing (a node without the module).
_READ_FILES = 'for f; do echo "--- dflash-ops $f"; cat "$f" 2>/dev/null; done; exit 0'
_LIST_DEV = 'echo "--- dflash-ops dev"; ls -1 "$1" 2>/dev/null; exit 0'


class ProvisionError(DflashOpsError):
    """provision (or doctor --fix) cannot go on: one line that says why and what to do."""


@dataclass(frozen=True)
class NodeInfo:
    name: str
    pve: tuple[int, ...]  # pve-manager's version, e.g. (8, 2, 4)
    module: str | None  # the NVIDIA kernel module's version (None: not loaded)
    gpus: tuple[int, ...]  # /dev/nvidiaN on the node
    devices: tuple[str, ...]  # every /dev/nvidia* node name
    uvm_major: int | None  # nvidia-uvm's char major (dynamic: /proc/devices)
    packages: DriverPackages = DriverPackages()  # the driver's distribution packages (none: an installer)

    @property
    def devn(self) -> bool:
        """The node writes devN passthrough entries (PVE 8.1+)."""
        return self.pve[:2] >= DEVN_SINCE


def parse_pveversion(text: str) -> tuple[int, ...]:
    match = re.search(r"pve-manager/(\d+(?:\.\d+)*)", text)
    if not match:
        raise ProvisionError(f"pveversion printed {text.strip()[:80]!r}: not a Proxmox VE node")
    return tuple(int(x) for x in match.group(1).split("."))


def _sections(stdout: str) -> dict[str, str]:
    found: dict[str, list[str]] = {}
    current = None
    for line in stdout.splitlines():
        if line.startswith("--- dflash-ops "):
            current = line[len("--- dflash-ops "):]
            found[current] = []
        elif current is not None:
            found[current].append(line)
    return {k: "\n".join(v) + ("\n" if v else "") for k, v in found.items()}


def node_commands(kind: NodeKind) -> list[list[str]]:
    """The read-only node commands of read_node, in order."""
    node_path = kind.node_path
    return [kind.node_tool(["pveversion"]),
            ["sh", "-c", _READ_FILES, "sh", node_path(MODULE_VERSION), node_path("/proc/devices")],
            ["sh", "-c", _LIST_DEV, "sh", node_path("/dev")], ["echo", DPKG_MARKER], node_dpkg_argv(kind)]


def read_node(node_name: str, kind: NodeKind, transport: Transport) -> NodeInfo:
    version, files, dev, marker, dpkg = node_commands(kind)
    result = transport.run(render.node_command(version), timeout=60)
    if not result.ok:
        said = (result.stderr.strip().splitlines() or [f"exit {result.exit_code}"])[-1]
        raise ProvisionError(f"node {node_name}: pveversion failed ({said}): provision needs a Proxmox VE node")
    pve = parse_pveversion(result.stdout)
    result = transport.run(render.node_sequence(files, dev, marker, dpkg).command, timeout=60)
    if not result.ok:
        raise ProvisionError(f"node {node_name}: reading the NVIDIA module's files failed: {result.stderr.strip()[-200:]}")
    listing, _, dpkg_text = result.stdout.partition(DPKG_MARKER + "\n")
    sections = _sections(listing)
    module_path, devices_path = files[4], files[5]
    module = parse_module_version(sections.get(module_path, ""))
    names = tuple(sorted(n for n in sections.get("dev", "").split() if n.startswith("nvidia")))
    gpus = tuple(sorted(int(n[6:]) for n in names if n[6:].isdigit()))
    uvm = re.search(r"^\s*(\d+) nvidia-uvm$", sections.get(devices_path, ""), re.M)
    return NodeInfo(node_name, pve, module, gpus, names, int(uvm.group(1)) if uvm else None,
                    DriverPackages.from_dpkg(parse_dpkg(dpkg_text)))
