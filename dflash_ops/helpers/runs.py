"""Run-directory helper: runs inside the container (python3.8+, stdlib only).

Invoked with plain arguments by the operator's side (see docs/run-lifecycle.md):

  runs.py list BASE [--run ID]
  runs.py follow PATH --offset N [--tail-lines N] [--follow] [--poll S] [--until-final RUNDIR]
                 [--max-seconds S]
  runs.py control RUNDIR checkpoint|stop
  runs.py start --base BASE --run-id ID --config FILE|- --release-root DIR --python PY
                [--resume latest|STEP] [--gpus 0,1] [--env KEY=VALUE ...] [--wait S]
                [--restart no|on-failure[:N]]
      PY is the fallback: the release's venv python (BASE/<venv>/bin/python from
      .dflash-release.json) is used when the release names one.
      A rank of a run across hosts adds --group JSON --nnodes N --rdzv-endpoint HOST:PORT
      --local-addr ADDR [--store-host]: the trainer starts under `python -m trainer launch`
      (torchrun) and RUNDIR/group.json records the group (docs/multi-node.md).
      With --restart on-failure:N the trainer runs under `runs.py supervise` (below), which
      resumes it from its latest checkpoint after a crash, at most N times.
  runs.py supervise RUNDIR           (stdin: the launch document, then EOF = go) the parent of the
      trainer: waits for it; after a crash (non-zero exit, a signal, an OOM kill, a lost peer)
      that was not an operator's stop, and while restarts are left, records the restart and its
      reason (RUNDIR/restarts.json, a `restart` event in metrics.jsonl, a line in train.log)
      and starts it again with --resume latest. A stop request or a signal sent through this
      helper leaves control/.no-restart: that ends supervision for good.
      --queue: when the GPUs are held (or wanted by an earlier queued run), the run is queued in
      the container instead (runqueue.py) and the queue worker starts it; --notify-stdin: stdin's
      first line is the notification spec (notify.py), the rest the config; --notify-file PATH
      reads it from a file; either runs the trainer under `supervise`, which sends the events.
  runs.py queue-worker BASE          (detached) start queued runs as their GPUs come free
  runs.py unqueue BASE ID            take a queued run out of the queue (`run stop` of a queued run)
  runs.py deliver BASE               (detached) deliver the container's outbox of run events
  runs.py address [--toward ADDR]    this container's address (the one routed toward ADDR)
  runs.py free-port --address ADDR   a TCP port free on ADDR now (for the rendezvous)
  runs.py signal RUNDIR TERM|KILL
  runs.py checkpoints RUNDIR
  runs.py hash-files ROOT PATH...

Exit status: 0 success, else one of the EXIT_* below (dflash_ops/runs/helper.py imports them).
Errors are one JSON object {"error": ...} on stdout (and the message on stderr).
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (~10 ms at start on 3.8)
if TYPE_CHECKING:
    import subprocess
    from typing import BinaryIO

if __package__:  # imported by the operator's side, as dflash_ops.helpers.runs
    from . import nodefacts, notify, runqueue
else:  # run as a script: nodefacts.py lies beside it (dflash_ops/helpers/__init__.py)
    import nodefacts  # type: ignore[no-redef]
    import notify  # type: ignore[no-redef]
    import runqueue  # type: ignore[no-redef]

# Exit statuses, named once for both sides: dflash_ops.runs maps them to its exceptions.
EXIT_NOT_FOUND = nodefacts.EXIT_BAD_INPUT  # bad input, or no such run / file / run directory (Refused's default)
EXIT_REFUSED = 3  # a conflict: the run exists, still runs, or its GPUs are busy
EXIT_DIED_AT_START = 4  # the trainer exited before it wrote status.json
EXIT_NOT_DEPLOYED = 5  # no release root (nothing deployed)
EXIT_TIME_UP = 6  # a follow reached --max-seconds; the run goes on (ask again from the offset reached)
EXIT_TRUNCATED = 7  # the followed file was truncated or replaced (stderr: `truncated OFFSET NEW_SIZE`)
EXIT_BROKEN_PIPE = 141  # the reader went away (128 + SIGPIPE)

LOG_TAIL_LINES = 40
CHUNK = 1 << 20
RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
CHILD_PATH_TAIL = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PASSED_THROUGH_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "HF_HOME", "HF_TOKEN", "TMPDIR", "TZ")


Refused = nodefacts.Refused
print_json = nodefacts.print_json
read_json = nodefacts.read_json
read_json_checked = nodefacts.read_json_checked
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


def describe_run(run_dir: str, now: float) -> dict:
    status, broken = read_json_checked(os.path.join(run_dir, "status.json"))
    info = dict(status or {})
    info["run_id"] = os.path.basename(run_dir)
    info["has_status"] = status is not None
    info["broken"] = broken
    alive = nodefacts.process_matches(*nodefacts.run_process(run_dir, status))
    info["alive"] = alive
    info["gpus"] = run_gpus(run_dir, status)
    launch = read_json(os.path.join(run_dir, "launch.json")) or {}
    info["launched"] = launch.get("time")
    restarts = read_json(os.path.join(run_dir, RESTARTS_FILE))
    info["restart_policy"] = restarts.get("policy") if restarts else None
    info["restarts"] = restarts.get("restarts", []) if restarts else []
    supervised = nodefacts.run_supervisor(run_dir) is not None
    info["supervised"] = supervised
    # between two attempts the trainer is gone and status.json is the last attempt's
    between = supervised and not (alive and (status or {}).get("pid") == launch.get("pid"))
    info["group"] = read_json(os.path.join(run_dir, "group.json"))
    heartbeat = info.get("heartbeat")
    info["heartbeat_age"] = (now - heartbeat) if isinstance(heartbeat, (int, float)) else None
    try:
        with open(os.path.join(run_dir, "release"), "rb") as f:
            info["release"] = f.read().decode("utf-8", "replace").strip() or None
    except OSError:
        info["release"] = None
    checkpoints = complete_checkpoints(run_dir)
    info["checkpoints"] = [c["step"] for c in checkpoints]
    if not info.get("last_checkpoint") and checkpoints:
        info["last_checkpoint"] = checkpoints[-1]["path"]
    state = info.get("state")
    info["reason"] = None
    info["log_tail"] = None
    if not isinstance(state, str):
        state = info["state"] = None
    if broken:
        info["effective_state"] = "broken"
        info["reason"] = broken + ("; the process still runs" if alive else "")
    elif between and state not in ("stopped", "done"):
        info["alive"] = True
        last = info["restarts"][-1] if info["restarts"] else None
        if last and restarts and (last.get("time") or 0) >= (launch.get("time") or 0):
            info["effective_state"] = "restarting"
            info["reason"] = "restart %s of %s after: %s" % (last.get("n", last.get("attempt")), restarts.get("max"),
                                                             last["reason"])
        else:  # the first attempt of this start has not written its status yet
            info["effective_state"] = "starting"
    elif state in nodefacts.FINAL_STATES:
        info["effective_state"] = state
        info["alive"] = alive or supervised  # a supervisor still ending counts: not over yet
    elif alive:
        info["effective_state"] = state or "starting"
    else:
        info["effective_state"] = "failed"
        info["reason"] = ("process died without saying so" if status is not None
                          else "no status.json and no live process")
        at_launch, now_count = launch.get("oom_kills"), oom_kills()
        if isinstance(at_launch, int) and now_count is not None and now_count > at_launch:
            info["oom_killed"] = True
            info["reason"] = ("OOM kill: the container's memory limit was hit (its memory cgroup counted "
                              "%d OOM kill(s) since the launch)" % (now_count - at_launch))
    if state == "failed" or info["effective_state"] == "failed":
        info["log_tail"] = tail_lines(os.path.join(run_dir, "train.log"), LOG_TAIL_LINES)
    return info


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


def cmd_list(args: argparse.Namespace) -> None:
    now = time.time()
    queued = queued_runs(args.base)
    if args.run:
        run_dir = os.path.join(args.base, "runs", check_run_id(args.run))
        waiting = [q for q in queued if q["run_id"] == args.run]
        if waiting and not os.path.isdir(run_dir):
            runs = waiting
        elif not os.path.isdir(run_dir):
            raise Refused("no run %r under %s" % (args.run, os.path.join(args.base, "runs")))
        else:
            runs = [describe_run(run_dir, now)]
    else:
        runs = [describe_run(d, now) for d in run_dirs(args.base) if RUN_ID_RE.match(os.path.basename(d))]
        runs += [q for q in queued if not os.path.isdir(os.path.join(args.base, "runs", q["run_id"]))]
    print_json({"version": 1, "time": now, "runs": runs})


# ---------------------------------------------------------------- following a file

EXIT_GRACE_S = 30


def run_is_over(run_dir: str) -> bool:
    """True once the trainer process is gone. A final status.json alone is not enough, since
    the trainer still writes its last log lines after it; but a final state whose process
    cannot be identified (no pid_start) or lingers past EXIT_GRACE_S counts as over."""
    if not os.path.isdir(run_dir):
        return True  # the run directory was removed: nothing more will be written
    if nodefacts.run_supervisor(run_dir) is not None:
        return False  # between two attempts, or the last one ending: its supervisor still runs
    status = read_json(os.path.join(run_dir, "status.json"))
    pid, pid_start = nodefacts.run_process(run_dir, status)
    if pid is not None and not nodefacts.process_matches(pid, pid_start):
        return True
    if not status or status.get("state") not in nodefacts.FINAL_STATES:
        return False
    heartbeat = status.get("heartbeat")
    stale = not isinstance(heartbeat, (int, float)) or time.time() - heartbeat > EXIT_GRACE_S
    return pid is None or pid_start is None or stale


def cmd_follow(args: argparse.Namespace) -> int:
    """Stream raw bytes of complete lines; the first line is `#offset <start>`.

    Only whole lines are sent while following (a line still being written waits), so the
    client's offset is always `start + bytes of complete lines received`. When the stream
    ends for good (no --follow, or the run is over) a final unterminated fragment is sent.
    With --max-seconds a follow that is not over by then exits EXIT_TIME_UP after its last
    complete line (no fragment), so a client can stop following promptly or ask again.

    A file that is truncated, rewritten or replaced under the reader (shorter than the
    offset reached, the bytes before the offset changed, a new inode at PATH) ends the
    follow with EXIT_TRUNCATED and a `truncated <offset> <new size>` line on stderr: bytes
    written before the truncation and not yet read are gone, and the client says so.
    """
    out = sys.stdout.buffer
    deadline = None if args.max_seconds is None else time.monotonic() + args.max_seconds
    while True:
        try:
            f = open(args.path, "rb")
            break
        except FileNotFoundError:
            if not args.follow:
                raise Refused("no such file: %s" % args.path) from None
            over = args.until_final and run_is_over(args.until_final)
            if over or time_is_up(deadline):
                send_offset(out, args.offset)
                return 0 if over else EXIT_TIME_UP
            time.sleep(args.poll)
    with f:
        start = args.offset
        size = os.fstat(f.fileno()).st_size
        if args.tail_lines is not None:
            f.seek(0)
            start = start_of_last_lines(f, args.tail_lines, complete_end(f, size))
        send_offset(out, start)
        if start > size:
            return truncated(start, size)
        f.seek(start)
        guard = FileGuard(f, args.path, start)
        pending: list[bytes] = []  # pieces of the unfinished last line, joined once it ends (linear cost)
        while True:
            if args.follow and time_is_up(deadline):
                return EXIT_TIME_UP
            if args.follow and guard.rewritten():
                return truncated(guard.position, guard.size)
            chunk = f.read(CHUNK)
            if chunk:
                guard.advance(chunk)
                send_lines(out, pending, chunk)
                continue
            if not args.follow:
                break
            if guard.replaced():
                return truncated(guard.position, guard.size)
            if args.until_final and run_is_over(args.until_final):
                send_lines(out, pending, f.read())
                break
            time.sleep(args.poll)
        out.write(b"".join(pending))
        out.flush()
    return 0


def send_offset(out: BinaryIO, offset: int) -> None:
    out.write(b"#offset %d\n" % offset)
    out.flush()


def send_lines(out: BinaryIO, pending: list[bytes], chunk: bytes) -> None:
    """Send the complete lines of pending + chunk; keep what follows the last newline in pending."""
    cut = chunk.rfind(b"\n") + 1
    if cut:
        out.write(b"".join(pending) + chunk[:cut] if pending else chunk[:cut])
        out.flush()
        del pending[:]
    if cut < len(chunk):
        pending.append(chunk[cut:])


GUARD_BYTES = 64


def truncated(offset: int, size: int) -> int:
    sys.stdout.flush()
    sys.stderr.write("truncated %d %d\n" % (offset, size))
    return EXIT_TRUNCATED


class FileGuard:
    """Notices a followed file being truncated, rewritten or replaced under the reader.

    Keeps the last GUARD_BYTES read; before each read they must still be there (one pread),
    the file must not be shorter than what was read, and PATH must still be this file.
    """

    def __init__(self, f: io.BufferedReader, path: str, position: int) -> None:
        self.f = f
        self.path = path
        self.position = position
        self.size = position
        self.ino = os.fstat(f.fileno()).st_ino
        back = min(GUARD_BYTES, position)
        self.tail = os.pread(f.fileno(), back, position - back) if back else b""

    def advance(self, data: bytes) -> None:
        self.position += len(data)
        self.tail = (self.tail + data[-GUARD_BYTES:])[-GUARD_BYTES:]

    def rewritten(self) -> bool:
        """Shorter than what was read, or the bytes just before the offset differ."""
        fd = self.f.fileno()
        self.size = os.fstat(fd).st_size
        if self.size < self.position:
            return True
        return bool(self.tail) and os.pread(fd, len(self.tail), self.position - len(self.tail)) != self.tail

    def replaced(self) -> bool:
        """PATH is now another file (log rotation, an editor's save): this one gets no more bytes."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False  # removed; run_is_over ends the follow when the run directory is gone
        if st.st_ino == self.ino:
            return False
        self.size = st.st_size
        return True


def time_is_up(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


# ---------------------------------------------------------------- control requests

def cmd_control(args: argparse.Namespace) -> None:
    """Create control/<kind> atomically; a request already pending is reused (its id printed)."""
    control = os.path.join(check_run_dir(args.run_dir), "control")
    if not os.path.isdir(args.run_dir):
        raise Refused("no run directory %s" % args.run_dir)
    os.makedirs(control, exist_ok=True)
    if args.kind == "stop":
        forbid_restarts(args.run_dir, "stop requested")
    request_id = os.urandom(6).hex()
    tmp = os.path.join(control, ".%s.%s.tmp" % (args.kind, request_id))
    final = os.path.join(control, args.kind)
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
    sys.stdout.write(request_id + "\n")


# ---------------------------------------------------------------- starting a run

def set_aside_stale_requests(run_dir: str) -> list[str]:
    """Control requests left by a trainer that was killed before it served them: a stale
    `stop` would stop the resumed run at its first step. They are renamed (kept, not
    deleted) to control/.KIND.stale-TIME; returns the kinds set aside."""
    control = os.path.join(run_dir, "control")
    stale = []
    for kind in ("stop", "checkpoint"):
        path = os.path.join(control, kind)
        if os.path.isfile(path):
            os.rename(path, os.path.join(control, ".%s.stale-%d" % (kind, time.time() * 1000)))
            stale.append(kind)
    return stale


def run_gpus(run_dir: str, status: dict | None) -> list[int]:
    launch = read_json(os.path.join(run_dir, "launch.json")) or {}
    gpus = launch.get("gpus") if launch.get("gpus") else (status or {}).get("gpus")
    return [g for g in (gpus or []) if isinstance(g, int)]


def gpu_conflicts(base: str, wanted: list[int], own_run_dir: str) -> list[dict]:
    conflicts = []
    for run_dir in run_dirs(base):
        if os.path.abspath(run_dir) == os.path.abspath(own_run_dir):
            continue
        status = read_json(os.path.join(run_dir, "status.json"))
        pid = nodefacts.live_pid(run_dir, status)  # the trainer's, or between two attempts its supervisor's
        if pid is None:
            continue
        held = sorted(set(run_gpus(run_dir, status)) & set(wanted))
        if held:
            conflicts.append({"run_id": os.path.basename(run_dir), "pid": pid, "gpus": held})
    return conflicts


def release_hash(release_root: str) -> str:
    doc = read_json(os.path.join(release_root, ".dflash-release.json"))
    if doc and isinstance(doc.get("hash"), str) and doc["hash"]:
        return doc["hash"]
    return "dev"


def release_python(base: str, release_root: str, fallback: str) -> str:
    """The release's venv python (docs/container-layout.md), else the given python."""
    doc = read_json(os.path.join(release_root, ".dflash-release.json")) or {}
    venv = doc.get("venv")
    if isinstance(venv, str) and venv:
        python = os.path.join(base, venv, "bin", "python")
        if not os.path.exists(python):
            raise Refused("release %s names venv %s but %s is missing; redeploy" % (
                doc.get("hash"), venv, python), code=EXIT_NOT_DEPLOYED)
        return python
    return fallback


def child_env(python: str, gpus: list[int], extra: list[str]) -> dict[str, str]:
    env = {
        "PATH": os.path.dirname(os.path.abspath(python)) + ":" + CHILD_PATH_TAIL,
        "HOME": os.environ.get("HOME") or "/root",
        "LANG": "C.UTF-8",
        "PYTHONUNBUFFERED": "1",
    }
    for key in PASSED_THROUGH_ENV:
        if key in os.environ:
            env[key] = os.environ[key]
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    for item in extra:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise Refused("--env wants KEY=VALUE, got %r" % item)
        env[key] = value
    return env


def cmd_start(args: argparse.Namespace) -> None:
    check_run_id(args.run_id)
    release_root = os.path.realpath(args.release_root)
    if not os.path.isdir(release_root):
        raise Refused("nothing deployed: %s does not exist" % args.release_root, code=EXIT_NOT_DEPLOYED, not_deployed=True)
    python = release_python(args.base, release_root, args.python)
    runs_root = os.path.join(args.base, "runs")
    run_dir = os.path.join(runs_root, args.run_id)
    try:
        gpus = nodefacts.parse_gpus(args.gpus)
    except ValueError as e:
        raise Refused(str(e)) from None
    config_bytes = None
    spec = None
    if args.notify_stdin:  # stdin: the spec's JSON line, then the config (the secret never is an argument)
        data = sys.stdin.buffer.read()
        line, _, rest = data.partition(b"\n")
        spec = check_notify(line.decode("utf-8", "replace"), "--notify-stdin")
        if args.config == "-":
            config_bytes = rest
    elif args.notify_file:
        spec = check_notify(read_bytes(args.notify_file).decode("utf-8", "replace"), args.notify_file)
    if config_bytes is None and args.config is not None:
        config_bytes = sys.stdin.buffer.read() if args.config == "-" else read_bytes(args.config)
    if args.resume is None and config_bytes is None:
        raise Refused("--config is required to start a fresh run")
    if args.group is not None and not (args.nnodes and args.rdzv_endpoint and args.local_addr):
        raise Refused("--group needs --nnodes, --rdzv-endpoint and --local-addr")
    max_restarts = parse_restart(args.restart)
    if spec is not None and max_restarts is None:
        max_restarts = 0  # supervised all the same: the supervisor sees the end and sends its event
    lock = nodefacts.start_lock(runs_root)
    try:
        queued = queue_if_held(args, run_dir, release_root, gpus, config_bytes, spec) if args.queue else None
        child = None if queued else launch(args, run_dir, release_root, python, gpus, config_bytes, max_restarts, spec)
    finally:
        os.close(lock)  # the child's launch.json is written: the next start sees its GPUs
    if child is None:
        ensure_worker(args.base)
        send_event(args.base, spec, args.run_id, "queued", reason="; ".join(queued["waits_for"]))
        print_json(queued)
        return

    status_path = os.path.join(run_dir, "status.json")
    launch_path = os.path.join(run_dir, "launch.json")
    deadline = time.time() + args.wait
    while time.time() < deadline:
        code = child.poll()  # the trainer, or its supervisor (which exits with the trainer's status)
        status = read_json(status_path)
        trainer = child.pid if max_restarts is None else (read_json(launch_path) or {}).get("pid")
        if status is not None and trainer is not None and status.get("pid") == trainer:
            break
        if code is not None:
            tail = tail_lines(os.path.join(run_dir, "train.log"), LOG_TAIL_LINES)
            raise Refused("trainer exited with status %d before writing status.json" % code, code=EXIT_DIED_AT_START,
                          exit_code=code, log_tail=tail, run_id=args.run_id)
        time.sleep(0.02)
    print_json({"run_id": args.run_id, "pid": (read_json(launch_path) or {}).get("pid") or child.pid,
                "run_dir": run_dir, "state": (read_json(status_path) or {}).get("state", "starting"),
                "restart": args.restart or "no"})


def parse_restart(text: str | None) -> int | None:
    """--restart no|on-failure|on-failure:N -> None (not supervised) or N restarts at most."""
    if text in (None, "", "no"):
        return None
    m = re.match(r"^on-failure(?::([0-9]{1,4}))?$", text or "")
    if not m:
        raise Refused("--restart wants no, on-failure or on-failure:N, got %r" % text)
    return DEFAULT_RESTARTS if m.group(1) is None else int(m.group(1))


def launch(args: argparse.Namespace, run_dir: str, release_root: str, python: str, gpus: list[int],
           config_bytes: bytes | None, max_restarts: int | None = None,
           spec: dict | None = None) -> subprocess.Popen[bytes]:
    """Check GPUs and the run directory, then start the trainer and record launch.json
    (called under start_lock). Returns the trainer's process; it logs to RUNDIR/train.log."""
    conflicts = gpu_conflicts(args.base, gpus, run_dir)
    if conflicts:
        names = ", ".join("%s (pid %d) holds GPU %s" % (c["run_id"], c["pid"], ",".join(map(str, c["gpus"])))
                          for c in conflicts)
        raise Refused("GPUs busy: " + names, code=EXIT_REFUSED, conflicts=conflicts)
    config_input = os.path.join(run_dir, "config.input.yaml")
    stale = []
    if args.resume is None:
        try:
            os.mkdir(run_dir)
        except FileExistsError:
            raise Refused("run %s already exists; resume it instead" % args.run_id, code=EXIT_REFUSED, exists=True) from None
        assert config_bytes is not None  # cmd_start refuses a fresh run without --config
        write_atomic(config_input, config_bytes)
    else:
        if not os.path.isdir(run_dir):
            raise Refused("no run %s to resume" % args.run_id)
        status = read_json(os.path.join(run_dir, "status.json"))
        pid, pid_start = nodefacts.run_process(run_dir, status)
        if pid is not None and nodefacts.process_matches(pid, pid_start):
            raise Refused("run %s is still running (pid %d)" % (args.run_id, pid), code=EXIT_REFUSED, running_pid=pid)
        supervisor = nodefacts.run_supervisor(run_dir)
        if supervisor is not None:
            raise Refused("run %s is being restarted by its supervisor (pid %d); stop it first"
                          % (args.run_id, supervisor), code=EXIT_REFUSED, running_pid=supervisor)
        stale = set_aside_stale_requests(run_dir)
        if config_bytes is not None:
            write_atomic(config_input, config_bytes)
        if not os.path.exists(config_input):
            config_input = os.path.join(run_dir, "config.yaml")
    release = release_hash(release_root)
    write_atomic(os.path.join(run_dir, "release"), (release + "\n").encode())
    if spec is not None:
        notify.write_spec(run_dir, spec)
    elif os.path.exists(os.path.join(run_dir, notify.NOTIFY_FILE)):
        os.unlink(os.path.join(run_dir, notify.NOTIFY_FILE))  # this start tells nobody

    argv = [python, "-m", "trainer"]
    if args.group is not None:
        write_atomic(os.path.join(run_dir, "group.json"), json.dumps(args.group, sort_keys=True).encode())
        argv += ["launch", "--nnodes", str(args.nnodes), "--rdzv-endpoint", args.rdzv_endpoint,
                 "--rdzv-id", args.run_id, "--local-addr", args.local_addr]
        argv += ["--store-host"] if args.store_host else []
    argv += ["--config", config_input, "--run-dir", run_dir]
    base_argv = list(argv)
    if args.resume is not None:
        argv += ["--resume", args.resume]
    no_restart = os.path.join(run_dir, "control", NO_RESTART)
    if os.path.exists(no_restart):
        os.unlink(no_restart)  # an operator's start or resume: the last stop is served
    record = {"gpus": gpus, "release_root": release_root, "release": release, "time": time.time(),
              "resume": args.resume, "oom_kills": oom_kills()}
    with open(os.path.join(run_dir, "train.log"), "ab") as log, open(os.devnull, "rb") as devnull:
        for kind in stale:
            log.write(("# dflash-ops: set aside a %s request left from before this start\n" % kind).encode())
        log.write(("# dflash-ops start %s: %s\n" % (time.strftime("%Y-%m-%d %H:%M:%S"), " ".join(argv))).encode())
        log.flush()
        import subprocess  # here, not at the top: `list` and `follow` start faster without it

        env = child_env(python, gpus, args.env)
        if max_restarts is None:
            child = subprocess.Popen(argv, cwd=release_root, env=env, stdin=devnull, stdout=log,
                                     stderr=subprocess.STDOUT, close_fds=True, start_new_session=True)
            record.update(pid=child.pid, pid_start=nodefacts.process_start_ticks(child.pid), argv=argv)
        else:  # the supervisor starts the trainer once launch.json names it (its stdin's EOF says go)
            child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "supervise", run_dir],
                                     cwd=release_root, env=env, stdin=subprocess.PIPE, stdout=log,
                                     stderr=subprocess.STDOUT, close_fds=True, start_new_session=True)
            record["supervisor"] = {"pid": child.pid, "pid_start": nodefacts.process_start_ticks(child.pid)}
            old = read_json(os.path.join(run_dir, RESTARTS_FILE)) if args.resume is not None else None
            history = old.get("restarts") if old and isinstance(old.get("restarts"), list) else []
            # the run's history is kept; this start gets N restarts of its own
            named = "no" if parse_restart(args.restart) is None else "on-failure:%d" % max_restarts
            policy = {"policy": named, "max": max_restarts, "restarts": history}
            write_atomic(os.path.join(run_dir, RESTARTS_FILE), json.dumps(policy, sort_keys=True).encode())
    write_atomic(os.path.join(run_dir, "launch.json"), json.dumps(record, sort_keys=True).encode())
    if max_restarts is not None:
        assert child.stdin is not None
        child.stdin.write(json.dumps({"argv": argv, "restart_argv": base_argv + ["--resume", "latest"],
                                      "fresh_argv": base_argv, "max": max_restarts}).encode())
        child.stdin.close()
    return child


