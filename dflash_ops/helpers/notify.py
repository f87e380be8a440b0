"""Run notifications (python3.8+, stdlib only; shipped beside the helpers that import it).

Every state change of a run is one event (docs/run-lifecycle.md, "Events"):

  {"version": 1, "id": IDEMPOTENCY KEY, "run_id", "target", "state", "step", "reason", "time",
   "log_tail" (failed only)}

state is one of EVENTS; `checkpoint` (one per checkpoint the run writes) only for a spec with
"checkpoints": true. Whoever causes a change writes its event to the container's outbox
(emit(): one file, atomically, before anything is delivered); dispatch() (by the emitter, and by
every `list`) moves it into one bounded queue per destination, and each destination has its own
worker (`runs.py deliver BASE KEY`, started when its queue holds events and none runs), so a
webhook that hangs or fails holds its own events only:

  BASE/runs/.notify/outbox/<seq>-<run id>-<state>.json   an event and where it goes (mode 0600:
                                                          a webhook URL is a secret)
  BASE/runs/.notify/queues/<key>/<seq>-<run id>-<state>.json   one destination's events, oldest
                                                          first (at most QUEUE_MAX wait: past it the
                                                          oldest is dropped, and that is recorded)
  BASE/runs/.notify/queues/<key>/sending-<...>.json      the one under way
  BASE/runs/.notify/queues/<key>/worker.lock, worker.json   flock and pid of its live worker

Where it goes (RUNDIR/notify.json, mode 0600, written by `runs.py start --notify-stdin`):

  {"target": NAME, "webhooks": [URL, ...], "commands": [[ARGV...], ...]}

* a webhook gets a POST of the event as JSON, with the header `Idempotency-Key: <id>` (the same
  on every retry, so a receiver that saw it once drops the repeat); a connection error, a
  timeout, 408, 429 or 5xx is retried after BACKOFF_S; another 4xx is not (it will not change);
* a command runs in the container with the event on stdin and DFLASH_EVENT, DFLASH_RUN_ID,
  DFLASH_TARGET, DFLASH_EVENT_ID in its environment; exit 0 = delivered (retried like a 5xx).

A delivery never touches the run: a worker is its own process, and what fails is written as
a `notify_failed` event (`notify_gave_up` after the last retry; `notify_dropped` for an event its
full queue dropped, `notify_undelivered` for one a stopped worker left queued) to the run's
metrics.jsonl (to BASE/runs/.notify/failures.jsonl while the run has no directory yet: a queued
run); the last three are counted in RUNDIR/notify-status.json, which `run status` shows. URLs appear
there, in logs and in errors only as redact_url() shows them: scheme and host, never the path,
query or user info, where webhook services keep their tokens.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

from . import nodefacts

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

EVENTS = ("queued", "started", "restart", "checkpoint", "stopped", "failed", "done")
NOTIFY_FILE = "notify.json"  # RUNDIR/notify.json
NOTIFY_DIR = ".notify"  # BASE/runs/.notify
BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0)  # waits between attempts: 8 attempts over about 2 min
TIMEOUT_S = 10.0  # one POST or command
COMMAND_TIMEOUT_S = 60.0
LOG_TAIL_CHARS = 4000
URL_RE = re.compile(r"^https?://[^/?#\s]+([/?#]\S*)?$")
OUTBOX_RE = re.compile(r"^[0-9]{20}-.+\.json$")
QUEUE_MAX = 100  # events waiting per destination; past it the oldest is dropped, and that is said
FLUSH_S = 5.0  # a stopped worker's last try at what its queue holds, in all
SENDING = "sending-"  # a queue's event under way: not dropped, and sent first by the next worker
STATUS_FILE = "notify-status.json"  # RUNDIR/: counts of what was not told (run status shows them)
COUNTED = {"notify_dropped": "dropped", "notify_gave_up": "gave_up", "notify_undelivered": "undelivered"}


class BadSpec(ValueError):
    """A notification spec that cannot be delivered (the message says what is wrong)."""


def redact_url(url: str) -> str:
    """scheme://host[:port]/… : what may be shown of a webhook URL (no user info, path or query)."""
    m = re.match(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://(?:[^@/?#]*@)?([^/?#]*)(.*)$", url or "")
    if not m:
        return "<url>"
    return "%s://%s%s" % (m.group(1), m.group(2), "/…" if m.group(3) else "")


def redact(text: str, spec: dict) -> str:
    """text with every webhook URL of spec replaced by its redact_url() form."""
    for url in spec.get("webhooks") or ():
        text = text.replace(url, redact_url(url))
    return text


def check_spec(doc: object) -> dict:
    """The spec in its one shape ({"target", "webhooks", "commands"}, and "checkpoints": true when
    the optional `checkpoint` events are wanted), or BadSpec naming the problem."""
    if not isinstance(doc, dict):
        raise BadSpec("notify: expected an object with webhooks and/or commands, got %s" % type(doc).__name__)
    unknown = sorted(set(doc) - {"target", "webhooks", "commands", "checkpoints"})
    if unknown:
        raise BadSpec("notify: unknown key %r (webhooks, commands, checkpoints)" % unknown[0])
    if not isinstance(doc.get("checkpoints", False), bool):
        raise BadSpec("notify: checkpoints must be true or false, got %r" % (doc["checkpoints"],))
    webhooks = doc.get("webhooks") or []
    commands = doc.get("commands") or []
    if not isinstance(webhooks, list) or not all(isinstance(u, str) and URL_RE.match(u) for u in webhooks):
        bad = [redact_url(u) if isinstance(u, str) else repr(u) for u in (webhooks if isinstance(webhooks, list)
                                                                          else [webhooks])]
        raise BadSpec("notify: webhooks must be http:// or https:// URLs, got %s" % ", ".join(bad))
    if not isinstance(commands, list) or not all(
            isinstance(c, list) and c and all(isinstance(a, str) for a in c) for c in commands):
        raise BadSpec("notify: commands must be argv lists of strings, e.g. [[\"/usr/local/bin/page\", \"--run\"]]")
    spec: dict = {"target": str(doc.get("target") or ""), "webhooks": list(webhooks), "commands": [list(c) for c in commands]}
    if doc.get("checkpoints"):
        spec["checkpoints"] = True  # absent when false: a spec of this shape is one an earlier helper reads
    return spec


def make_event(run_id: str, target: str, state: str, *, step: object = None, reason: str | None = None,
               log_tail: str | None = None, now: float | None = None, seq: int | None = None) -> dict:
    """One event. Its id (the idempotency key) is unique per emission and kept across retries."""
    if state not in EVENTS:
        raise ValueError("unknown event %r (one of %s)" % (state, ", ".join(EVENTS)))
    now = time.time() if now is None else now
    seq = time.time_ns() if seq is None else seq
    event = {"version": 1, "id": "%s/%s/%d" % (run_id, state, seq), "run_id": run_id, "target": target,
             "state": state, "step": step if isinstance(step, int) else None, "reason": reason, "time": now}
    if state == "failed":
        event["log_tail"] = (log_tail or "")[-LOG_TAIL_CHARS:]
    return event


# ---------------------------------------------------------------- the outbox

def notify_root(base: str) -> str:
    return os.path.join(base, "runs", NOTIFY_DIR)


def outbox(base: str) -> str:
    return os.path.join(notify_root(base), "outbox")


def write_spec(run_dir: str, spec: dict) -> None:
    """RUNDIR/notify.json, readable by its owner only."""
    path = os.path.join(run_dir, NOTIFY_FILE)
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, json.dumps(check_spec(spec), sort_keys=True).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read_spec(run_dir: str) -> dict | None:
    doc = nodefacts.read_json(os.path.join(run_dir, NOTIFY_FILE))
    if doc is None:
        return None
    try:
        return check_spec(doc)
    except BadSpec:
        return None


def emit(base: str, spec: dict | None, event: dict) -> bool:
    """Put an event in the outbox (False when the spec names nobody to tell). The caller then
    dispatches it and makes sure its destinations' workers run (run_events.ensure_deliverer)."""
    if not spec or not (spec.get("webhooks") or spec.get("commands")):
        return False
    box = outbox(base)
    os.makedirs(box, mode=0o700, exist_ok=True)
    name = "%020d-%s-%s.json" % (time.time_ns(), event["run_id"], event["state"])
    tmp = os.path.join(box, "." + name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, json.dumps({"event": event, "to": spec}, sort_keys=True).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, os.path.join(box, name))
    return True


def pending(base: str) -> list[str]:
    """The outbox's files, oldest first."""
    return _entries(outbox(base))


def _entries(folder: str) -> list[str]:
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return [os.path.join(folder, n) for n in sorted(names) if OUTBOX_RE.match(n)]


# ---------------------------------------------------------------- a queue per destination

def destinations(spec: dict) -> list[dict]:
    """Every place spec sends to, each as a spec of its own (one webhook or one command)."""
    return ([{"target": spec.get("target") or "", "webhooks": [url], "commands": []} for url in spec.get("webhooks") or ()]
            + [{"target": spec.get("target") or "", "webhooks": [], "commands": [list(argv)]}
               for argv in spec.get("commands") or ()])


def shown_destination(dest: dict) -> str:
    """A destination as it may be shown: a webhook's scheme://host/…, a command's program."""
    urls, commands = dest.get("webhooks") or [], dest.get("commands") or []
    return redact_url(urls[0]) if urls else (commands[0][0] if commands and commands[0] else "?")


def queue_key(dest: dict) -> str:
    """The folder name of a destination's queue (a hash: the URL is a secret, and so its name)."""
    import hashlib

    what = {"webhooks": dest.get("webhooks") or [], "commands": dest.get("commands") or []}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def queues_root(base: str) -> str:
    return os.path.join(notify_root(base), "queues")


def queue_dir(base: str, key: str) -> str:
    return os.path.join(queues_root(base), key)


def _write_private(path: str, data: bytes) -> None:
    """path, mode 0600, whole or not at all (a temporary name beside it, then a rename)."""
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, "." + name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)


