"""Operator-side view of the stand-in's containers: where their python is, and creating them.

The stand-in (pct.py) is the node; this module only builds its `pct create` command and
reads the one thing an admin would know about a container it made: its python's path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from dflash_ops.simnode.pct import Node as SimNode

SIM_TEMPLATE = "local:vztmpl/dflash-sim-debian.tar.zst"  # recorded in the config; nothing is unpacked


def container_python(sim_root: str | Path, ctid: int | str) -> str:
    """The python a simulated container's create step provisions (not on pct's PATH)."""
    return str(Path(sim_root) / "ct" / str(ctid) / "usr" / "bin" / "python3")


def is_created(sim_root: str | Path, ctid: int | str) -> bool:
    return SimNode(Path(sim_root)).exists(str(ctid))


def create_argv(pct: Sequence[str], ctid: int | str, *, hostname: str | None = None,
                python: str | None = None, packages: Sequence[str] | None = None) -> list[str]:
    """`pct create CTID TEMPLATE --start 1 ...` for the stand-in.

    `python`: the base interpreter of the container's python3 (default: the stand-in's);
    `packages`: what its site-packages provide (default: the trainer's; () for none).
    """
    argv = [*pct, "create", str(ctid), SIM_TEMPLATE, "--start", "1"]
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
           packages: Sequence[str] | None = None, hostname: str | None = None) -> str:
    """Create (and start) a simulated container directly, as a test fixture's setup; returns its python."""
    import subprocess

    proc = subprocess.run(create_argv(stand_in_argv(sim_root), ctid, hostname=hostname, python=python,
                                      packages=packages), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"pct create {ctid} failed ({proc.returncode}): {proc.stderr.strip()}")
    return container_python(sim_root, ctid)