# ---------------------------------------------------------------- supervising a run (--restart on-failure:N)

DEFAULT_RESTARTS = 3
NO_RESTART = ".no-restart"  # control/.no-restart: an operator stopped the run; never restart it
RESTARTS_FILE = "restarts.json"
RESTART_DELAY_S = 1.0


def forbid_restarts(run_dir: str, why: str) -> None:
    """Tell the supervisor of a run started with --restart not to restart it (others: nothing to do)."""
    if not os.path.exists(os.path.join(run_dir, RESTARTS_FILE)):
        return
    control = os.path.join(run_dir, "control")
    os.makedirs(control, exist_ok=True)
    write_atomic(os.path.join(control, NO_RESTART), json.dumps({"why": why, "time": time.time()}).encode())


def crash_reason(code: int, status: dict | None, pid: int, oom_before: int | None) -> str:
    """Why the trainer ended, in words: an OOM kill, a signal, a lost peer, its own error, an exit code."""
    oom_after = oom_kills()
    if code < 0 and oom_before is not None and oom_after is not None and oom_after > oom_before:
        return "OOM kill (SIG%s; the container's memory cgroup counted an OOM kill)" % signal.Signals(-code).name
    error = (status or {}).get("error") if (status or {}).get("pid") == pid else None
    message = str(error.get("message") or "")[:300] if isinstance(error, dict) else ""
    if code < 0:
        try:
            name = "SIG" + signal.Signals(-code).name.replace("SIG", "")
        except ValueError:
            name = "signal %d" % -code
        return "killed by %s" % name
    lost = ("peer", "connection reset", "connection closed", "broken pipe", "rendezvous", "timed out", "nccl", "gloo")
    if message and any(word in message.lower() for word in lost):
        return "lost peer (exit %d): %s" % (code, message)
    return "exit %d%s" % (code, ": " + message if message else "")


