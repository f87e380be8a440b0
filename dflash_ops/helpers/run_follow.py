"""`runs.py follow`: stream a run's file (train.log, metrics.jsonl) as complete lines from an
offset, and notice it being truncated or replaced (stdlib only, python3.8+). The wire format is
docs/run-lifecycle.md's: a first line `#offset N`, then raw bytes of complete lines.

Not a helper: a shared module shipped beside runs.py (dflash_ops/helpers/__init__.py).
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time

from . import nodefacts, run_protocol

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (~10 ms at start on 3.8)
if TYPE_CHECKING:
    from typing import BinaryIO

CHUNK = 1 << 20
Refused = nodefacts.Refused
read_json = nodefacts.read_json
EXIT_TIME_UP, EXIT_TRUNCATED = run_protocol.EXIT_TIME_UP, run_protocol.EXIT_TRUNCATED
start_of_last_lines, complete_end = run_protocol.start_of_last_lines, run_protocol.complete_end

EXIT_GRACE_S = 30


def run_is_over(run_dir: str) -> bool:
    """True once the trainer process is gone. A final status.json alone is not enough, since
    the trainer still writes its last log lines after it; but a final state whose process
    cannot be identified (no pid_start) or lingers past EXIT_GRACE_S counts as over."""
    if not os.path.isdir(run_dir):
        return True  # the run directory was removed: nothing more will be written
    if nodefacts.run_supervisor(run_dir) is not None:
        return False  # between two attempts, or the last one ending: its supervisor still runs
    status = read_json(os.path.join(run_dir, "status.json"))
    pid, pid_start = nodefacts.run_process(run_dir, status)
    if pid is not None and not nodefacts.process_matches(pid, pid_start):
        return True
    if not status or status.get("state") not in nodefacts.FINAL_STATES:
        return False
    heartbeat = status.get("heartbeat")
    stale = not isinstance(heartbeat, (int, float)) or time.time() - heartbeat > EXIT_GRACE_S
    return pid is None or pid_start is None or stale


def cmd_follow(args: argparse.Namespace) -> int:
    """Stream raw bytes of complete lines; the first line is `#offset <start>`.

    Only whole lines are sent while following (a line still being written waits), so the
    client's offset is always `start + bytes of complete lines received`. When the stream
    ends for good (no --follow, or the run is over) a final unterminated fragment is sent.
    With --max-seconds a follow that is not over by then exits EXIT_TIME_UP after its last
    complete line (no fragment), so a client can stop following promptly or ask again.

    A file that is truncated, rewritten or replaced under the reader (shorter than the
    offset reached, the bytes before the offset changed, a new inode at PATH) ends the
    follow with EXIT_TRUNCATED and a `truncated <offset> <new size>` line on stderr: bytes
    written before the truncation and not yet read are gone, and the client says so.
    """
    out = sys.stdout.buffer
    deadline = None if args.max_seconds is None else time.monotonic() + args.max_seconds
    while True:
        try:
            f = open(args.path, "rb")
            break
        except FileNotFoundError:
            if not args.follow:
                raise Refused("no such file: %s" % args.path) from None
            over = args.until_final and run_is_over(args.until_final)
            if over or time_is_up(deadline):
                send_offset(out, args.offset)
                return 0 if over else EXIT_TIME_UP
            time.sleep(args.poll)
    with f:
        start = args.offset
        size = os.fstat(f.fileno()).st_size
        if args.tail_lines is not None:
            f.seek(0)
            start = start_of_last_lines(f, args.tail_lines, complete_end(f, size))
        send_offset(out, start)
        if start > size:
            return truncated(start, size)
        f.seek(start)
        guard = FileGuard(f, args.path, start)
        pending: list[bytes] = []  # pieces of the unfinished last line, joined once it ends (linear cost)
        while True:
            if args.follow and time_is_up(deadline):
                return EXIT_TIME_UP
            if args.follow and guard.rewritten():
                return truncated(guard.position, guard.size)
            chunk = f.read(CHUNK)
            if chunk:
                guard.advance(chunk)
                send_lines(out, pending, chunk)
                continue
            if not args.follow:
                break
            if guard.replaced():
                return truncated(guard.position, guard.size)
            if args.until_final and run_is_over(args.until_final):
                send_lines(out, pending, f.read())
                break
            time.sleep(args.poll)
        out.write(b"".join(pending))
        out.flush()
    return 0


def send_offset(out: BinaryIO, offset: int) -> None:
    out.write(b"#offset %d\n" % offset)
    out.flush()


def send_lines(out: BinaryIO, pending: list[bytes], chunk: bytes) -> None:
    """Send the complete lines of pending + chunk; keep what follows the last newline in pending."""
    cut = chunk.rfind(b"\n") + 1
    if cut:
        out.write(b"".join(pending) + chunk[:cut] if pending else chunk[:cut])
        out.flush()
        del pending[:]
    if cut < len(chunk):
        pending.append(chunk[cut:])


GUARD_BYTES = 64


def truncated(offset: int, size: int) -> int:
    sys.stdout.flush()
    sys.stderr.write("truncated %d %d\n" % (offset, size))
    return EXIT_TRUNCATED


class FileGuard:
    """Notices a followed file being truncated, rewritten or replaced under the reader.

    Keeps the last GUARD_BYTES read; before each read they must still be there (one pread),
    the file must not be shorter than what was read, and PATH must still be this file.
    """

    def __init__(self, f: io.BufferedReader, path: str, position: int) -> None:
        self.f = f
        self.path = path
        self.position = position
        self.size = position
        self.ino = os.fstat(f.fileno()).st_ino
        back = min(GUARD_BYTES, position)
        self.tail = os.pread(f.fileno(), back, position - back) if back else b""

    def advance(self, data: bytes) -> None:
        self.position += len(data)
        self.tail = (self.tail + data[-GUARD_BYTES:])[-GUARD_BYTES:]

    def rewritten(self) -> bool:
        """Shorter than what was read, or the bytes just before the offset differ."""
        fd = self.f.fileno()
        self.size = os.fstat(fd).st_size
        if self.size < self.position:
            return True
        return bool(self.tail) and os.pread(fd, len(self.tail), self.position - len(self.tail)) != self.tail

    def replaced(self) -> bool:
        """PATH is now another file (log rotation, an editor's save): this one gets no more bytes."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False  # removed; run_is_over ends the follow when the run directory is gone
        if st.st_ino == self.ino:
            return False
        self.size = st.st_size
        return True


def time_is_up(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


