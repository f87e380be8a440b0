"""What the runs helper's tools share (stdlib only, python3.8+): its exit statuses, the run id
and run directory rules, and the readers of a run directory's files (the last lines of a log, the
complete checkpoints, the launch record's GPUs, the OOM kill count).

Not a helper: a shared module shipped beside runs.py (dflash_ops/helpers/__init__.py), like nodefacts.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import re
import time
from collections.abc import Iterator

from . import nodefacts

# Exit statuses, named once for both sides: dflash_ops.runs maps them to its exceptions.
EXIT_NOT_FOUND = nodefacts.EXIT_BAD_INPUT  # bad input, or no such run / file / run directory (Refused's default)
EXIT_REFUSED = 3  # a conflict: the run exists, still runs, or its GPUs are busy
EXIT_DIED_AT_START = 4  # the trainer exited before it wrote status.json
EXIT_NOT_DEPLOYED = 5  # no release root (nothing deployed)
EXIT_TIME_UP = 6  # a follow reached --max-seconds; the run goes on (ask again from the offset reached)
EXIT_TRUNCATED = 7  # the followed file was truncated or replaced (stderr: `truncated OFFSET NEW_SIZE`)
EXIT_BROKEN_PIPE = 141  # the reader went away (128 + SIGPIPE)

LOG_TAIL_LINES = 40
RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

RESTARTS_FILE = "restarts.json"  # RUNDIR/restarts.json: the restart policy and history (runs.py supervise)
NO_RESTART = ".no-restart"  # control/.no-restart: an operator stopped the run; never restart it


Refused = nodefacts.Refused
read_json = nodefacts.read_json
write_atomic = nodefacts.write_atomic


def check_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not RUN_ID_RE.match(run_id):
        raise Refused("bad run id %r (letters, digits, '.', '_', '-'; at most 128, not starting with '.' or '-')"
                      % (run_id,))
    return run_id


def check_run_dir(run_dir: str) -> str:
    """A run directory argument must be BASE/runs/<valid id>: nothing else is read or signalled."""
    parent, name = os.path.split(os.path.normpath(run_dir))
    if os.path.basename(parent) != "runs" or ".." in run_dir.split("/"):
        raise Refused("not a run directory (BASE/runs/ID): %r" % run_dir)
    check_run_id(name)
    return run_dir


def tail_lines(path: str, n: int) -> str:
    """The text of the last n lines of a file ("" when missing)."""
    try:
        with open(path, "rb") as f:
            start = start_of_last_lines(f, n)
            f.seek(start)
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def newlines_before(f: io.BufferedReader, end: int) -> Iterator[int]:
    """Offsets of the newlines before `end`, the last one first (read backwards in blocks)."""
    pos = end
    while pos > 0:
        size = min(65536, pos)
        pos -= size
        f.seek(pos)
        block = f.read(size)
        i = block.rfind(b"\n")
        while i >= 0:
            yield pos + i
            i = block.rfind(b"\n", 0, i)


def start_of_last_lines(f: io.BufferedReader, n: int, end: int | None = None) -> int:
    """Byte offset where the last n complete lines before `end` begin."""
    if end is None:
        end = f.seek(0, os.SEEK_END)
    if n <= 0:
        return end
    # the newline that ends the last line does not start one
    starts = (i + 1 for i in newlines_before(f, end) if i != end - 1)
    return next(itertools.islice(starts, n - 1, None), 0)


def complete_end(f: io.BufferedReader, size: int) -> int:
    """Offset just past the last newline of the file (0 when none)."""
    return next(newlines_before(f, size), -1) + 1


def complete_checkpoints(run_dir: str) -> list[dict]:
    root = os.path.join(run_dir, "checkpoints")
    try:
        names = os.listdir(root)
    except OSError:
        return []
    found: list[dict] = []
    for name in names:
        m = re.match(r"^step_(\d+)$", name)
        if not m or not os.path.isdir(os.path.join(root, name)):
            continue
        manifest = read_json(os.path.join(root, name, "manifest.json"))
        found.append({"step": int(m.group(1)), "path": "checkpoints/" + name, "manifest": manifest})
    found.sort(key=lambda c: c["step"])
    return found



def read_quietly(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def oom_kills() -> int | None:
    """OOM kills counted by this process' memory cgroup (the container's, inside a CT's cgroup
    namespace): cgroup v2 memory.events, else v1 memory.oom_control; None when unreadable."""
    text = read_quietly("/proc/self/cgroup")
    v1 = v2 = None
    for line in text.splitlines():
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if "memory" in controllers.split(","):
            v1 = path
        elif controllers == "":
            v2 = path
    candidates = []
    if v1 is not None:
        candidates.append("/sys/fs/cgroup/memory%s/memory.oom_control" % v1.rstrip("/"))
    if v2 is not None:
        candidates.append("/sys/fs/cgroup%s/memory.events" % v2.rstrip("/"))
    for path in candidates:
        for line in read_quietly(path).splitlines():
            if line.startswith("oom_kill "):
                try:
                    return int(line.split()[1])
                except ValueError:
                    return None
    return None


def run_dirs(base: str) -> list[str]:
    root = os.path.join(base, "runs")
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    return [os.path.join(root, n) for n in names
            if not n.startswith(".") and os.path.isdir(os.path.join(root, n))]



def run_gpus(run_dir: str, status: dict | None) -> list[int]:
    launch = read_json(os.path.join(run_dir, "launch.json")) or {}
    gpus = launch.get("gpus") if launch.get("gpus") else (status or {}).get("gpus")
    return [g for g in (gpus or []) if isinstance(g, int)]



def forbid_restarts(run_dir: str, why: str, signal: str | None = None) -> None:
    """Record an operator's stop first, unconditionally, before anything acts on it: the run's
    supervisor (a run started with --restart) reads it before each attempt and again once the
    attempt is recorded in launch.json, so a stop that finds no trainer (between two attempts, or
    before the first one is recorded) is still served; `signal` (TERM or KILL) is what the
    supervisor sends an attempt it started meanwhile. A run without a supervisor ignores it (a start
    or resume clears it)."""
    control = os.path.join(run_dir, "control")
    os.makedirs(control, exist_ok=True)
    doc = {"why": why, "time": time.time(), "signal": signal}
    write_atomic(os.path.join(control, NO_RESTART), json.dumps(doc).encode())


def control_request(run_dir: str, kind: str) -> str:
    """control/<kind> ("checkpoint" or "stop") created atomically (tmp + link); a request already
    pending is reused. Returns its id. A stop records the operator's intent first (forbid_restarts)."""
    control = os.path.join(run_dir, "control")
    os.makedirs(control, exist_ok=True)
    if kind == "stop":
        forbid_restarts(run_dir, "stop requested")
    request_id = os.urandom(6).hex()
    tmp = os.path.join(control, ".%s.%s.tmp" % (kind, request_id))
    final = os.path.join(control, kind)
    nodefacts.write_file_synced(tmp, json.dumps({"id": request_id, "time": time.time()}).encode())
    try:
        os.link(tmp, final)
    except FileExistsError:
        pending = read_json(final)
        if pending and pending.get("id"):
            request_id = pending["id"]
        else:
            os.replace(tmp, final)  # not a request (unreadable, no id): this one takes its place
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
    return request_id


def stop_intent(run_dir: str) -> dict | None:
    """The operator's recorded stop ({"why", "time", "signal"}; a control/stop request counts as one
    without a signal), or None. An unreadable record is a stop all the same."""
    control = os.path.join(run_dir, "control")
    if os.path.exists(os.path.join(control, NO_RESTART)):
        doc = read_json(os.path.join(control, NO_RESTART))
        return doc if isinstance(doc, dict) else {"why": "stop requested", "signal": None}
    if os.path.exists(os.path.join(control, "stop")):
        return {"why": "stop requested", "signal": None}
    return None


