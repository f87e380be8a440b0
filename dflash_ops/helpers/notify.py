"""Run notifications (python3.8+, stdlib only; shipped beside the helpers that import it).

Every state change of a run is one event (docs/run-lifecycle.md, "Events"):

  {"version": 1, "id": IDEMPOTENCY KEY, "run_id", "target", "state", "step", "reason", "time",
   "log_tail" (failed only)}

state is one of EVENTS; `checkpoint` (one per checkpoint the run writes) only for a spec with
"checkpoints": true. Whoever causes a change writes its event to the container's outbox
(emit(): one file, atomically, before anything is delivered), and one deliverer per container
(`runs.py deliver BASE`, started by emit's caller when none runs) sends the outbox oldest first:

  BASE/runs/.notify/outbox/<seq>-<run id>-<state>.json   an event and where it goes (mode 0600:
                                                          a webhook URL is a secret)
  BASE/runs/.notify/deliver.lock                          flock held by the live deliverer
  BASE/runs/.notify/deliver.json                          its pid and pid_start

Where it goes (RUNDIR/notify.json, mode 0600, written by `runs.py start --notify-stdin`):

  {"target": NAME, "webhooks": [URL, ...], "commands": [[ARGV...], ...]}

* a webhook gets a POST of the event as JSON, with the header `Idempotency-Key: <id>` (the same
  on every retry, so a receiver that saw it once drops the repeat); a connection error, a
  timeout, 408, 429 or 5xx is retried after BACKOFF_S; another 4xx is not (it will not change);
* a command runs in the container with the event on stdin and DFLASH_EVENT, DFLASH_RUN_ID,
  DFLASH_TARGET, DFLASH_EVENT_ID in its environment; exit 0 = delivered (retried like a 5xx).

A delivery never touches the run: the deliverer is its own process, and what fails is written as
a `notify_failed` event (`notify_gave_up` after the last retry) to the run's metrics.jsonl (to
BASE/runs/.notify/failures.jsonl while the run has no directory yet: a queued run). URLs appear
there, in logs and in errors only as redact_url() shows them: scheme and host, never the path,
query or user info, where webhook services keep their tokens.
"""

from __future__ import annotations

import json
import os
import re
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
    makes sure a deliverer runs (runs.py: start_deliverer)."""
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
    try:
        names = os.listdir(outbox(base))
    except OSError:
        return []
    return [os.path.join(outbox(base), n) for n in sorted(names) if OUTBOX_RE.match(n)]


def deliver_lock(base: str) -> int | None:
    import fcntl

    os.makedirs(notify_root(base), mode=0o700, exist_ok=True)
    fd = os.open(os.path.join(notify_root(base), "deliver.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def deliverer_running(base: str) -> bool:
    fd = deliver_lock(base)
    if fd is None:
        return True
    os.close(fd)
    return False


def run_deliverer(base: str, sleep: Callable[[float], None] = time.sleep) -> None:
    """Deliver the outbox, oldest first, while this process holds the deliver lock; once it is
    empty and the lock let go, look once more (an event emitted meanwhile found the lock held)."""
    while True:
        fd = deliver_lock(base)
        if fd is None:
            return
        me = {"pid": os.getpid(), "pid_start": nodefacts.process_start_ticks(os.getpid()), "time": time.time()}
        nodefacts.write_atomic(os.path.join(notify_root(base), "deliver.json"), json.dumps(me).encode())
        try:
            for path in iter(lambda: next(iter(pending(base)), None), None):
                doc = nodefacts.read_json(path)
                if doc and isinstance(doc.get("event"), dict) and isinstance(doc.get("to"), dict):
                    deliver(doc["to"], doc["event"], failure_log(base, doc["event"].get("run_id")), sleep=sleep)
                os.unlink(path)
        finally:
            os.close(fd)
        if not pending(base):
            return


def failure_log(base: str, run_id: object) -> Callable[[dict], None]:
    """Where delivery failures go: the run's metrics.jsonl, or BASE/runs/.notify/failures.jsonl."""
    run_dir = os.path.join(base, "runs", str(run_id))
    if isinstance(run_id, str) and run_id and not run_id.startswith(".") and os.path.isdir(run_dir):
        path = os.path.join(run_dir, "metrics.jsonl")
    else:
        path = os.path.join(notify_root(base), "failures.jsonl")

    def append(record: dict) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(record, sort_keys=True) + "\n").encode())
        finally:
            os.close(fd)

    return append


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


def _bind(send: Callable[..., None], to: object, event: dict) -> Callable[[], None]:
    return lambda: send(to, event)


def deliver(spec: dict, event: dict, log_failure: Callable[[dict], None],
            sleep: Callable[[float], None] = time.sleep, backoff: tuple[float, ...] = BACKOFF_S) -> bool:
    """Deliver one event to every webhook and command of spec, each retried after `backoff`;
    each failed attempt is handed to log_failure (secrets redacted). True when all got it."""
    sinks: list[tuple[str, Callable[[], None]]] = []
    for url in spec.get("webhooks") or ():
        sinks.append((redact_url(url), _bind(post, url, event)))
    for argv in spec.get("commands") or ():
        sinks.append((argv[0], _bind(run_command, argv, event)))
    delivered = True
    for shown, send in sinks:
        for attempt in range(1, len(backoff) + 2):
            try:
                send()
                break
            except Failed as e:
                wait = backoff[attempt - 1] if e.retry and attempt <= len(backoff) else None
                log_failure({"event": "notify_failed" if wait is not None else "notify_gave_up",
                             "notify": event["state"], "notify_id": event["id"], "to": shown, "attempt": attempt,
                             "error": redact(str(e), spec), "retry_in": wait, "time": time.time(),
                             "step": event.get("step")})
                if wait is None:
                    delivered = False
                    break
                sleep(wait)
    return delivered