def append_line(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, text.encode("utf-8", "replace"))
    finally:
        os.close(fd)


def cmd_supervise(args: argparse.Namespace) -> int:
    """The trainer's parent for a run with --restart (see the module docstring)."""
    import subprocess

    run_dir = check_run_dir(args.run_dir)
    plan = json.loads(sys.stdin.buffer.read().decode("utf-8"))  # EOF: launch.json names this supervisor
    launch_path = os.path.join(run_dir, "launch.json")
    restarts_path = os.path.join(run_dir, RESTARTS_FILE)
    log = os.path.join(run_dir, "train.log")
    argv = plan["argv"]
    used = 0
    tell = run_events(run_dir)
    while True:
        oom_before = oom_kills()
        with open(os.devnull, "rb") as devnull:
            child = subprocess.Popen(argv, stdin=devnull, close_fds=True)
        record = dict(read_json(launch_path) or {}, pid=child.pid, pid_start=nodefacts.process_start_ticks(child.pid), argv=argv,
                      oom_kills=oom_before)
        write_atomic(launch_path, json.dumps(record, sort_keys=True).encode())
        if used == 0:
            tell("started")
        code = child.wait()
        status = read_json(os.path.join(run_dir, "status.json"))
        state = (status or {}).get("state") if (status or {}).get("pid") == child.pid else None
        step = (status or {}).get("step")
        if code == 0 or state in ("stopped", "done"):
            tell(state if state in ("stopped", "done") else "done", step=step)
            return 0
        if os.path.exists(os.path.join(run_dir, "control", NO_RESTART)):
            append_line(log, "# dflash-ops supervise: trainer ended (exit %d) after an operator's stop: not restarted\n"
                        % code)
            tell("stopped", step=step, reason="stopped by the operator (exit %d)" % code)
            return 0
        if state is None:  # it never wrote status.json: a start failure (config, import), not a crash
            append_line(log, "# dflash-ops supervise: trainer exited %d before writing status.json: not restarted\n"
                        % code)
            tell("failed", reason="the trainer exited %d before writing status.json" % code, log_tail=True)
            return code if code > 0 else 128 - code
        reason = crash_reason(code, status, child.pid, oom_before)
        policy = read_json(restarts_path) or {"max": plan["max"], "restarts": []}
        if used >= plan["max"]:
            policy["gave_up"] = {"time": time.time(), "reason": reason}
            write_atomic(restarts_path, json.dumps(policy, sort_keys=True).encode())
            append_line(log, "# dflash-ops supervise: %s; no restart left (%d used): the run stays failed\n"
                        % (reason, used))
            if state not in nodefacts.FINAL_STATES:  # killed before it could say so
                write_status_failed(run_dir, status, reason)
            tell("failed", step=step, reason=reason if not used else "%s; no restart left (%d used)" % (reason, used),
                 log_tail=True)
            return code if code > 0 else 128 - code
        used += 1
        checkpoints = complete_checkpoints(run_dir)
        argv = plan["restart_argv"] if checkpoints else plan["fresh_argv"]
        attempt = len(policy.get("restarts", [])) + 1
        entry = {"attempt": attempt, "n": used, "time": time.time(), "reason": reason, "exit_code": code,
                 "step": (status or {}).get("step"),
                 "from": checkpoints[-1]["path"] if checkpoints else None}
        policy.setdefault("restarts", []).append(entry)
        write_atomic(restarts_path, json.dumps(policy, sort_keys=True).encode())
        event = dict(entry, event="restart", max=plan["max"])
        append_line(os.path.join(run_dir, "metrics.jsonl"), json.dumps(event, sort_keys=True) + "\n")
        append_line(log, "# dflash-ops supervise %s: %s at step %s; restart %d of %d from %s\n" % (
            time.strftime("%Y-%m-%d %H:%M:%S"), reason, entry["step"], used, plan["max"],
            entry["from"] or "the start (no checkpoint yet)"))
        tell("restart", step=entry["step"], reason="restart %d of %d after: %s" % (used, plan["max"], reason))
        # a pending checkpoint request stays for the next attempt to serve (a stop one ended supervision above)
        time.sleep(RESTART_DELAY_S)


