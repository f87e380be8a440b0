"""What only the node knows about a container: `pct status` and the GPU entries of `pct config`.

`pct config VMID` prints one `key: value` line per option, sorted by key, then the raw
`lxc.*` keys in file order (pve-container src/PVE/CLI/pct.pm, `config`). GPUs reach a
container either as passthrough devices (`devN: /dev/nvidia0[,gid=...]`, PVE 8.1+, which also
allow them in the cgroup) or as bind mounts (`lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none
bind,optional,create=file`) that also need `lxc.cgroup2.devices.allow: c MAJOR:* rwm`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dflash_ops import render
from dflash_ops.errors import TransportError
from dflash_ops.target_states import read_pct_status

if TYPE_CHECKING:
    from dflash_ops.inventory import Target
    from dflash_ops.nodekinds.base import NodeKind
    from dflash_ops.transport.base import Transport


NVIDIA_MAJOR = 195
MODULE_VERSION = "/proc/driver/nvidia/version"

# The node's boot unit (dflash_ops/provision/bootunit.py installs it; doctor reads its state here).
UNIT = "dflash-ops-nvidia-devices.service"
UNIT_PATH = f"/etc/systemd/system/{UNIT}"
UNIT_TEXT = """\
# Installed by `dflash-ops provision --boot-unit` (docs/provision.md): the NVIDIA device nodes exist
# before pve-guests starts the GPU containers (pct start checks every devN path).
[Unit]
Description=NVIDIA device nodes for GPU containers (dflash-ops)
After=systemd-modules-load.service
Before=pve-guests.service

[Service]
Type=oneshot
RemainAfterExit=yes
# /dev/nvidia0..N and /dev/nvidiactl (loads the nvidia module when it is not loaded)
ExecStart=/usr/bin/nvidia-smi -L
# /dev/nvidia-uvm and /dev/nvidia-uvm-tools: otherwise made on first CUDA use only
ExecStart=/usr/bin/nvidia-modprobe -u -c 0

[Install]
WantedBy=multi-user.target
"""
UNIT_MARKER = "--- dflash-ops unit state"


def unit_state_argvs(kind: NodeKind) -> list[list[str]]:
    """Node commands whose output (after UNIT_MARKER) says the unit's state: its file, then `enabled`
    or something else (systemctl is-enabled); every one exits 0, so it can join a sequence."""
    return [["sh", "-c", 'cat "$1" 2>/dev/null; exit 0', "sh", kind.node_path(UNIT_PATH)], ["echo", UNIT_MARKER],
            ["sh", "-c", '"$@" 2>/dev/null; exit 0', "sh", *kind.node_tool(["systemctl", "is-enabled", UNIT])]]


def parse_unit_state(text: str) -> tuple[str, str]:
    """(the unit file's text, its is-enabled word) from state_argvs' output."""
    body, _, state = text.partition(UNIT_MARKER + "\n")
    return body, (state.split() or ["not-found"])[0]




def parse_module_version(text: str) -> str | None:
    """`NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.14  Thu Feb ...` -> 550.54.14
    (also the open module's `NVIDIA UNIX Open Kernel Module for x86_64  570.86.15 ...`)."""
    match = re.search(r"Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)\s", text.split("\n")[0] + " ")
    return match.group(1) if match else None  # /dev/nvidia0..N and /dev/nvidiactl (nvidia-frontend); nvidia-uvm's major is dynamic


@dataclass
class PctConfig:
    options: dict[str, str] = field(default_factory=dict)
    lxc: list[tuple[str, str]] = field(default_factory=list)

    def passthrough_paths(self) -> set[str]:
        """Device paths of the devN entries (`devN: [path=]/dev/X[,gid=...]`)."""
        return {value.split(",")[0].removeprefix("path=") for key, value in self.options.items()
                if re.fullmatch(r"dev\d+", key)}

    def bind_mounted(self) -> set[str]:
        """Source paths of lxc.mount.entry lines (`SRC DST TYPE OPTIONS ...`)."""
        return {value.split()[0] for key, value in self.lxc if key == "lxc.mount.entry" and value.split()}

    def cgroup_allows(self) -> list[str]:
        return [value for key, value in self.lxc if key in ("lxc.cgroup2.devices.allow", "lxc.cgroup.devices.allow")]

    def allows(self, major: int) -> bool:
        """A cgroup allow rule admits char devices of this major (`a`, `c MAJOR:N`, `c *:N`)."""
        rules = [rule.split() for rule in self.cgroup_allows()]
        return any(w[:1] == ["a"] or (w[:1] == ["c"] and len(w) > 1 and w[1].partition(":")[0] in ("*", str(major)))
                   for w in rules)

    def used_dev_indices(self) -> set[int]:
        return {int(k[3:]) for k in self.options if re.fullmatch(r"dev\d+", k)}


def parse_pct_config(text: str) -> PctConfig:
    config = PctConfig()
    for line in text.splitlines():
        key, sep, value = line.partition(": ")
        if not sep:
            key, sep, value = line.partition(":")
        if not sep or not key:
            continue
        if key.startswith("lxc."):
            config.lxc.append((key, value.strip()))
        else:
            config.options[key] = value.strip()
    return config


@dataclass
class NodeFacts:
    pct: bool  # False: the node has no pct, the target is the node itself
    state: str  # running | stopped | missing | unreachable | unknown
    detail: str = ""
    config: PctConfig | None = None
    config_error: str | None = None
    module: str | None = None  # the node's NVIDIA kernel module version (/proc/driver/nvidia/version)
    boot_unit: str | None = None  # `systemctl is-enabled` of UNIT (enabled, disabled, not-found); None: not read


def node_facts(target: Target, transport: Transport, timeout: float = 30.0) -> NodeFacts:
    """`pct status` and `pct config` in one round trip (both read the container's config file)."""
    if not target.node.pct:
        try:
            result = transport.run(render.node_command(["true"]), timeout=timeout)
        except TransportError as e:
            return NodeFacts(False, "unreachable", str(e))
        return NodeFacts(False, "running" if result.ok else "unknown", "no pct: the target is the node itself")
    status = render.pct_argv(target.node.pct, "status", target.ctid)
    config = render.pct_argv(target.node.pct, "config", target.ctid)
    marker = "--- dflash-ops pct config ---"
    module_marker = "--- dflash-ops nvidia module ---"
    module = ["sh", "-c", 'cat "$1" 2>/dev/null; exit 0', "sh", target.node.kind.node_path(MODULE_VERSION)]
    unit_marker = "--- dflash-ops boot unit ---"
    command = render.node_sequence(status, ["echo", marker], config, ["echo", module_marker], module,
                                   ["echo", unit_marker], *unit_state_argvs(target.node.kind)).command
    try:
        result = transport.run(command, timeout=timeout)
    except TransportError as e:
        return NodeFacts(True, "unreachable", str(e))
    head, sep, tail = result.stdout.partition(marker + "\n")
    facts = NodeFacts(True, *read_pct_status(head, result.stderr, result.exit_code))
    if not head.strip().startswith("status: "):
        return facts
    tail, _, module_text = tail.partition(module_marker + "\n")
    module_text, found_unit, unit_text = module_text.partition(unit_marker + "\n")
    facts.module = parse_module_version(module_text)
    if found_unit:
        facts.boot_unit = parse_unit_state(unit_text)[1]
    if sep and result.ok:
        facts.config = parse_pct_config(tail)
    else:
        said = result.stderr.strip().splitlines()
        facts.config_error = said[-1] if said else f"pct config exited {result.exit_code}"
    return facts
