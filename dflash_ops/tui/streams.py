"""Thread-side plumbing: bounded line buffers, backoff, and a self-reconnecting follower.

A follower thread pushes lines into a `LineSink` at whatever rate the run writes them; the
UI drains the sink on a timer, so 10,000 lines a second cost one widget update per tick
and memory stays bounded (the oldest undrained lines are dropped and counted).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable

from dflash_ops.tui.source import DashSource, LogName


class Backoff:
    """Delays 0.5, 1, 2, ... capped at `maximum`; `reset()` after a success."""

    def __init__(self, initial: float = 0.5, maximum: float = 10.0) -> None:
        self.initial = initial
        self.maximum = maximum
        self._next = initial

    def next(self) -> float:
        delay = self._next
        self._next = min(self.maximum, self._next * 2)
        return delay

    def reset(self) -> None:
        self._next = self.initial


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


@dataclass(frozen=True)
class LinkState:
    """How a stream or a target is doing, as the UI shows it."""

    connected: bool
    error: str | None = None
    retry_in: float | None = None

    def describe(self) -> str:
        if self.connected:
            return "live"
        if self.error is None:
            return "connecting"
        return f"disconnected: {self.error} (retry in {self.retry_in:g}s)"


def follow_forever(source: DashSource, target: str, run_id: str, name: LogName, sink: LineSink, stop: threading.Event,
                   on_state: Callable[[LinkState], None], tail_lines: int, backoff: Backoff | None = None,
                   idle_s: float = 2.0) -> None:
    """Follow one run file until `stop`, reconnecting with backoff where the offset left off."""
    backoff = backoff or Backoff()
    offset: int | None = None

    def on_lines(lines: list[str], end: int) -> None:
        nonlocal offset
        offset = end
        sink.add(lines)
        backoff.reset()

    while not stop.is_set():
        on_state(LinkState(True))
        try:
            source.follow(target, run_id, name, on_lines, stop, start=offset, tail_lines=tail_lines)
        except Exception as exc:  # noqa: BLE001 - any failure of the link is shown and retried
            delay = backoff.next()
            on_state(LinkState(False, f"{type(exc).__name__}: {exc}", delay))
            stop.wait(delay)
        else:
            stop.wait(idle_s)  # follow returned without stop: the source gave up; try again
