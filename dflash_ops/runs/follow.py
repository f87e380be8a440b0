"""Following train.log / metrics.jsonl by byte offset, resuming after a dropped connection.

The `runs follow` helper answers with one header line `#offset <start>\\n`, then the file's raw
bytes from <start>, complete lines only until the stream ends for good. So the offset of the
end of every complete line received is `start + bytes so far`; after a ConnectionLost we ask
again from the last complete line's end: no line is lost and none is repeated.

A follow that can be cancelled (`stop`) asks the helper to give up after `stop_check_s`
(exit EXIT_TIME_UP after its last complete line) and asks again from the exact offset while
`stop` is unset, so a quiet follow notices `stop` within about `stop_check_s`.
"""

from __future__ import annotations

import posixpath
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from dflash_ops.errors import ConnectionLost, Unreachable, UsageError
from dflash_ops.runs.helper import EXIT_TIME_UP, EXIT_TRUNCATED, call, run_dir
from dflash_ops.runs.info import RunError

if TYPE_CHECKING:
    from dflash_ops.container import ContainerAPI

RETRYABLE = (ConnectionLost, Unreachable)  # the link failed; a host key or login failure is final

FOLLOWABLE = ("train.log", "metrics.jsonl")
HEADER_PREFIX = b"#offset "


class FileTruncated(RunError):
    """A followed file was truncated or replaced under the reader (see follow_file)."""


def _truncation(stderr: str, fallback: int) -> tuple[int, int]:
    for line in stderr.splitlines():
        words = line.split()
        if len(words) == 3 and words[0] == "truncated" and words[1].isdigit() and words[2].isdigit():
            return int(words[1]), int(words[2])
    return fallback, 0


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How a follow rides out a dropped link (ConnectionLost) or a node it cannot reach (Unreachable).

    reconnect=False: the first such failure is raised. Otherwise it asks again from the exact
    offset after `delay(n)` (`backoff` doubling up to `max_backoff`), and gives up (re-raising)
    after `give_up_after` seconds of failures without a line received (math.inf: never)."""

    reconnect: bool = True
    give_up_after: float = 600.0
    backoff: float = 0.5
    max_backoff: float = 10.0

    def delay(self, failures: int) -> float:
        """The wait before the next attempt, after `failures` failures in a row (0: the first)."""
        return min(self.backoff * 2 ** failures, self.max_backoff)


NO_RETRY = RetryPolicy(reconnect=False)


@dataclass(frozen=True, kw_only=True)
class FollowCallbacks:
    """What follow_file tells its caller: each line, and the events around the lines.

    on_line(line): a complete line with its b"\\n" (a final fragment only when the stream ends normally).
    on_start(offset): once, before any line: the offset the first line starts at (with `tail_lines`).
    on_retry(error, delay): the link failed; the next attempt is in `delay` seconds.
    on_resumed(offset): the helper answered again after a failure, streaming from `offset`.
    on_truncated(offset_reached, new_size): the file was truncated or replaced; the follow goes on
    from its start (without this callback follow_file raises FileTruncated instead).
    """

    on_line: Callable[[bytes], None]
    on_start: Callable[[int], None] | None = None
    on_retry: Callable[[Exception, float], None] | None = None
    on_resumed: Callable[[int], None] | None = None
    on_truncated: Callable[[int, int], None] | None = None


@dataclass
class LineStream:
    """Turns the helper's stdout lines into delivered lines and an exact offset."""

    on_line: Callable[[bytes], None]
    expected_start: int | None  # None: any start is accepted (the first request)
    stop: threading.Event | None = None
    on_header: Callable[[int], None] | None = None
    offset: int | None = None
    start: int | None = None
    partial: bytes = b""
    unexpected: bytes | None = None
    halted: bool = False  # `stop` was seen: nothing more is delivered or counted

    def feed(self, line: bytes) -> None:
        if self.unexpected is not None or self.halted:
            return
        if self.offset is not None and self.stop is not None and self.stop.is_set():
            self.halted = True
        elif not line.endswith(b"\n"):
            self.partial = line  # counts only if the stream then ends normally
        elif self.offset is None:
            self._header(line)
        else:
            self.offset += len(line)
            self.on_line(line)

    def _header(self, line: bytes) -> None:
        """Never raises: the helper's error document (if any) is reported after it exits."""
        if line.startswith(HEADER_PREFIX) and line[len(HEADER_PREFIX):-1].isdigit():
            self.start = self.offset = int(line[len(HEADER_PREFIX):])
            if self.on_header is not None:
                self.on_header(self.start)
        else:
            self.unexpected = line

    def check(self, name: str) -> int:
        """The offset reached; a missing header or a start other than the one asked for is an error."""
        if self.unexpected is not None or self.offset is None:
            raise RunError(f"follow helper for {name} sent no offset header (got {self.unexpected!r})")
        if self.expected_start is not None and self.start != self.expected_start:
            raise RunError(f"follow helper started {name} at {self.start}, asked for {self.expected_start}")
        return self.offset


