"""A container's run queue on disk (python3.8+, stdlib only; shipped beside the helpers that import it).

`run start --queue` on a container whose GPUs are held puts the run here instead of refusing;
the queue worker (`runs.py queue-worker BASE`) starts it once its GPUs are free. Everything is a
file next to the runs, so the queue survives the operator's disconnect, a new helper version and
a kill -9 of the worker (the next helper call that finds entries and no worker starts one):

  BASE/runs/.queue/<seq>-<run id>/              one queued run (seq: 20 digits; the FIFO order)
      entry.json                                 run id, GPUs, queued time, the release and the
                                                 `runs.py start` arguments it will be started with
      config.input.yaml                          the config as it was when queued
  BASE/runs/.queue/<seq>-<run id>.starting/      claimed by the worker while it starts the run
  BASE/runs/.queue/worker.lock                   flock held by the one live worker
  BASE/runs/.queue/worker.log                    what the worker did (one line per start / failure)
  BASE/runs/.queue/worker.json                   the last worker's pid and pid_start

A queued run waits for its GPUs (a live run holding one of them) and for every run queued
before it that wants one of the same GPUs: first come, first served per GPU, so a run never
overtakes an earlier one on a GPU they share, and one on other GPUs is not held up.

Claiming is a rename, so the worker and `run stop` of a queued run (remove(): a rename too)
never both win: a run is either removed from the queue or started, never both and never lost.
`run stop` records its intent first (request_stop: a `stop` file inside the entry, which travels
with it through every rename), then tries the rename: an entry the worker holds just then is
dropped by the worker if it could not start, or its run gets a stop request once started.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time

from . import nodefacts

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

QUEUE_DIR = ".queue"  # BASE/runs/.queue (run_dirs skips names starting with '.')
ENTRY = "entry.json"
CONFIG = "config.input.yaml"
CLAIMED = ".starting"
STOP = "stop"  # <entry>/stop: `run stop` asked for this queued run (recorded before anything else)
WORKER_LOCK = "worker.lock"
WORKER_LOG = "worker.log"
WORKER_FILE = "worker.json"  # the live worker's pid and pid_start (what `run queue` shows)
ENTRY_RE = re.compile(r"^([0-9]{20})-([A-Za-z0-9][A-Za-z0-9._-]{0,127})$")
POLL_S = 1.0  # how often the worker looks: a run starts within about this after its GPUs are free


def queue_root(base: str) -> str:
    return os.path.join(base, "runs", QUEUE_DIR)


def _scan(base: str) -> list[tuple[int, str, bool, str]]:
    """(seq, run id, claimed, path) of every entry, oldest first."""
    root = queue_root(base)
    try:
        names = os.listdir(root)
    except OSError:
        return []
    found = []
    for name in names:
        claimed = name.endswith(CLAIMED)  # a run id may hold '.', so the suffix is cut before the match
        m = ENTRY_RE.match(name[: -len(CLAIMED)] if claimed else name)
        path = os.path.join(root, name)
        if m and os.path.isfile(os.path.join(path, ENTRY)):
            found.append((int(m.group(1)), m.group(2), claimed, path))
    found.sort()
    return found


def entries(base: str) -> list[dict]:
    """The queued runs, first in line first: entry.json plus `position` (1 = next) and `claimed`."""
    result = []
    for position, (seq, run_id, claimed, path) in enumerate(_scan(base), 1):
        doc = nodefacts.read_json(os.path.join(path, ENTRY)) or {}
        doc.update(run_id=run_id, seq=seq, position=position, claimed=claimed, path=path)
        result.append(doc)
    return result


def find(base: str, run_id: str) -> dict | None:
    for entry in entries(base):
        if entry["run_id"] == run_id:
            return entry
    return None


def add(base: str, run_id: str, gpus: list[int], start_args: list[str], config: bytes,
        files: dict[str, bytes] | None = None, **extra: object) -> dict:
    """Queue a run (the caller holds the start lock and has checked that the id is new).
    `start_args` are the `runs.py start` arguments without --config/--release-root, which the
    worker adds: this entry's config copy and the release resolved now. `files` are written into
    the entry before it is in line (its directory is the owner's only). Returns the entry."""
    root = queue_root(base)
    os.makedirs(root, exist_ok=True)
    last = max((seq for seq, _id, _c, _p in _scan(base)), default=0)
    seq = max(time.time_ns(), last + 1)
    final = os.path.join(root, "%020d-%s" % (seq, run_id))
    tmp = os.path.join(root, ".tmp-%020d-%s" % (seq, run_id))
    os.mkdir(tmp, 0o700)  # the entry may name a notification secret
    nodefacts.write_atomic(os.path.join(tmp, CONFIG), config)
    for name, data in (files or {}).items():
        nodefacts.write_atomic(os.path.join(tmp, name), data)
    doc = dict(extra, run_id=run_id, gpus=gpus, time=time.time(), start_args=start_args)
    nodefacts.write_atomic(os.path.join(tmp, ENTRY), json.dumps(doc, sort_keys=True).encode())
    os.rename(tmp, final)
    nodefacts.fsync_dir(root)
    return find(base, run_id) or doc


def request_stop(base: str, run_id: str) -> bool:
    """Record `run stop` of a queued run in its entry (whichever name it has now: a claim renames
    it, and the file goes with it). False: no such entry."""
    for _attempt in range(5):  # a rename between the scan and the write: look again
        for _seq, rid, _claimed, path in _scan(base):
            if rid != run_id:
                continue
            try:
                nodefacts.write_atomic(os.path.join(path, STOP), json.dumps({"time": time.time()}).encode())
                return True
            except FileNotFoundError:
                break
        else:
            return False
    return False


def stop_requested(path: str) -> bool:
    return os.path.exists(os.path.join(path, STOP))


def entry_problem(entry: dict) -> str | None:
    """Why an entry cannot be started as it says (None: it can): its GPUs are what it waits for,
    its start arguments what starts, so the two must agree (a hand-edited entry.json, one written by
    another version); a disagreement retried every second would block the queue behind it forever."""
    args = entry.get("start_args")
    gpus = entry.get("gpus")
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        return "entry.json's start_args is not a list of strings"
    if not isinstance(gpus, list) or not all(isinstance(g, int) and not isinstance(g, bool) for g in gpus):
        return "entry.json's gpus is not a list of GPU indices: %r" % (gpus,)
    named = args[args.index("--gpus") + 1] if "--gpus" in args[:-1] else ""
    try:
        started = nodefacts.parse_gpus(named)
    except ValueError as e:
        return "entry.json's start arguments: %s" % e
    if sorted(gpus) != started:
        return "entry.json waits for GPU %s but its start arguments name %s" % (
            ",".join(map(str, gpus)) or "none", "--gpus " + named if named else "no GPU")
    if "--run-id" in args[:-1] and args[args.index("--run-id") + 1] != entry.get("run_id"):
        return "entry.json's start arguments name run %r, not %r" % (args[args.index("--run-id") + 1],
                                                                     entry.get("run_id"))
    return None


def remove(base: str, run_id: str) -> str:
    """Take a run out of the queue: "removed", "starting" (the worker claimed it first: it is being
    started, stop it as a run) or "absent"."""
    for _seq, rid, claimed, path in _scan(base):
        if rid != run_id:
            continue
        if claimed:
            return "starting"
        gone = os.path.join(queue_root(base), ".removed-%s-%d" % (run_id, time.time_ns()))
        try:
            os.rename(path, gone)  # the worker's claim is a rename of the same path: one of them wins
        except FileNotFoundError:
            return "starting"
        shutil.rmtree(gone, ignore_errors=True)
        return "removed"
    return "absent"


def claim(entry: dict) -> str | None:
    """Rename an entry to <name>.starting; its new path, or None when it was removed meanwhile."""
    path = entry["path"]
    if path.endswith(CLAIMED):
        return path
    claimed = path + CLAIMED
    try:
        os.rename(path, claimed)
    except FileNotFoundError:
        return None
    return claimed


def unclaim(path: str) -> None:
    """Put a claimed entry back in line, in its old place (its seq is kept)."""
    if path.endswith(CLAIMED):
        os.rename(path, path[: -len(CLAIMED)])


def drop(path: str) -> None:
    """Forget a claimed entry once its run is started (or could not be)."""
    shutil.rmtree(path, ignore_errors=True)


def waits_for(base: str, entry: dict, earlier: list[dict], busy: Callable[[list[int]], list[dict]]) -> list[str]:
    """What a queued run waits for, in words: the live runs holding its GPUs (busy(gpus): the
    runs helper's GPU check) and the runs queued before it on one of its GPUs. [] = it may start."""
    gpus = set(entry.get("gpus") or [])
    why = ["%s (pid %s) holds GPU %s" % (c["run_id"], c.get("pid"), ",".join(map(str, c["gpus"])))
           for c in busy(sorted(gpus))]
    for other in earlier:
        shared = sorted(gpus & set(other.get("gpus") or []))
        if shared:
            why.append("%s is queued before it for GPU %s" % (other["run_id"], ",".join(map(str, shared))))
    return why


def describe(base: str, busy: Callable[[list[int]], list[dict]]) -> list[dict]:
    """Every queued run as `runs.py list` shows it: effective_state `queued`, its position and
    what it waits for."""
    queued = entries(base)
    shown = []
    for i, entry in enumerate(queued):
        why = waits_for(base, entry, queued[:i], busy)
        shown.append({"run_id": entry["run_id"], "state": "queued", "effective_state": "queued",
                      "position": entry["position"], "queued": entry.get("time"), "gpus": entry.get("gpus") or [],
                      "release": entry.get("release"), "restart_policy": entry.get("restart"),
                      "waits_for": why if not entry["claimed"] else ["being started"],
                      "reason": ("waits for " + "; ".join(why)) if why and not entry["claimed"] else None,
                      "alive": False, "has_status": False, "queued_run": True})
    return shown


def worker_lock(base: str, blocking: bool = False) -> int | None:
    """The worker's flock (its fd), or None when another worker holds it."""
    import fcntl

    root = queue_root(base)
    os.makedirs(root, exist_ok=True)
    fd = os.open(os.path.join(root, WORKER_LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except OSError:
        os.close(fd)
        return None
    return fd


def worker_running(base: str) -> bool:
    fd = worker_lock(base)
    if fd is None:
        return True
    os.close(fd)
    return False


def log(base: str, text: str) -> None:
    line = "%s %s\n" % (time.strftime("%Y-%m-%d %H:%M:%S"), text)
    fd = os.open(os.path.join(queue_root(base), WORKER_LOG), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode("utf-8", "replace"))
    finally:
        os.close(fd)


def run_worker(base: str, busy: Callable[[list[int]], list[dict]], start: Callable[[dict, str], str | None],
               poll: float = POLL_S) -> None:
    """Serve the queue while this process holds the worker lock; end when it is empty. After the
    lock is let go the queue is looked at once more: a run queued while this worker was ending
    found the lock held (so no new worker was started) and is served here."""
    while True:
        fd = worker_lock(base)
        if fd is None:
            return  # another worker serves the queue
        me = {"pid": os.getpid(), "pid_start": nodefacts.process_start_ticks(os.getpid()), "time": time.time()}
        nodefacts.write_atomic(os.path.join(queue_root(base), WORKER_FILE), json.dumps(me).encode())
        try:
            serve(base, busy, start, poll)
        finally:
            os.close(fd)
        if not entries(base):
            return


def serve(base: str, busy: Callable[[list[int]], list[dict]], start: Callable[[dict, str], str | None],
          poll: float = POLL_S, sleep: Callable[[float], None] = time.sleep) -> None:
    """The worker's loop, while it holds the worker lock: start every queued run that may start
    (waits_for is empty), oldest first; sleep `poll`; end once the queue is empty.

    start(entry, claimed path) starts one run and returns None, or a reason it could not start
    now ("busy": it goes back in line; anything else: the entry is dropped, the reason logged).
    A claimed entry left by a worker that was killed is put back in line first.
    """
    for entry in entries(base):
        if entry["claimed"]:
            unclaim(entry["path"])
    while True:
        queued = entries(base)
        if not queued:
            return
        for i, entry in enumerate(queued):
            # a stopped entry, or one that cannot start as it says, is served (dropped) at once
            ready = stop_requested(entry["path"]) or entry_problem(entry) is not None
            if not ready and waits_for(base, entry, queued[:i], busy):
                continue
            path = claim(entry)
            if path is None:
                continue  # removed by `run stop` meanwhile
            why = start(entry, path)
            if why == "busy":
                unclaim(path)  # a run took its GPUs meanwhile: it stays in line
                sleep(poll)  # and is looked at again in a while, not at once (it was retried in a tight loop)
                break
            log(base, "%s %s" % (entry["run_id"], "started" if why is None else "not started: " + why))
            drop(path)
            break  # GPUs changed hands: recompute every wait
        else:
            sleep(poll)
