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


# The NVIDIA driver from the distribution's packages instead of NVIDIA's .run installer: the module from
# a *-dkms package, the user space from packages of one version (their Depends pin each other with `=`).
# A container needs the user-space ones at exactly the node's version (provision/driverpkgs.py); the
# kernel ones never. Two families of names:
# * Debian's non-free nvidia-graphics-drivers (and NVIDIA's CUDA repository for Debian): fixed names,
#   libcuda1, libnvidia-ml1, nvidia-smi, ...;
# * Ubuntu's (restricted, and NVIDIA's CUDA repository for Ubuntu): the driver branch and flavour in the
#   name, libnvidia-compute-550 (libcuda, libnvidia-ml, the PTX JIT, NVVM), nvidia-utils-550
#   (nvidia-smi), -server for the data-centre branch; the module from nvidia-dkms-550[-server][-open].
#   Ubuntu's prebuilt linux-modules-nvidia-550-* are versioned by the kernel, not the driver: not read.
DRIVER_KERNEL_PACKAGES = ("nvidia-kernel-dkms", "nvidia-kernel-open-dkms", "nvidia-open-kernel-dkms")
DRIVER_USERSPACE_PACKAGES = ("libcuda1", "libnvidia-ml1", "nvidia-smi", "libnvidia-ptxjitcompiler1",
                             "libnvidia-nvvm4", "libcudadebugger1")
DRIVER_NEEDED = ("libcuda1", "libnvidia-ml1")  # what torch and NVML load: a container gets them always
# Ubuntu's: (branch, "-server" or None) from the name (helpers/doctor.py UBUNTU_USERSPACE: keep the two equal).
UBUNTU_USERSPACE = re.compile(r"(?:libnvidia-compute|nvidia-utils)-(\d+)(-server)?")
UBUNTU_KERNEL = re.compile(r"(?:nvidia-dkms|nvidia-kernel-common)-(\d+)(-server)?(?:-open)?")
# what dpkg-query -W is asked for Ubuntu's names (its own glob patterns; the names are then matched above)
UBUNTU_PATTERNS = ("libnvidia-compute-*", "nvidia-utils-*", "nvidia-dkms-*", "nvidia-kernel-common-*")


def is_userspace_package(name: str) -> bool:
    return name in DRIVER_USERSPACE_PACKAGES or UBUNTU_USERSPACE.fullmatch(name) is not None


def is_kernel_package(name: str) -> bool:
    return name in DRIVER_KERNEL_PACKAGES or UBUNTU_KERNEL.fullmatch(name) is not None


DPKG_FORMAT = "${Package}\t${Version}\t${db:Status-Abbrev}\n"
DPKG_MARKER = "--- dflash-ops driver packages"
# dpkg-query exits 1 when a name is not known (it still prints the others) and the shell 127 when
# there is no dpkg at all (a simulated node on a machine without it): neither is a failure here.
_DPKG = '"$@" 2>/dev/null; s=$?; [ "$s" -le 1 ] || [ "$s" -eq 127 ]'


def dpkg_query_argv(names: tuple[str, ...] | list[str], tool: list[str] | None = None) -> list[str]:
    """What dpkg knows of `names`, a `PACKAGE\tVERSION\tSTATUS-ABBREV` line each (exits 0 unless dpkg
    itself fails); `tool`: the dpkg-query argv prefix (the node kind's node_tool(["dpkg-query"]))."""
    return ["sh", "-c", _DPKG, "sh", *(tool or ["dpkg-query"]), "-W", "-f", DPKG_FORMAT, *names]


def node_dpkg_argv(kind: NodeKind) -> list[str]:
    """The node's NVIDIA driver packages, as dpkg_query_argv prints them."""
    return dpkg_query_argv([*DRIVER_KERNEL_PACKAGES, *DRIVER_USERSPACE_PACKAGES, *UBUNTU_PATTERNS],
                           kind.node_tool(["dpkg-query"]))


