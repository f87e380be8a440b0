"""A target's venvs on disk, named once for both sides (stdlib only, python3.8+; shipped beside
the helpers that import it, and imported by the operator's side as dflash_ops.helpers.venvs).

    BASE/venvs/<lock-hash>/                 one venv per requirements lock (VenvSpec.lock_hash)
    BASE/venvs/<lock-hash>/.dflash-venv.json  written last, before the rename into place: the venv
                                            is complete exactly when it holds this file
    BASE/releases/<hash>/.dflash-release.json  "venv": "venvs/<lock-hash>" (relative to BASE),
                                            or null / absent: the release runs with the target's python

The venv helper (venv.py) writes both the venv and its meta; the release store (`query`), `run
start`, doctor, deploy, the playbook and patch rollouts read them through these functions, so the
layout has one definition. Every release deployed so far wrote exactly this shape (a string or
null under "venv"); anything else there reads as "no venv", as before.
"""

from __future__ import annotations

import os
import posixpath
import time

VENVS_DIR = "venvs"
META = ".dflash-venv.json"
META_VERSION = 1
# what makes a venv with pip on a Debian container without it (no ensurepip): the fix every side names
NO_PIP_FIX_ARGV = ["apt-get", "install", "-y", "python3-venv"]


def rel_path(lock: str) -> str:
    """The venv of a requirements lock, relative to BASE (what a release's manifest names)."""
    return posixpath.join(VENVS_DIR, lock)


def python(base: str, rel: str) -> str:
    """The venv's interpreter (the only thing ops runs from a venv: `<venv>/bin/python -m ...`)."""
    return posixpath.join(base, rel, "bin", "python")


def meta_path(base: str, rel: str) -> str:
    return posixpath.join(base, rel, META)


def is_complete(base: str, rel: str) -> bool:
    """Whether the venv at BASE/rel was built to the end (its meta is the last thing written)."""
    return os.path.exists(meta_path(base, rel))


def make_meta(lock: str, *, pip: bool, uv: bool, requirements: list[str], created: float | None = None) -> dict:
    """The .dflash-venv.json document of a finished build."""
    return {"version": META_VERSION, "lock": lock, "created": time.time() if created is None else created,
            "pip": pip, "uv": uv, "requirements": requirements}


def release_venv(release_meta: dict | None) -> str | None:
    """The venv a release runs with (its .dflash-release.json "venv"), None for the target's python."""
    venv = (release_meta or {}).get("venv")
    return venv if isinstance(venv, str) and venv else None


def release_python(base: str, release_meta: dict | None) -> str | None:
    """The interpreter a release runs with, None when it names no venv (the target's python)."""
    venv = release_venv(release_meta)
    return None if venv is None else python(base, venv)
