"""The transport interface: run a node-level command string, move files to and from the node.

`command` is always the string a login shell on the node parses (render.node_command's
output), so the local and SSH transports test the very same rendering.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

LineCallback = Callable[[bytes], None]


@runtime_checkable
class Readable(Protocol):
    """A binary stream to send on a command's stdin (a file, a spooled tar, a ProgressReader)."""

    def read(self, size: int = ..., /) -> bytes: ...


Stdin = bytes | Readable | Iterable[bytes] | None  # an iterable: the chunks to send, in order
CHUNK = 64 * 1024


@dataclass
class Result:
    exit_code: int
    stdout_bytes: bytes
    stderr_bytes: bytes

    @property
    def stdout(self) -> str:
        return self.stdout_bytes.decode("utf-8", errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_bytes.decode("utf-8", errors="replace")

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


class Transport(Protocol):
    commands_run: int  # node-level commands started (one per run())
    connections_opened: int  # SSH connections made (0 for local)

    def run(self, command: str, *, stdin: Stdin = None, on_line: LineCallback | None = None,
            on_stderr_line: LineCallback | None = None, timeout: float | None = None) -> Result:
        """Run `command`; its lines go to the callbacks, none after run() has returned or raised
        (a reader that counts offsets from what it received resumes from exactly there)."""
        ...

    def put(self, local: Path, remote: str) -> None: ...

    def get(self, remote: str, local: Path) -> None: ...

    def close(self) -> None: ...


class LineSplitter:
    """Collects a byte stream and hands each complete line (with its b"\\n") to a callback.

    A final partial line is delivered by `finish()` without a newline. Bytes are never
    re-encoded, so a reader can count byte offsets from what it receives.
    """

    def __init__(self, callback: LineCallback | None):
        self.callback = callback
        self.chunks: list[bytes] = []
        self._pending: list[bytes] = []  # pieces of the unfinished line: joined once, when it ends
        self._delivering = threading.Lock()
        self._stopped = False

    def feed(self, data: bytes) -> None:
        self.chunks.append(data)
        if self.callback is None or not data:
            return
        *lines, rest = data.split(b"\n")
        if lines:
            lines[0] = b"".join(self._pending) + lines[0]
            self._pending = []
        for line in lines:
            with self._delivering:
                if self._stopped:
                    return
                self.callback(line + b"\n")
        if rest:
            self._pending.append(rest)

    def stop_delivering(self) -> None:
        """No callback from now on; returns once a callback in progress has finished.

        A transport whose run() fails while its reader threads still drain buffered output
        calls this before raising, so that no line arrives after the caller took its offset."""
        with self._delivering:
            self._stopped = True

    def finish(self) -> bytes:
        if self.callback is not None and self._pending:
            self.callback(b"".join(self._pending))
            self._pending = []
        return b"".join(self.chunks)


def iter_stdin(stdin: Stdin) -> Iterator[bytes]:
    """Yield stdin as binary chunks: bytes as-is, a file object up to CHUNK bytes at a time,
    an iterable's chunks as they come.

    A buffered file (sys.stdin.buffer, a pipe) is read with read1, so each chunk goes out as
    soon as it arrives instead of waiting for CHUNK bytes or EOF."""
    if stdin is None:
        return
    if isinstance(stdin, (bytes, bytearray, memoryview)):
        data = bytes(stdin)
        for i in range(0, len(data), CHUNK):
            yield data[i : i + CHUNK]
        return
    if not isinstance(stdin, Readable):
        yield from stdin
        return
    read = getattr(stdin, "read1", None) or stdin.read
    while True:
        chunk = read(CHUNK)
        if not chunk:
            return
        if isinstance(chunk, str):
            raise TypeError("stdin must be bytes or a binary file object")
        yield chunk


class BackgroundCall:
    """Run a function in a daemon thread, keeping the exception it raised (if any)."""

    def __init__(self, func: Callable[[], None], name: str):
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(func,), name=name, daemon=True)
        self.thread.start()

    def _run(self, func: Callable[[], None]) -> None:
        try:
            func()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            self.error = e

    def join(self, timeout: float | None = None) -> bool:
        self.thread.join(timeout)
        return not self.thread.is_alive()
