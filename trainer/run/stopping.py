"""The shared stop signal (and the first error that caused it) and a stop-aware barrier.

Every blocking wait in the pipeline is a short timeout loop that re-checks the stop signal, so a
crash in any thread (or a stop request) ends every other thread promptly instead of hanging it.
"""
from __future__ import annotations

import threading
import traceback

POLL_SECONDS = 0.05


class PipelineStopped(Exception):
    """Raised inside a stage when the run is stopping; the stage should just return."""


class PipelineFailed(RuntimeError):
    """The first error of a pipeline thread: the trainer raises it once every thread has stopped,
    and status.json's `error` is its record()."""

    def __init__(self, thread: str, message: str, traceback: str, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.thread = thread
        self.message = message
        self.traceback = traceback
        self.cause = cause  # the thread's exception

    def record(self) -> dict:
        return {"message": self.message, "traceback": self.traceback, "thread": self.thread}


class StopSignal:
    """A stop event plus the first error that caused it (if any)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self.error: PipelineFailed | None = None
        self.reason: str | None = None

    def is_set(self) -> bool:
        return self._event.is_set()

    def stop(self, reason: str) -> None:
        with self._lock:
            if self.reason is None:
                self.reason = reason
        self._event.set()

    def fail(self, exc: BaseException, thread: str | None = None) -> None:
        """Record the first error (later ones are usually consequences) and stop everyone."""
        name = thread or threading.current_thread().name
        with self._lock:
            if self.error is None:
                tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
                self.error = PipelineFailed(name, f"{type(exc).__name__}: {exc}", tb, exc)
            if self.reason is None:
                self.reason = "error"
        self._event.set()

    def wait(self, seconds: float) -> bool:
        return self._event.wait(seconds)

    def check(self) -> None:
        if self._event.is_set():
            raise PipelineStopped(self.reason)


class StopAwareBarrier:
    """A reusable barrier for `parties` threads whose wait gives up when the run stops."""

    def __init__(self, parties: int, stop: StopSignal) -> None:
        self.parties = parties
        self._stop = stop
        self._cond = threading.Condition()
        self._count = 0
        self._generation = 0

    def wait(self) -> None:
        with self._cond:
            generation = self._generation
            self._count += 1
            if self._count == self.parties:
                self._count = 0
                self._generation += 1
                self._cond.notify_all()
                return
            while generation == self._generation:
                self._stop.check()
                self._cond.wait(POLL_SECONDS)
