"""The node over SSH: one cached Fabric Connection per node, a raw Paramiko channel per command.

Why a raw channel: Fabric's `in_stream` reads stdin one byte per 10 ms and decodes it as
text (invoke#774). Here stdin is sent in binary chunks with `sendall`, stdout and stderr are
read concurrently before `recv_exit_status`, and a timeout closes the channel.

A partition does not break a TCP connection: packets just vanish, and a blocked read would
wait for the kernel's retransmission timeout (many minutes). So, like OpenSSH's
ServerAliveInterval with ServerAliveCountMax 3, a command that hears nothing for
`keepalive` seconds asks the server for a reply, and when the server has been silent for
3 x `keepalive` seconds the connection is closed: every command on it raises ConnectionLost.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import paramiko

from dflash_ops.errors import CommandTimeout, ConnectionLost, TransportError, Unreachable
from dflash_ops.inventory import Node
from dflash_ops.transport.base import CHUNK, BackgroundCall, LineCallback, LineSplitter, Result, Stdin, iter_stdin
from trainer.run.contract import named_for

if TYPE_CHECKING:
    from fabric import Connection

_STATUS_POLL = 0.2
ALIVE_COUNT_MAX = 3  # unanswered keepalive intervals before the connection counts as dead

# Paramiko's transport thread logs failures (e.g. a bad banner) with a traceback; with no
# handler anywhere logging's last resort prints it to stderr. Every such failure reaches
# the caller as a TransportError anyway, so give paramiko a handler that drops them
# (records still propagate to handlers an application configures).
logging.getLogger("paramiko").addHandler(logging.NullHandler())


def fabric_connection(node: Node) -> Connection:
    """A not-yet-opened Fabric Connection for `node`, honouring ~/.ssh/config and the agent."""
    import fabric

    connect_kwargs: dict = {}
    if node.identity_file:
        key = os.path.expanduser(node.identity_file)
        if not os.path.isfile(key):
            raise TransportError(f"node {node.name!r}: identity_file {node.identity_file} does not exist")
        connect_kwargs["key_filename"] = [key]
    conn = fabric.Connection(
        host=node.address,
        user=node.user,
        port=node.port,
        connect_timeout=node.connect_timeout,
        connect_kwargs=connect_kwargs,
    )
    client = conn.client
    client.set_missing_host_key_policy(paramiko.RejectPolicy() if node.strict_host_key_checking
                                       else paramiko.WarningPolicy())
    known_hosts = os.path.expanduser(node.known_hosts or "~/.ssh/known_hosts")
    if node.known_hosts:
        client.get_host_keys().clear()
    if os.path.isfile(known_hosts):
        client.load_host_keys(known_hosts)
    return conn


class SSHTransport:
    def __init__(self, node: Node, connection_factory: Callable[[Node], Connection] = fabric_connection):
        self.node = node
        self._factory = connection_factory
        self._conn: Connection | None = None
        self._lock = threading.Lock()
        self.commands_run = 0
        self.connections_opened = 0
        self.connect_attempts = 0
        self._alive: _AliveCheck | None = None

    def connection(self) -> Connection:
        """The open Fabric Connection, (re)connecting once if there is none or it died."""
        with self._lock:
            if self._conn is not None and _alive(self._conn):
                return self._conn
            if self._conn is not None:
                _quietly_close(self._conn)
                self._conn = None
            conn = self._factory(self.node)
            self.connect_attempts += 1
            try:
                conn.open()
            except paramiko.BadHostKeyException as e:
                raise TransportError(
                    f"node {self.node.name!r}: host key for {e.hostname} does not match known_hosts - refusing to connect"
                ) from None
            except paramiko.AuthenticationException as e:
                raise TransportError(f"node {self.node.name!r}: cannot log in to {self._where()}: {e}") from None
            except socket.timeout:
                raise Unreachable(f"node {self.node.name!r}: cannot connect to {self._where()}: "
                                  f"timed out after {self.node.connect_timeout:g}s") from None
            except paramiko.ssh_exception.NoValidConnectionsError as e:  # "[Errno None] Unable to connect ..."
                why = "; ".join(sorted({err.strerror or str(err) for err in e.errors.values()})) or str(e)
                raise Unreachable(f"node {self.node.name!r}: cannot connect to {self._where()}: {why}") from None
            except (paramiko.SSHException, OSError, EOFError) as e:
                raise Unreachable(f"node {self.node.name!r}: cannot connect to {self._where()}: "
                                  f"{str(e) or type(e).__name__}") from None
            transport = conn.client.get_transport()
            if self.node.keepalive:
                transport.set_keepalive(self.node.keepalive)
            self._alive = _AliveCheck(transport, self.node.keepalive)
            self.connections_opened += 1
            self._conn = conn
            return conn

    def connect(self) -> None:
        """Open the connection now (map_by_node does, once per node, before its targets run)."""
        self.connection()

    def _where(self) -> str:
        user = f"{self.node.user}@" if self.node.user else ""
        port = f":{self.node.port}" if self.node.port else ""
        return f"{user}{self.node.address}{port}"

    def _open_channel(self) -> paramiko.Channel:
        """A new channel; a connection that turns out dead is replaced once."""
        for retry in (False, True):
            conn = self.connection()
            try:
                return conn.client.get_transport().open_session(timeout=self.node.connect_timeout)
            except (paramiko.SSHException, OSError, EOFError, AttributeError) as e:
                if retry:
                    raise ConnectionLost(f"node {self.node.name!r}: cannot open a channel: {e}") from None
                with self._lock:
                    _quietly_close(conn)
                    self._conn = None
        raise AssertionError("unreachable")

    def run(self, command: str, *, stdin: Stdin = None, on_line: LineCallback | None = None,
            on_stderr_line: LineCallback | None = None, timeout: float | None = None) -> Result:
        self.commands_run += 1
        chan = self._open_channel()
        transport = chan.get_transport()
        alive = self._alive if self._alive is not None and self._alive.transport is transport else _AliveCheck(transport, 0)
        alive.heard()  # silence counts from now: an idle connection was not listened to
        deadline = None if timeout is None else time.monotonic() + timeout
        out, err = LineSplitter(on_line), LineSplitter(on_stderr_line)

        def check_link() -> None:
            if alive.dead():
                transport.close()
            if not transport.is_active():
                raise _lost(self.node, command)

        try:
            chan.exec_command(command)
            readers = [
                BackgroundCall(lambda: _pump(chan.recv, out, alive), "ssh-stdout"),
                BackgroundCall(lambda: _pump(chan.recv_stderr, err, alive), "ssh-stderr"),
            ]
            writer = BackgroundCall(lambda: _send(chan, stdin), "ssh-stdin")
            # Only the command's end is waited for, never the writer: like ssh(1), a command
            # that exits without reading all of stdin (or a local stdin that never closes)
            # must not hold us; closing the channel below ends the writer's next send.
            for call in readers:
                while not call.join(_STATUS_POLL):
                    _check_deadline(deadline, chan, command, timeout)
                    _check_calls(writer, *readers)
                    check_link()
            while not chan.status_event.wait(_STATUS_POLL):
                _check_deadline(deadline, chan, command, timeout)
                check_link()
            if not transport.is_active() and chan.exit_status == -1:  # no exit status came
                raise _lost(self.node, command)
            _check_calls(writer, *readers)
            code = chan.recv_exit_status()
        except BaseException as e:
            out.stop_delivering()
            err.stop_delivering()
            if isinstance(e, _CallFailed):
                raise e.args[0] from None
            if isinstance(e, (paramiko.SSHException, EOFError, socket.error)):
                if not transport.is_active():
                    raise _lost(self.node, command) from None
                raise TransportError(f"node {self.node.name!r}: {e}") from None
            raise
        finally:
            chan.close()
        if code == -1:  # killed by a signal (exit-signal) or closed without a status
            code = 255
        return Result(exit_code=code, stdout_bytes=out.finish(), stderr_bytes=err.finish())

    def put(self, local: Path, remote: str) -> None:
        try:
            self.connection().sftp().put(str(local), remote)
        except (OSError, paramiko.SSHException, EOFError) as e:
            raise TransportError(f"node {self.node.name!r}: upload {local} -> {remote} failed: {e}") from None

    def get(self, remote: str, local: Path) -> None:
        local = Path(local)
        tmp = local.with_name(f".{local.name}.tmp-{os.getpid()}")
        try:
            self.connection().sftp().get(remote, str(tmp))
            os.replace(tmp, local)
        except (OSError, paramiko.SSHException, EOFError) as e:
            tmp.unlink(missing_ok=True)
            shown = named_for(e, tmp, local)  # a local write's error named the .NAME.tmp-PID copy
            raise TransportError(f"node {self.node.name!r}: download {remote} -> {local} failed: {shown}") from None

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                _quietly_close(self._conn)
                self._conn = None


def _alive(conn: Connection) -> bool:
    transport = conn.client.get_transport()
    return transport is not None and transport.is_active()


def _quietly_close(conn: Connection) -> None:
    try:
        conn.close()
    except Exception:  # noqa: BLE001 - already broken
        pass


def _pump(recv: Callable[[int], bytes], splitter: LineSplitter, alive: _AliveCheck) -> None:
    while True:
        data = recv(CHUNK)
        if not data:
            return
        alive.heard()
        splitter.feed(data)


class _AliveCheck:
    """Is the server still there? OpenSSH's ServerAliveInterval / ServerAliveCountMax.

    Commands call `heard()` when they start and whenever data arrives, and poll `dead()`. After `interval`
    seconds of silence a probe (a global request the server must answer, even if only
    with a failure) runs in a daemon thread; its answer counts as hearing from the server.
    Dead = silent for ALIVE_COUNT_MAX x interval. interval 0 disables the check.
    """

    def __init__(self, transport: paramiko.Transport, interval: float):
        self.transport = transport
        self.interval = interval
        self.last_heard = time.monotonic()
        self._probe: threading.Thread | None = None

    def heard(self) -> None:
        self.last_heard = time.monotonic()

    def dead(self) -> bool:
        if not self.interval:
            return False
        silent = time.monotonic() - self.last_heard
        if silent < self.interval:
            return False
        if self._probe is None or not self._probe.is_alive():
            self._probe = threading.Thread(target=self._ask, name="ssh-alive-probe", daemon=True)
            self._probe.start()
        return silent > ALIVE_COUNT_MAX * self.interval

    def _ask(self) -> None:
        try:
            self.transport.global_request("keepalive@openssh.com", wait=True)
        except Exception:  # noqa: BLE001 - a broken transport is noticed by is_active()
            return
        if self.transport.is_active():
            self.heard()


def _send(chan: paramiko.Channel, stdin: Stdin) -> None:
    """Stream stdin, then EOF. A failed send only means the command stopped reading (or ended);
    an error reading the local stdin propagates: the command must not wait for the rest."""
    for chunk in iter_stdin(stdin):
        try:
            chan.sendall(chunk)
        except (OSError, paramiko.SSHException, EOFError):
            return
    try:
        chan.shutdown_write()
    except (OSError, paramiko.SSHException, EOFError):
        pass


class _CallFailed(Exception):
    """Reading the caller's stdin or a line callback failed; run() re-raises the original error."""


def _check_calls(*calls: BackgroundCall) -> None:
    """Stop at once when a stream thread failed: nobody feeds or drains the channel any more."""
    for call in calls:
        if call.error is not None:
            raise _CallFailed(call.error)


def _check_deadline(deadline: float | None, chan: paramiko.Channel, command: str, timeout: float | None) -> None:
    if deadline is not None and time.monotonic() > deadline:
        chan.close()
        raise CommandTimeout(command, timeout)


def _lost(node: Node, command: str) -> ConnectionLost:
    return ConnectionLost(f"node {node.name!r}: connection lost while running: {command[:200]}")
