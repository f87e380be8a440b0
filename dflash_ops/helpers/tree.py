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
  tree.py discard BASE DEST         remove what a push to DEST staged (its sender failed)
  tree.py manifest SRC              {"kind", "files": {rel: {size, sha256, mode}}, "dirs": {rel: mode}}
                                    of a file or tree
  tree.py read SRC OFFSET LENGTH    raw bytes of the file SRC (for fetch, one chunk at a time)
  tree.py read-files SRC REL...     small whole files of the tree SRC in one go: per file a JSON
                                    line {"rel", "size"} and its bytes

Staging lives beside DEST as `.NAME.dflash-push/` (one push at a time: flock; private, 0700);
what each push wrote is recorded in BASE/pushed/<hash of DEST>.json, with the files' mtimes so an
unchanged file is not hashed again. Files keep their permission bits (mode & 0777). A tree is
read as `rsync -L` reads it: a symlink to a file or directory inside the tree is carried as
what it points to; a link that leaves the tree, dangles or loops, and a special file, are
refused by name (never silently left out). Empty directories are not carried.

Whether DEST may be replaced at all is `replace_refusal`: the one rule, kept in the trainer
(trainer/run/destination.py, stdlib only: the trainer's export applies it and never imports
dflash_ops) and shipped beside this helper like nodefacts.py; push applies it here, fetch on the
operator's side (dflash_ops.transfer imports this file).
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

if not __package__:  # run as a script: its directory becomes its package (as_package.py)
    import as_package

    as_package.enter(globals())
from . import destination, nodefacts

CHUNK = 1 << 20
FILE_REL = destination.FILE_REL  # the one entry of a single-file push
EXIT_REFUSED = 3
EXIT_INCOMPLETE = 4
LOCK_WAIT_S = 60
STAGE_SUFFIX = ".dflash-push"


Refused = destination.Refused
# the replace rule (trainer/run/destination.py, the one copy: the trainer's export applies it too)
OUTPUT_KINDS, SYSTEM_DIRS, SYSTEM_TREES = destination.OUTPUT_KINDS, destination.SYSTEM_DIRS, destination.SYSTEM_TREES
marker_path, marker_files = destination.marker_path, destination.marker_files
protected_paths, replace_refusal = destination.protected_paths, destination.replace_refusal
size_text, dest_path = destination.size_text, destination.dest_path
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



def record_path(base: str, dest: str) -> str:
    return os.path.join(base, "pushed", hashlib.sha256(dest.encode()).hexdigest()[:32] + ".json")


