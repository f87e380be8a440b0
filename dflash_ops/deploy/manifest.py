"""Local side of a code release: which files, their sha256 manifest, the release hash, the tar.

A release is the trainer package tree (`trainer/...`) plus any extra paths, keyed by their
path relative to the project root. Its hash covers the manifest and the venv it runs with, so
the same hash always means the same code and the same environment.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterable

from dflash_ops.errors import DflashOpsError
from dflash_ops.hashing import sha256_file
from dflash_ops.tarstream import build_tar

RELEASE_META = ".dflash-release.json"
RELEASE_DELTA = ".dflash-delta.json"
HELPER_STAGE = ".helpers"
_SKIP_DIRS = {"__pycache__", ".git", ".pytest_cache", ".mypy_cache"}
_SKIP_SUFFIXES = (".pyc", ".pyo")


def trainer_dir() -> Path:
    """The `trainer` package directory, wherever it is imported from."""
    import trainer

    return Path(trainer.__path__[0]).resolve()


@dataclass
class LocalRelease:
    """What one deploy would put into `releases/<hash>/`."""

    root: Path
    files: dict[str, Path]
    manifest: dict[str, str]
    venv: str | None
    hash: str = field(init=False)

    def __post_init__(self) -> None:
        blob = json.dumps({"files": self.manifest, "venv": self.venv}, sort_keys=True).encode()
        self.hash = hashlib.sha256(blob).hexdigest()[:16]

    def size(self, rels: Iterable[str]) -> int:
        return sum(self.files[r].stat().st_size for r in rels)

    def meta(self) -> dict:
        return {"version": 1, "hash": self.hash, "created": None, "parent": None,
                "venv": self.venv, "files": self.manifest}


class ReleasePathError(DflashOpsError):
    """A path to ship is something a release cannot hold (a FIFO, a device, an outside symlink...)."""


def _walk(top: Path) -> Iterable[Path]:
    """Regular files under `top` (or `top` itself). Refused, never skipped or followed out:
    FIFOs, sockets and devices (reading one hangs or never ends), symlinks that leave `top`
    or dangle, and symlinks to directories (os.walk would silently drop them)."""
    if top.is_file():
        yield _regular(top, top.parent)
        return
    if not top.is_dir():
        raise ReleasePathError(f"{top} is not a regular file or a directory; a release holds files only")
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames:
            if os.path.islink(os.path.join(dirpath, name)):
                raise ReleasePathError(f"{Path(dirpath, name)} is a symlink to a directory: ship the directory "
                                       "itself, or list it with its own --extra")
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if not name.endswith(_SKIP_SUFFIXES):
                yield _regular(Path(dirpath) / name, top)


def _regular(path: Path, top: Path) -> Path:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        target = path.resolve()
        if not target.is_relative_to(top.resolve()):
            raise ReleasePathError(f"{path} is a symlink that points outside {top} (to {target}); refusing to "
                                   "ship it (copy the file into the tree if it belongs in the release)")
        if not target.is_file():
            raise ReleasePathError(f"{path} is a symlink to {target}, which is not a regular file")
        st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise ReleasePathError(f"{path} is not a regular file (a FIFO, socket or device); a release holds "
                               "regular files only: remove it or ship another path")
    return path


def collect(extra_paths: Iterable[str | Path] = (), *, source: Path | None = None,
            venv: str | None = None) -> LocalRelease:
    """Hash the trainer tree (or `source`, a package directory) plus `extra_paths`.

    Paths are keyed relative to the package's parent directory (the project root); an extra
    path outside it is keyed by its own name.
    """
    package = (source or trainer_dir()).resolve()
    root = package.parent
    files: dict[str, Path] = {}
    for top in [package, *(Path(p).resolve() for p in extra_paths)]:
        if not top.exists():
            raise ReleasePathError(f"release path does not exist: {top}")
        anchor = root if top.is_relative_to(root) else top.parent
        for path in _walk(top):
            files[path.relative_to(anchor).as_posix()] = path
    manifest = {rel: sha256_file(path) for rel, path in sorted(files.items())}
    return LocalRelease(root=root, files=dict(sorted(files.items())), manifest=manifest, venv=venv)


def changed_files(release: LocalRelease, remote_manifest: dict[str, str] | None) -> list[str]:
    """Relpaths whose content the container's current release does not already hold."""
    remote = remote_manifest or {}
    return [rel for rel, digest in release.manifest.items() if remote.get(rel) != digest]


def release_tar(release: LocalRelease, rels: Iterable[str], helpers: Iterable[tuple[str, Path]] = (),
                parent_manifest: dict[str, str] | None = None) -> IO[bytes]:
    """The apply stream: the given files, helpers staged under `.helpers/`, and the manifest:
    whole, or as a delta against `parent_manifest` (the release the container builds on)."""
    rels = list(rels)
    if parent_manifest is None:
        meta = (RELEASE_META, json.dumps(release.meta(), sort_keys=True).encode())
    else:
        delta = {"hash": release.hash, "venv": release.venv,
                 "changed": {rel: release.manifest[rel] for rel in rels},
                 "removed": sorted(set(parent_manifest) - set(release.manifest))}
        meta = (RELEASE_DELTA, json.dumps(delta, sort_keys=True).encode())
    entries = [(rel, release.files[rel]) for rel in rels]
    entries += [(f"{HELPER_STAGE}/{rel.split('/', 1)[1]}", path) for rel, path in helpers]
    return build_tar(entries, extra=[meta])