def _flock(path: str, wait: bool) -> int | None:
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except OSError:
        os.close(fd)
        return None
    return fd


def dispatch(base: str, queue_max: int = QUEUE_MAX) -> list[str]:
    """Move the outbox into one queue per destination (the same file name, so each queue keeps the
    events' order), then bound each queue: past queue_max waiting events its oldest are dropped, each
    drop a `notify_dropped` record where the run's failures go. Returns the keys of the queues that
    hold events. Anyone may call it (every emitter and `list` does): a lock makes it one at a time.

    Why a queue per destination: one queue for all meant a webhook that timed out (8 attempts of
    10 s, backoff between) held every other destination's events ~3.5 minutes per event."""
    if not pending(base) and not os.path.isdir(queues_root(base)):
        return []
    os.makedirs(queues_root(base), mode=0o700, exist_ok=True)
    fd = _flock(os.path.join(notify_root(base), "dispatch.lock"), wait=True)
    try:
        for path in pending(base):
            doc = nodefacts.read_json(path)
            if doc and isinstance(doc.get("event"), dict) and isinstance(doc.get("to"), dict):
                for dest in destinations(doc["to"]):
                    folder = queue_dir(base, queue_key(dest))
                    os.makedirs(folder, mode=0o700, exist_ok=True)
                    _write_private(os.path.join(folder, os.path.basename(path)),
                                   json.dumps({"event": doc["event"], "to": dest}, sort_keys=True).encode())
            os.unlink(path)  # a crash before this line sends it again, under the same Idempotency-Key
        keys = []
        for key in sorted(os.listdir(queues_root(base))):
            waiting = _entries(queue_dir(base, key))
            for path in waiting[:max(0, len(waiting) - queue_max)]:
                _drop(base, path, queue_max)
            if _entries(queue_dir(base, key)) or _sending(queue_dir(base, key)):
                keys.append(key)
        return keys
    finally:
        if fd is not None:
            os.close(fd)


