"""Run events and their delivery (dflash_ops/helpers/notify.py) against a real HTTP sink on 127.0.0.1."""

from __future__ import annotations

import json
import os
import stat
import sys

import pytest

from dflash_ops.helpers import notify
from tests.http_sink import HttpSink


@pytest.fixture
def sink():
    s = HttpSink()
    yield s
    s.close()


def no_wait(_seconds: float) -> None:
    pass


def test_redact_url_keeps_scheme_and_host_only():
    assert notify.redact_url("https://hooks.example.com/services/T0/B0/XXXX") == "https://hooks.example.com/…"
    assert notify.redact_url("http://user:pw@10.0.0.1:8080/x?token=1") == "http://10.0.0.1:8080/…"
    assert notify.redact_url("https://ntfy.sh") == "https://ntfy.sh"
    assert notify.redact_url("not a url") == "<url>"


def test_check_spec_names_the_problem_without_the_secret():
    assert notify.check_spec({"webhooks": ["https://h/x"]}) == {"target": "", "webhooks": ["https://h/x"],
                                                                 "commands": []}
    with pytest.raises(notify.BadSpec, match="unknown key 'hooks'"):
        notify.check_spec({"hooks": []})
    with pytest.raises(notify.BadSpec, match="http:// or https://") as bad:
        notify.check_spec({"webhooks": ["ftp://h/s3cret"]})
    assert "s3cret" not in str(bad.value)
    with pytest.raises(notify.BadSpec, match="argv lists"):
        notify.check_spec({"commands": ["echo hi"]})


def test_a_webhook_answering_500_twice_gets_one_event_retried_under_one_key(sink):
    sink.fail_first = [500, 503]
    spec = notify.check_spec({"target": "host200", "webhooks": [sink.url()]})
    event = notify.make_event("r1", "host200", "failed", step=7, reason="exit 1: boom", log_tail="a\nb\n")
    failures: list[dict] = []
    assert notify.deliver(spec, event, failures.append, sleep=no_wait)
    assert [r.answered for r in sink.received] == [500, 503, 200]
    assert {r.headers["Idempotency-Key"] for r in sink.received} == {event["id"]}
    assert sink.delivered() == [event]
    body = sink.delivered()[0]
    assert (body["run_id"], body["target"], body["state"], body["step"], body["reason"]) == (
        "r1", "host200", "failed", 7, "exit 1: boom")
    assert body["log_tail"] == "a\nb\n" and isinstance(body["time"], float)
    assert [(f["event"], f["attempt"], f["retry_in"]) for f in failures] == [
        ("notify_failed", 1, 1.0), ("notify_failed", 2, 2.0)]
    assert "s3cret" not in json.dumps(failures) and failures[0]["to"].endswith("/…")


def test_a_4xx_is_not_retried_and_an_unreachable_hook_gives_up(sink):
    sink.fail_first = [404]
    event = notify.make_event("r1", "t", "done")
    failures: list[dict] = []
    assert not notify.deliver({"webhooks": [sink.url()]}, event, failures.append, sleep=no_wait)
    assert len(sink.received) == 1 and [f["event"] for f in failures] == ["notify_gave_up"]
    sink.close()
    failures.clear()
    assert not notify.deliver({"webhooks": [sink.url()]}, event, failures.append, sleep=no_wait, backoff=(0.0, 0.0))
    assert [f["event"] for f in failures] == ["notify_failed", "notify_failed", "notify_gave_up"]
    assert "cannot reach" in failures[-1]["error"] and "s3cret" not in json.dumps(failures)


def test_a_command_gets_the_event_on_stdin_and_in_its_environment(tmp_path):
    out = tmp_path / "got.json"
    script = "import json,os,sys; d=json.load(sys.stdin); d['env']=os.environ['DFLASH_EVENT']; " \
             "open(sys.argv[1],'w').write(json.dumps(d))"
    event = notify.make_event("r2", "t", "started", step=0)
    assert notify.deliver({"commands": [[sys.executable, "-c", script, str(out)]]}, event, [].append, sleep=no_wait)
    got = json.loads(out.read_text())
    assert got["id"] == event["id"] and got["env"] == "started"
    failures: list[dict] = []
    assert not notify.deliver({"commands": [[sys.executable, "-c", "raise SystemExit(3)"]]}, event,
                              failures.append, sleep=no_wait, backoff=())
    assert failures[0]["event"] == "notify_gave_up" and "exited 3" in failures[0]["error"]