def follow_file(
    container: ContainerAPI,
    run_id: str,
    name: str,
    callbacks: FollowCallbacks | Callable[[bytes], None],
    *,
    tail_lines: int | None = None,
    offset: int = 0,
    follow: bool = False,
    poll: float = 0.2,
    retry: RetryPolicy = RetryPolicy(),
    stop: threading.Event | None = None,
    stop_check_s: float = 1.0,
    timeout: float | None = None,
) -> int:
    """Deliver each line of runs/<run_id>/<name> (bytes, with its b"\\n") to the callbacks' on_line
    (a bare callable is on_line alone).

    Starts at byte `offset`, or at the last `tail_lines` complete lines. With follow=True it
    keeps going until the run is over (final state or process gone) and the file is drained.
    A final unterminated fragment is delivered only when the stream ends normally. Returns
    the offset just past the last complete line delivered (pass it back in to continue).
    `timeout` bounds the whole call (CommandTimeout when it runs out).

    A dropped connection, or a node that cannot be reached (sshd gone, a partition), is retried
    as `retry` says, from the exact offset (see RetryPolicy, FollowCallbacks.on_retry / on_resumed).

    `stop`: once set, no further line is delivered and follow_file returns the offset past
    the last delivered line (no fragment), within about `stop_check_s` even when the file is quiet.

    A file truncated or replaced while followed (the helper exits EXIT_TRUNCATED) is never
    skipped silently: on_truncated is called and the follow goes on from the new file's start
    (byte 0); without on_truncated it raises FileTruncated.
    """
    if name not in FOLLOWABLE:
        raise UsageError(f"can follow {' or '.join(FOLLOWABLE)}, not {name!r}")
    hooks = callbacks if isinstance(callbacks, FollowCallbacks) else FollowCallbacks(on_line=callbacks)
    directory = run_dir(container, run_id)
    position = offset
    first = True  # no header received yet: `tail_lines` and `on_start` still apply, any start is accepted
    failing_since: float | None = None
    failures = 0
    deadline = None if timeout is None else time.monotonic() + timeout

    def stopped() -> bool:
        return stop is not None and stop.is_set()

    def on_header(start: int, *, initial: bool, resumed: bool) -> None:
        if initial and hooks.on_start is not None:
            hooks.on_start(start)
        if resumed and hooks.on_resumed is not None:
            hooks.on_resumed(start)

    while True:
        if stopped():
            return position
        args = ["follow", posixpath.join(directory, name), "--offset", str(position)]
        if first and tail_lines is not None:
            args += ["--tail-lines", str(tail_lines)]
        if follow:
            args += ["--follow", "--poll", str(poll), "--until-final", directory]
            if stop is not None:
                args += ["--max-seconds", str(stop_check_s)]
        stream = LineStream(hooks.on_line, None if first else position, stop,
                         partial(on_header, initial=first, resumed=failing_since is not None))
        try:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.001)
            result = call(container, args, on_line=stream.feed, timeout=remaining,
                          answers=(EXIT_TIME_UP, EXIT_TRUNCATED))
        except RETRYABLE as error:
            progressed = stream.offset is not None and (first or stream.offset != position)
            if stream.offset is not None:
                position, first = stream.check(name), False
            now = time.monotonic()
            if progressed or failing_since is None:
                failing_since, failures = now, 0
            if not retry.reconnect or now - failing_since > retry.give_up_after:
                raise
            delay = retry.delay(failures)
            if deadline is not None:
                delay = min(delay, max(deadline - now, 0.0))
            failures += 1
            if hooks.on_retry is not None:
                hooks.on_retry(error, delay)
            if stop is not None:
                stop.wait(delay)
            else:
                time.sleep(delay)
            continue
        failing_since = None
        position, first = stream.check(name), False
        if result.exit_code == EXIT_TRUNCATED and not stream.halted:
            reached, size = _truncation(result.stderr, position)
            if hooks.on_truncated is None:
                raise FileTruncated(f"{name} of run {run_id} was truncated or replaced at byte {reached} "
                                    f"(now {size} bytes): bytes written before that and not yet read are lost")
            hooks.on_truncated(reached, size)
            position = 0
            continue
        if result.exit_code == EXIT_TIME_UP or stream.halted or stopped():
            continue
        if stream.partial:
            hooks.on_line(stream.partial)
        return position