def _drop(base: str, path: str, queue_max: int) -> None:
    doc = nodefacts.read_json(path) or {}
    try:
        os.unlink(path)
    except FileNotFoundError:
        return  # its worker took it meanwhile
    event, dest = doc.get("event") or {}, doc.get("to") or {}
    record(base, event.get("run_id"), {
        "event": "notify_dropped", "notify": event.get("state"), "notify_id": event.get("id"),
        "to": shown_destination(dest), "time": time.time(), "step": event.get("step"),
        "error": "%d newer events wait for this destination (its queue holds %d): the oldest is dropped"
                 % (queue_max, queue_max)})


def _sending(folder: str) -> list[str]:
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return [os.path.join(folder, n) for n in sorted(names) if n.startswith(SENDING) and OUTBOX_RE.match(n[len(SENDING):])]


def worker_running(base: str, key: str) -> bool:
    fd = _flock(os.path.join(queue_dir(base, key), "worker.lock"), wait=False)
    if fd is None:
        return True
    os.close(fd)
    return False


class _Stop(Exception):
    """SIGTERM reached a worker while it waited or sent: it flushes what it holds and ends."""


def run_worker(base: str, key: str, sleep: Callable[[float], None] = time.sleep,
               flush_s: float = FLUSH_S, backoff: tuple[float, ...] = BACKOFF_S) -> None:
    """Deliver one destination's queue, oldest first, while this process holds its worker lock
    (one worker per destination: a slow one holds only its own events); once it is empty and the
    lock let go, look once more (an event queued meanwhile found the lock held). A SIGTERM (a
    container shutdown) ends the wait or the attempt under way; what the queue holds then gets one
    try each, in order, flush_s in all, and what is left is said (`notify_undelivered` per event,
    a line on stderr) and kept: the next worker sends it."""
    import signal

    folder = queue_dir(base, key)
    if not os.path.isdir(folder):
        return
    armed = {"stop": False, "interruptible": False}

    def on_term(_signum: int, _frame: object) -> None:
        armed["stop"] = True
        if armed["interruptible"]:
            armed["interruptible"] = False
            raise _Stop()

    def interruptible(call: Callable[[], None]) -> None:
        if armed["stop"]:
            raise _Stop()
        armed["interruptible"] = True
        try:
            call()
        finally:
            armed["interruptible"] = False

    on_main = _main_thread()
    previous = signal.signal(signal.SIGTERM, on_term) if on_main else None
    try:
        while True:
            fd = _flock(os.path.join(folder, "worker.lock"), wait=False)
            if fd is None:
                return
            me = {"pid": os.getpid(), "pid_start": nodefacts.process_start_ticks(os.getpid()), "time": time.time()}
            nodefacts.write_atomic(os.path.join(folder, "worker.json"), json.dumps(me).encode())
            try:
                stopped = _serve(base, folder, interruptible, sleep, backoff)
                if stopped:
                    _flush(base, folder, flush_s)
                    return
            finally:
                os.close(fd)
            if not (_entries(folder) or _sending(folder)):
                return
    finally:
        if on_main:
            signal.signal(signal.SIGTERM, previous)


