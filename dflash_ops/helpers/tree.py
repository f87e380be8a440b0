"""Files and trees in and out of a container (stdlib only; runs on the GPU host's python).

  tree.py plan BASE DEST            (stdin: JSON {"kind", "files": {rel: {size, sha256}}, "force"})
      What a push to DEST still needs: per file, the offset to send from (0: all of it;
      a resumed file: the bytes already staged). Refuses (exit 3) to replace a DEST that no
      push wrote, or to drop files in it that no push wrote, unless "force".
  tree.py receive BASE DEST         (stdin: the same JSON line, then frames, then {"end": true})
      Each frame is a JSON line {"rel", "offset", "length"} and `length` raw bytes, appended
      to the staged `.part` at `offset`; a complete file is checked against its sha256 and
      renamed. After the end frame the new tree is completed with hard links to DEST's
      unchanged files, verified whole, and swapped in with one rename (RENAME_EXCHANGE for a
      tree), so DEST holds the old complete tree or the new one, never a mix. A stream that
      ends early (dropped connection) keeps what arrived for the next push to resume (exit 4).
  tree.py manifest SRC              {"kind", "files": {rel: {size, sha256}}} of a file or tree
  tree.py read SRC OFFSET LENGTH    raw bytes of the file SRC (for fetch, one chunk at a time)
  tree.py read-files SRC REL...     small whole files of the tree SRC in one go: per file a JSON
                                    line {"rel", "size"} and its bytes

Staging lives beside DEST as `.NAME.dflash-push/` (one push at a time: flock); what each push
wrote is recorded in BASE/pushed/<hash of DEST>.json, with the files' mtimes so an unchanged
file is not hashed again. Empty directories and symlinks are not carried.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import fcntl
import hashlib
import json
import os
import shutil
import stat
import sys
import time

if __package__:  # imported by the operator's side, as dflash_ops.helpers.tree
    from . import nodefacts
else:  # run as a script: nodefacts.py lies beside it (dflash_ops/helpers/__init__.py)
    import nodefacts  # type: ignore[no-redef]

CHUNK = 1 << 20
FILE_REL = "."  # the one entry of a single-file push
EXIT_REFUSED = 3
EXIT_INCOMPLETE = 4
LOCK_WAIT_S = 60
STAGE_SUFFIX = ".dflash-push"


class Refused(Exception):
    pass


print_json = nodefacts.print_json
read_json = nodefacts.read_json
fsync_dir = nodefacts.fsync_dir
sha256_file = nodefacts.sha256_file


def check_dest(dest: str) -> str:
    """An absolute, normalised path that is not / and has no '..' (the caller validated it too)."""
    if not dest.startswith("/") or dest != os.path.normpath(dest) or dest == "/" or "\0" in dest:
        raise Refused("destination must be a normalised absolute path other than /: %r" % dest)
    if ".." in dest.split("/"):
        raise Refused("destination may not contain '..': %r" % dest)
    return dest


def check_rel(rel: str) -> str:
    if rel == FILE_REL:
        return rel
    parts = rel.split("/")
    if rel.startswith("/") or not rel or any(p in ("", ".", "..") for p in parts):
        raise Refused("unsafe relative path %r" % rel)
    return rel


def stage_dir(dest: str) -> str:
    parent, name = os.path.split(dest)
    return os.path.join(parent, "." + name + STAGE_SUFFIX)


def staged_path(stage: str, rel: str) -> str:
    return os.path.join(stage, "data" if rel == FILE_REL else os.path.join("tree", rel))


def dest_path(dest: str, rel: str) -> str:
    return dest if rel == FILE_REL else os.path.join(dest, rel)


def record_path(base: str, dest: str) -> str:
    return os.path.join(base, "pushed", hashlib.sha256(dest.encode()).hexdigest()[:32] + ".json")


def write_json_atomic(path: str, obj: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    nodefacts.write_json_atomic(path, obj)


def walk_files(root: str) -> list[str]:
    """Relative paths of the regular files under root (symlinks and special files skipped)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            if stat.S_ISREG(os.lstat(path).st_mode):
                found.append(os.path.relpath(path, root).replace(os.sep, "/"))
    return found


