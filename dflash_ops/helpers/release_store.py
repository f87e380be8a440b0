"""Release store inside a container (stdlib only; runs on the GPU host's python).

Subcommands (each prints one JSON object on stdout):

  query BASE --release HASH [--venv venvs/<lock>] [--helper helpers/<hash>/<file>]...
      What the container holds: the current release and its manifest, whether HASH is
      already complete, whether the venv is built, which helper paths exist. Read-only.

  apply BASE HASH [--parent HASH] [--keep N]     (stdin: tar stream)
      Extract the tar (changed files + .dflash-release.json, optionally .helpers/...) into
      releases/.tmp-HASH-PID, fill the unchanged files from the parent release (hardlink,
      else copy), verify every file's sha256 against the manifest, rename into
      releases/HASH, swap `current` atomically, prune to the newest N releases.

  switch BASE HASH [--keep N]
      Point `current` at an existing complete release, then prune.

A failure or a kill at any point leaves `current` and every complete release untouched. New
trees are built in scratch directories `.tmp-KIND-PID-STARTTICKS-RANDOM` marked inside with
their own name; a failure (a full disk included) removes its own scratch at once, and a later
apply removes one left by a kill only when its maker is gone and the mark proves it is ours.
Nothing else in BASE, releases/ or helpers/ is ever deleted: prune removes complete releases
only (their manifest names them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

if not __package__:  # run as a script: its directory becomes its package (as_package.py)
    import as_package

    as_package.enter(globals())
from . import nodefacts, runqueue, venvs

RELEASE_META = ".dflash-release.json"
RELEASE_DELTA = ".dflash-delta.json"
HELPER_STAGE = ".helpers"


sha256_file = nodefacts.sha256_file


def read_meta(release_dir: str) -> dict | None:
    try:
        with open(os.path.join(release_dir, RELEASE_META)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def current_hash(base: str) -> str | None:
    try:
        return os.path.basename(os.readlink(os.path.join(base, "current")))
    except OSError:
        return None


def is_complete(base: str, release: str) -> bool:
    meta = read_meta(os.path.join(base, "releases", release))
    return meta is not None and meta.get("hash") == release


def live_run_releases(base: str) -> set[str]:
    """The releases live runs use (nodefacts.run_is_live). The caller holds the start lock, so
    a run being started has its launch.json by the time it is looked at."""
    runs = os.path.join(base, "runs")
    found: set[str] = set()
    try:
        names = os.listdir(runs)
    except OSError:
        return found
    for name in names:
        run_dir = os.path.join(runs, name)
        try:
            with open(os.path.join(run_dir, "release")) as f:
                release = f.read().strip()
        except OSError:
            continue
        if release and nodefacts.run_is_live(run_dir, nodefacts.read_json(os.path.join(run_dir, "status.json"))):
            found.add(release)
    # a queued run starts on the release it was queued with (runqueue.py)
    found.update(os.path.basename(str(e.get("release_root"))) for e in runqueue.entries(base) if e.get("release_root"))
    return found


SCRATCH_KINDS = ("release", "current", "helper", "prune")
SCRATCH_MARK = nodefacts.SCRATCH_MARK
scratch_name = nodefacts.scratch_name
make_scratch_dir = nodefacts.make_scratch_dir


def owned_stale_scratch(parent: str, name: str) -> bool:
    """True only for an entry this tool made and whose maker is gone (nodefacts.stale_scratch_kind):
    a directory proves it with SCRATCH_MARK, a `current` symlink by pointing into releases/."""
    kind = nodefacts.stale_scratch_kind(parent, name, SCRATCH_KINDS)
    path = os.path.join(parent, name)
    if kind is None:
        return False
    if os.path.islink(path):
        return kind == "current" and os.readlink(path).startswith("releases/")
    return os.path.isdir(path)


def remove_scratch(path: str) -> None:
    if os.path.islink(path) or not os.path.isdir(path):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    else:
        shutil.rmtree(path, ignore_errors=True)


def clean_stale_tmp(parent: str) -> list[str]:
    """Remove scratch entries left by dead deploys; anything else in `parent` is never touched."""
    removed: list[str] = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        if owned_stale_scratch(parent, name):
            remove_scratch(os.path.join(parent, name))
            removed.append(name)
    return removed


def fsync_write_json(path: str, obj: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def swap_current(base: str, release: str) -> None:
    clean_stale_tmp(base)
    link_tmp = os.path.join(base, scratch_name("current"))
    os.symlink(os.path.join("releases", release), link_tmp)
    try:
        os.replace(link_tmp, os.path.join(base, "current"))
    except BaseException:
        remove_scratch(link_tmp)
        raise
    fsync_dir(base)


fsync_dir = nodefacts.fsync_dir


def prune(base: str, keep: int) -> list[str]:
    """Remove all but the newest `keep` releases, never `current` or a live run's release.

    Each one is renamed to `.tmp-prune-*` first, so a kill mid-removal leaves no half-deleted
    `releases/<hash>` that still holds its manifest (and would pass as complete).
    """
    runs_root = os.path.join(base, "runs")
    if not os.path.isdir(runs_root):
        return prune_unlocked(base, keep)
    lock = nodefacts.start_lock(runs_root)  # no start is halfway: its launch.json names its process
    try:
        return prune_unlocked(base, keep)
    finally:
        os.close(lock)


def prune_unlocked(base: str, keep: int) -> list[str]:
    releases_dir = os.path.join(base, "releases")
    protected = live_run_releases(base)
    cur = current_hash(base)
    if cur:
        protected.add(cur)
    complete = []
    for name in os.listdir(releases_dir):
        if name.startswith(".") or not is_complete(base, name):
            continue  # only complete releases are ours to prune; anything else stays
        created = (read_meta(os.path.join(releases_dir, name)) or {}).get("created")
        complete.append((created if isinstance(created, (int, float)) else 0.0, name))
    complete.sort(reverse=True)
    removed = []
    for _created, name in complete[keep:]:
        if name not in protected and remove_release(base, name):
            removed.append(name)
    return removed


def extract(stream: nodefacts.BinaryIO, dest: str) -> list[str]:
    import tarfile  # here, not at the top (with hashlib): `query`, every deploy's first call, uses neither

    names = []
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        for member in tar:
            if not (member.isfile() or member.isdir()):
                raise SystemExit(f"release tar: refusing non-regular entry {member.name!r}")
            parts = member.name.split("/")
            if member.name.startswith("/") or ".." in parts or SCRATCH_MARK in parts:
                raise SystemExit(f"release tar: refusing path {member.name!r}")
            if hasattr(tarfile, "data_filter"):
                tar.extract(member, dest, filter="data")
            else:
                tar.extract(member, dest)
            if member.isfile():
                names.append(member.name)
    return names


def link_or_copy(src: str, dst: str) -> None:
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def install_staged_helpers(base: str, stage: str) -> list[str]:
    """Move `.helpers/<hash>/<file>` from the extracted tree to BASE/helpers, atomically each."""
    installed: list[str] = []
    if not os.path.isdir(stage):
        return installed
    helpers = os.path.join(base, "helpers")
    os.makedirs(helpers, exist_ok=True)
    clean_stale_tmp(helpers)
    for digest in os.listdir(stage):
        final = os.path.join(helpers, digest)
        if os.path.isdir(final):
            continue
        tmp = make_scratch_dir(helpers, "helper")
        try:
            shutil.copytree(os.path.join(stage, digest), tmp, dirs_exist_ok=True)
            os.unlink(os.path.join(tmp, SCRATCH_MARK))
            os.rename(tmp, final)
        except FileExistsError:  # a concurrent deploy installed it first
            shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not os.path.isdir(final):
                raise
        installed.append(digest)
    shutil.rmtree(stage)
    return installed


def build_release(base: str, release: str, parent: str | None, stream: nodefacts.BinaryIO) -> dict:
    releases_dir = os.path.join(base, "releases")
    os.makedirs(releases_dir, exist_ok=True)
    cleaned = clean_stale_tmp(releases_dir)
    tmp = make_scratch_dir(releases_dir, "release")
    try:
        return fill_release(base, release, parent, stream, releases_dir, tmp, cleaned)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a full disk or a bad tree: leave nothing behind
        raise


def fill_release(base: str, release: str, parent: str | None, stream: nodefacts.BinaryIO, releases_dir: str, tmp: str,
                 cleaned: list[str]) -> dict:
    sent = extract(stream, tmp)
    helpers = install_staged_helpers(base, os.path.join(tmp, HELPER_STAGE))
    result = {"received": len(sent), "cleaned": cleaned, "helpers_installed": helpers}
    if is_complete(base, release):
        shutil.rmtree(tmp)
        return dict(result, built=False, linked=0)
    meta = compose_meta(tmp, releases_dir, parent)
    if meta is None or meta.get("hash") != release:
        raise SystemExit(f"release tar: missing or wrong {RELEASE_META} for {release}")
    files = meta["files"]
    parent_dir = os.path.join(releases_dir, parent) if parent else None
    linked = 0
    for rel in files:
        dst = os.path.join(tmp, rel)
        if os.path.exists(dst):
            continue
        if parent_dir is None:
            raise SystemExit(f"release {release}: {rel} was not sent and there is no parent")
        link_or_copy(os.path.join(parent_dir, rel), dst)
        linked += 1
    verify_tree(tmp, files)
    meta["created"] = time.time()
    meta["parent"] = parent
    fsync_write_json(os.path.join(tmp, RELEASE_META), meta)
    os.unlink(os.path.join(tmp, SCRATCH_MARK))
    os.rename(tmp, os.path.join(releases_dir, release))
    fsync_dir(releases_dir)
    return dict(result, built=True, linked=linked)


def release_hash(files: dict, venv: str | None) -> str:
    """Must equal dflash_ops.deploy.manifest.release_hash (same JSON, same digest)."""
    import hashlib

    blob = json.dumps({"files": files, "venv": venv}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def compose_meta(tmp: str, releases_dir: str, parent: str | None) -> dict | None:
    """The new release's metadata: sent whole, or as a delta against the parent's manifest.

    A delta (`{"hash", "venv", "changed": {rel: sha}, "removed": [rel]}`) keeps a one-file
    redeploy of a large tree small; the composed manifest must hash to the promised hash.
    """
    delta_path = os.path.join(tmp, RELEASE_DELTA)
    if not os.path.exists(delta_path):
        return read_meta(tmp)
    with open(delta_path) as f:
        delta = json.load(f)
    os.unlink(delta_path)
    parent_meta = read_meta(os.path.join(releases_dir, parent)) if parent else None
    if parent_meta is None:
        raise SystemExit(f"release delta needs parent release {parent}, which is missing")
    files = {rel: digest for rel, digest in parent_meta["files"].items() if rel not in set(delta["removed"])}
    files.update(delta["changed"])
    files = dict(sorted(files.items()))
    if release_hash(files, delta["venv"]) != delta["hash"]:
        raise SystemExit("release delta does not compose to the promised hash")
    return {"version": 1, "hash": delta["hash"], "venv": delta["venv"], "files": files}


def verify_tree(root: str, files: dict) -> None:
    present = set()
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            rel = os.path.relpath(os.path.join(dirpath, name), root)
            if rel not in (RELEASE_META, SCRATCH_MARK):
                present.add(rel)
    extra = sorted(present - set(files))
    missing = sorted(set(files) - present)
    if extra or missing:
        raise SystemExit(f"release tree mismatch: missing {missing[:5]} extra {extra[:5]}")
    bad = [rel for rel, digest in files.items() if sha256_file(os.path.join(root, rel)) != digest]
    if bad:
        raise SystemExit(f"release tree: sha256 mismatch for {bad[:5]}")


def cmd_query(args: argparse.Namespace) -> dict:
    base = args.base
    cur = current_hash(base)
    meta = read_meta(os.path.join(base, "releases", cur)) if cur else None
    venv_ready = None
    if args.venv:
        venv_ready = venvs.is_complete(base, args.venv)
    return {
        "current": cur if meta else None,
        "current_files": meta.get("files") if meta else None,
        "current_venv": venvs.release_venv(meta),
        "has_release": is_complete(base, args.release),
        "venv_ready": venv_ready,
        "helpers_present": [p for p in args.helper if os.path.exists(os.path.join(base, p))],
    }


def cmd_apply(args: argparse.Namespace) -> dict:
    os.makedirs(args.base, exist_ok=True)
    result = build_release(args.base, args.release, args.parent, sys.stdin.buffer)
    if not is_complete(args.base, args.release):
        raise SystemExit(f"release {args.release} is not complete after apply")
    try:
        if args.fail_before_swap:
            raise SystemExit("injected failure before swapping current")
        swap_current(args.base, args.release)
    except BaseException:
        if result["built"] and current_hash(args.base) != args.release:
            remove_release(args.base, args.release)  # ours, never current: take it back
        raise
    result["pruned"] = prune(args.base, args.keep)
    result["current"] = args.release
    return result


def remove_release(base: str, release: str) -> bool:
    """Rename a release aside (marked as scratch) and delete it: never a half-deleted tree
    that still holds its manifest. False when it is left alone: a concurrent prune took it,
    or it cannot be marked."""
    releases_dir = os.path.join(base, "releases")
    doomed = os.path.join(releases_dir, scratch_name("prune"))
    try:
        with open(os.path.join(releases_dir, release, SCRATCH_MARK), "w") as f:
            f.write(os.path.basename(doomed))
        os.rename(os.path.join(releases_dir, release), doomed)
    except OSError:
        return False
    shutil.rmtree(doomed, ignore_errors=True)
    return True


def cmd_switch(args: argparse.Namespace) -> dict:
    if not is_complete(args.base, args.release):
        raise SystemExit(f"release {args.release} is not a complete release in {args.base}")
    swap_current(args.base, args.release)
    return {"current": args.release, "pruned": prune(args.base, args.keep)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="release_store.py")
    sub = parser.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("query")
    q.add_argument("base")
    q.add_argument("--release", required=True)
    q.add_argument("--venv")
    q.add_argument("--helper", action="append", default=[])
    a = sub.add_parser("apply")
    a.add_argument("base")
    a.add_argument("release")
    a.add_argument("--parent")
    a.add_argument("--keep", type=int, default=5)
    a.add_argument("--fail-before-swap", action="store_true", help="for tests: die after building")
    s = sub.add_parser("switch")
    s.add_argument("base")
    s.add_argument("release")
    s.add_argument("--keep", type=int, default=5)
    args = parser.parse_args(argv)
    handler = {"query": cmd_query, "apply": cmd_apply, "switch": cmd_switch}
    try:
        print(json.dumps(handler[args.cmd](args)))
    except OSError as e:  # ENOSPC, EROFS, EACCES...: one line; what this run wrote is removed
        where = f": {e.filename}" if e.filename else ""
        sys.stderr.write(f"release.py {args.cmd}: {e.strerror or e}{where}; the previous release still serves\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