def test_the_outbox_is_delivered_in_order_and_failures_land_in_the_runs_metrics(tmp_path, sink):
    base = str(tmp_path)
    run_dir = tmp_path / "runs" / "r3"
    run_dir.mkdir(parents=True)
    sink.fail_first = [500]
    spec = {"target": "t", "webhooks": [sink.url()], "commands": []}
    events = [notify.make_event("r3", "t", state) for state in ("started", "restart", "done")]
    for event in events:
        assert notify.emit(base, spec, event)
    box = notify.pending(base)
    assert len(box) == 3 and all(stat.S_IMODE(os.stat(p).st_mode) == 0o600 for p in box)
    assert not notify.emit(base, {"webhooks": [], "commands": []}, events[0])  # nobody to tell: nothing queued
    keys = notify.dispatch(base)
    assert notify.pending(base) == [] and len(keys) == 1
    notify.run_worker(base, keys[0], sleep=no_wait)
    assert [e["state"] for e in sink.delivered()] == ["started", "restart", "done"]
    assert notify.dispatch(base) == []
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(e["event"], e["notify"]) for e in logged] == [("notify_failed", "started")]
    assert "s3cret" not in (run_dir / "metrics.jsonl").read_text()


def test_spec_file_is_private(tmp_path):
    notify.write_spec(str(tmp_path), {"webhooks": ["https://h/s3cret"]})
    assert stat.S_IMODE(os.stat(tmp_path / notify.NOTIFY_FILE).st_mode) == 0o600
    assert notify.read_spec(str(tmp_path))["webhooks"] == ["https://h/s3cret"]


def test_a_follower_runs_local_commands_on_the_changes_it_sees(tmp_path):
    from dflash_ops.runs.info import RunInfo
    from dflash_ops.runs.local_notify import LocalNotifier

    out = tmp_path / "events.jsonl"
    script = "import sys; open(sys.argv[1], 'a').write(sys.stdin.read() + '\\n')"
    errors: list[str] = []
    notifier = LocalNotifier("host200", [[sys.executable, "-c", script, str(out)]], errors.append)

    def see(state, **fields):
        made = notifier.see(RunInfo.from_json({"run_id": "r", "effective_state": state, **fields}))
        notifier.wait()
        return [e["state"] for e in made]

    assert see("queued") == []  # first sight: no change seen yet
    assert see("queued") == []
    assert see("starting") == ["started"]
    assert see("running", step=3) == []  # still started
    assert see("restarting", restarts=[{"reason": "killed by SIGKILL", "step": 3}]) == ["restart"]
    assert see("running", restarts=[{"reason": "killed by SIGKILL", "step": 3}]) == []
    assert see("failed", reason="exit 1", log_tail="boom\n", restarts=[{}]) == ["failed"]
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(e["state"], e["target"]) for e in got] == [("started", "host200"), ("restart", "host200"),
                                                         ("failed", "host200")]
    assert got[1]["reason"] == "killed by SIGKILL" and got[2]["log_tail"] == "boom\n" and not errors
    failing = LocalNotifier("host200", [[sys.executable, "-c", "raise SystemExit(4)"]], errors.append)
    failing.see(RunInfo(run_id="r", effective_state="running"))
    failing.see(RunInfo(run_id="r", effective_state="done"))
    failing.wait()
    assert len(errors) == 1 and "done event of r" in errors[0] and "exited 4" in errors[0]