@dataclass(frozen=True)
class DpkgPackage:
    version: str
    installed: bool  # dpkg's status is `installed` (not config-files, half-installed, ...)
    held: bool  # selection `hold` (apt-mark hold): apt upgrades and removes it only when told to


def parse_dpkg(text: str) -> dict[str, DpkgPackage]:
    """dpkg_query_argv's lines -> {package: DpkgPackage}; a package dpkg has no version of is left out."""
    found = {}
    for line in text.splitlines():
        parts = line.split("\t")
        if len(parts) == 3 and parts[1]:
            abbrev = parts[2].ljust(2)
            found[parts[0]] = DpkgPackage(parts[1], abbrev[1] == "i", abbrev[0] == "h")
    return found


def upstream_version(version: str) -> str:
    """A Debian version's upstream part: `1:550.54.14-1~deb12u1` -> `550.54.14` (the module's version)."""
    without_epoch = version.partition(":")[2] if ":" in version else version
    return without_epoch.rsplit("-", 1)[0] if "-" in without_epoch else without_epoch


@dataclass(frozen=True)
class DriverPackages:
    """The node's installed NVIDIA driver packages ({package: version}); empty: the node has none (an
    installer, or no driver)."""

    installed: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_dpkg(cls, found: dict[str, DpkgPackage]) -> DriverPackages:
        return cls({name: p.version for name, p in sorted(found.items())
                    if p.installed and (is_userspace_package(name) or is_kernel_package(name))})

    @property
    def version(self) -> str | None:
        """The user space's package version (else the kernel package's): what a container gets."""
        for wanted in (is_userspace_package, is_kernel_package):
            versions = sorted({v for n, v in self.installed.items() if wanted(n)})
            if versions:
                return versions[-1] if len(versions) == 1 else None
        return None

    def for_container(self) -> tuple[str, ...]:
        """The packages a container gets: the node's user-space ones, and always what torch and NVML load:
        DRIVER_NEEDED (Debian's names), or libnvidia-compute-BRANCH[-server] of the branch and flavour the
        node's Ubuntu names say."""
        ubuntu = {m.groups() for m in (UBUNTU_USERSPACE.fullmatch(n) or UBUNTU_KERNEL.fullmatch(n) for n in self.installed)
                  if m}
        debian = not ubuntu or any(n in DRIVER_USERSPACE_PACKAGES or n in DRIVER_KERNEL_PACKAGES for n in self.installed)
        needed = {f"libnvidia-compute-{branch}{server or ''}" for branch, server in ubuntu} | set(DRIVER_NEEDED if debian else ())
        return tuple(sorted(needed | {n for n in self.installed if is_userspace_package(n)}))

    def problem(self, node: str, module: str | None) -> str | None:
        """Why a container cannot be given the node's version (one line), or None."""
        listed = ", ".join(f"{n} {v}" for n, v in self.installed.items())
        if self.version is None:
            return (f"node {node}: its NVIDIA packages are of more than one version ({listed}): finish the driver "
                    "upgrade on the node (apt-get install of one version for all of them), then provision")
        if module is not None and upstream_version(self.version) != module:
            return (f"node {node}: its NVIDIA packages are {self.version} ({listed}) but its loaded kernel module is "
                    f"{module}: reboot the node (or reload the nvidia module) so they agree, then provision")
        return None


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
    driver_packages: DriverPackages | None = None  # the node's NVIDIA driver packages; None: not read


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
                                   ["echo", unit_marker], *unit_state_argvs(target.node.kind),
                                   ["echo", DPKG_MARKER], node_dpkg_argv(target.node.kind)).command
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
    unit_text, found_dpkg, dpkg_text = unit_text.partition(DPKG_MARKER + "\n")
    if found_unit:
        facts.boot_unit = parse_unit_state(unit_text)[1]
    if found_dpkg:
        facts.driver_packages = DriverPackages.from_dpkg(parse_dpkg(dpkg_text))
    if sep and result.ok:
        facts.config = parse_pct_config(tail)
    else:
        said = result.stderr.strip().splitlines()
        facts.config_error = said[-1] if said else f"pct config exited {result.exit_code}"
    return facts
