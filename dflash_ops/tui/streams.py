"""Thread-side plumbing: bounded line buffers and a follower that keeps going after failures.

A follower thread pushes lines into a `LineSink` at whatever rate the run writes them; the
UI drains the sink on a timer, so 10,000 lines a second cost one widget update per tick
and memory stays bounded (the oldest undrained lines are dropped and counted).
"""

from __future__ import annotations

import inspect
import threading
from collections import deque
from typing import Callable

from dflash_ops.runs.follow import RetryPolicy
from dflash_ops.tui.source import DashSource, LinkState, LogName

__all__ = ["LineSink", "LinkState", "follow_forever"]


class LineSink:
    """Thread-safe, bounded FIFO of lines between one writer thread and the UI."""

    def __init__(self, maxlen: int) -> None:
        self._lines: deque[str] = deque(maxlen=maxlen)
        self._lock = threading.Lock()
        self._dropped = 0
        self.received = 0

    def add(self, lines: list[str]) -> None:
        with self._lock:
            self._dropped += max(0, len(self._lines) + len(lines) - (self._lines.maxlen or 0))  # pushed out
            self._lines.extend(lines)
            self.received += len(lines)

    def drain(self) -> tuple[list[str], int]:
        """Take everything buffered: (lines, how many were dropped since the last drain)."""
        with self._lock:
            lines, dropped = list(self._lines), self._dropped
            self._lines.clear()
            self._dropped = 0
        return lines, dropped


def _takes_on_link(source: DashSource) -> bool:
    try:
        parameters = inspect.signature(source.follow).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        return False
    return "on_link" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def follow_forever(source: DashSource, target: str, run_id: str, name: LogName, sink: LineSink, stop: threading.Event,
                   on_state: Callable[[LinkState], None], tail_lines: int, retry: RetryPolicy = RetryPolicy(),
                   idle_s: float = 2.0) -> None:
    """Follow one run file until `stop`, from where the offset left off after every failure.

    A dropped link is the source's to ride out (RemoteSource: follow_file's reconnects, reported
    through `on_state`). What it raises instead (a file not written yet, a source that does not
    reconnect) is shown and asked again after `retry`'s backoff, reset by every line received."""
    offset: int | None = None
    failures = 0
    # a DashSource written before `on_link` existed (run_dash's library users) is called as before
    link = {"on_link": on_state} if _takes_on_link(source) else {}

    def on_lines(lines: list[str], end: int) -> None:
        nonlocal offset, failures
        offset = end
        sink.add(lines)
        failures = 0

    while not stop.is_set():
        on_state(LinkState(True))
        try:
            source.follow(target, run_id, name, on_lines, stop, start=offset, tail_lines=tail_lines, **link)
        except Exception as exc:  # noqa: BLE001 - any failure is shown and retried
            delay = retry.delay(failures)
            failures += 1
            on_state(LinkState.lost(exc, delay))
            stop.wait(delay)
        else:
            stop.wait(idle_s)  # follow returned without stop: the source gave up; try again