class _Receiver:
    """A webhook receiver on 127.0.0.1 whose answer the test chooses: a redirect, a Basic-auth
    check, or an answer trickled a byte at a time."""

    def __init__(self, mode: str) -> None:
        import http.server
        import threading

        self.requests: list[tuple[str, dict, bytes]] = []
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                receiver.requests.append((self.path, dict(self.headers), body))
                self._answer()

            def do_GET(self) -> None:  # noqa: N802 - where urllib sent a redirected POST, without its body
                receiver.requests.append((self.path, dict(self.headers), b""))
                self.send_response(200)
                self.end_headers()

            def _answer(self) -> None:
                import time

                if mode == "redirect" and self.path == "/old":
                    self.send_response(302)
                    self.send_header("Location", "/new")
                    self.end_headers()
                elif mode == "trickle":
                    self.wfile.write(b"HTTP/1.1 200 OK\r\n")
                    try:
                        for _ in range(60):
                            self.wfile.write(b"X-Slow: 1\r\n")
                            self.wfile.flush()
                            time.sleep(0.1)
                    except OSError:
                        pass  # the deliverer gave up
                else:
                    self.send_response(200)
                    self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.base = "127.0.0.1:%d" % self.server.server_address[1]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_webhook_behind_a_redirect_is_not_counted_as_delivered():
    """urllib turned the redirected POST into a GET without the event, the GET answered 200, and
    the delivery counted as done (issue 55): a redirect is a failure naming where it points."""
    r = _Receiver("redirect")
    try:
        failures: list[dict] = []
        event = notify.make_event("r1", "t", "done")
        spec = {"target": "t", "webhooks": [f"http://{r.base}/old"], "commands": []}
        assert notify.deliver(spec, event, failures.append, sleep=lambda _s: None) is False
        assert [p for p, _h, _b in r.requests] == ["/old"]  # no GET to /new
        assert failures[-1]["event"] == "notify_gave_up" and "redirected to http://127.0.0.1" in failures[-1]["error"]
    finally:
        r.close()


def test_user_and_token_in_a_webhook_url_are_sent_as_basic_authentication():
    import base64

    r = _Receiver("ok")
    try:
        event = notify.make_event("r1", "t", "done")
        spec = {"target": "t", "webhooks": [f"http://hook:s3cret%40x@{r.base}/in"], "commands": []}
        assert notify.deliver(spec, event, lambda _f: None, sleep=lambda _s: None) is True
        (path, headers, body), = r.requests
        assert path == "/in" and json.loads(body)["id"] == event["id"]
        assert headers["Authorization"] == "Basic " + base64.b64encode(b"hook:s3cret@x").decode()
    finally:
        r.close()


def test_a_trickling_webhook_is_given_up_on_at_the_attempts_deadline():
    """An answer trickled a header every 0.1 s never hit the per-read timeout and held the
    deliverer (and every event behind it) for as long as it trickled: each attempt has a deadline."""
    r = _Receiver("trickle")
    try:
        # (without a deadline the 6 s trickle ends in a dropped connection, another message)
        with pytest.raises(notify.Failed, match="no complete answer within 1s"):
            notify.post(f"http://{r.base}/in", notify.make_event("r1", "t", "done"), timeout=1.0)
    finally:
        r.close()


