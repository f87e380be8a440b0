"""The pipeline's stages: stop-aware bounded queues between them and the threads that run them."""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

from trainer.run.stopping import POLL_SECONDS, PipelineStopped, StopSignal


class StageQueue:
    """A bounded queue (backpressure) whose put/get give up when the run stops."""

    def __init__(self, name: str, maxsize: int, stop: StopSignal) -> None:
        if maxsize < 1:
            raise ValueError(f"queue {name!r}: maxsize must be >= 1, got {maxsize}")
        self.name = name
        self.maxsize = maxsize
        self._q: queue.Queue = queue.Queue(maxsize)
        self._stop = stop

    def put(self, item: object) -> None:
        while True:
            self._stop.check()
            try:
                self._q.put(item, timeout=POLL_SECONDS)
                return
            except queue.Full:
                continue

    def get(self) -> Any:
        while True:
            self._stop.check()
            try:
                return self._q.get(timeout=POLL_SECONDS)
            except queue.Empty:
                continue

    def depth(self) -> int:
        return self._q.qsize()


class StageThread(threading.Thread):
    """A daemon thread running `body()`; any exception fails the whole run via the stop signal."""

    def __init__(self, name: str, body: Callable[[], None], stop: StopSignal) -> None:
        super().__init__(name=name, daemon=True)
        self._body = body
        self._stop_signal = stop

    def run(self) -> None:
        try:
            self._body()
        except PipelineStopped:
            pass
        except BaseException as exc:  # noqa: BLE001 - every failure must reach status.json
            self._stop_signal.fail(exc, self.name)


def join_all(threads: Sequence[threading.Thread], stop: StopSignal, grace_seconds: float = 30.0) -> list[str]:
    """Join threads; returns the names of any that did not finish within the grace period."""
    import time

    stopped_at = None
    for t in threads:
        while t.is_alive():
            t.join(POLL_SECONDS)
            if stop.is_set():
                stopped_at = stopped_at or time.monotonic()
                if time.monotonic() - stopped_at > grace_seconds:
                    break
    return [t.name for t in threads if t.is_alive()]
