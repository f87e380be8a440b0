"""A guarded patch becomes a new release of a target; `rollback` goes back to its parent.

    patch_target(container, diff_text)        check, import-check in the container, new release
    patch_target(..., check_only=True)        every check, nothing changed
    rollback(container)                       `current` -> the current release's parent

Round trips: read the current release's manifest (1), fetch the touched files in one tar (1),
copy the release to a scratch dir in the container and unpack the patched files over it (1),
import-check there with the release's python (1), remove the scratch dir (1); then the deploy
machinery's `release_store.py apply` builds the new release from a delta (only the patched files
travel), verifies every sha256 and swaps `current` atomically (1).
"""

from __future__ import annotations

import hashlib
import io
import json
import posixpath
import tarfile
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Callable

from dflash_ops import render
from dflash_ops.deploy.manifest import RELEASE_META, LocalRelease, release_tar
from dflash_ops.deploy.push import DEFAULT_KEEP
from dflash_ops.errors import DflashOpsError, HelperFailed
from dflash_ops.helpers import venvs
from dflash_ops.helpers.import_check import EXIT_IMPORT_FAILED
from dflash_ops.patching.diff import DiffError, parse_unified_diff
from dflash_ops.patching.guard import PatchReport, Problem, check_patch
from dflash_ops.runs import resume_run, stop_run
from dflash_ops.tarstream import build_tar

if TYPE_CHECKING:
    from dflash_ops.container import ContainerAPI

REQUIREMENTS = "trainer/requirements.txt"  # the venv's lock: a release built by deploy, never a patch


class PatchError(DflashOpsError):
    """The patch was refused (its report says why) or could not be applied."""

    def __init__(self, message: str, report: PatchReport | None = None, imports: list[dict] | None = None) -> None:
        super().__init__(message)
        self.report = report
        self.imports = imports or []


@dataclass
class PatchOutcome:
    report: PatchReport
    release_before: str
    release: str | None = None  # the new release (None with check_only)
    imports: list[dict] = field(default_factory=list)  # import_check results
    checked_only: bool = False


def current_release(container: ContainerAPI) -> dict:
    """The current release's .dflash-release.json (hash, parent, venv, files)."""
    path = posixpath.join(container.base_dir, "current", RELEASE_META)
    result = container.exec(["cat", "--", path])
    if not result.ok:
        name = container.target.name
        raise PatchError(f"nothing is deployed on {name} yet (no {path}): run `dflash-ops deploy {name}` first")
    try:
        meta = json.loads(result.stdout)
    except ValueError:
        raise PatchError(f"{path} on {container.target.name} is not valid JSON") from None
    if not isinstance(meta.get("files"), dict) or not meta.get("hash"):
        raise PatchError(f"{path} on {container.target.name} has no hash or files manifest")
    return meta


def fetch_release_files(container: ContainerAPI, meta: dict, rels: list[str], dest: Path) -> list[str]:
    """Copy the listed files of the current release into dest (one tar), verified by sha256.

    Files the release does not have are skipped (a patch may create them); returns the fetched ones.
    """
    present = sorted(rel for rel in set(rels) if rel in meta["files"])
    if not present:
        return []
    root = posixpath.join(container.base_dir, "releases", meta["hash"])
    result = container.exec(["tar", "-c", "-f", "-", "-C", root, "--", *present])
    if not result.ok:
        raise PatchError(f"cannot read {', '.join(present)} from release {meta['hash']}: {result.stderr.strip()}")
    with tarfile.open(fileobj=io.BytesIO(result.stdout_bytes), mode="r:") as tar:
        for member in tar:
            if member.name not in present or not member.isfile():
                raise PatchError(f"unexpected entry {member.name!r} in the release tar")
            extracted = tar.extractfile(member)
            assert extracted is not None  # a regular file (checked above)
            data = extracted.read()
            if hashlib.sha256(data).hexdigest() != meta["files"][member.name]:
                raise PatchError(f"{member.name} of release {meta['hash']} does not match its manifest")
            local = dest / member.name
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_bytes(data)
    return present


def release_python(container: ContainerAPI, meta: dict) -> str:
    return venvs.release_python(container.base_dir, meta) or container.target.python


