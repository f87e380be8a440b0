"""The NVIDIA user space in the container from the distribution's packages, where the node has its driver
from them: the same packages at exactly the node's package version, installed by apt and held.

A node whose driver is Debian's (or NVIDIA's CUDA repository for Debian) has `libcuda1`, `libnvidia-ml1`,
`nvidia-smi`, ... of one version `V-REV` whose upstream part is the loaded module's version (doctor/node.py
DriverPackages reads them). The container gets those user-space packages at `V-REV` from its own apt
sources (`apt-get install PKG=V-REV`, without Recommends: those pull the kernel module's -dkms package,
which a container must not have), then `apt-mark hold`: an `apt upgrade` in the container would
otherwise move them to a newer driver than the node's module ("Failed to initialize NVML:
Driver/library version mismatch"). After the node's driver upgrade provision (doctor --fix) installs
the new version over the held one (`--allow-change-held-packages`: the move is the one asked for) and
holds it again. Nothing is downloaded but by the container's apt, from the sources its admin gave it;
a version its sources do not have is refused in one line naming the version and the sources.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from dflash_ops.doctor.node import DpkgPackage, dpkg_query_argv, parse_dpkg
from dflash_ops.provision.node import NodeInfo, ProvisionError

if TYPE_CHECKING:
    from dflash_ops.container import Container
    from dflash_ops.inventory import Target
    from dflash_ops.provision.session import _Session

_MARKER = "--- dflash-ops apt sources"
# Every version of each package the container's apt knows (`PKG | VERSION | SOURCE`), then apt's
# package files (the sources, `apt-cache policy` without arguments). Reads only.
_AVAILABLE = f'apt-cache madison "$@" 2>/dev/null; echo "{_MARKER}"; apt-cache policy 2>/dev/null; exit 0'


def query_argv(packages: tuple[str, ...]) -> list[str]:
    return dpkg_query_argv(packages)


def available_argv(packages: tuple[str, ...]) -> list[str]:
    return ["sh", "-c", _AVAILABLE, "sh", *packages]


def parse_available(text: str) -> tuple[dict[str, list[tuple[str, str]]], list[str]]:
    """({package: [(version, source)]}, [source]) from available_argv's output; a source is apt's
    `URI SUITE[/COMPONENT]` (`file:/srv/nvidia ./`, `http://deb.debian.org/debian bookworm/non-free`)."""
    versions: dict[str, list[tuple[str, str]]] = {}
    madison, _, policy = text.partition(_MARKER + "\n")
    for line in madison.splitlines():
        parts = [p.strip() for p in line.split("|")]
        if len(parts) == 3 and parts[0] and parts[1]:
            versions.setdefault(parts[0], []).append((parts[1], parts[2].removesuffix(" Packages")))
    sources = []
    for line in policy.splitlines():
        match = re.match(r"\s*-?\d+\s+(\S+\s+\S+)(?:\s+\S+)?\s+Packages$", line)
        if match and match.group(1) not in sources:
            sources.append(match.group(1))
    return versions, sources


_SHOW = 'apt-cache show "$@" 2>/dev/null; exit 0'
_PINNED = re.compile(r"([a-z0-9][a-z0-9+.-]*)(?::[a-z0-9]+)?\s*\(\s*=\s*([^)\s]+)\s*\)")


def pinned_by(text: str, version: str) -> set[str]:
    """The packages that `apt-cache show` stanzas' Depends/Pre-Depends pin to exactly `version` (`nvidia-alternative
    (= 550.54.14-1)`); an alternative (`a | b`) pins nothing."""
    found = set()
    for line in text.splitlines():
        key, _, value = line.partition(": ")
        if key not in ("Depends", "Pre-Depends"):
            continue
        for item in value.split(","):
            match = _PINNED.fullmatch(item.strip())
            if match and match.group(2) == version:
                found.add(match.group(1))
    return found


def with_pinned(container: Container, packages: tuple[str, ...], version: str) -> tuple[str, ...]:
    """`packages` and every package they pin to `version`, transitively, as the container's apt knows them.

    apt's resolver takes a dependency's candidate (the newest) version: `apt-get install libcuda1=V` fails
    ("held broken packages") when libcuda1 V depends on `nvidia-alternative (= V)` and the sources also
    have a newer one, which a mirror ahead of the node always has. Naming each pinned one at V mends it."""
    have, todo = set(packages), list(packages)
    while todo:
        result = container.exec(["sh", "-c", _SHOW, "sh", *(f"{p}={version}" for p in sorted(todo))], timeout=120)
        todo = sorted(pinned_by(result.stdout, version) - have)
        have.update(todo)
    return tuple(sorted(have))


def container_packages(container: Container, packages: tuple[str, ...]) -> dict[str, DpkgPackage]:
    result = container.exec(query_argv(packages), timeout=60)
    if not result.ok:
        raise ProvisionError(f"reading the packages of CT {container.target.ctid} (dpkg-query) failed: "
                             f"{(result.stderr.strip().splitlines() or [f'exit {result.exit_code}'])[-1]}")
    return parse_dpkg(result.stdout)


def plan(node: NodeInfo, target: Target, root: str) -> tuple[str, tuple[str, ...]]:
    """(the package version, the packages) the target's container gets. Refused (provision asks first,
    before anything changes): a node whose packages do not say one version of its loaded module, and a
    container whose `/` is this machine's (`root`), where apt would install onto this machine."""
    packages = node.packages
    problem = packages.problem(node.name, node.module)
    if problem or packages.version is None:
        raise ProvisionError(problem or f"node {node.name}: no NVIDIA driver packages")
    version, names = packages.version, packages.for_container()
    if root != "/":
        raise ProvisionError(
            f"node {node.name} has its NVIDIA driver from packages, so CT {target.ctid} needs "
            f"{' '.join(f'{p}={version}' for p in names)} from apt, but its / is this machine's (a directory "
            f"container of the simulated node): make it an LXC container (dflash-ops sim-remake {target.name} "
            "--backend lxc)")
    return version, names


def ensure(s: _Session, container: Container, node: NodeInfo, root: str) -> None:
    """The container's NVIDIA user-space packages at the node's version, held (nothing when they are)."""
    target = container.target
    version, packages = plan(node, target, root)
    pinned = [f"{p}={version}" for p in packages]
    s.show("the container's NVIDIA packages (read)", container.render(query_argv(packages)))
    have = container_packages(container, packages)
    at = [p for p in packages if p in have and have[p].installed and have[p].version == version]
    if len(at) == len(packages):
        loose = [p for p in packages if not have[p].held]
        if loose:
            s.change(f"hold {', '.join(loose)} at {version} in CT {target.ctid} (apt-mark hold: an upgrade in the "
                     "container cannot move them off the node's version)", container.render(["apt-mark", "hold", *loose]))
        return
    was = ", ".join(f"{p} {have[p].version}" for p in packages if p in have and have[p].installed) or "none"
    s.change(f"apt-get update in CT {target.ctid}", container.render(["apt-get", "update"]), count=False, timeout=600)
    look = container.render(available_argv(packages))
    show = container.render(["sh", "-c", _SHOW, "sh", *pinned])
    if s.dry_run:  # the lists are not updated: which dependencies they pin is known after the update
        s.show(f"whether the container's apt sources have {version} (read, after the update)", look)
        s.show(f"the packages they pin to {version} (read, after the update; each is installed at {version} too)", show)
        every = packages
    else:
        s.show(f"whether the container's apt sources have {version} (read)", look)
        _check_available(container, node, version, packages)
        s.show(f"the packages they pin to {version} (read)", show)
        every = with_pinned(container, packages, version)
    argv = ["env", "DEBIAN_FRONTEND=noninteractive", "apt-get", "install", "-y", "--no-install-recommends",
            "--allow-downgrades", "--allow-change-held-packages", *(f"{p}={version}" for p in every)]
    also = [p for p in every if p not in packages]
    pinning = f"; with {', '.join(also)}, which they pin to it" if also else ""
    s.change(f"install the NVIDIA user-space {version} from the container's apt sources: {', '.join(packages)} "
             f"(was: {was}){pinning}", container.render(argv), timeout=1800)
    s.change(f"hold {', '.join(packages)} at {version} (apt-mark hold)", container.render(["apt-mark", "hold", *packages]),
             count=False)
    if not s.dry_run:
        after = container_packages(container, packages)
        wrong = [f"{p} {after[p].version if p in after else 'none'}{'' if p in after and after[p].held else ' (not held)'}"
                 for p in packages if p not in after or after[p].version != version or not after[p].held]
        if wrong:
            raise ProvisionError(f"after apt-get install, CT {target.ctid} has {', '.join(wrong)}, not {version} held")


def _check_available(container: Container, node: NodeInfo, version: str, packages: tuple[str, ...]) -> None:
    result = container.exec(available_argv(packages), timeout=120)
    versions, sources = parse_available(result.stdout)
    missing = [p for p in packages if version not in [v for v, _ in versions.get(p, [])]]
    if not missing:
        return
    there = ", ".join(f"{p} {' '.join(v for v, _ in versions[p]) if versions.get(p) else 'none'}" for p in missing)
    raise ProvisionError(
        f"NVIDIA user-space {version} (node {node.name}'s driver packages, module {node.module}) is not in the apt "
        f"sources of CT {container.target.ctid} ({', '.join(sources) or 'none'}; they have {there}): add a source "
        f"that has {version} to the container (Debian's non-free, or NVIDIA's CUDA repository for Debian), then rerun")


__all__ = ["ensure", "parse_available", "plan"]
