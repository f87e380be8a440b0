"""Operator-side view of the stand-in's containers: their backend, where their python is, creating them.

The stand-in (pct.py) is the node; this module only builds its `pct create` command and reads
what an admin would know about a container it made: what runs it (a real LXC container or a
directory with its own python), its python's path, where a path inside it is on this machine.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from dflash_ops.simnode import pct as sim_pct
from dflash_ops.simnode import rootfs
from dflash_ops.simnode.pct import Node as SimNode

BACKENDS = ("lxc", "directory")
CREATED_ROOTS: set[str] = set()  # state roots create() made containers in (test fixtures stop them at the end)
BACKEND_ENV = "DFLASH_OPS_SIM_BACKEND"

SIM_TEMPLATE = "local:vztmpl/dflash-sim-debian.tar.zst"  # recorded in the config; nothing is unpacked


def pick_backend(choice: str = "auto") -> str:
    """The backend of a new container: `choice`, or for "auto" $DFLASH_OPS_SIM_BACKEND, else lxc
    where this machine can run it (rootfs.unavailable_reason), else directory."""
    if choice == "auto":
        choice = os.environ.get(BACKEND_ENV) or "auto"
    if choice in BACKENDS:
        return choice
    return "lxc" if rootfs.unavailable_reason() is None else "directory"


def backend_reason(sim_root: str | Path, ctid: int | str, choice: str = "auto") -> str:
    """Why a container runs (or will run) on its backend, in a few words: what forced it (the
    inventory's sim_backend, $DFLASH_OPS_SIM_BACKEND), its creation, or what this machine lacks."""
    recorded = recorded_backend(sim_root, ctid)
    if recorded is not None:
        lxc_now = rootfs.unavailable_reason() is None
        return f"created as one{'; LXC is available here' if recorded == 'directory' and lxc_now else ''}"
    if choice in BACKENDS:
        return f"the inventory's sim_backend: {choice}"
    if os.environ.get(BACKEND_ENV) in BACKENDS:
        return f"${BACKEND_ENV}={os.environ[BACKEND_ENV]}"
    missing = rootfs.unavailable_reason()
    return "LXC is available here" if missing is None else f"no LXC here: {missing}"


def recorded_backend(sim_root: str | Path, ctid: int | str) -> str | None:
    """The backend a created container runs on (None: not created)."""
    node = SimNode(Path(sim_root))
    return node.backend(str(ctid)) if node.exists(str(ctid)) else None


def backend_of(sim_root: str | Path, ctid: int | str) -> str:
    return recorded_backend(sim_root, ctid) or pick_backend()


def target_defaults(sim_root: str | Path, ctid: int | str, backend: str) -> dict[str, str]:
    """A target's base_dir and python in a container of `backend`: in an LXC container Debian's
    own python3 (on pct's PATH) and /opt/dflash; in a directory container the same paths under
    its directory (its python is not on pct's PATH, so the target names it)."""
    if backend == "lxc":
        return {"base_dir": "/opt/dflash", "python": "python3"}
    ct = Path(sim_root) / "ct" / str(ctid)
    return {"base_dir": str(ct / "opt" / "dflash"), "python": str(ct / "usr" / "bin" / "python3")}


def container_python(sim_root: str | Path, ctid: int | str) -> str:
    """The python a simulated container's create step provisions (a directory container's is not on pct's PATH)."""
    return target_defaults(sim_root, ctid, backend_of(sim_root, ctid))["python"]


def host_path(sim_root: str | Path, ctid: int | str, path: str | Path) -> Path:
    """Where a file the container wrote at `path` (absolute, inside it) is on this machine.

    A directory container's paths are this machine's; an LXC container's files written since its
    creation are in its overlay's upper directory (files of the shared rootfs are not)."""
    if backend_of(sim_root, ctid) != "lxc":
        return Path(path)
    return SimNode(Path(sim_root)).upper_dir(str(ctid)) / str(path).lstrip("/")


def is_created(sim_root: str | Path, ctid: int | str) -> bool:
    return SimNode(Path(sim_root)).exists(str(ctid))


def is_running(sim_root: str | Path, ctid: int | str) -> bool:
    return SimNode(Path(sim_root)).running(str(ctid))


def mend_packages(sim_root: str | Path, ctid: int | str) -> list[str]:
    """Point a created directory container's trainer packages at this interpreter's where the
    site-packages they came from is gone (the venv that created the container was removed), as an
    admin would mend the node; a line per change. The container's python links the packages: its
    dangling links are made again from this interpreter's distributions. (An LXC container's
    package binds are checked by the stand-in at every start: pct.py _packages_to_bind.)"""
    node, vmid = SimNode(Path(sim_root)), str(ctid)
    if node.backend(vmid) == "lxc":
        return []
    sites = sorted((node.ct_root(vmid) / "usr" / "lib").glob("python3.*/site-packages"))
    dangling = [link for site in sites for link in site.iterdir() if link.is_symlink() and not link.exists()]
    if not dangling:
        return []
    here = dict(sim_pct._package_files(list(sim_pct.DEFAULT_SIM_PACKAGES)))
    mended = [link for link in dangling if link.name in here]
    for link in mended:
        fresh = link.with_name(f".{link.name}.mend")
        fresh.unlink(missing_ok=True)
        fresh.symlink_to(here[link.name])
        os.replace(fresh, link)
    return [f"CT {ctid}: {len(mended)} package links pointed into a site-packages that is gone; "
            "they point into this interpreter's now"] if mended else []


def create_argv(pct: Sequence[str], ctid: int | str, *, hostname: str | None = None,
                python: str | None = None, packages: Sequence[str] | None = None,
                backend: str | None = None, network: bool = False, memory_mb: int | None = None,
                binds: Sequence[str] = ()) -> list[str]:
    """`pct create CTID TEMPLATE --start 1 ...` for the stand-in.

    `backend`: lxc or directory (default: pick_backend()); `network`: a `--net0` (an LXC
    container then shares the node's network; without one it has only loopback, as a CT without
    net0 on a node); `memory_mb`: `--memory`, the container's memory limit; `binds`: node
    directories an LXC container sees at the same path (`--mpN DIR,mp=DIR`, an admin's bind mount
    points; the test tiers bind each container's test directory so tests read what it wrote).
    `python` (directory containers): the base interpreter of the container's python3 (default:
    the stand-in's); `packages`: what its python sees besides the stdlib (default: the trainer's;
    () for none): an LXC container gets exactly their files bound read-only, nothing else of this
    interpreter's.
    """
    backend = backend or pick_backend()
    argv = [*pct, "create", str(ctid), SIM_TEMPLATE, "--start", "1", "--sim-backend", backend]
    if backend == "lxc":
        argv += ["--sim-rootfs", str(rootfs.path())]
    if network:
        argv += ["--net0", "name=eth0,bridge=vmbr0,ip=dhcp"]
    if memory_mb is not None:
        argv += ["--memory", str(memory_mb)]
    if backend == "lxc":
        for index, directory in enumerate(binds, start=1):
            argv += [f"--mp{index}", f"{directory},mp={directory}"]
    if hostname:
        argv += ["--hostname", hostname]
    if python:
        argv += ["--sim-python", python]
    if packages is not None:
        argv += ["--sim-packages", ",".join(packages)]
    return argv


PCT_SCRIPT = Path(__file__).resolve().parent / "pct.py"


def stand_in_argv(sim_root: str | Path) -> list[str]:
    """The stand-in run by this interpreter, as `pct: simulated` nodes and the sshd tier run it.

    `-I -S`: it is stdlib only, so it skips site-packages and their .pth hooks (an editable
    install's finder alone doubles an interpreter's start; `pct create` loads site itself);
    pct_main.py imports pct.py, so its compiled code is cached instead of compiled each time.
    """
    import sys

    return [sys.executable, "-I", "-S", str(PCT_SCRIPT.with_name("pct_main.py")), "--state-root", str(sim_root)]


def create(sim_root: str | Path, ctid: int | str, *, python: str | None = None,
           packages: Sequence[str] | None = None, hostname: str | None = None, backend: str | None = None,
           network: bool = False, memory_mb: int | None = None, binds: Sequence[str] = (),
           prefix: Sequence[str] = ()) -> str:
    """Create (and start) a simulated container directly, as a test fixture's setup; returns its python.

    `prefix`: runs the stand-in under it (`ip netns exec NS`: the node of the many-node tier)."""
    import subprocess

    argv = create_argv(stand_in_argv(sim_root), ctid, hostname=hostname, python=python, packages=packages,
                       backend=backend, network=network, memory_mb=memory_mb, binds=binds)
    for directory in binds:
        Path(directory).mkdir(parents=True, exist_ok=True)
    CREATED_ROOTS.add(str(sim_root))
    proc = subprocess.run([*prefix, *argv], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"pct create {ctid} failed ({proc.returncode}): {proc.stderr.strip()}")
    return container_python(sim_root, ctid)


def stop_all(sim_root: str | Path, prefix: Sequence[str] = ()) -> None:
    """Stop every running LXC container of a state root (lxc-stop -k; `prefix`: `ip netns exec NS`
    for a node in a network namespace, where its containers' command sockets are)."""
    import shutil
    import subprocess

    stop = shutil.which("lxc-stop")
    lxcpath = SimNode(Path(sim_root)).lxc_path()
    if stop is None or not lxcpath.is_dir():
        return
    for config in sorted(lxcpath.glob("*/config")):
        subprocess.run([*prefix, stop, "-P", str(lxcpath), "-n", config.parent.name, "-k"], capture_output=True)


def remake(sim_root: str | Path, pct: Sequence[str], ctid: int | str, backend: str, *, hostname: str,
           listed: bool) -> list[str]:
    """Make a simulated container again on `backend` (a container keeps the backend it was created
    with): `pct stop` when it runs, `pct destroy`, then, for a container the node lists under
    sim_containers, `pct create` as its first use would. Everything in it is gone (releases, runs).
    A container provision made is left destroyed: provision makes it again, on the new backend when
    `backend` is what a new container gets. Returns what was done, a line each."""
    import subprocess

    if backend not in BACKENDS:
        raise sim_pct.PctError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "lxc" and rootfs.unavailable_reason() is not None:
        raise sim_pct.PctError(f"no LXC here: {rootfs.unavailable_reason()}")
    done: list[str] = []

    def pct_run(*words: str) -> None:
        proc = subprocess.run([*pct, *words], capture_output=True, text=True)
        if proc.returncode != 0:
            said = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
            raise sim_pct.PctError(f"pct {' '.join(words)}: {said}")
        done.append(f"pct {' '.join(words[:2])}")

    if is_created(sim_root, ctid):
        if is_running(sim_root, ctid):
            pct_run("stop", str(ctid))
        pct_run("destroy", str(ctid))
    if listed:
        argv = create_argv(pct, ctid, hostname=hostname, backend=backend, network=True)
        proc = subprocess.run(argv, capture_output=True, text=True)
        if proc.returncode != 0 or not is_created(sim_root, ctid):
            raise sim_pct.PctError(f"pct create {ctid}: {proc.stderr.strip()[-300:]}")
        done.append(f"pct create {ctid} (backend {backend}, running)")
    return done
