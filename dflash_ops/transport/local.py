"""The node is this machine: run the node command with /bin/sh -c, as sshd would.

As sshd would also means sshd's environment and directory, not the operator's shell's:
a command on a node never sees the operator's VIRTUAL_ENV, PYTHONPATH or working directory,
so neither does one here (pct exec then passes this environment into the container).
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import IO

from dflash_ops.errors import CommandTimeout, TransportError
from dflash_ops.transport.base import CHUNK, BackgroundCall, LineCallback, LineSplitter, Result, Stdin, iter_stdin


class LocalTransport:
    def __init__(self) -> None:
        self.commands_run = 0
        self.connections_opened = 0

    def run(self, command: str, *, stdin: Stdin = None, on_line: LineCallback | None = None,
            on_stderr_line: LineCallback | None = None, timeout: float | None = None) -> Result:
        self.commands_run += 1
        proc = subprocess.Popen(
            ["/bin/sh", "-c", command],
            stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # a timeout kills the whole process group
            env=session_env(),
            cwd=session_env()["HOME"],
        )
        out, err = LineSplitter(on_line), LineSplitter(on_stderr_line)
        readers = [
            BackgroundCall(lambda: _pump(proc.stdout, out), "local-stdout"),
            BackgroundCall(lambda: _pump(proc.stderr, err), "local-stderr"),
        ]
        writer = None
        if stdin is not None:
            writer = BackgroundCall(lambda: _feed(proc.stdin, stdin), "local-stdin")
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            _wait(proc, deadline, writer)
            for reader in readers:
                reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
                if not reader.join(0):
                    raise subprocess.TimeoutExpired(command, timeout or 0.0)
        except BaseException as e:
            _kill_group(proc)
            out.stop_delivering()
            err.stop_delivering()
            if isinstance(e, subprocess.TimeoutExpired):
                raise CommandTimeout(command, timeout) from None
            raise
        if writer is not None and writer.join(0) and (error := _stdin_error(writer)) is not None:
            raise error
        for reader in readers:
            if reader.error is not None:
                raise reader.error
        code = proc.returncode
        return Result(exit_code=128 - code if code < 0 else code, stdout_bytes=out.finish(), stderr_bytes=err.finish())

    def put(self, local: Path, remote: str) -> None:
        _copy_atomically(Path(local), Path(remote))

    def get(self, remote: str, local: Path) -> None:
        _copy_atomically(Path(remote), Path(local))

    def close(self) -> None:
        pass


# OpenSSH session.c do_setup_env: USER, LOGNAME, HOME, SHELL, MAIL and the compiled-in PATH
# (Debian: the superuser's for root); Debian's sshd_config accepts LANG and LC_* from clients.
_SSHD_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/games"
_SSHD_ROOT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def session_env() -> dict[str, str]:
    """The environment an SSH login of the current user starts a command with."""
    uid = os.geteuid()
    try:
        entry = pwd.getpwuid(uid)
        user, home, shell = entry.pw_name, entry.pw_dir, entry.pw_shell or "/bin/sh"
    except KeyError:
        user, home, shell = str(uid), "/", "/bin/sh"
    home = os.environ.get("HOME") or home  # a private HOME (tests, `HOME=... dflash-ops`) is the login's
    if not os.path.isdir(home):
        home = "/"
    env = {"USER": user, "LOGNAME": user, "HOME": home, "SHELL": shell, "MAIL": f"/var/mail/{user}",
           "PATH": _SSHD_ROOT_PATH if uid == 0 else _SSHD_PATH}
    env.update({k: v for k, v in os.environ.items() if k == "LANG" or k.startswith("LC_")})
    return env


_POLL = 0.05


def _wait(proc: subprocess.Popen, deadline: float | None, writer: BackgroundCall | None) -> None:
    """Wait for the command to end. The stdin writer is not waited for (a command may exit
    without reading all of it, or our stdin may never close), but an error reading the
    caller's stdin stops the command at once instead of leaving it waiting for EOF."""
    while True:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise subprocess.TimeoutExpired(proc.args, 0)
        try:
            proc.wait(timeout=_POLL if left is None else min(_POLL, left))
            return
        except subprocess.TimeoutExpired:
            pass
        if writer is not None and (error := _stdin_error(writer)) is not None:
            raise error


def _stdin_error(writer: BackgroundCall) -> BaseException | None:
    """The stdin writer's error; a broken pipe is none (the command exited without reading it all)."""
    error = writer.error
    return None if isinstance(error, BrokenPipeError) else error


def _pump(stream: IO[bytes] | None, splitter: LineSplitter) -> None:
    assert stream is not None  # run() asks for pipes
    fd = stream.fileno()
    try:
        while True:
            data = os.read(fd, CHUNK)
            if not data:
                return
            splitter.feed(data)
    finally:
        stream.close()


def _feed(stream: IO[bytes] | None, stdin: Stdin) -> None:
    assert stream is not None  # run() asks for a pipe when there is stdin
    try:
        for chunk in iter_stdin(stdin):
            stream.write(chunk)
            stream.flush()
    finally:
        try:
            stream.close()
        except BrokenPipeError:
            pass


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _copy_atomically(src: Path, dst: Path) -> None:
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise TransportError(f"copy {src} -> {dst} failed: {e.strerror or e}") from None
