"""`dflash-ops exporter --listen HOST:PORT`: every inventory target's runs for Prometheus, at /metrics.

A scrape asks every target at once, each on its own thread, and waits at most `timeout` seconds in
all: a target that has not answered by then is `dflash_target_up 0` with "no answer within Ns", and
the scrape returns. Its thread is not abandoned to pile up: while it is still out, the next scrapes
do not start another for that target (they report it as still waiting), so a dead node costs one
thread, never one per scrape. Plain threads (not asyncio): the transports block (Paramiko, subprocess).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

from dflash_ops.runs.prometheus import CONTENT_TYPE, TargetScrape, exposition, scrape_target

if TYPE_CHECKING:
    from dflash_ops.container import ContainerAPI


class Collector:
    """openers: {target: a function opening its container}; timeout: seconds a scrape waits in all."""

    def __init__(self, openers: Mapping[str, Callable[[], ContainerAPI]], timeout: float = 5.0,
                 gpus: bool = True) -> None:
        self.openers, self.timeout, self.gpus = dict(openers), timeout, gpus
        self._lock = threading.Lock()
        self._inflight: dict[str, tuple[threading.Thread, list[TargetScrape], float]] = {}

    def _start(self, target: str) -> tuple[threading.Thread, list[TargetScrape], float]:
        with self._lock:
            current = self._inflight.get(target)
            if current is not None and current[0].is_alive():
                return current
            box: list[TargetScrape] = []
            thread = threading.Thread(target=lambda: box.append(scrape_target(target, self.openers[target], self.gpus)),
                                      name=f"exporter-{target}", daemon=True)
            entry = (thread, box, time.monotonic())
            self._inflight[target] = entry
            thread.start()
            return entry

    def collect(self) -> list[TargetScrape]:
        """Every target's scrape, or its timeout, within about `timeout` seconds."""
        started = {target: self._start(target) for target in self.openers}
        deadline = time.monotonic() + self.timeout
        out = []
        for target, (thread, box, since) in started.items():
            thread.join(max(0.0, deadline - time.monotonic()))
            if box:
                out.append(box[0])
            else:
                waited = time.monotonic() - since
                out.append(TargetScrape(target, error=f"no answer within {self.timeout:g}s (asked {waited:.0f}s ago)",
                                        seconds=waited))
        return out

    def text(self) -> str:
        return exposition(self.collect())


def serve(collector: Collector, host: str, port: int, ready: Callable[[int], None] | None = None,
          stop: threading.Event | None = None) -> None:
    """Serve GET /metrics until `stop` is set (or forever); ready(port) once listening (port 0 picks one)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path.split("?")[0] not in ("/metrics", "/"):
                self.send_error(404, "only /metrics")
                return
            body = collector.text().encode()
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - http.server's signature
            pass  # a scrape every 15 s is not news

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    if ready is not None:
        ready(server.server_address[1])
    if stop is None:
        server.serve_forever()
        return
    def stop_when_asked() -> None:
        stop.wait()
        server.shutdown()

    threading.Thread(target=stop_when_asked, daemon=True).start()
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
