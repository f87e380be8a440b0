"""Node-side facts the helpers share (stdlib only, python3.8+). Not a helper: it is never run.

Each fact a helper needs about the node has its one definition here: the run states that are
final, a process's start time in /proc, whether a run is live, the grammar of a GPU list, the
start lock, scratch directories a dead process left behind, and JSON files read, written and
printed the way every helper does.

It travels with the helpers that import it, the way Ansible ships `module_utils` with a module:
BASE/helpers/<hash>/ holds the helper and this file beside it, and <hash> covers both, so a
change here is a new version of every helper that imports it (dflash_ops/helpers/__init__.py).
A helper imports it as `from . import nodefacts` (as_package.py says how that works in a container).
"""

from __future__ import annotations

import json
import os
import re
import sys

from . import contract

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (~10 ms at start on 3.8)
if TYPE_CHECKING:
    from typing import BinaryIO  # noqa: F401  (the helpers annotate streams as nodefacts.BinaryIO)

# What the trainer and the helpers agree on has one definition, the run directory's contract
# (trainer/run/contract.py, shipped beside the helpers): the final states, a process's start time
# (a zombie counts as gone), the atomic write, fsync and sha256.
FINAL_STATES = contract.FINAL_STATES
proc_stat, process_start_ticks = contract.proc_stat, contract.process_start_ticks
write_file_synced, write_atomic = contract.write_file_synced, contract.write_atomic
sha256_file, fsync_dir = contract.sha256_file, contract.fsync_dir

START_LOCK = ".start.lock"  # BASE/runs/.start.lock
GPUS_RE = re.compile(r"^[0-9]{1,4}(,[0-9]{1,4})*$")


# ---------------------------------------------------------------- answers

EXIT_BAD_INPUT = 2


class Refused(Exception):
    """A helper's refusal: answered as {"error": message, **extra} on stdout and the message on
    stderr, exit status `code` (each helper names its statuses)."""

    def __init__(self, message: str, code: int = EXIT_BAD_INPUT, **extra: object) -> None:
        super().__init__(message)
        self.code = code
        self.extra = extra

    def answer(self, prog: str) -> int:
        print_json({"error": str(self), **self.extra})
        sys.stderr.write("%s: %s\n" % (prog, self))
        return self.code


# ---------------------------------------------------------------- JSON files

def print_json(obj: object) -> None:
    """A helper's answer: one JSON line on stdout (the operator reads the last one)."""
    sys.stdout.write(json.dumps(obj, sort_keys=True) + "\n")
    sys.stdout.flush()


def read_json(path: str) -> dict | None:
    """The JSON object in `path`, or None (missing, unreadable, not JSON, or not an object)."""
    doc, _problem = read_json_checked(path)
    return doc


JSON_FILE_BYTES = 64 << 20  # a run's JSON files (status, launch, manifest, group) are KiB to a few MiB
JSON_DEPTH = 32  # the deepest of them nests 4 levels


def loads_bounded(data: bytes | str, max_bytes: int = JSON_FILE_BYTES, max_depth: int = JSON_DEPTH) -> tuple[object, str | None]:
    """(value, None) or (None, what is wrong): the JSON text in `data`, refused when longer than
    `max_bytes` or nested deeper than `max_depth`. json.loads raises ValueError for bad JSON and
    bad UTF-8 but RecursionError for a deep nest ([[[[... a few thousand levels): both are caught."""
    if len(data) > max_bytes:
        return None, "longer than %d bytes" % max_bytes
    try:
        value = json.loads(data)
    except RecursionError:
        return None, "nested deeper than %d levels" % max_depth
    except ValueError as e:
        return None, "not valid JSON (%s)" % (getattr(e, "msg", None) or getattr(e, "reason", None) or e)
    if json_depth(value, max_depth) > max_depth:
        return None, "nested deeper than %d levels" % max_depth
    return value, None