def write_status_failed(run_dir: str, status: dict | None, reason: str) -> None:
    """A trainer killed without a word leaves a live-looking status.json; say what happened."""
    doc = dict(status or {}, state="failed", error={"message": reason, "thread": "supervisor"})
    write_atomic(os.path.join(run_dir, "status.json"), json.dumps(doc, sort_keys=True).encode())


# ---------------------------------------------------------------- the queue and run events (#39)

def spawn_detached(command: list[str], log_path: str) -> None:
    """Start `runs.py COMMAND...` in its own session (it outlives this call and the operator's
    connection), output appended to log_path."""
    import subprocess

    with open(os.devnull, "rb") as devnull, open(log_path, "ab") as out:
        subprocess.Popen([sys.executable, os.path.abspath(__file__), *command], stdin=devnull, stdout=out,
                         stderr=subprocess.STDOUT, close_fds=True, start_new_session=True, cwd="/")


def ensure_worker(base: str) -> None:
    """A queue worker runs while runs are queued: start one when none holds the worker lock (the
    first queued run, or after one was killed: every start and list comes here)."""
    if runqueue.entries(base) and not runqueue.worker_running(base):
        spawn_detached(["queue-worker", base], os.path.join(runqueue.queue_root(base), runqueue.WORKER_LOG))