def _next(folder: str) -> str | None:
    """The event to send now: one being sent when the last worker ended, else the oldest waiting,
    marked as being sent (so dispatch's bound never drops the one under way)."""
    for path in _sending(folder):
        return path
    for path in _entries(folder):
        sending = os.path.join(folder, SENDING + os.path.basename(path))
        try:
            os.rename(path, sending)
        except FileNotFoundError:
            continue  # dropped meanwhile
        return sending
    return None


def _serve(base: str, folder: str, interruptible: Callable[[Callable[[], None]], None],
           sleep: Callable[[float], None], backoff: tuple[float, ...]) -> bool:
    """Send the queue until it is empty (False) or a SIGTERM came (True)."""
    while True:
        path = _next(folder)
        if path is None:
            return False
        doc = nodefacts.read_json(path)
        if doc and isinstance(doc.get("event"), dict) and isinstance(doc.get("to"), dict):
            event = doc["event"]
            log = failure_log(base, event.get("run_id"))
            try:
                deliver(doc["to"], event, log, backoff=backoff,
                        sleep=lambda s: interruptible(lambda: sleep(s)),
                        send=lambda to, ev: interruptible(lambda: send_once(to, ev)))
            except _Stop:
                return True
        os.unlink(path)


def _flush(base: str, folder: str, flush_s: float) -> None:
    """A stopped worker's last try: each event once, in order, until one fails or flush_s is
    spent; each one left is said where the run's failures go, and on stderr."""
    deadline = time.monotonic() + flush_s
    left = _sending(folder) + _entries(folder)
    while left and time.monotonic() < deadline - 0.05:
        doc = nodefacts.read_json(left[0]) or {}
        try:
            send_once(doc["to"], doc["event"], timeout=max(0.05, min(TIMEOUT_S, deadline - time.monotonic())))
        except (Failed, KeyError, TypeError):
            break
        os.unlink(left.pop(0))
    for path in left:
        doc = nodefacts.read_json(path) or {}
        event, dest = doc.get("event") or {}, doc.get("to") or {}
        record(base, event.get("run_id"), {
            "event": "notify_undelivered", "notify": event.get("state"), "notify_id": event.get("id"),
            "to": shown_destination(dest), "time": time.time(), "step": event.get("step"),
            "error": "the deliverer was stopped (SIGTERM) before it was delivered; it stays queued and is "
                     "sent when a deliverer next runs (the next event, start or `run list`)"})
    if left:
        first = nodefacts.read_json(left[0]) or {}
        sys.stderr.write("runs.py deliver: stopped with %d event(s) to %s undelivered (kept queued)\n"
                         % (len(left), shown_destination(first.get("to") or {})))


