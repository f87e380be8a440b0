"""A Paramiko-level double: channels whose 'remote side' is a real local /bin/sh process.

It stands in for the network and sshd only, so SSHTransport's own code (channel handling,
stdin streaming, concurrent reads, timeouts, reconnects) is what the unit tests exercise.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading

import paramiko


class FakeChannel:
    def __init__(self, transport: "FakeTransport"):
        self.transport = transport
        self.status_event = threading.Event()
        self.exit_status = -1
        self.closed = False
        self.proc: subprocess.Popen | None = None
        self.command: str | None = None

    def get_transport(self):
        return self.transport

    def exec_command(self, command: str) -> None:
        self.command = command
        self.proc = subprocess.Popen(["/bin/sh", "-c", command], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, start_new_session=True)
        threading.Thread(target=self._wait, daemon=True).start()

    def _wait(self) -> None:
        code = self.proc.wait()
        if self.transport.active and not self.closed:
            self.exit_status = 128 - code if code < 0 else code
        self.status_event.set()

    def recv(self, n: int) -> bytes:
        return os.read(self.proc.stdout.fileno(), n)

    def recv_stderr(self, n: int) -> bytes:
        return os.read(self.proc.stderr.fileno(), n)

    def sendall(self, data: bytes) -> None:
        if self.closed or not self.transport.active:
            raise OSError("Socket is closed")
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise OSError("Socket is closed") from None

    def shutdown_write(self) -> None:
        self.proc.stdin.close()

    def recv_exit_status(self) -> int:
        self.status_event.wait()
        return self.exit_status

    def close(self) -> None:
        self.closed = True
        self.kill()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class FakeTransport:
    def __init__(self):
        self.active = True
        self.keepalive = None
        self.channels: list[FakeChannel] = []
        self.partitioned = False  # packets vanish: nothing is answered, nothing breaks
        self.probes = 0

    def global_request(self, kind: str, data=None, wait: bool = True):
        """Like paramiko: a request the server answers (OpenSSH: with a failure) unless the
        link is partitioned, where it waits until the transport is closed."""
        self.probes += 1
        while self.partitioned and self.active:
            threading.Event().wait(0.05)
        return None

    def close(self) -> None:
        self.drop()

    def is_active(self) -> bool:
        return self.active

    def set_keepalive(self, interval: int) -> None:
        self.keepalive = interval

    def open_session(self, timeout=None) -> FakeChannel:
        if not self.active:
            raise paramiko.SSHException("SSH session not active")
        chan = FakeChannel(self)
        self.channels.append(chan)
        return chan

    def drop(self) -> None:
        """The network went away: every channel ends without an exit status."""
        self.active = False
        for chan in self.channels:
            chan.kill()


class FakeClient:
    def __init__(self):
        self.transport: FakeTransport | None = None

    def get_transport(self):
        return self.transport


class FakeSFTP:
    def put(self, local: str, remote: str) -> None:
        shutil.copyfile(local, remote)

    def get(self, remote: str, local: str) -> None:
        shutil.copyfile(remote, local)


class FakeServer:
    """Hands out connections and counts them, like an sshd would."""

    def __init__(self):
        self.connections: list[FakeConnection] = []
        self.refuse_with: Exception | None = None

    def connection(self, node) -> "FakeConnection":
        return FakeConnection(self)


class FakeConnection:
    def __init__(self, server: FakeServer):
        self.server = server
        self.client = FakeClient()

    def open(self) -> None:
        if self.server.refuse_with is not None:
            raise self.server.refuse_with
        self.client.transport = FakeTransport()
        self.server.connections.append(self)

    def close(self) -> None:
        if self.client.transport is not None:
            self.client.transport.drop()

    def sftp(self) -> FakeSFTP:
        return FakeSFTP()
