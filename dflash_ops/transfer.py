"""Moving a file or a tree into a container (`push`) and any file or tree out of one (`fetch`).

    push_path(container, Path("models/Qwen3-8B"), "/models/Qwen3-8B")
    fetch_path(container, "/opt/dflash/runs/r1/export", Path("exports/r1"))

DEST is the path SRC will have (not a directory to put it in). Both directions are
incremental by content hash, stream large files with progress, verify every file's sha256,
resume after a dropped connection, and replace a destination in one rename: it holds the
old complete state or the new one, never a mix. Whether DEST may be replaced is one rule,
`tree.replace_refusal` (helpers/tree.py): absent, empty, or an earlier output of the same command;
`force` adds an earlier output of another command (an export, say); never a file no command
wrote, and never /, a system directory, the working or home directory, the target's base_dir or an
ancestor of any of them. Files keep their permission bits; a tree's symlinks are read as
`rsync -L` reads them (one that leaves the tree or dangles is refused by name).

Push: one `tree.py plan` (what the container already has, what a dropped push staged), then
one `tree.py receive` stream with only the missing bytes; the container checks free space
first, then completes, verifies and swaps (a failed receive removes what it staged; a dropped one
keeps it for the resume). Fetch: one `tree.py manifest`, then `tree.py read` chunks appended to local
`.part` files beside DEST; a local record next to DEST (`.NAME.dflash-fetch.json`) says what
the last fetch wrote, so the next one copies only changed files.
"""

from __future__ import annotations

import json
import os
import posixpath
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, TypeVar

from dflash_ops.errors import ConnectionLost, DflashOpsError, HelperFailed, TransferError
from dflash_ops.hashing import sha256_file
from dflash_ops.helpers import tree as tree_helper
from dflash_ops.transport.base import CHUNK

if TYPE_CHECKING:
    from dflash_ops.container import ContainerAPI

HELPER = "tree"
FILE_REL = tree_helper.FILE_REL
FETCH_CHUNK = 32 << 20
RESUME_ATTEMPTS = 3  # a push or fetch reconnects and resumes this many times after a dropped connection
PROTECTED = ("releases", "helpers", "venvs", "pushed", "current", "runs")

ProgressCallback = Callable[[int, int], None]  # (bytes done so far, bytes to move in all)
T = TypeVar("T")


class TransferRefused(DflashOpsError):
    """The transfer would replace or drop something it did not write (or the path is invalid)."""