def failure_log(base: str, run_id: object) -> Callable[[dict], None]:
    """Where a run's delivery problems go (record())."""
    return lambda entry: record(base, run_id, entry)


def record(base: str, run_id: object, entry: dict) -> None:
    """One delivery problem: appended to the run's metrics.jsonl (BASE/runs/.notify/failures.jsonl
    while the run has no directory yet) and counted in RUNDIR/notify-status.json, which `run status`
    shows (dropped, given up, undelivered at a stop: what the user must know was not told)."""
    run_dir = os.path.join(base, "runs", str(run_id))
    has_dir = isinstance(run_id, str) and bool(run_id) and not run_id.startswith(".") and os.path.isdir(run_dir)
    path = os.path.join(run_dir, "metrics.jsonl") if has_dir else os.path.join(notify_root(base), "failures.jsonl")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(entry, sort_keys=True) + "\n").encode())
    finally:
        os.close(fd)
    counted = COUNTED.get(str(entry.get("event")))
    if not has_dir or counted is None:
        return
    lock = _flock(os.path.join(run_dir, ".notify-status.lock"), wait=True)
    try:
        doc = nodefacts.read_json(os.path.join(run_dir, STATUS_FILE)) or {}
        before = doc.get(counted)
        doc[counted] = (before if isinstance(before, int) else 0) + 1
        doc["last"] = {k: entry.get(k) for k in ("event", "notify", "to", "error", "time")}
        nodefacts.write_json_atomic(os.path.join(run_dir, STATUS_FILE), doc)
    finally:
        if lock is not None:
            os.close(lock)


def run_summary(base: str, run_id: str) -> dict | None:
    """What `run status` says of a run's notifications: RUNDIR/notify-status.json's counts plus
    the events of this run waiting in any destination's queue now (None: nothing to say)."""
    doc = nodefacts.read_json(os.path.join(base, "runs", run_id, STATUS_FILE)) or {}
    summary = {k: doc[k] for k in COUNTED.values() if isinstance(doc.get(k), int) and doc[k] > 0}
    waiting = 0
    suffix = re.compile(r"^(%s)?[0-9]{20}-%s-[a-z]+\.json$" % (SENDING, re.escape(run_id)))
    try:
        keys = os.listdir(queues_root(base))
    except OSError:
        keys = []
    for key in keys:
        try:
            waiting += sum(1 for n in os.listdir(queue_dir(base, key)) if suffix.match(n))
        except OSError:
            pass
    if waiting:
        summary["waiting"] = waiting
    if summary and isinstance(doc.get("last"), dict):
        summary["last"] = doc["last"]
    return summary or None


# ---------------------------------------------------------------- delivery

class Failed(Exception):
    """One attempt failed; `retry` says whether another may succeed."""

    def __init__(self, message: str, retry: bool = True) -> None:
        super().__init__(message)
        self.retry = retry


def split_credentials(url: str) -> tuple[str, str | None]:
    """(the URL without its `user:token@`, the Authorization header value for it, or None). A
    webhook URL's user info is sent as HTTP Basic authentication, as curl does; urllib sent it to
    nobody (the request failed on the host name, or went out without it) (issue 55)."""
    import base64
    import urllib.parse

    parts = urllib.parse.urlsplit(url)
    if "@" not in parts.netloc:
        return url, None
    userinfo, host = parts.netloc.rsplit("@", 1)
    user, _, token = userinfo.partition(":")
    secret = "%s:%s" % (urllib.parse.unquote(user), urllib.parse.unquote(token))
    bare = urllib.parse.urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))
    return bare, "Basic " + base64.b64encode(secret.encode("utf-8")).decode("ascii")


class _Deadline(Exception):
    pass


def _time_up(_signum: int, _frame: object) -> None:
    raise _Deadline()