def ensure_deliverer(base: str) -> None:
    if notify.pending(base) and not notify.deliverer_running(base):
        spawn_detached(["deliver", base], os.path.join(notify.notify_root(base), "deliver.log"))


def send_event(base: str, spec: dict | None, run_id: str, state: str, step: object = None,
               reason: str | None = None, log_tail: str | None = None) -> None:
    """Queue one run event for delivery (notify.py). Never raises: telling comes after the run."""
    try:
        event = notify.make_event(run_id, (spec or {}).get("target") or "", state, step=step, reason=reason,
                                  log_tail=log_tail)
        if notify.emit(base, spec, event):
            ensure_deliverer(base)
    except Exception as e:  # noqa: BLE001 (a full disk or a broken spec must not end a start or a supervisor)
        sys.stderr.write("runs.py: the %s event of %s was not queued: %s\n" % (state, run_id, e))


def run_events(run_dir: str) -> Callable[..., None]:
    """tell(state, step=, reason=, log_tail=True) for the supervisor: an event of this run to whom
    RUNDIR/notify.json names (nobody: nothing happens); log_tail=True sends train.log's tail."""
    base = os.path.dirname(os.path.dirname(os.path.abspath(run_dir)))
    run_id = os.path.basename(os.path.normpath(run_dir))

    def tell(state: str, step: object = None, reason: str | None = None, log_tail: bool = False) -> None:
        spec = notify.read_spec(run_dir)
        if spec is None:
            return
        tail = tail_lines(os.path.join(run_dir, "train.log"), LOG_TAIL_LINES) if log_tail else None
        send_event(base, spec, run_id, state, step=step, reason=reason, log_tail=tail)
        if state in nodefacts.FINAL_STATES:
            ensure_worker(base)  # the run's GPUs are free: a killed queue worker is replaced now

    return tell


