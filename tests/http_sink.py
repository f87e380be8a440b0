"""A webhook receiver on 127.0.0.1 for the notification tests: records every POST and answers
with the codes it is told to (then 200), the way a flaky webhook service does."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: dict
    answered: int


@dataclass
class HttpSink:
    fail_first: list[int] = field(default_factory=list)  # answers before the first 200, in order
    received: list[Received] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with sink.lock:
                    code = sink.fail_first.pop(0) if sink.fail_first else 200
                    sink.received.append(Received(self.path, dict(self.headers), json.loads(body), code))
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str = "/hook/s3cret-token?key=s3cret-key") -> str:
        return "http://127.0.0.1:%d%s" % (self.server.server_address[1], path)

    def delivered(self) -> list[dict]:
        """The bodies answered 200, in order."""
        with self.lock:
            return [r.body for r in self.received if r.answered == 200]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
