"""The simulated node's LXC root filesystem: one Debian bookworm minbase tree per machine, cached.

    dflash-ops sim-rootfs            # builds it once (about a minute), prints its path
    python -m dflash_ops.simnode.rootfs

Every LXC container of the simulated node is an overlay clone of this tree (the stand-in writes
only the clone's upper directory). It is built by `mmdebstrap` as root from the Debian mirror apt
is configured with (/etc/apt/sources.list{,.d}), the only download; nothing is fetched at run
time. The tree lives under /var/cache/dflash-ops/lxc-rootfs/<recipe hash>/ ($DFLASH_OPS_ROOTFS_CACHE
moves it): a changed RECIPE is a new hash, so it is rebuilt, and older builds are removed.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

# What a fresh Proxmox Debian 12 CT has that the tool relies on: Debian's python3 (3.11) and
# python3-venv (a fresh CT from Proxmox's template lacks it: docs/simulated-node.md). The init is
# LXC's static init.lxc (a real CT runs systemd), copied in as /sbin/init.lxc.
RECIPE: dict[str, Any] = {
    "suite": "bookworm",
    "variant": "minbase",
    "include": ["python3", "python3-venv", "procps"],
    "init": "/usr/sbin/init.lxc.static",
    "version": 1,
}
DEFAULT_CACHE = "/var/cache/dflash-ops/lxc-rootfs"


def cache_dir() -> Path:
    return Path(os.environ.get("DFLASH_OPS_ROOTFS_CACHE") or DEFAULT_CACHE)


def recipe_hash() -> str:
    return hashlib.sha256(json.dumps(RECIPE, sort_keys=True).encode()).hexdigest()[:16]


def build_dir() -> Path:
    return cache_dir() / f"{RECIPE['suite']}-{recipe_hash()}"


def path() -> Path:
    """Where the current recipe's tree is (built or not)."""
    return build_dir() / "rootfs"


def built() -> bool:
    return (build_dir() / "complete").is_file()


def unavailable_reason() -> str | None:
    """Why this machine cannot run the simulated node's LXC containers (None: it can)."""
    if os.geteuid() != 0:
        return "not root (LXC containers need root)"
    for tool in ("lxc-start", "lxc-attach", "lxc-info", "lxc-stop"):
        if shutil.which(tool) is None:
            return f"{tool} not found (apt-get install lxc)"
    if not os.path.isdir("/sys/fs/cgroup/memory") and not os.path.isfile("/sys/fs/cgroup/cgroup.controllers"):
        return "no memory cgroup"
    if not built():
        return "no LXC rootfs built (run `dflash-ops sim-rootfs`)"
    return None


def apt_sources(suite: str) -> str:
    """The entries of apt's configuration for `suite` (and its -updates/-security), as sources.list lines."""
    lines = []
    for file in ["/etc/apt/sources.list", *sorted(glob.glob("/etc/apt/sources.list.d/*.list"))]:
        try:
            text = Path(file).read_text()
        except OSError:
            continue
        for line in text.splitlines():
            words = line.split("#", 1)[0].split()
            if len(words) >= 3 and words[0] == "deb" and _suite_matches(words[-2] if words[1].startswith("[") and len(words) > 3 else words[2], suite):
                lines.append(" ".join(words))
    for file in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
        try:
            stanzas = re.split(r"\n\s*\n", Path(file).read_text())
        except OSError:
            continue
        for stanza in stanzas:
            fields = {}
            for line in stanza.splitlines():
                if line.startswith("#") or ":" not in line or line[:1].isspace():
                    continue
                key, _, value = line.partition(":")
                fields[key.strip().lower()] = value.split()
            if "deb" not in fields.get("types", []) or fields.get("enabled", ["yes"]) == ["no"]:
                continue
            signed = fields.get("signed-by", [])
            option = f"[signed-by={signed[0]}] " if signed and signed[0].startswith("/") else ""
            for uri in fields.get("uris", []):
                for s in fields.get("suites", []):
                    if _suite_matches(s, suite):
                        lines.append(f"deb {option}{uri} {s} {' '.join(fields.get('components', ['main']))}")
    return "".join(line + "\n" for line in dict.fromkeys(lines))


def _suite_matches(candidate: str, suite: str) -> bool:
    return candidate == suite or candidate.startswith(suite + "-") or candidate.startswith(suite + "/")


def users(tree: Path) -> list[str]:
    """The running containers (any process whose mount namespace holds an overlay over `tree`),
    one mount namespace each: "CT 200 (pid 1234)" for the simulated node's, else "pid N (command)".
    Their overlay reads `tree` as its lower directory: replacing it under them breaks them."""
    needle = f"lowerdir={tree}"
    found: dict[str, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            namespace = os.readlink(f"/proc/{entry}/ns/mnt")
            if namespace in found:
                continue
            with open(f"/proc/{entry}/mountinfo") as f:
                if not any(" overlay " in line and (needle + "," in line or needle + ":" in line
                                                    or line.rstrip().endswith(needle)) for line in f):
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        vmid = argv[argv.index("-n") + 1] if "-n" in argv[:-1] and argv[0].endswith("init.lxc") else None
        found[namespace] = f"CT {vmid} (pid {entry})" if vmid else f"pid {entry} ({' '.join(argv).strip()[:60]})"
    return sorted(found.values())


def build(force: bool = False) -> Path:
    """Build the tree for the current RECIPE unless it is there; remove older builds that no running
    container uses. Returns path(). A rebuild is refused while running containers use the tree (it
    would be replaced under them): they are named."""
    if built() and not force:
        return path()
    if build_dir().exists():
        using = users(path())
        if using:
            raise SystemExit(f"dflash-ops sim-rootfs --rebuild: running containers use {path()}: {', '.join(using)}; "
                             "stop them first (pct stop VMID), or leave the tree as it is")
    if os.geteuid() != 0:
        raise SystemExit("dflash-ops sim-rootfs: must run as root (mmdebstrap builds a root-owned tree)")
    if shutil.which("mmdebstrap") is None:
        raise SystemExit("dflash-ops sim-rootfs: mmdebstrap not found (apt-get install mmdebstrap lxc)")
    sources = apt_sources(str(RECIPE["suite"]))
    if not sources:
        raise SystemExit(f"dflash-ops sim-rootfs: apt has no source for {RECIPE['suite']} in /etc/apt/sources.list{{,.d}}")
    target = build_dir()
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    argv = ["mmdebstrap", "--quiet", f"--variant={RECIPE['variant']}", f"--include={','.join(RECIPE['include'])}",
            str(RECIPE["suite"]), str(tmp / "rootfs"), "-"]
    proc = subprocess.run(argv, input=sources, text=True, capture_output=True)
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise SystemExit(f"dflash-ops sim-rootfs: mmdebstrap failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    shutil.copy2(str(RECIPE["init"]), tmp / "rootfs" / "sbin" / "init.lxc")
    (tmp / "recipe.json").write_text(json.dumps(RECIPE, sort_keys=True, indent=1) + "\n")
    (tmp / "complete").write_text("")
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    for old in cache_dir().glob(f"{RECIPE['suite']}-*"):
        if old != target and not users(old / "rootfs"):
            shutil.rmtree(old, ignore_errors=True)  # an older build still in use stays until the next build
    return path()


if __name__ == "__main__":
    print(build(force="--rebuild" in sys.argv[1:]))