def json_depth(value: object, limit: int) -> int:
    """How deep `value` nests (a scalar is 0, [1] is 1), counting no further than limit + 1."""
    deepest, todo = 0, [(value, 0)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, (list, dict)):
            depth += 1
            if depth > limit:
                return depth
            deepest = max(deepest, depth)
            todo.extend((child, depth) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def read_json_checked(path: str) -> tuple[dict | None, str | None]:
    """(object, None), (None, None) when the file is missing, or (None, what is wrong with it)."""
    try:
        with open(path, "rb") as f:
            data = f.read(JSON_FILE_BYTES + 1)
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, "%s is unreadable: %s" % (os.path.basename(path), e.strerror)
    doc, problem = loads_bounded(data)
    if problem is not None:
        return None, "%s is %s" % (os.path.basename(path), problem if problem.startswith("not") else "not usable: " + problem)
    if not isinstance(doc, dict):
        return None, "%s holds a JSON %s, not an object" % (os.path.basename(path), type(doc).__name__)
    return doc, None


def write_json_atomic(path: str, obj: dict) -> None:
    write_atomic(path, json.dumps(obj, sort_keys=True).encode())


# ---------------------------------------------------------------- processes

def process_matches(pid: object, pid_start: object) -> bool:
    """Does `pid` still run, as the process started at `pid_start` ticks (when that is known)?"""
    if not isinstance(pid, int) or pid <= 0:
        return False
    start = process_start_ticks(pid)
    if start is None:
        return False
    return pid_start is None or start == pid_start


# ---------------------------------------------------------------- runs

def run_process(run_dir: str, status: dict | None) -> tuple[int | None, object]:
    """(pid, pid_start) of a run's trainer: status.json's (the trainer's own), else launch.json's
    (ops' record, written when the runs helper starts the trainer, before status.json exists)."""
    for doc in (status, read_json(os.path.join(run_dir, "launch.json"))):
        if doc and isinstance(doc.get("pid"), int):
            return doc["pid"], doc.get("pid_start")
    return None, None


def run_supervisor(run_dir: str) -> int | None:
    """The pid of the run's live supervisor (`runs.py supervise`, a run started with --restart),
    as launch.json records it, or None."""
    launch = read_json(os.path.join(run_dir, "launch.json")) or {}
    supervisor = launch.get("supervisor")
    if not isinstance(supervisor, dict):
        return None
    pid = supervisor.get("pid")
    return pid if isinstance(pid, int) and process_matches(pid, supervisor.get("pid_start")) else None


def live_pid(run_dir: str, status: dict | None) -> int | None:
    """The pid that makes a run live (run_is_live): its trainer's, or between two attempts of a
    run that restarts itself, its supervisor's (it holds the run's GPUs and release meanwhile).
    A `failed` status with a live supervisor is such a pause too: a rank of a group, or a trainer
    that failed with an error, said so before its supervisor restarts it."""
    if status and status.get("state") in FINAL_STATES:
        return run_supervisor(run_dir) if status.get("state") == "failed" else None
    pid, pid_start = run_process(run_dir, status)
    if isinstance(pid, int) and process_matches(pid, pid_start):
        return pid
    return run_supervisor(run_dir)


def run_is_live(run_dir: str, status: dict | None) -> bool:
    """The one rule for "is this run live?": its status is not final and its trainer process
    (run_process), or its supervisor between two attempts, still runs. `status` is its
    status.json as read (None: missing or unreadable, and launch.json names the process).

    Used by the GPU check of a start, the doctor's held GPUs (through `runs.py list`) and the
    release store's prune (a live run's release stays). A run whose trainer died before it wrote
    status.json is not live; one being started is seen under the start lock (start_lock), so a
    caller that must not miss it takes the lock.
    """
    return live_pid(run_dir, status) is not None


def start_lock(runs_root: str) -> int:
    """An exclusive lock on BASE/runs/.start.lock (its fd; os.close releases it). A start holds
    it from its GPU check until launch.json records the new process, so another start's check,
    or a prune deciding which releases live runs use, never sees a run halfway started."""
    import fcntl

    os.makedirs(runs_root, exist_ok=True)
    fd = os.open(os.path.join(runs_root, START_LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def parse_gpus(text: str | None) -> list[int]:
    """'0,1' -> [0, 1]; '' or None -> [] (no GPU). Anything else raises ValueError: an empty
    item, a sign, a space, a duplicate; a silently dropped item would let two runs share a GPU."""
    if not text:
        return []
    if not GPUS_RE.match(text):
        raise ValueError("--gpus must be comma-separated GPU indices like 0,1, got %r" % text)
    gpus = [int(g) for g in text.split(",")]
    if len(set(gpus)) != len(gpus):
        raise ValueError("--gpus names a GPU twice: %r" % text)
    return sorted(gpus)


# ---------------------------------------------------------------- scratch directories

SCRATCH_MARK = ".dflash-scratch"
SCRATCH_RE = re.compile(r"^\.tmp-([a-z]+)-(\d+)-(\d+)-[0-9a-f]{8}$")


def scratch_name(kind: str) -> str:
    """`.tmp-KIND-PID-STARTTICKS-RANDOM`: a name this process owns; a later run removes such an
    entry only when that process is gone and the entry proves it is ours (stale_scratch_kind)."""
    import secrets  # here, not at the top: `runs.py list` and `follow` start faster without it

    pid = os.getpid()
    return ".tmp-%s-%d-%s-%s" % (kind, pid, process_start_ticks(pid), secrets.token_hex(4))


def make_scratch_dir(parent: str, kind: str) -> str:
    """A new scratch directory under parent, marked inside with its own name."""
    name = scratch_name(kind)
    path = os.path.join(parent, name)
    os.mkdir(path)
    try:
        with open(os.path.join(path, SCRATCH_MARK), "w") as f:
            f.write(name)
    except BaseException:
        import shutil

        shutil.rmtree(path, ignore_errors=True)
        raise
    return path


def stale_scratch_kind(parent: str, name: str, kinds: tuple[str, ...]) -> str | None:
    """The kind of `parent/name` when it is a scratch entry of one of `kinds` that its maker left:
    the name has our exact shape and the process it names (pid + start time) no longer runs. A
    directory must also prove it is ours (SCRATCH_MARK holding its name); any other entry is for
    the caller to judge (None for a directory that does not prove it)."""
    m = SCRATCH_RE.match(name)
    if not m or m.group(1) not in kinds:
        return None
    if process_start_ticks(int(m.group(2))) == int(m.group(3)):
        return None  # its maker still runs
    path = os.path.join(parent, name)
    if os.path.isdir(path) and not os.path.islink(path):
        try:
            with open(os.path.join(path, SCRATCH_MARK)) as f:
                if f.read() != name:
                    return None
        except OSError:
            return None
    return m.group(1)