def check_notify(text: str, where: str) -> dict:
    try:
        return notify.check_spec(json.loads(text))
    except ValueError as e:  # BadSpec is a ValueError; so is bad JSON
        raise Refused("%s: %s" % (where, e if isinstance(e, notify.BadSpec) else "not a JSON notification spec")) from None


def queued_runs(base: str) -> list[dict]:
    """The queued runs as `list` shows them; a queue left without a worker gets one."""
    queued = runqueue.describe(base, lambda wanted: gpu_conflicts(base, wanted, ""))
    if queued:
        ensure_worker(base)
    ensure_deliverer(base)
    return queued


def queue_if_held(args: argparse.Namespace, run_dir: str, release_root: str, gpus: list[int],
                  config_bytes: bytes | None, spec: dict | None) -> dict | None:
    """Under the start lock: queue this start (its answer) when a live run holds one of its GPUs or
    a run queued before wants one; None: it may start now. The release is resolved now, so the run
    starts on the code it was queued with (prune keeps it: release_store.live_run_releases)."""
    if args.resume is not None:
        raise Refused("--queue starts a fresh run; resume a run when its GPUs are free")
    if os.path.exists(run_dir) or runqueue.find(args.base, args.run_id):
        raise Refused("run %s already exists; resume it instead" % args.run_id, code=EXIT_REFUSED, exists=True)
    why = runqueue.waits_for(args.base, {"gpus": gpus}, runqueue.entries(args.base),
                             lambda wanted: gpu_conflicts(args.base, wanted, run_dir))
    if not why:
        return None
    assert config_bytes is not None  # cmd_start refuses a fresh run without --config
    start_args = ["--base", args.base, "--run-id", args.run_id, "--python", args.python]
    start_args += ["--gpus", ",".join(map(str, gpus))] if gpus else []
    start_args += [a for item in args.env for a in ("--env", item)]
    start_args += ["--restart", args.restart] if args.restart else []
    files = {notify.NOTIFY_FILE: json.dumps(spec, sort_keys=True).encode()} if spec else {}
    entry = runqueue.add(args.base, args.run_id, gpus, start_args, config_bytes, files,
                         release=release_hash(release_root), release_root=release_root, restart=args.restart)
    return {"run_id": args.run_id, "state": "queued", "position": entry.get("position"), "waits_for": why,
            "run_dir": run_dir, "restart": args.restart or "no"}


