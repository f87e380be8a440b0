"""The simulated node's NVIDIA GPUs: fixture files a test (or a demo) gives the node, read by provision and doctor.

A node with the NVIDIA kernel module has `/proc/driver/nvidia/version` (its first line names the
module's version), `/dev/nvidia0..N`, `/dev/nvidiactl` and `/dev/nvidia-uvm` (char devices 195:N and
the dynamic uvm major listed in `/proc/devices`). The simulated node keeps them under ROOT/node/
(pct.py Node.node_path): the device files are plain files (nothing opens them; a devN entry binds
one into an LXC container), the version file has the kernel module's format. `installers`: the
NVIDIA installers the node has, `NVIDIA-Linux-x86_64-VERSION.run` in /var/lib/dflash-ops/nvidia
(a stand-in: a shell script that, as the real one with --no-kernel-module, installs the user-space
libraries of its version and no kernel module; it refuses without that option, as the real one in
a container fails to load its module). `driver_from="packages"`: the node took its driver from the
distribution's packages instead (simnode/aptrepo.py): its dpkg status database lists them at the
module's version, the node's apt repository holds their .debs, and there is no installer.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from dflash_ops.simnode import aptrepo
from dflash_ops.simnode.pct import Node

UVM_MAJOR = 511
DEVICES_RECORD = "/var/lib/dflash-ops-sim/nvidia-devices"  # what the boot unit makes again at a simulated boot
BOOT_UNIT = "dflash-ops-nvidia-devices.service"
INSTALLER_DIR = "/var/lib/dflash-ops/nvidia"
PVEVERSION_FILE = "pveversion"  # ROOT/node/pveversion: what `pveversion` prints on the simulated node
DEFAULT_PVEVERSION = "pve-manager/8.2.4/faa83925c9641325 (running kernel: 6.8.12-1-pve)"


def version_text(version: str) -> str:
    """/proc/driver/nvidia/version as the kernel module writes it."""
    return (f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {version}  Thu Feb 22 01:44:30 UTC 2024\n"
            "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")


def install_gpus(sim_root: str | Path, count: int = 2, driver: str | None = "550.54.14",
                 installers: tuple[str, ...] | None = None, pve: str | None = None,
                 driver_from: str = "installer") -> None:
    """Give the simulated node `count` GPUs and the kernel module `driver` (None: no module loaded:
    no version file, no device nodes), the installers of `installers` (default: `driver`'s) and what
    `pveversion` prints (`pve`, e.g. "pve-manager/7.4-17/..." for a node without devN entries).
    `driver_from="packages"`: the driver's packages instead of an installer (aptrepo.py)."""
    if driver_from not in ("installer", "packages"):
        raise ValueError(f"driver_from must be installer or packages, got {driver_from!r}")
    node = Node(Path(sim_root))
    dev = node.node_path("/dev")
    if dev.is_dir():
        for old in dev.glob("nvidia*"):
            old.unlink()
    dev.mkdir(parents=True, exist_ok=True)
    version = node.node_path("/proc/driver/nvidia/version")
    names = [*(f"nvidia{i}" for i in range(count)), "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"]
    if driver is None:
        version.unlink(missing_ok=True)
    else:
        version.parent.mkdir(parents=True, exist_ok=True)
        version.write_text(version_text(driver))
        for name in names:
            (dev / name).write_text("")
    names = [] if driver is None else names
    node.node_path(DEVICES_RECORD).parent.mkdir(parents=True, exist_ok=True)
    node.node_path(DEVICES_RECORD).write_text("".join(name + "\n" for name in names))
    node.node_path("/proc/devices").write_text(
        "Character devices:\n  1 mem\n  4 tty\n195 nvidia-frontend\n"
        + (f"{UVM_MAJOR} nvidia-uvm\n" if driver else "") + "\nBlock devices:\n  8 sd\n")
    store = node.node_path(INSTALLER_DIR)
    if store.is_dir():
        shutil.rmtree(store)
    store.mkdir(parents=True)
    repo, status = node.node_path(aptrepo.REPO_DIR), node.node_path(aptrepo.STATUS)
    for old in repo.iterdir() if repo.is_dir() else ():  # emptied, not removed: running containers bind it
        old.unlink()
    status.unlink(missing_ok=True)
    if driver_from == "packages":
        if driver:
            aptrepo.build_debs(repo, driver)
            status.parent.mkdir(parents=True, exist_ok=True)
            status.write_text(aptrepo.node_status(driver))
        installers = ()
    for wanted in installers if installers is not None else ((driver,) if driver else ()):
        path = store / f"NVIDIA-Linux-x86_64-{wanted}.run"
        path.write_text(installer_script(wanted))
        os.chmod(path, 0o755)
    node.node_path(PVEVERSION_FILE).write_text((pve or DEFAULT_PVEVERSION) + "\n")
    for name in ("subuid", "subgid"):  # a PVE node's: root maps the unprivileged containers' range
        ids = node.node_path(f"/etc/{name}")
        if not ids.exists():
            ids.parent.mkdir(parents=True, exist_ok=True)
            ids.write_text("root:100000:65536\n")


def reboot(sim_root: str | Path) -> list[str]:
    """A node reboot (or a kernel update's): every container stops; the NVIDIA module is loaded
    again but makes no device files, so /dev/nvidia* are gone; an enabled boot unit
    (provision --boot-unit, the stand-in's systemctl) makes them again; then pve-guests starts the
    containers with `onboot: 1` through `pct start`, which checks every devN path. Returns a line
    per container started or refused (`Device /dev/nvidia0 does not exist`)."""
    import subprocess

    from dflash_ops.simnode import containers as simct

    root = Path(sim_root)
    node = Node(root)
    simct.stop_all(root)
    for vmid in node.vmids():
        if node.running(vmid) or (node.lxc / f"{vmid}.state").read_text().strip() == "running":
            node.set_state(vmid, "stopped")
    dev = node.node_path("/dev")
    for old in dev.glob("nvidia*") if dev.is_dir() else ():
        old.unlink()
    said = []
    units = node.node_path("/etc/systemd/system")
    if (units / "multi-user.target.wants" / BOOT_UNIT).is_symlink() and (units / BOOT_UNIT).is_file():
        record = node.node_path(DEVICES_RECORD)
        names = record.read_text().split() if record.is_file() else []
        for name in names:
            (dev / name).write_text("")
        said.append(f"{BOOT_UNIT}: made /dev/{', /dev/'.join(names)}" if names else f"{BOOT_UNIT}: no GPUs")
    for vmid in node.vmids():
        if not re.search(r"^onboot: 1$", node.conf(vmid).read_text(), re.M):
            continue
        started = subprocess.run([*simct.stand_in_argv(root), "start", vmid], capture_output=True, text=True)
        said.append(f"pve-guests: CT {vmid} " + ("started" if started.returncode == 0 else
                                                  f"not started: {started.stderr.strip().splitlines()[-1]}"))
    return said


def upgrade_driver(sim_root: str | Path, driver: str, keep_installers: bool = True, publish: bool = True) -> None:
    """A host driver upgrade: the kernel module is now `driver`, and its installer is on the node. A node
    with the driver's packages (install_gpus driver_from="packages") has them upgraded instead (`apt
    upgrade` and a reboot): its dpkg status says `driver`, and the node's repository gets that version's
    .debs beside the old ones (`publish=False`: not, as a mirror that does not carry it yet)."""
    node = Node(Path(sim_root))
    node.node_path("/proc/driver/nvidia/version").write_text(version_text(driver))
    status = node.node_path(aptrepo.STATUS)
    if status.is_file():
        status.write_text(aptrepo.node_status(driver))
        if publish:
            aptrepo.build_debs(node.node_path(aptrepo.REPO_DIR), driver)
        return
    store = node.node_path(INSTALLER_DIR)
    store.mkdir(parents=True, exist_ok=True)
    if not keep_installers:
        for old in store.glob("NVIDIA-Linux-*.run"):
            old.unlink()
    path = store / f"NVIDIA-Linux-x86_64-{driver}.run"
    path.write_text(installer_script(driver))
    os.chmod(path, 0o755)


# The installer stand-in. Options as NVIDIA's: --silent, --no-kernel-module, --opengl-prefix=P and
# --utility-prefix=P (where libraries and tools go; default /usr). It removes what an earlier run of
# it installed (the real installer uninstalls the previous driver first), then writes this version's
# libnvidia-ml and libcuda. No .so.1 links (ldconfig makes those): nothing loads these files.
_INSTALLER = r"""#!/bin/sh
# NVIDIA-Linux-x86_64-@VERSION@.run: the simulated node's installer stand-in (dflash_ops/simnode/gpus.py)
version=@VERSION@
prefix=/usr
nokernel=
for arg in "$@"; do
  case "$arg" in
    --no-kernel-module|--no-kernel-modules) nokernel=1 ;;
    --opengl-prefix=*) prefix=${arg#--opengl-prefix=} ;;
    --utility-prefix=*|--silent|-s|--no-questions|--ui=none|--accept-license) ;;
    *) echo "ERROR: Unrecognized option: '$arg'" >&2; exit 1 ;;
  esac
done
if [ -z "$nokernel" ]; then
  echo "ERROR: Unable to load the kernel module 'nvidia.ko'.  This happens most frequently when this kernel module was built against the wrong or improperly configured kernel sources" >&2
  exit 1
fi
libdir="$prefix/lib/x86_64-linux-gnu"
mkdir -p "$libdir" || exit 1
manifest="$libdir/.nvidia-installer-manifest"
if [ -f "$manifest" ]; then
  while read -r old; do rm -f "$libdir/$old"; done < "$manifest"
fi
: > "$manifest"
for lib in libnvidia-ml.so libcuda.so; do
  echo "simulated $lib $version" > "$libdir/$lib.$version" || exit 1
  echo "$lib.$version" >> "$manifest"
done
echo "Installation of the NVIDIA Accelerated Graphics Driver for Linux-x86_64 (version: $version) is now complete."
"""


def installer_script(version: str) -> str:
    return _INSTALLER.replace("@VERSION@", version)