class _Hanging:
    """A webhook receiver on 127.0.0.1 that takes each POST and holds it open, unanswered, until
    release() (then answers 200): a destination that hangs."""

    def __init__(self) -> None:
        import http.server
        import threading

        self.bodies: list[dict] = []
        self.answered = 0
        self.released = threading.Event()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                receiver.bodies.append(json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0))))
                if not receiver.released.wait(120):
                    return
                try:
                    self.send_response(200)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    receiver.answered += 1
                except OSError:
                    pass  # the worker gave up on this attempt

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self) -> str:
        return "http://127.0.0.1:%d/slow/s3cret" % self.server.server_address[1]

    def close(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()


def _wait_for(get, seconds=60.0):
    import time

    deadline = time.monotonic() + seconds
    while not get():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    return get()


def _workers(base: str) -> list[int]:
    """The pids of the live delivery workers of base (queues/<key>/worker.json)."""
    from dflash_ops.helpers import nodefacts

    pids = []
    for key in os.listdir(notify.queues_root(base)):
        doc = nodefacts.read_json(os.path.join(notify.queue_dir(base, key), "worker.json")) or {}
        if nodefacts.process_matches(doc.get("pid"), doc.get("pid_start")):
            pids.append(doc["pid"])
    return pids


def _stop_workers(base: str) -> None:
    import signal

    for pid in _workers(base):
        os.kill(pid, signal.SIGTERM)
    _wait_for(lambda: not _workers(base) or None)


def test_a_hanging_webhook_holds_its_own_events_only(tmp_path, sink):
    """One queue for every destination meant a webhook that hangs held every other destination's
    events (8 attempts of 10 s each, backoff between: ~3.5 minutes an event). Each destination has
    its own worker: the answering webhook gets all five events, in order, while the hanging one
    still holds the first request open; a SIGTERM then ends the stuck worker within its flush
    bound, which says what it did not deliver and keeps it for the next worker."""
    from dflash_ops.helpers import run_describe, run_events

    base = str(tmp_path)
    (tmp_path / "runs" / "r5").mkdir(parents=True)
    slow = _Hanging()
    try:
        spec = notify.check_spec({"target": "t", "webhooks": [slow.url(), sink.url()]})  # the hanging one first
        events = [notify.make_event("r5", "t", state) for state in ("queued", "started", "checkpoint", "restart", "done")]
        for event in events:
            assert notify.emit(base, spec, event)
        run_events.ensure_deliverer(base)
        _wait_for(lambda: len(sink.delivered()) == 5 and slow.bodies)  # (the slow worker may start last)
        assert [e["id"] for e in sink.delivered()] == [e["id"] for e in events]
        assert slow.bodies and {b["id"] for b in slow.bodies} == {events[0]["id"]} and slow.answered == 0
        # the slow destination's five wait (one under way, four behind) once the fast worker unlinked its last
        _wait_for(lambda: (notify.run_summary(base, "r5") or {}).get("waiting") == 5)

        _stop_workers(base)  # a container shutdown: SIGTERM; the hanging one is cut off at its flush bound
        logged = [json.loads(line) for line in (tmp_path / "runs" / "r5" / "metrics.jsonl").read_text().splitlines()]
        undelivered = [e for e in logged if e["event"] == "notify_undelivered"]
        assert [e["notify_id"] for e in undelivered] == [e["id"] for e in events]
        assert {e["to"] for e in undelivered} == {notify.redact_url(slow.url())}
        assert "s3cret" not in json.dumps(logged)
        info = run_describe.describe_run(str(tmp_path / "runs" / "r5"), 0.0)
        assert info["notify"]["undelivered"] == 5 and info["notify"]["waiting"] == 5
        from dflash_ops.runs.info import RunInfo
        from dflash_ops.runs.report import status_detail

        shown = [line for line in status_detail(RunInfo.from_json(info)) if line.startswith("notifications:")]
        assert shown and "5 left undelivered at a stop, 5 waiting" in shown[0]

        slow.released.set()  # the receiver is back: the next worker sends what was kept, in order
        run_events.ensure_deliverer(base)
        _wait_for(lambda: slow.answered >= 5 and not _workers(base))
        assert [b["id"] for b in slow.bodies][-5:] == [e["id"] for e in events]
        assert len(sink.delivered()) == 5  # the answering one got each event once
        assert notify.run_summary(base, "r5").get("waiting") is None
    finally:
        if os.path.isdir(notify.queues_root(base)):
            _stop_workers(base)
        slow.close()


def test_a_full_destination_queue_drops_its_oldest_and_says_so(tmp_path, sink):
    """A queue is bounded: past queue_max waiting events the oldest is dropped, each drop recorded
    in the run's metrics.jsonl and counted where `run status` shows it; the others keep their order."""
    from dflash_ops.helpers import run_describe
    from dflash_ops.runs.info import RunInfo
    from dflash_ops.runs.report import status_detail

    base = str(tmp_path)
    run_dir = tmp_path / "runs" / "r6"
    run_dir.mkdir(parents=True)
    spec = notify.check_spec({"target": "t", "webhooks": [sink.url()]})
    events = [notify.make_event("r6", "t", "checkpoint", step=i) for i in range(5)]
    for event in events:
        notify.emit(base, spec, event)
    (key,) = notify.dispatch(base, queue_max=3)
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(e["event"], e["step"]) for e in logged] == [("notify_dropped", 0), ("notify_dropped", 1)]
    line = [t for t in status_detail(RunInfo.from_json(run_describe.describe_run(str(run_dir), 0.0)))
            if t.startswith("notifications:")]
    assert line and line[0].startswith("notifications: 2 dropped (a destination's queue was full), 3 waiting")
    assert "s3cret" not in line[0]
    notify.run_worker(base, key, sleep=no_wait)
    assert [e["step"] for e in sink.delivered()] == [2, 3, 4]