@dataclass
class TransferSummary:
    src: str
    dest: str
    kind: str  # "file" | "tree"
    files: int = 0
    files_sent: int = 0  # files that needed bytes moved
    bytes_total: int = 0  # size of SRC
    bytes_sent: int = 0  # bytes moved by this call (resumed files count only their remainder)
    resumed: int = 0  # times a dropped connection was resumed within this call
    up_to_date: bool = False
    seconds: float = 0.0
    direction: str = "push"  # "push" | "fetch": whether files_sent / bytes_sent went out or came in

    def to_json(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        if self.up_to_date:
            return f"{self.dest}: up to date ({self.files} files, {self.bytes_total / 1e6:.1f} MB, sha256 verified)"
        resumed = f", resumed {self.resumed}x after a dropped connection" if self.resumed else ""
        moved = "received" if self.direction == "fetch" else "sent"
        return (f"{self.dest}: {self.files} files ({self.bytes_total / 1e6:.1f} MB), {moved} {self.files_sent} "
                f"({self.bytes_sent / 1e6:.1f} MB) in {self.seconds:.1f}s, sha256 verified{resumed}")


def container_path(path: str, base_dir: str | None = None, *, home: str | None = None) -> str:
    """A container path a transfer may write or read: absolute, normalised, not /, no '..',
    and not inside the tool's own state under BASE (releases, venvs, runs, ...). A relative path is
    under `home` (the target's base_dir), as scp's is under the login's home: `data/prompts.jsonl` is
    the same file in an LXC container and in a directory container of the simulated node, whose `/`
    is this machine's."""
    if isinstance(path, str) and path and not path.startswith("/") and home:
        path = f"{home.rstrip('/')}/{path}"
    if not isinstance(path, str) or not path.startswith("/"):
        raise TransferRefused(f"container path must be absolute: {path!r}")
    if "\0" in path or "\n" in path:
        raise TransferRefused(f"container path may not contain NUL or newline: {path!r}")
    if ".." in path.split("/"):
        raise TransferRefused(f"container path may not contain '..': {path!r}")
    norm = posixpath.normpath(path)
    if norm == "/" or norm.startswith("//"):
        raise TransferRefused(f"refusing container path {path!r}")
    if base_dir:
        base = posixpath.normpath(base_dir)
        if norm == base or any(norm == f"{base}/{p}" or norm.startswith(f"{base}/{p}/") for p in PROTECTED):
            raise TransferRefused(f"{norm} is dflash-ops' own state under {base}; choose another path "
                                  f"(e.g. {base}/data/...)")
    return norm


def local_manifest(src: Path) -> tuple[str, dict[str, dict], dict[str, Path]]:
    """(kind, {rel: {size, sha256, mode}}, {rel: local path}) of a local file or tree; a tree's
    symlinks are read like `rsync -L` (tree.tree_files: one leaving the tree or dangling is refused)."""
    if src.is_file():
        paths = {FILE_REL: src}
        kind = "file"
    elif src.is_dir():
        try:
            paths = {rel: Path(path) for rel, path in tree_helper.tree_files(str(src)).items()}
        except tree_helper.Refused as e:
            raise TransferRefused(str(e)) from None
        if not paths:
            raise TransferRefused(f"{src}: no files to send (empty directories are not carried)")
        kind = "tree"
    elif src.is_symlink():
        raise TransferRefused(f"{src} -> {os.readlink(src)}: a dangling link")
    elif src.exists():
        raise TransferRefused(f"{src}: neither a regular file nor a directory")
    else:
        raise TransferRefused(f"{src}: no such file or directory")
    return kind, {rel: {"size": p.stat().st_size, "sha256": sha256_file(p), "mode": tree_helper.file_mode(str(p))}
                  for rel, p in paths.items()}, paths


def _frames(request: bytes, sends: list[tuple[str, Path, int, int]],
            on_bytes: Callable[[int], None]) -> Iterator[bytes]:
    """The receive stream: request line, then per file a frame header and its bytes from the offset."""
    yield request
    for rel, path, offset, length in sends:
        yield json.dumps({"rel": rel, "offset": offset, "length": length}).encode() + b"\n"
        with open(path, "rb") as f:
            f.seek(offset)
            while length:
                data = f.read(min(CHUNK, length))
                if not data:
                    raise TransferError("a local file shrank while it was being sent")
                length -= len(data)
                on_bytes(len(data))
                yield data
    yield b'{"end": true}\n'


def push_path(container: ContainerAPI, src: Path | str, dest: str, *, force: bool = False,
              on_progress: ProgressCallback | None = None) -> TransferSummary:
    """Push a local file or tree to `dest` in the container (see the module docstring)."""
    started = time.monotonic()
    src = Path(src)
    dest = container_path(dest, container.base_dir, home=container.base_dir)
    kind, files, paths = local_manifest(src)
    summary = TransferSummary(src=str(src), dest=dest, kind=kind, files=len(files),
                              bytes_total=sum(f["size"] for f in files.values()))
    dirs = tree_helper.dir_modes(str(src), list(files)) if kind == "tree" else {}
    request = json.dumps({"kind": kind, "files": files, "force": force, "dirs": dirs},
                         sort_keys=True).encode() + b"\n"
    progress = _Counter(on_progress)
    what = f"push {src} -> {container.target.name}:{dest}"

    def attempt() -> bool:
        """One plan + receive; True when the container already had everything."""
        try:
            plan = container.helper_json(HELPER, ["plan", container.base_dir, dest], stdin=request)
        except HelperFailed as e:
            raise TransferRefused(f"push to {container.target.name}: {e.reason}") from None
        if plan["up_to_date"]:
            return True
        sends = [(rel, paths[rel], step, files[rel]["size"] - step)
                 for rel, step in sorted(plan["steps"].items()) if isinstance(step, int)]
        if not summary.resumed:
            summary.files_sent = len(sends)
        progress.total = progress.done + sum(length for *_, length in sends)
        try:
            container.helper_json(HELPER, ["receive", container.base_dir, dest],
                                  stdin=_frames(request, sends, progress.add))
        except HelperFailed as e:
            if e.exit_code == tree_helper.EXIT_INCOMPLETE:
                raise ConnectionLost(e.document.get("error") or "the stream ended early") from None
            raise TransferError(f"{what}: {e.reason}") from None
        except TransferError:  # this side failed (a file changed while it was read): nothing stays staged
            _discard(container, dest)
            raise
        return False

    summary.up_to_date = _resuming(what, summary, attempt)
    summary.bytes_sent = progress.done
    summary.seconds = round(time.monotonic() - started, 3)
    return summary


# ---------------------------------------------------------------------------- fetch


def fetch_path(container: ContainerAPI, src: str, dest: Path | str, *, force: bool = False, chunk: int = FETCH_CHUNK,
               on_progress: ProgressCallback | None = None) -> TransferSummary:
    """Fetch a file or tree from the container to the local path `dest` (see the module docstring)."""
    started = time.monotonic()
    src = container_path(src, home=container.base_dir)
    dest = Path(os.path.normpath(Path(os.path.expanduser(str(dest))).absolute()))
    # the rule first: `fetch ... /`, `.` or `~` is refused before anything is read or staged
    protected = [*tree_helper.protected_paths(), (container.base_dir, "the target's base_dir")]
    record_file = Path(tree_helper.marker_path(str(dest), "fetch"))
    record = tree_helper.read_json(str(record_file)) or {}
    ours = tree_helper.marker_files(record) or set()
    refusal = tree_helper.replace_refusal(str(dest), "fetch", own=ours or None, force=force, protected=protected)
    if refusal:
        raise TransferRefused(refusal)
    try:
        remote = container.helper_json(HELPER, ["manifest", src])
    except HelperFailed as e:
        raise TransferRefused(f"fetch {container.target.name}:{src}: {e.reason}") from None
    kind, files = remote["kind"], remote["files"]
    for rel in files:
        tree_helper.check_rel(rel)
    summary = TransferSummary(src=src, dest=str(dest), kind=kind, files=len(files),
                              bytes_total=sum(f["size"] for f in files.values()), direction="fetch")
    present_kind, present = tree_helper.existing_files(str(dest))
    same_kind = present_kind == kind
    cached = record.get("files", {})
    if same_kind and set(present) == set(files) and all(
            tree_helper.matches(tree_helper.dest_path(str(dest), rel), want, cached.get(rel))
            and tree_helper.has_mode(tree_helper.dest_path(str(dest), rel), want) for rel, want in files.items()) \
            and tree_helper.dir_modes_match(str(dest), remote.get("dirs") or {}):
        summary.up_to_date = True
        summary.seconds = round(time.monotonic() - started, 3)
        return summary
    stage = dest.with_name(f".{dest.name}.dflash-fetch")
    stage.mkdir(mode=0o700, parents=True, exist_ok=True)
    todo: list[tuple[str, int]] = []  # (rel, offset)
    for rel, want in sorted(files.items()):
        target = Path(tree_helper.staged_path(str(stage), rel))
        if tree_helper.matches(str(target), want):
            continue
        source = tree_helper.dest_path(str(dest), rel)
        if same_kind and rel in present and tree_helper.matches(source, want, cached.get(rel)):
            target.parent.mkdir(parents=True, exist_ok=True)  # unchanged: linked (or copied) from DEST
            target.unlink(missing_ok=True)
            try:
                os.link(source, target)
            except OSError:
                shutil.copy2(source, target)
            continue
        part = target.with_name(target.name + ".part")
        offset = part.stat().st_size if part.is_file() and part.stat().st_size <= want["size"] else 0
        todo.append((rel, offset))
    total = sum(files[rel]["size"] - offset for rel, offset in todo)
    summary.files_sent = len(todo)
    progress = _Counter(on_progress, total)
    small = [rel for rel, offset in todo if kind == "tree" and offset == 0 and files[rel]["size"] <= chunk // 4]
    for batch in _batches(small, files, chunk):
        for rel, data in _read_files(container, src, batch, summary):
            target = Path(tree_helper.staged_path(str(stage), rel))
            _append_part(target, data, 0)
            _finish_part(target, files[rel], f"{src}/{rel}")
            progress.add(len(data))
    for rel, offset in todo:
        if rel in small:
            continue
        want = files[rel]
        target = Path(tree_helper.staged_path(str(stage), rel))
        remote_path = src if rel == FILE_REL else f"{src}/{rel}"
        ask = json.dumps({"path": remote_path}).encode() + b"\n"  # on stdin: any name, also one not UTF-8
        position = offset
        while True:  # the first pass truncates the .part to the resume offset
            length = min(chunk, want["size"] - position)
            args = ["read", "-", str(position), str(length)]
            data = _helper_bytes(container, args, remote_path, summary, stdin=ask) if length else b""
            if len(data) != length:
                raise TransferError(f"fetch {remote_path}: got {len(data)} of {length} bytes at offset "
                                    f"{position} (did it change while fetching?)")
            _append_part(target, data, position)
            position += length
            progress.add(length)
            if position >= want["size"]:
                break
        _finish_part(target, want, remote_path)
    new = Path(tree_helper.staged_path(str(stage), FILE_REL)) if kind == "file" else stage / "tree"
    if kind == "tree":
        new.mkdir(exist_ok=True)
        for rel in set(tree_helper.walk_files(str(new))) - set(files):
            (new / rel).unlink()
    for rel, want in files.items():
        os.chmod(tree_helper.staged_path(str(stage), rel), tree_helper.mode_of(want))
    if kind == "tree":
        tree_helper.set_dir_modes(str(new), remote.get("dirs") or {})
    entries = {rel: {**files[rel], "mtime_ns": Path(tree_helper.staged_path(str(stage), rel)).stat().st_mtime_ns}
               for rel in files}
    doc = {"target": container.target.name, "src": src, "kind": kind, "files": entries, "time": time.time()}
    # `previous` keeps the old files counted as ours should a crash come between here and the swap
    tree_helper.write_json_atomic(str(record_file), {**doc, "previous": sorted(ours | set(present))})
    dest.parent.mkdir(parents=True, exist_ok=True)
    old = tree_helper.swap_in(str(new), str(dest))
    tree_helper.fsync_dir(str(dest.parent))
    if old is not None:
        tree_helper.remove(old)
    tree_helper.write_json_atomic(str(record_file), {**doc, "previous": []})
    shutil.rmtree(stage, ignore_errors=True)
    summary.bytes_sent = progress.done
    summary.seconds = round(time.monotonic() - started, 3)
    return summary


def _discard(container: ContainerAPI, dest: str) -> None:
    try:
        container.helper_json(HELPER, ["discard", container.base_dir, dest])
    except DflashOpsError:
        pass  # the next push resumes or replaces what stayed; the error being raised says more


class _Counter:
    """Bytes moved so far, reported to on_progress(done, total) as they move."""

    def __init__(self, on_progress: ProgressCallback | None, total: int = 0):
        self.total, self.done, self.on_progress = total, 0, on_progress

    def add(self, n: int) -> None:
        self.done += n
        if self.on_progress is not None:
            self.on_progress(self.done, self.total)


def _resuming(what: str, summary: TransferSummary, call: Callable[[], T]) -> T:
    """call(), made again after each dropped connection (RESUME_ATTEMPTS times), counted in summary."""
    for attempt in range(RESUME_ATTEMPTS + 1):
        try:
            return call()
        except ConnectionLost:
            if attempt == RESUME_ATTEMPTS:
                raise TransferError(f"{what}: the connection dropped {attempt + 1} times; run the same "
                                    f"{what.split()[0]} again to resume") from None
            summary.resumed += 1
    raise AssertionError("unreachable")


def _helper_bytes(container: ContainerAPI, args: list[str], what: str, summary: TransferSummary,
                  stdin: bytes | None = None) -> bytes:
    """The stdout of one tree helper call of a fetch, resumed after a dropped connection."""
    result = _resuming(f"fetch {what}", summary, lambda: container.helper(HELPER, args, stdin=stdin))
    if not result.ok:
        raise TransferError(f"fetch {what}: {result.stderr.strip() or f'exit {result.exit_code}'}")
    return result.stdout_bytes


def _batches(rels: list[str], files: dict, limit: int) -> list[list[str]]:
    """Groups of small files, each at most `limit` bytes of content plus names (by bytes, not by count:
    the names travel on stdin, and many long names are as large as their files)."""
    batches: list[list[str]] = []
    size = limit
    for rel in rels:
        cost = files[rel]["size"] + len(rel.encode("utf-8", "surrogateescape")) + 64
        if size + cost > limit:
            batches.append([])
            size = 0
        batches[-1].append(rel)
        size += cost
    return batches


def _append_part(target: Path, data: bytes, offset: int) -> None:
    part = target.with_name(target.name + ".part")
    part.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)  # private until its mode is set
    with os.fdopen(fd, "ab") as f:
        f.truncate(offset)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _finish_part(target: Path, want: dict, remote_path: str) -> None:
    """Check the .part's sha256, rename it into the stage."""
    part = target.with_name(target.name + ".part")
    if sha256_file(part) != want["sha256"]:
        part.unlink()
        raise TransferError(f"fetch {remote_path}: sha256 mismatch (did it change while fetching?); "
                            "the copy was discarded, fetch again")
    os.replace(part, target)


def _read_files(container: ContainerAPI, src: str, rels: list[str], summary: TransferSummary) -> list[tuple[str, bytes]]:
    names = json.dumps(rels).encode() + b"\n"  # on stdin: no argument-length limit, any name
    out, data, at = [], _helper_bytes(container, ["read-files", src], src, summary, stdin=names), 0
    for rel in rels:
        end = data.index(b"\n", at)
        header = json.loads(data[at:end])
        size = int(header["size"])
        if header.get("rel") != rel:
            raise TransferError(f"fetch {src}: unexpected reply for {rel}")
        out.append((rel, data[end + 1: end + 1 + size]))
        at = end + 1 + size
    return out