def post(url: str, event: dict, timeout: float = TIMEOUT_S) -> None:
    """POST the event as JSON; Failed on anything but a 2xx answer. A redirect is not followed
    (urllib turned a redirected POST into a GET without the event, or refused a 307/308, and a 2xx
    of that counted as delivered): it fails, naming where it points, so the URL is fixed. The whole
    attempt (connect, answer, body) has `timeout` in all: a receiver that trickles bytes no longer
    holds the deliverer (the deliverer is its own single-threaded process: SIGALRM is its own)."""
    import signal
    import urllib.error
    import urllib.request

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
            raise Failed("HTTP %d: redirected to %s; give the webhook's final URL (a redirect is not followed)"
                         % (code, redact_url(newurl)), retry=False)

    bare, authorization = split_credentials(url)
    headers = {"Content-Type": "application/json", "Idempotency-Key": event["id"], "User-Agent": "dflash-ops-notify/1"}
    if authorization:
        headers["Authorization"] = authorization
    request = urllib.request.Request(bare, data=json.dumps(event, sort_keys=True).encode(), method="POST",
                                     headers=headers)
    opener = urllib.request.build_opener(NoRedirect)
    on_main = signal.getsignal(signal.SIGALRM) is not None and _main_thread()
    if on_main:
        previous = signal.signal(signal.SIGALRM, _time_up)
        signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        with opener.open(request, timeout=timeout) as answer:  # noqa: S310 (http/https checked)
            answer.read(65536)
    except _Deadline:
        raise Failed("no complete answer within %gs" % timeout) from None
    except urllib.error.HTTPError as e:
        raise Failed("HTTP %d %s" % (e.code, e.reason), retry=e.code in (408, 429) or e.code >= 500) from None
    except urllib.error.URLError as e:
        raise Failed("cannot reach: %s" % (e.reason,)) from None
    except (OSError, ValueError) as e:  # timeouts, resets, a bad URL
        raise Failed("%s: %s" % (type(e).__name__, e)) from None
    finally:
        if on_main:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def run_command(argv: list[str], event: dict, timeout: float = COMMAND_TIMEOUT_S) -> None:
    """Run a notification command with the event on stdin; Failed unless it exits 0."""
    import subprocess

    env = {"PATH": os.environ.get("PATH") or "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
           "HOME": os.environ.get("HOME") or "/root", "LANG": "C.UTF-8",
           "DFLASH_EVENT": event["state"], "DFLASH_RUN_ID": event["run_id"],
           "DFLASH_TARGET": event.get("target") or "", "DFLASH_EVENT_ID": event["id"]}
    try:
        done = subprocess.run(argv, input=json.dumps(event, sort_keys=True).encode(), env=env, timeout=timeout,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, close_fds=True)
    except subprocess.TimeoutExpired:
        raise Failed("%s: no exit within %gs" % (argv[0], timeout)) from None
    except OSError as e:
        raise Failed("%s: %s" % (argv[0], e.strerror or e), retry=False) from None
    if done.returncode != 0:
        tail = done.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
        raise Failed("%s exited %d%s" % (argv[0], done.returncode, ": " + tail[0][:200] if tail[0] else ""))


def send_once(to: dict, event: dict, timeout: float | None = None) -> None:
    """One attempt at a one-destination spec (destinations()): its webhook or its command."""
    if to.get("webhooks"):
        post(to["webhooks"][0], event, TIMEOUT_S if timeout is None else timeout)
    elif to.get("commands"):
        run_command(to["commands"][0], event, COMMAND_TIMEOUT_S if timeout is None else timeout)


def deliver(spec: dict, event: dict, log_failure: Callable[[dict], None],
            sleep: Callable[[float], None] = time.sleep, backoff: tuple[float, ...] = BACKOFF_S,
            send: Callable[[dict, dict], None] = send_once) -> bool:
    """Deliver one event to every webhook and command of spec, one after another, each retried
    after `backoff`; each failed attempt is handed to log_failure (secrets redacted). True when
    all got it. (The container's workers call it with one destination each: run_worker.)"""
    delivered = True
    for dest in destinations(spec):
        for attempt in range(1, len(backoff) + 2):
            try:
                send(dest, event)
                break
            except Failed as e:
                wait = backoff[attempt - 1] if e.retry and attempt <= len(backoff) else None
                log_failure({"event": "notify_failed" if wait is not None else "notify_gave_up",
                             "notify": event["state"], "notify_id": event["id"], "to": shown_destination(dest),
                             "attempt": attempt, "error": redact(str(e), spec), "retry_in": wait,
                             "time": time.time(), "step": event.get("step")})
                if wait is None:
                    delivered = False
                    break
                sleep(wait)
    return delivered
