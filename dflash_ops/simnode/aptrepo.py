"""The simulated node's NVIDIA driver as distribution packages: real .deb files in a flat apt repository,
and the node's dpkg status database saying which of them the node has installed.

A node that took its driver from Debian's packages (or NVIDIA's CUDA repository for Debian) has
`nvidia-kernel-dkms` for the module and `libnvidia-ml1`, `libcuda1`, `nvidia-smi` for the user space,
all of one version `V-REV`; their Depends pin each other and `nvidia-alternative` with `=`, so apt
installs an older version only when each pinned dependency is named at that version too. The simulated node records them
in ROOT/node/var/lib/dpkg/status, which `dpkg-query --admindir` reads (simnode/kind.py node_tool);
the repository (ROOT/node/srv/dflash-sim-apt, `deb [trusted=yes] file:/srv/dflash-sim-apt ./`)
holds the .debs that apt installs into a container: built here by `dpkg-deb --build` (Debian's dpkg,
on every Debian machine), each with the library files of its version where Debian puts them
(usr/lib/x86_64-linux-gnu/nvidia/current) and a Packages index as apt reads a flat repository.
The libraries are text files: nothing loads them (there is no GPU here).
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

REPO_DIR = "/srv/dflash-sim-apt"  # on the node; an LXC container of the stand-in sees it at the same path
SOURCE_LINE = f"deb [trusted=yes] file:{REPO_DIR} ./"
LIB_DIR = "usr/lib/x86_64-linux-gnu/nvidia/current"  # Debian's nvidia-graphics-drivers put the libraries here
STATUS = "/var/lib/dpkg/status"


def debian_version(driver: str) -> str:
    """The package version of driver `driver`, as Debian's first revision of it."""
    return f"{driver}-1"


def _packages(version: str) -> dict[str, dict[str, object]]:
    """Package -> its control fields (less Package/Version/Architecture) and files {path: text}."""
    upstream = version.rsplit("-", 1)[0]
    smi = ("#!/bin/sh\n# nvidia-smi of the simulated node's driver packages (dflash_ops/simnode/aptrepo.py)\n"
           f'echo "NVIDIA-SMI {upstream}    Driver Version: {upstream}    (simulated: no GPU here)"\n')
    return {
        "nvidia-kernel-dkms": {"Depends": "", "files": {f"usr/src/nvidia-current-{upstream}/dkms.conf": "simulated\n"},
                               "Description": "NVIDIA binary kernel module DKMS source"},
        # Debian's: the alternatives links of the driver's libraries; every library package pins it with `=`
        "nvidia-alternative": {"Depends": "", "files": {f"usr/share/doc/nvidia-alternative/{upstream}": "simulated\n"},
                               "Description": "allows the selection of NVIDIA as GLX provider"},
        "libnvidia-ml1": {"Depends": f"nvidia-alternative (= {version})",
                          "files": {f"{LIB_DIR}/libnvidia-ml.so.{upstream}": f"simulated {upstream}\n"},
                          "Description": "NVIDIA Management Library (NVML) runtime library"},
        "libcuda1": {"Depends": f"nvidia-alternative (= {version})",
                     "Recommends": f"nvidia-kernel-dkms (= {version}), nvidia-smi",
                     "files": {f"{LIB_DIR}/libcuda.so.{upstream}": f"simulated {upstream}\n"},
                     "Description": "NVIDIA CUDA Driver Library"},
        "nvidia-smi": {"Depends": f"libnvidia-ml1 (= {version})", "files": {"usr/bin/nvidia-smi": smi},
                       "Description": "NVIDIA System Management Interface"},
    }


def architecture() -> str:
    try:
        return subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True,
                              check=True).stdout.strip() or "amd64"
    except (OSError, subprocess.CalledProcessError):
        return "amd64"


def _fields(name: str, version: str, arch: str, spec: dict[str, object]) -> list[tuple[str, str]]:
    fields = [("Package", name), ("Version", version), ("Architecture", arch),
              ("Maintainer", "dflash-ops simulated node <nobody@localhost>"), ("Section", "non-free/libs"),
              ("Priority", "optional"), ("Source", "nvidia-graphics-drivers")]
    fields += [(key, str(spec[key])) for key in ("Depends", "Recommends") if spec.get(key)]
    return fields + [("Description", str(spec["Description"]))]


def build_debs(repo: Path, driver: str) -> list[Path]:
    """The .debs of driver `driver` in `repo` (made by `dpkg-deb --build`), then its Packages index."""
    if shutil.which("dpkg-deb") is None:
        raise RuntimeError("dpkg-deb not found: the simulated node's driver packages are made by Debian's dpkg "
                           "(apt-get install dpkg)")
    version, arch = debian_version(driver), architecture()
    repo.mkdir(parents=True, exist_ok=True)
    made = []
    for name, spec in _packages(version).items():
        out = repo / f"{name}_{version}_{arch}.deb"
        with tempfile.TemporaryDirectory() as tmp:
            tree = Path(tmp) / "tree"
            (tree / "DEBIAN").mkdir(parents=True)
            control = "".join(f"{k}: {v}\n" for k, v in _fields(name, version, arch, spec))
            (tree / "DEBIAN" / "control").write_text(control)
            for rel, text in dict(spec["files"]).items():  # type: ignore[call-overload]
                path = tree / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
                path.chmod(0o755 if rel.startswith("usr/bin/") else 0o644)
            proc = subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(tree), str(out)],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"dpkg-deb --build {name} {version}: {proc.stderr.strip()}")
        made.append(out)
    write_index(repo)
    return made


def write_index(repo: Path) -> None:
    """repo/Packages for `deb [trusted=yes] file:REPO ./`: each .deb's control stanza with Filename, Size
    and checksums, as dpkg-scanpackages writes it (that tool is in dpkg-dev, not on every machine)."""
    stanzas = []
    for deb in sorted(repo.glob("*.deb")):
        control = subprocess.run(["dpkg-deb", "--field", str(deb)], capture_output=True, text=True, check=True).stdout
        data = deb.read_bytes()
        stanzas.append(control.rstrip("\n") + f"\nFilename: ./{deb.name}\nSize: {len(data)}\n"
                       f"MD5sum: {hashlib.md5(data).hexdigest()}\nSHA256: {hashlib.sha256(data).hexdigest()}\n")
    tmp = repo / "Packages.tmp"
    tmp.write_text("\n".join(stanzas))
    tmp.replace(repo / "Packages")


def node_status(driver: str, names: tuple[str, ...] = ("nvidia-kernel-dkms", "nvidia-alternative", "libnvidia-ml1",
                                                      "libcuda1", "nvidia-smi")) -> str:
    """The node's dpkg status database with `names` installed at driver `driver`'s package version."""
    version, arch = debian_version(driver), architecture()
    specs = _packages(version)
    return "\n".join("".join(f"{k}: {v}\n" for k, v in [
        ("Package", name), ("Status", "install ok installed"),
        *[(k, v) for k, v in _fields(name, version, arch, specs[name]) if k != "Package"]]) for name in names)
