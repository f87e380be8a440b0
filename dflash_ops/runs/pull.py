"""Copy a checkpoint out of a container, verified file by file against its manifest."""

from __future__ import annotations

import json
import os
from pathlib import Path, PurePosixPath

from dflash_ops.hashing import sha256_file
from dflash_ops.runs.helper import call_json, run_dir
from dflash_ops.runs.info import RunError, RunNotFound

ATTEMPTS_PER_FILE = 2


def _matches(path: Path, expected: dict) -> bool:
    return path.is_file() and path.stat().st_size == expected["size"] and sha256_file(path) == expected["sha256"]


def _safe_relpath(rel: str) -> PurePosixPath:
    p = PurePosixPath(rel)
    if p.is_absolute() or ".." in p.parts or not p.parts:
        raise RunError(f"checkpoint manifest names an unsafe path {rel!r}")
    return p


def find_checkpoint(container, run_id: str, step: int | str = "latest") -> dict:
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


def pull_checkpoint(container, run_id: str, step: int | str, dest: Path | str) -> Path:
    """Copy checkpoint step_N (or "latest") of a run into dest/step_N; returns that directory.

    Resumable: a file already there with the manifest's size and sha256 is skipped. Each file
    is fetched to a hidden .part file, verified, then renamed; manifest.json is written last,
    so a directory with a manifest is a complete copy.
    """
    entry = find_checkpoint(container, run_id, step)
    manifest = entry["manifest"]
    if not manifest or not isinstance(manifest.get("files"), dict):
        raise RunError(f"{entry['path']} of run {run_id} has no readable manifest.json")
    remote_root = f"{run_dir(container, run_id)}/{entry['path']}"
    target = Path(dest) / f"step_{entry['step']}"
    target.mkdir(parents=True, exist_ok=True)
    for rel, expected in sorted(manifest["files"].items()):
        local = target.joinpath(*_safe_relpath(rel).parts)
        if _matches(local, expected):
            continue
        _fetch_verified(container, f"{remote_root}/{rel}", local, expected, remote_root, rel)
    manifest_part = target / ".manifest.json.part"
    container.pull(f"{remote_root}/manifest.json", manifest_part)
    try:
        copied = json.loads(manifest_part.read_bytes())
    except ValueError:
        copied = None
    if copied != manifest:
        manifest_part.unlink(missing_ok=True)
        raise RunError(f"{remote_root}/manifest.json changed or was damaged while copying")
    os.replace(manifest_part, target / "manifest.json")
    return target


def _fetch_verified(container, remote: str, local: Path, expected: dict, remote_root: str, rel: str) -> None:
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