def start_queued(base: str, entry: dict, path: str) -> str | None:
    """The queue worker's start of one claimed entry: `runs.py start` with its saved arguments,
    config and release. None: started; "busy": a run took its GPUs meanwhile (it stays queued)."""
    import subprocess

    argv = [sys.executable, os.path.abspath(__file__), "start", *entry.get("start_args", []),
            "--config", os.path.join(path, runqueue.CONFIG), "--release-root", str(entry.get("release_root")),
            "--wait", "5"]
    spec_path = os.path.join(path, notify.NOTIFY_FILE)
    if os.path.exists(spec_path):
        argv += ["--notify-file", spec_path]
    done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          close_fds=True)
    if done.returncode == 0:
        return None
    lines = done.stdout.decode("utf-8", "replace").strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else {}
    except ValueError:
        answer = {}
    if done.returncode == EXIT_REFUSED and answer.get("conflicts"):
        return "busy"
    if done.returncode == EXIT_REFUSED and answer.get("exists"):
        return "its run directory exists already (started before the last worker ended)"
    reason = str(answer.get("error") or "runs.py start exited %d" % done.returncode)
    if done.returncode != EXIT_DIED_AT_START:  # else its supervisor has said so
        spec = notify.read_spec(path)
        send_event(base, spec, entry["run_id"], "failed", reason="could not start from the queue: " + reason,
                   log_tail=answer.get("log_tail"))
    return reason


def cmd_queue_worker(args: argparse.Namespace) -> None:
    runqueue.run_worker(args.base, lambda wanted: gpu_conflicts(args.base, wanted, ""),
                        lambda entry, path: start_queued(args.base, entry, path))


def cmd_unqueue(args: argparse.Namespace) -> None:
    """Take a queued run out of the queue. `result`: removed, starting (the worker got it first:
    stop it as a run) or absent."""
    check_run_id(args.run_id)
    entry = runqueue.find(args.base, args.run_id)
    spec = notify.read_spec(entry["path"]) if entry else None
    result = runqueue.remove(args.base, args.run_id)
    if result == "removed":
        send_event(args.base, spec, args.run_id, "stopped", reason="removed from the queue before it started")
    print_json({"run_id": args.run_id, "result": result})


def cmd_deliver(args: argparse.Namespace) -> None:
    notify.run_deliverer(args.base)


def parse_group(text: str) -> dict:
    try:
        group = json.loads(text)
    except ValueError:
        raise Refused("--group wants a JSON object, got %r" % text) from None
    if not isinstance(group, dict) or not isinstance(group.get("targets"), list) or not isinstance(group.get("index"), int):
        raise Refused("--group wants {\"targets\": [...], \"index\": N, ...}, got %r" % text)
    return group


def cmd_address(args: argparse.Namespace) -> None:
    """The address other hosts reach this container at: the source address of a route toward
    --toward (a UDP connect sends nothing), else the hostname's address."""
    if args.toward:
        address = sockname(socket.SOCK_DGRAM, "connect", (args.toward, 9),
                           "no route from this container toward %s" % args.toward)[0]
    else:
        try:
            address = socket.gethostbyname(socket.gethostname())
        except OSError as e:
            raise Refused("cannot tell this container's address: %s" % (e.strerror or e)) from None
    print_json({"address": address, "hostname": socket.gethostname()})