def module_names(rels: list[str]) -> list[str]:
    """Dotted module names of the .py files among rels (packages by their __init__)."""
    names = []
    for rel in rels:
        path = PurePosixPath(rel)
        if path.suffix != ".py":
            continue
        parts = list(path.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if parts and all(p.isidentifier() for p in parts):
            names.append(".".join(parts))
    return names


def import_check_in_container(container: ContainerAPI, meta: dict, patched_root: Path, report: PatchReport,
                              static: bool = False) -> list[dict]:
    """Import the touched modules from a scratch copy of the release holding the patched files.

    static: compile them and resolve their imports without running any of their code."""
    changed = [rel for rel, text in report.new_contents.items() if text is not None]
    modules = module_names(changed)
    if not modules:
        return []
    scratch = posixpath.join(container.base_dir, "patches", f".check-{uuid.uuid4().hex[:12]}")
    release_root = posixpath.join(container.base_dir, "releases", meta["hash"])
    deleted = [posixpath.join(scratch, rel) for rel, text in report.new_contents.items() if text is None]
    try:
        steps = [["mkdir", "-p", "--", posixpath.dirname(scratch)], ["cp", "-a", "--", release_root + "/.", scratch],
                 ["tar", "-x", "-f", "-", "-C", scratch]]
        if deleted:
            steps.append(["rm", "-f", "--", *deleted])
        with build_tar([(rel, patched_root / rel) for rel in changed]) as tar:
            container.exec(render.script(*steps), stdin=tar, check=True)
        try:
            doc = container.helper_json("import-check", [*(["--static"] if static else []), scratch, *modules],
                                        python=release_python(container, meta), answers=(EXIT_IMPORT_FAILED,))
        except HelperFailed as e:
            raise PatchError(f"import check failed to run (exit {e.exit_code}): {e.stderr.strip()[-300:]}") from None
        return [dict(r, file=_relative(r.get("file"), scratch)) for r in doc["results"]]
    finally:
        container.exec(["rm", "-rf", "--", scratch])


def _relative(path: str | None, root: str) -> str | None:
    return path.removeprefix(root + "/") if path else path


def patched_release(meta: dict, patched_root: Path, report: PatchReport) -> tuple[LocalRelease, list[str]]:
    """The new release (manifest = current + patched files) and the files to send."""
    manifest = dict(meta["files"])
    files = {}
    for rel, text in report.new_contents.items():
        if text is None:
            manifest.pop(rel, None)
            continue
        path = patched_root / rel
        manifest[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
        files[rel] = path
    release = LocalRelease(root=patched_root, files=files, manifest=dict(sorted(manifest.items())),
                           venv=meta.get("venv"))
    return release, sorted(files)


def tree_clashes(release_files: dict, report: PatchReport) -> list[Problem]:
    """Created files that cannot exist beside the release's: a directory of the release, or
    a path under one of its files (only the touched files are fetched, so the guard can't see it)."""
    problems = []
    for rel, text in report.new_contents.items():
        if text is None or rel in release_files:
            continue
        parents = [str(p) for p in PurePosixPath(rel).parents][:-1]
        if any(parent in release_files for parent in parents) or any(f.startswith(rel + "/") for f in release_files):
            problems.append(Problem("file", rel, None, "clashes with the release tree (a file or directory there)"))
    return problems


def patch_target(container: ContainerAPI, diff_text: str, *, check_only: bool = False, allow_moves: bool = False,
                 restart_run: str | None = None, keep: int = DEFAULT_KEEP, say: Callable[[str], None] = lambda text: None) -> PatchOutcome:
    """Check a unified diff against the target's current release and, unless check_only,
    make it a new release whose parent is the current one. Raises PatchError when refused.

    restart_run: stop that run with a final checkpoint before `current` swaps, then resume
    it on the new release.
    """
    meta = current_release(container)
    try:
        touched = [p.path for p in parse_unified_diff(diff_text)]
    except DiffError as e:
        raise PatchError(f"not a usable unified diff: {e}") from None
    if REQUIREMENTS in touched:
        raise PatchError(f"{REQUIREMENTS} changes the venv, which a patch keeps: "
                         f"edit it locally and run `dflash-ops deploy {container.target.name}`")
    with tempfile.TemporaryDirectory(prefix="dflash-patch-") as tmp:
        root = Path(tmp)
        fetch_release_files(container, meta, touched, root)
        report = check_patch(root, diff_text, allow_moves=allow_moves)
        report.problems += tree_clashes(meta["files"], report)
        if not report.ok:
            raise PatchError(f"patch refused by the structural guard (release {meta['hash']})", report)
        report.write_to(root)
        verb = "resolving the imports of (no code runs)" if check_only else "importing"
        say(f"structural checks passed; {verb} {', '.join(module_names(report.touched)) or 'nothing'} "
            f"in {container.target.name}'s python")
        imports = import_check_in_container(container, meta, root, report, static=check_only)
        failed = [r for r in imports if not r["ok"]]
        if failed:
            raise PatchError(f"patch refused: {len(failed)} module(s) fail to import", report, imports)
        outcome = PatchOutcome(report=report, release_before=meta["hash"], imports=imports, checked_only=check_only)
        if check_only:
            return outcome
        release, to_send = patched_release(meta, root, report)
        if release.hash == meta["hash"]:
            raise PatchError("the patch changes nothing")
        if restart_run is not None:
            info = stop_run(container, restart_run)
            say(f"stopped {restart_run} at step {info.step} ({info.last_checkpoint})")
        try:
            with release_tar(release, to_send, (), meta["files"]) as tar:
                container.helper_json("release-store", ["apply", container.base_dir, release.hash,
                                                    "--parent", meta["hash"], "--keep", str(keep)], stdin=tar)
            outcome.release = release.hash
        finally:
            if restart_run is not None:  # on a failure `current` did not change: the run goes on where it was
                resume_run(container, restart_run)
                say(f"resumed {restart_run} on release {release.hash}" if outcome.release else
                    f"the new release failed; resumed {restart_run} on release {meta['hash']}")
    return outcome


def rollback(container: ContainerAPI, keep: int = DEFAULT_KEEP) -> tuple[str, str]:
    """Point `current` back at the current release's parent, atomically; returns (from, to)."""
    meta = current_release(container)
    parent = meta.get("parent")
    if not parent:
        raise PatchError(f"release {meta['hash']} on {container.target.name} has no parent to roll back to")
    container.helper_json("release-store", ["switch", container.base_dir, parent, "--keep", str(keep)])
    return meta["hash"], parent