def write_json_atomic(path: str, obj: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    nodefacts.write_json_atomic(path, obj)


def walk_files(root: str) -> list[str]:
    """Relative paths of the regular files under root, not following links (what a tool wrote there)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            if stat.S_ISREG(os.lstat(path).st_mode):
                found.append(os.path.relpath(path, root).replace(os.sep, "/"))
    return found


def tree_files(root: str) -> dict[str, str]:
    """{rel: path to read} of every file a transfer of the tree `root` carries, as `rsync -L`
    reads it: a symlink to a file or directory inside the tree is carried as what it points to.
    Refuses (naming each) a link that leaves the tree, dangles or loops, and a special file:
    nothing is silently left out."""
    real_root = os.path.realpath(root)
    found: dict[str, str] = {}
    bad: list[str] = []

    def visit(directory: str, prefix: str, seen: frozenset) -> None:
        for name in sorted(os.listdir(directory)):
            path = os.path.join(directory, name)
            rel = prefix + name
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                link = os.readlink(path)
                real = os.path.realpath(path)
                if real != real_root and not real.startswith(real_root.rstrip("/") + "/"):
                    bad.append("%s -> %s (leaves the tree)" % (rel, link))
                    continue
                try:
                    st = os.stat(path)
                except OSError:
                    bad.append("%s -> %s (dangling or a loop)" % (rel, link))
                    continue
            if stat.S_ISDIR(st.st_mode):
                key = (st.st_dev, st.st_ino)
                if key in seen:
                    bad.append("%s (a link back into its own directory)" % rel)
                    continue
                visit(path, rel + "/", seen | {key})
            elif stat.S_ISREG(st.st_mode):
                found[rel] = path
            else:
                bad.append("%s (%s, not a file)" % (rel, _kind_name(st.st_mode)))

    top = os.stat(root)
    visit(root, "", frozenset({(top.st_dev, top.st_ino)}))
    if bad:
        raise Refused("%s: %d entr%s cannot be carried: %s" % (
            root, len(bad), "y" if len(bad) == 1 else "ies", "; ".join(bad[:10]) + (" ..." if len(bad) > 10 else "")))
    return found


def _kind_name(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a fifo"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "a special file"


def file_mode(path: str) -> int:
    """The permission bits a transfer carries (no setuid/setgid/sticky)."""
    return stat.S_IMODE(os.stat(path).st_mode) & 0o777


def dir_modes(root: str, rels: list[str]) -> dict[str, int]:
    """{dir rel ("." for the root): mode} of the directories holding `rels` under root, so that a
    file inside a private directory stays out of others' reach where it arrives."""
    dirs = {FILE_REL}
    for rel in rels:
        parts = rel.split("/")[:-1]
        dirs.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
    return {d: file_mode(root if d == FILE_REL else os.path.join(root, d)) for d in sorted(dirs)}


def set_dir_modes(root: str, dirs: dict) -> None:
    """chmod the directories of a staged tree (deepest first) to the modes the request carries."""
    for rel in sorted(dirs, key=lambda d: -d.count("/")):
        if rel != FILE_REL:
            check_rel(rel)
        path = root if rel == FILE_REL else os.path.join(root, rel)
        if os.path.isdir(path):
            os.chmod(path, int(dirs[rel]) & 0o777)


def dir_modes_match(root: str, dirs: dict) -> bool:
    try:
        return all(file_mode(root if rel == FILE_REL else os.path.join(root, rel)) == int(mode) & 0o777
                   for rel, mode in dirs.items())
    except OSError:
        return False


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
        if not isinstance(meta.get("mode", 0o644), int):
            raise Refused("file %r: mode must be an integer" % rel)
    dirs = request.get("dirs") or {}
    if not isinstance(dirs, dict) or not all(isinstance(m, int) for m in dirs.values()):
        raise Refused("dirs must map directories to integer modes")
    for rel in dirs:
        if rel != FILE_REL:
            check_rel(rel)
    return request


def mode_of(want: dict) -> int:
    return int(want.get("mode", 0o644)) & 0o777


def has_mode(path: str, want: dict) -> bool:
    try:
        return stat.S_IMODE(os.stat(path).st_mode) & 0o777 == mode_of(want)
    except OSError:
        return False


SPACE_MARGIN = 64 << 20  # a push needs its bytes + this + 1% free where it stages


def free_bytes(path: str) -> tuple[int, str]:
    """Free bytes (for an unprivileged writer) of the filesystem that holds `path`, and where measured."""
    probe = path
    while not os.path.exists(probe) and probe != "/":
        probe = os.path.dirname(probe)
    st = os.statvfs(probe)
    return st.f_bavail * st.f_frsize, probe


def push_record(base: str, dest: str) -> dict:
    record = read_json(record_path(base, dest)) or {}
    return record if record.get("dest") == dest else {}


def check_replace(base: str, dest: str, request: dict) -> None:
    """The replace rule for a push to DEST (refuses, exit 3)."""
    refusal = replace_refusal(dest, "push", own=marker_files(push_record(base, dest)) or None,
                              force=bool(request.get("force")), protected=protected_paths(base))
    if refusal:
        raise Refused(refusal)


def plan(base: str, dest: str, request: dict) -> dict:
    """Per file: "dest" (DEST has it), "staged" (a previous push staged it) or the offset to send from.
    Refuses a DEST the replace rule protects, and a push that would not fit (size + margin)."""
    check_replace(base, dest, request)
    kind, present = existing_files(dest)
    record = push_record(base, dest)
    files = request["files"]
    stage = stage_dir(dest)
    cached = record.get("files", {})
    same_kind = kind == request["kind"]
    steps: dict[str, str | int] = {}
    # a dropped push's receive may still be writing what was in flight: read the stage once it is done
    fd = lock_stage(stage) if os.path.isdir(stage) else None
    try:
        for rel, want in sorted(files.items()):
            if same_kind and rel in present and matches(dest_path(dest, rel), want, cached.get(rel)):
                steps[rel] = "dest"
            elif matches(staged_path(stage, rel), want):
                steps[rel] = "staged"
            else:
                part = staged_path(stage, rel) + ".part"
                size = os.path.getsize(part) if os.path.isfile(part) else 0
                steps[rel] = size if size <= want["size"] else 0
    finally:
        if fd is not None:
            os.close(fd)
    up_to_date = same_kind and set(present) == set(files) and all(s == "dest" for s in steps.values()) \
        and all(has_mode(dest_path(dest, rel), want) for rel, want in files.items()) \
        and dir_modes_match(dest, request.get("dirs") or {})
    need = sum(files[rel]["size"] - step for rel, step in steps.items() if isinstance(step, int))
    if need:
        free, where = free_bytes(os.path.dirname(dest))
        want_free = need + SPACE_MARGIN + need // 100
        if free < want_free:
            raise Refused("not enough space for this push: it needs %s (+ %s margin) at %s, %s is free there; "
                          "nothing was sent" % (size_text(need), size_text(want_free - need), where, size_text(free)))
    return {"steps": steps, "up_to_date": up_to_date, "existing": kind}


def lock_stage(stage: str) -> int:
    os.makedirs(stage, mode=0o700, exist_ok=True)
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
    fd = os.open(part, os.O_WRONLY | os.O_CREAT, 0o600)  # private until its mode is set at commit
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
    for rel, want in files.items():
        os.chmod(staged_path(stage, rel), mode_of(want))
    new = staged_path(stage, FILE_REL) if request["kind"] == "file" else os.path.join(stage, "tree")
    if request["kind"] == "tree":
        os.makedirs(new, exist_ok=True)
        leftovers = set(walk_files(new)) - set(files)
        for rel in leftovers:  # .part files of an abandoned push
            os.unlink(os.path.join(new, rel))
        set_dir_modes(new, request.get("dirs") or {})
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
    check_replace(args.base, dest, request)  # the same refusal as the plan that came before
    stage = stage_dir(dest)
    fd = lock_stage(stage)
    try:
        cut, received = receive_frames(stream, stage, files)
        if cut is None:
            linked = commit(args.base, dest, request, stage)
    except Exception:
        shutil.rmtree(stage, ignore_errors=True)  # a failed push leaves nothing staged (a dropped one keeps it)
        raise
    finally:
        os.close(fd)
    if cut is not None:
        return incomplete(cut, received)
    shutil.rmtree(stage, ignore_errors=True)
    print_json({"dest": dest, "received": received, "linked": linked, "files": len(files)})
    return 0


def receive_frames(stream: nodefacts.BinaryIO, stage: str, files: dict) -> tuple[str | None, int]:
    """Stage every frame up to the end frame: (None, bytes received), or (where, bytes received)
    when the stream was cut off first."""
    received = 0
    while True:
        line = stream.readline()
        if not line.endswith(b"\n"):  # nothing, or a frame header cut off: the connection dropped
            return "early", received
        frame = json.loads(line)
        if frame.get("end"):
            return None, received
        rel = check_rel(frame["rel"])
        if rel not in files:
            raise Refused("frame for %r, which the request does not list" % rel)
        if not receive_file(stream, stage, rel, int(frame["offset"]), int(frame["length"]), files[rel]):
            return "inside " + rel, received
        received += int(frame["length"])


def cmd_discard(args: argparse.Namespace) -> None:
    """Remove what a push to DEST staged (the operator's side failed after sending began)."""
    dest = check_dest(args.dest)
    stage = stage_dir(dest)
    if not os.path.isdir(stage):
        print_json({"discarded": False})
        return
    fd = lock_stage(stage)
    try:
        shutil.rmtree(stage, ignore_errors=True)
    finally:
        os.close(fd)
    print_json({"discarded": True})


def incomplete(where: str, received: int) -> int:
    print_json({"error": "the stream ended %s; %d bytes staged for the next push" % (where, received),
                "incomplete": True, "received": received})
    return EXIT_INCOMPLETE


def manifest(src: str) -> dict:
    """{"kind", "files": {rel: {size, sha256, mode}}} of a file or a tree (links read as tree_files does)."""
    if os.path.isfile(src):
        paths = {FILE_REL: src}
    elif os.path.isdir(src):
        paths = tree_files(src)
    elif os.path.lexists(src):
        raise Refused("%s is neither a regular file nor a directory" % src)
    else:
        raise Refused("no such file or directory: %s" % src)
    files = {rel: {"size": os.path.getsize(path), "sha256": sha256_file(path), "mode": file_mode(path)}
             for rel, path in paths.items()}
    if FILE_REL in paths:
        return {"kind": "file", "files": files}
    return {"kind": "tree", "files": files, "dirs": dir_modes(src, list(files))}


def cmd_manifest(args: argparse.Namespace) -> None:
    print_json(manifest(check_dest(args.src)))


def cmd_read(args: argparse.Namespace) -> None:
    out = sys.stdout.buffer
    src = args.src
    if src == "-":  # the path on stdin as JSON: any file name, also one that is not UTF-8
        src = json.loads(sys.stdin.buffer.readline())["path"]
    with open(check_dest(src), "rb") as f:
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
    """The relative paths come on stdin as one JSON list (no argument-length limit, any name)."""
    out = sys.stdout.buffer
    root = check_dest(args.src)
    rels = json.loads(sys.stdin.buffer.readline()) if not args.rels else args.rels
    for rel in rels:
        with open(dest_path(root, check_rel(rel)), "rb") as f:
            data = f.read()
        out.write(json.dumps({"rel": rel, "size": len(data)}).encode() + b"\n")
        out.write(data)
    out.flush()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tree.py")
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("plan", "receive", "discard"):
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
    f.add_argument("rels", nargs="*")
    args = parser.parse_args(argv)
    handler = {"plan": cmd_plan, "receive": cmd_receive, "discard": cmd_discard, "manifest": cmd_manifest,
               "read": cmd_read, "read-files": cmd_read_files}[args.cmd]
    try:
        return handler(args) or 0
    except (Refused, OSError) as e:
        error = "%s: %s" % (e.filename or "", e.strerror or e) if isinstance(e, OSError) else str(e)
        print_json({"error": error})
        sys.stderr.write("tree.py: %s\n" % e)
        return EXIT_REFUSED


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