def cmd_free_port(args: argparse.Namespace) -> None:
    port = sockname(socket.SOCK_STREAM, "bind", (args.address, 0),
                    "cannot bind a port on %s in this container" % args.address)[1]
    print_json({"address": args.address, "port": port})


def sockname(kind: int, op: str, address: tuple[str, int], failure: str) -> tuple:
    """The local (address, port) of an IPv4 socket after its `op` ("connect" or "bind") to address."""
    with socket.socket(socket.AF_INET, kind) as s:
        try:
            getattr(s, op)(address)
            return s.getsockname()
        except OSError as e:
            raise Refused("%s: %s" % (failure, e.strerror or e)) from None


def read_bytes(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise Refused("cannot read %s: %s" % (path, e.strerror)) from None


# ---------------------------------------------------------------- signals, checkpoints, hashes

def launched_process(run_dir: str) -> tuple[int | None, str | None]:
    """(pid, why not) of the trainer this helper started for run_dir, verified: launch.json (ops'
    own record, never the trainer-written status.json) names a pid whose start time and
    command line are still the ones recorded at launch. Any doubt means: not ours."""
    launch, problem = read_json_checked(os.path.join(run_dir, "launch.json"))
    if launch is None:
        return None, problem or "no launch.json: not started by dflash-ops"
    pid, pid_start, argv = launch.get("pid"), launch.get("pid_start"), launch.get("argv")
    if not (isinstance(pid, int) and pid > 1 and isinstance(pid_start, int) and isinstance(argv, list) and argv):
        return None, "launch.json does not identify a process"
    if nodefacts.process_start_ticks(pid) != pid_start:
        return None, "not running"
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            cmdline = f.read().split(b"\0")[:-1]
    except OSError:
        return None, "not running"
    # argv[0] is the python that was started; it may be a wrapper that exec'ed the real one
    want = [a.encode("utf-8", "surrogateescape") for a in argv[1:] if isinstance(a, str)]
    if len(want) != len(argv) - 1 or cmdline[len(cmdline) - len(want):] != want or len(cmdline) <= len(want):
        return None, "pid %d runs another command than the one launched" % pid
    return pid, None


def cmd_signal(args: argparse.Namespace) -> None:
    check_run_dir(args.run_dir)
    pid, why = launched_process(args.run_dir)
    if pid is None:
        print_json({"sent": False, "pid": None, "reason": why})
        return
    forbid_restarts(args.run_dir, "SIG%s sent by the operator" % args.signal)
    os.kill(pid, signal.SIGTERM if args.signal == "TERM" else signal.SIGKILL)
    print_json({"sent": True, "pid": pid, "signal": args.signal})


def cmd_checkpoints(args: argparse.Namespace) -> None:
    check_run_dir(args.run_dir)
    if not os.path.isdir(args.run_dir):
        raise Refused("no run directory %s" % args.run_dir)
    print_json(complete_checkpoints(args.run_dir))


def sha256_file(path: str) -> dict:
    import hashlib  # here, not at the top: loading OpenSSL is most of what `list` would spend on it

    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            size += len(block)
            h.update(block)
    return {"size": size, "sha256": h.hexdigest()}


def cmd_hash_files(args: argparse.Namespace) -> None:
    result: dict[str, dict] = {}
    for rel in args.paths:
        try:
            result[rel] = sha256_file(os.path.join(args.root, rel))
        except OSError as e:
            result[rel] = {"error": e.strerror or str(e)}
    print_json(result)


# ---------------------------------------------------------------- argument parsing

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="runs.py")
    sub = p.add_subparsers(dest="command", required=True)

    def command(name: str, func: Callable[[argparse.Namespace], int | None],
                *positionals: str) -> argparse.ArgumentParser:
        s = sub.add_parser(name)
        for positional in positionals:
            s.add_argument(positional)
        s.set_defaults(func=func)
        return s

    command("list", cmd_list, "base").add_argument("--run")

    s = command("follow", cmd_follow, "path")
    s.add_argument("--offset", type=int, default=0)
    s.add_argument("--tail-lines", type=int)
    s.add_argument("--follow", action="store_true")
    s.add_argument("--poll", type=float, default=0.2)
    s.add_argument("--until-final", metavar="RUNDIR")
    s.add_argument("--max-seconds", type=float)

    command("control", cmd_control, "run_dir").add_argument("kind", choices=("checkpoint", "stop"))

    s = command("start", cmd_start)
    s.add_argument("--base", required=True)
    s.add_argument("--run-id", required=True)
    s.add_argument("--config")
    s.add_argument("--release-root", required=True)
    s.add_argument("--python", required=True)
    s.add_argument("--resume")
    s.add_argument("--gpus")
    s.add_argument("--env", action="append", default=[])
    s.add_argument("--wait", type=float, default=30.0)
    s.add_argument("--group", type=parse_group)
    s.add_argument("--nnodes", type=int)
    s.add_argument("--rdzv-endpoint")
    s.add_argument("--local-addr")
    s.add_argument("--store-host", action="store_true")
    s.add_argument("--restart")
    s.add_argument("--queue", action="store_true")
    s.add_argument("--notify-stdin", action="store_true")
    s.add_argument("--notify-file")

    command("supervise", cmd_supervise, "run_dir")
    command("queue-worker", cmd_queue_worker, "base")
    command("unqueue", cmd_unqueue, "base", "run_id")
    command("deliver", cmd_deliver, "base")

    command("address", cmd_address).add_argument("--toward")
    command("free-port", cmd_free_port).add_argument("--address", required=True)
    command("signal", cmd_signal, "run_dir").add_argument("signal", choices=("TERM", "KILL"))
    command("checkpoints", cmd_checkpoints, "run_dir")
    command("hash-files", cmd_hash_files, "root").add_argument("paths", nargs="+")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except Refused as e:
        return e.answer("runs.py %s" % args.command)
    except BrokenPipeError:
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
