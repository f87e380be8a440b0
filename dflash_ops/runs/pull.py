"""Copy a checkpoint out of a container, verified file by file against its manifest."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from dflash_ops.hashing import sha256_file
from dflash_ops.runs.helper import call_json, check_run_id, run_dir
from dflash_ops.runs.info import RunError, RunNotFound

if TYPE_CHECKING:
    from dflash_ops.container import ContainerAPI

ATTEMPTS_PER_FILE = 2


def _matches(path: Path, expected: dict) -> bool:
    return path.is_file() and path.stat().st_size == expected["size"] and sha256_file(path) == expected["sha256"]


def _safe_relpath(rel: str) -> PurePosixPath:
    p = PurePosixPath(rel)
    if p.is_absolute() or ".." in p.parts or not p.parts:
        raise RunError(f"checkpoint manifest names an unsafe path {rel!r}")
    return p


def find_checkpoint(container: ContainerAPI, run_id: str, step: int | str = "latest") -> dict:
    """The helper's entry {"step", "path", "manifest"} for step N or the latest one."""
    checkpoints = call_json(container, ["checkpoints", run_dir(container, run_id)])
    if not checkpoints:
        raise RunNotFound(f"run {run_id} has no complete checkpoint")
    if step == "latest":
        return checkpoints[-1]
    for c in checkpoints:
        if c["step"] == int(step):
            return c
    have = ", ".join(str(c["step"]) for c in checkpoints)
    raise RunNotFound(f"run {run_id} has no checkpoint step_{step} (has {have})")


PARTIAL_MARK = ".dflash-pull.json"


def pull_checkpoint(container: ContainerAPI, run_id: str, step: int | str, dest: Path | str) -> Path:
    """Copy checkpoint step_N (or "latest") of a run into dest/step_N; returns that directory.

    dest/step_N is only ever absent, or a complete copy: files are fetched into
    dest/.step_N.partial (each to a hidden .part file, verified, renamed), manifest.json last,
    and the whole directory is renamed into place once every file matches. A failed or
    interrupted pull leaves dest/step_N as it was; the next pull resumes the partial copy
    (files already verified there are kept). A dest/step_N that is a complete copy of the
    same checkpoint is checked and repaired file by file; one holding anything else is refused.
    """
    dest = Path(dest)
    if dest.exists() and not dest.is_dir():
        raise RunError(f"pull destination {dest} is a file, not a directory: give a directory (the checkpoint "
                       "lands in DEST/step_N)")
    check_run_id(run_id)
    entry = find_checkpoint(container, run_id, step)
    manifest = entry["manifest"]
    if not manifest or not isinstance(manifest.get("files"), dict):
        raise RunError(f"{entry['path']} of run {run_id} has no readable manifest.json")
    remote_root = f"{run_dir(container, run_id)}/{entry['path']}"
    name = f"step_{int(entry['step'])}"
    target = dest / name
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunError(f"cannot create pull destination {dest}: {e.strerror or e}") from None
    if target.exists() or target.is_symlink():
        if _read_json(target / "manifest.json") != manifest:
            raise RunError(f"{target} already holds something else than {entry['path']} of run {run_id} "
                           "(its manifest.json differs or is missing): pull into another directory, or move it away")
        _copy_files(container, remote_root, manifest, target)  # the same checkpoint: repair in place
        return target
    partial = dest / f".{name}.partial"
    mark = {"run_id": run_id, "path": entry["path"], "manifest_sha256": _digest(manifest)}
    if partial.exists():
        if _read_json(partial / PARTIAL_MARK) != mark:
            raise RunError(f"{partial} is not an unfinished pull of {entry['path']} of run {run_id}: "
                           "move it away and pull again")
        _drop_unlisted(partial, manifest)
    else:
        partial.mkdir()
        (partial / PARTIAL_MARK).write_text(json.dumps(mark))
    _copy_files(container, remote_root, manifest, partial)
    (partial / PARTIAL_MARK).unlink()
    os.rename(partial, target)
    return target


TRACKER_DIRS = ("tensorboard", "mlruns")  # what run.trackers writes into a run directory (trainer/train/trackers.py)


def pull_tracker_files(container: ContainerAPI, run_id: str, dest: Path | str) -> list[Path]:
    """The run's TensorBoard event files and MLflow file store, each into DEST/<name> (fetch_path:
    verified, resumable, replacing only an earlier fetch); the ones the run does not have are
    skipped. Returns the directories fetched."""
    from dflash_ops.transfer import TransferRefused, fetch_path

    fetched = []
    for name in TRACKER_DIRS:
        try:
            fetch_path(container, f"{run_dir(container, run_id)}/{name}", Path(dest) / name)
        except TransferRefused as e:
            if "no such file or directory" in str(e):  # the run logged to no such tracker
                continue
            raise RunError(str(e)) from None
        fetched.append(Path(dest) / name)
    return fetched


def _copy_files(container: ContainerAPI, remote_root: str, manifest: dict, into: Path) -> None:
    """Every manifest file into `into` (kept when it already matches), then manifest.json."""
    for rel, expected in sorted(manifest["files"].items()):
        local = into.joinpath(*_safe_relpath(rel).parts)
        if _matches(local, expected):
            continue
        _fetch_verified(container, f"{remote_root}/{rel}", local, expected, remote_root, rel)
    manifest_part = into / ".manifest.json.part"
    container.pull(f"{remote_root}/manifest.json", manifest_part)
    if _read_json(manifest_part) != manifest:
        manifest_part.unlink(missing_ok=True)
        raise RunError(f"{remote_root}/manifest.json changed or was damaged while copying")
    os.replace(manifest_part, into / "manifest.json")


def _read_json(path: Path) -> Any:
    """The file's JSON document; None when it is missing, unreadable or not JSON."""
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None


def _digest(manifest: dict) -> str:
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()


def _drop_unlisted(partial: Path, manifest: dict) -> None:
    """An unfinished pull of this checkpoint keeps only files its manifest lists."""
    keep = {PurePosixPath(rel).as_posix() for rel in manifest["files"]} | {PARTIAL_MARK}
    for path in sorted(partial.rglob("*"), reverse=True):
        rel = path.relative_to(partial).as_posix()
        if path.is_dir() and not path.is_symlink():
            if not any(k.startswith(rel + "/") for k in keep):
                shutil.rmtree(path)
        elif rel not in keep:
            path.unlink()


def _fetch_verified(container: ContainerAPI, remote: str, local: Path, expected: dict, remote_root: str, rel: str) -> None:
    local.parent.mkdir(parents=True, exist_ok=True)
    part = local.with_name(f".{local.name}.part")
    for _ in range(ATTEMPTS_PER_FILE):
        part.unlink(missing_ok=True)
        container.pull(remote, part)
        if _matches(part, expected):
            os.replace(part, local)
            return
    part.unlink(missing_ok=True)
    remote_hash = call_json(container, ["hash-files", remote_root, rel])[rel]
    if remote_hash.get("sha256") != expected["sha256"]:
        raise RunError(f"{remote} does not match its manifest inside the container "
                       f"({remote_hash}): the checkpoint itself is damaged")
    raise RunError(f"{remote}: copy does not match sha256 {expected['sha256']} after {ATTEMPTS_PER_FILE} tries")