def existing_files(dest: str) -> tuple[str, list[str]]:
    """(kind, rels) of what is at DEST now: ("none", []), ("file", ["."]), ("tree", [...])."""
    try:
        st = os.lstat(dest)
    except FileNotFoundError:
        return "none", []
    if stat.S_ISDIR(st.st_mode):
        return "tree", walk_files(dest)
    if stat.S_ISREG(st.st_mode):
        return "file", [FILE_REL]
    raise Refused("%s exists and is neither a regular file nor a directory" % dest)


def matches(path: str, want: dict, cached: dict | None = None) -> bool:
    """Does the file at path hold `want` ({size, sha256})? A cached {size, sha256, mtime_ns}
    entry for the same size and mtime stands in for hashing it again."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_size != want["size"]:
        return False
    if cached and cached.get("sha256") == want["sha256"] and cached.get("size") == st.st_size \
            and cached.get("mtime_ns") == st.st_mtime_ns:
        return True
    return sha256_file(path) == want["sha256"]


def read_request(stream: nodefacts.BinaryIO) -> dict:
    line = stream.readline()
    try:
        request = json.loads(line)
    except ValueError:
        raise Refused("expected a JSON request line") from None
    files = request.get("files")
    if request.get("kind") not in ("file", "tree") or not isinstance(files, dict):
        raise Refused("request needs kind file|tree and files")
    if request["kind"] == "file" and list(files) != [FILE_REL]:
        raise Refused("a file push has exactly one entry %r" % FILE_REL)
    for rel, meta in files.items():
        check_rel(rel)
        if not isinstance(meta.get("size"), int) or not isinstance(meta.get("sha256"), str):
            raise Refused("file %r needs size and sha256" % rel)
    return request


def plan(base: str, dest: str, request: dict) -> dict:
    """Per file: "dest" (DEST has it), "staged" (a previous push staged it) or the offset to send from."""
    kind, present = existing_files(dest)
    record = read_json(record_path(base, dest)) or {}
    ours = set(record.get("files", {})) | set(record.get("previous", []))
    files = request["files"]
    if kind != "none" and not request.get("force"):
        if not record or record.get("dest") != dest:
            raise Refused("%s exists and was not written by dflash-ops push (--force replaces it)" % dest)
        if kind != request["kind"]:
            raise Refused("%s is a %s; this push sends a %s (--force replaces it)"
                          % (dest, "directory" if kind == "tree" else "file", request["kind"]))
        foreign = sorted(set(present) - set(files) - ours)
        if foreign:
            raise Refused("%s holds files no push wrote, which this push would drop: %s (--force drops them)"
                          % (dest, ", ".join(foreign[:5]) + (" ..." if len(foreign) > 5 else "")))
    stage = stage_dir(dest)
    cached = record.get("files", {})
    same_kind = kind == request["kind"]
    steps: dict[str, str | int] = {}
    for rel, want in sorted(files.items()):
        if same_kind and rel in present and matches(dest_path(dest, rel), want, cached.get(rel)):
            steps[rel] = "dest"
        elif matches(staged_path(stage, rel), want):
            steps[rel] = "staged"
        else:
            part = staged_path(stage, rel) + ".part"
            size = os.path.getsize(part) if os.path.isfile(part) else 0
            steps[rel] = size if size <= want["size"] else 0
    up_to_date = same_kind and set(present) == set(files) and all(s == "dest" for s in steps.values())
    return {"steps": steps, "up_to_date": up_to_date, "existing": kind}


def lock_stage(stage: str) -> int:
    os.makedirs(stage, exist_ok=True)
    fd = os.open(os.path.join(stage, ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise Refused("another push to this destination is still running (%s)" % stage) from None
            time.sleep(0.2)


def receive_file(stream: nodefacts.BinaryIO, stage: str, rel: str, offset: int, length: int, want: dict) -> bool:
    """Append one frame to rel's .part; rename it into the stage when complete and verified."""
    final = staged_path(stage, rel)
    part = final + ".part"
    os.makedirs(os.path.dirname(part), exist_ok=True)
    fd = os.open(part, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        have = os.fstat(fd).st_size
        if offset > have:
            raise Refused("%s: asked to resume at %d but only %d bytes are staged" % (rel, offset, have))
        os.ftruncate(fd, offset)
        os.lseek(fd, offset, os.SEEK_SET)
        left = length
        while left:
            chunk = stream.read(min(CHUNK, left))
            if not chunk:
                os.fsync(fd)
                return False  # the stream ended: keep what arrived
            os.write(fd, chunk)
            left -= len(chunk)
        os.fsync(fd)
    finally:
        os.close(fd)
    if offset + length == want["size"]:
        if sha256_file(part) != want["sha256"]:
            os.unlink(part)
            raise Refused("%s: sha256 mismatch after transfer; the staged copy was discarded, push again" % rel)
        os.replace(part, final)
    return True


_RENAME_EXCHANGE = 2


def exchange(a: str, b: str) -> bool:
    """Swap two paths in one step (renameat2 RENAME_EXCHANGE); False when the system cannot."""
    libc_name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(libc_name, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError, TypeError):
        return False
    AT_FDCWD = -100
    rc = renameat2(AT_FDCWD, a.encode(), AT_FDCWD, b.encode(), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (22, 38, 95):  # EINVAL / ENOSYS / EOPNOTSUPP: this filesystem or kernel cannot
        return False
    raise OSError(err, os.strerror(err), b)


def swap_in(new: str, dest: str) -> str | None:
    """Make `new` (a complete file or tree) be DEST; returns the old DEST's path to remove, or None.

    A file replaces DEST with one rename. A tree is exchanged with DEST in one step where the
    kernel can; elsewhere the old tree is renamed aside first (a kill between the two renames
    leaves DEST missing and the old tree complete at `<stage>.old`)."""
    if not os.path.lexists(dest) or (os.path.isfile(new) and not os.path.isdir(dest)):
        os.rename(new, dest)
        return None
    if os.path.isdir(new) == os.path.isdir(dest) and os.path.isdir(dest) and exchange(new, dest):
        return new
    aside = new + ".old"
    if os.path.lexists(aside):
        remove(aside)
    os.rename(dest, aside)
    os.rename(new, dest)
    return aside


def remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def commit(base: str, dest: str, request: dict, stage: str) -> int:
    """Complete the staged tree from DEST's unchanged files, verify it, record it, swap it in."""
    files = request["files"]
    record = read_json(record_path(base, dest)) or {}
    cached = record.get("files", {})
    kind, present = existing_files(dest)
    linked = 0
    for rel, want in sorted(files.items()):
        target = staged_path(stage, rel)
        if matches(target, want):
            continue
        source = dest_path(dest, rel)
        if kind == request["kind"] and rel in present and matches(source, want, cached.get(rel)):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            try:
                os.link(source, target)
            except OSError:
                shutil.copy2(source, target)
            linked += 1
            continue
        raise Refused("%s was neither sent nor unchanged in %s; push again" % (rel, dest))
    new = staged_path(stage, FILE_REL) if request["kind"] == "file" else os.path.join(stage, "tree")
    if request["kind"] == "tree":
        os.makedirs(new, exist_ok=True)
        leftovers = set(walk_files(new)) - set(files)
        for rel in leftovers:  # .part files of an abandoned push
            os.unlink(os.path.join(new, rel))
    entries = {rel: {"size": want["size"], "sha256": want["sha256"],
                     "mtime_ns": os.stat(staged_path(stage, rel)).st_mtime_ns} for rel, want in files.items()}
    doc = {"dest": dest, "kind": request["kind"], "files": entries}
    # until the swap is done, the files of the DEST being replaced count as ours too ("previous")
    write_json_atomic(record_path(base, dest), dict(doc, previous=sorted(set(cached) | set(present)), time=time.time()))
    parent = os.path.dirname(dest)
    os.makedirs(parent, exist_ok=True)
    old = swap_in(new, dest)
    fsync_dir(parent)
    if old is not None:
        remove(old)
    write_json_atomic(record_path(base, dest), dict(doc, previous=[], time=time.time()))
    return linked


def cmd_plan(args: argparse.Namespace) -> None:
    request = read_request(sys.stdin.buffer)
    print_json(plan(args.base, check_dest(args.dest), request))


def cmd_receive(args: argparse.Namespace) -> int:
    dest = check_dest(args.dest)
    stream = sys.stdin.buffer
    request = read_request(stream)
    files = request["files"]
    if not request.get("force"):
        plan(args.base, dest, request)  # the same refusals as the plan that came before
    stage = stage_dir(dest)
    fd = lock_stage(stage)
    received = 0
    try:
        while True:
            line = stream.readline()
            if not line:
                return incomplete("early", received)
            frame = json.loads(line)
            if frame.get("end"):
                break
            rel = check_rel(frame["rel"])
            if rel not in files:
                raise Refused("frame for %r, which the request does not list" % rel)
            if not receive_file(stream, stage, rel, int(frame["offset"]), int(frame["length"]), files[rel]):
                return incomplete("inside " + rel, received)
            received += int(frame["length"])
        linked = commit(args.base, dest, request, stage)
    finally:
        os.close(fd)
    shutil.rmtree(stage, ignore_errors=True)
    print_json({"dest": dest, "received": received, "linked": linked, "files": len(files)})
    return 0


def incomplete(where: str, received: int) -> int:
    print_json({"error": "the stream ended %s; %d bytes staged for the next push" % (where, received),
                "incomplete": True, "received": received})
    return EXIT_INCOMPLETE


def manifest(src: str) -> dict:
    kind, rels = existing_files(src)
    if kind == "none":
        raise Refused("no such file or directory: %s" % src)
    files = {}
    for rel in rels:
        path = dest_path(src, rel)
        files[rel] = {"size": os.path.getsize(path), "sha256": sha256_file(path)}
    return {"kind": kind, "files": files}


def cmd_manifest(args: argparse.Namespace) -> None:
    print_json(manifest(check_dest(args.src)))


def cmd_read(args: argparse.Namespace) -> None:
    out = sys.stdout.buffer
    with open(check_dest(args.src), "rb") as f:
        f.seek(args.offset)
        left = args.length
        while left:
            chunk = f.read(min(CHUNK, left))
            if not chunk:
                break
            out.write(chunk)
            left -= len(chunk)
    out.flush()


def cmd_read_files(args: argparse.Namespace) -> None:
    out = sys.stdout.buffer
    root = check_dest(args.src)
    for rel in args.rels:
        with open(dest_path(root, check_rel(rel)), "rb") as f:
            data = f.read()
        out.write(json.dumps({"rel": rel, "size": len(data)}).encode() + b"\n")
        out.write(data)
    out.flush()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tree.py")
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("plan", "receive"):
        p = sub.add_parser(name)
        p.add_argument("base")
        p.add_argument("dest")
    m = sub.add_parser("manifest")
    m.add_argument("src")
    r = sub.add_parser("read")
    r.add_argument("src")
    r.add_argument("offset", type=int)
    r.add_argument("length", type=int)
    f = sub.add_parser("read-files")
    f.add_argument("src")
    f.add_argument("rels", nargs="+")
    args = parser.parse_args(argv)
    handler = {"plan": cmd_plan, "receive": cmd_receive, "manifest": cmd_manifest, "read": cmd_read,
               "read-files": cmd_read_files}[args.cmd]
    try:
        return handler(args) or 0
    except (Refused, OSError) as e:
        error = "%s: %s" % (e.filename or "", e.strerror or e) if isinstance(e, OSError) else str(e)
        print_json({"error": error})
        sys.stderr.write("tree.py: %s\n" % e)
        return EXIT_REFUSED


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
