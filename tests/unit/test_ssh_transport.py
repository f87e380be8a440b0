"""SSHTransport against a Paramiko-level double (no network)."""

import socket
import threading

import paramiko
import pytest

from dflash_ops.container import Container
from dflash_ops.errors import CommandTimeout, ConnectionLost, TransportError, Unreachable
from dflash_ops.inventory import Node, Target, load_inventory
from dflash_ops.transport.ssh import SSHTransport, fabric_connection
from tests import container_checks as checks
from tests.conftest import write_sim_inventory
from tests.unit.fake_ssh import FakeServer


@pytest.fixture
def server():
    return FakeServer()


@pytest.fixture
def ssh(server):
    node = Node(name="fake", transport="ssh", pct=("pct",), address="10.0.0.1", keepalive=7)
    return SSHTransport(node, connection_factory=server.connection)


@pytest.fixture
def container(tmp_path, server):
    """The sim node's pct behind the fake SSH: the same node command a real sshd would get."""
    sim = load_inventory(write_sim_inventory(tmp_path / "n")).target("host200")
    node = Node(name="fake", transport="ssh", pct=sim.node.pct, address="10.0.0.1")
    target = Target(name="host200", node=node, ctid=200, base_dir=sim.base_dir)
    return Container(target, SSHTransport(node, connection_factory=server.connection))


def test_exit_codes_output_and_keepalive(ssh, server):
    result = ssh.run("echo out; echo err >&2; exit 5")
    assert (result.exit_code, result.stdout, result.stderr, result.ok) == (5, "out\n", "err\n", False)
    assert server.connections[0].client.transport.keepalive == 7


def test_one_connection_for_many_commands(ssh, server):
    for i in range(5):
        assert ssh.run(f"echo {i}").stdout == f"{i}\n"
    assert len(server.connections) == 1 and ssh.connections_opened == 1 and ssh.commands_run == 5


def test_stdin_streams_binary_in_chunks(ssh):
    data = bytes(range(256)) * 2000
    assert ssh.run("cat", stdin=data).stdout_bytes == data


def test_line_callbacks_get_bytes_with_newlines(ssh):
    out, err = [], []
    ssh.run("printf 'a\\nb\\377\\nc'; printf 'e1\\ne2' >&2", on_line=out.append, on_stderr_line=err.append)
    assert out == [b"a\n", b"b\xff\n", b"c"] and err == [b"e1\n", b"e2"]


def test_lines_stream_before_exit(container, tmp_path):
    checks.assert_lines_stream_before_exit(container, tmp_path / "flag")


def test_timeout_closes_the_channel(ssh, server):
    with pytest.raises(CommandTimeout):
        ssh.run("sleep 30", timeout=0.3)
    chan = server.connections[0].client.transport.channels[-1]
    assert chan.closed
    chan.proc.wait(5)
    assert ssh.run("echo still").stdout == "still\n"


def test_dead_connection_reconnects_once_transparently(ssh, server):
    ssh.run("true")
    server.connections[0].client.transport.drop()
    assert ssh.run("echo back").stdout == "back\n"
    assert len(server.connections) == 2 and ssh.connections_opened == 2


def test_drop_mid_stream_raises_connection_lost_then_next_command_reconnects(ssh, server):
    def drop_after_first_line(line):
        server.connections[-1].client.transport.drop()

    with pytest.raises(ConnectionLost):
        ssh.run("echo first; sleep 30", on_line=drop_after_first_line)
    assert ssh.run("echo next").stdout == "next\n"
    assert len(server.connections) == 2


def test_connect_failure_is_a_transport_error(ssh, server):
    key = paramiko.RSAKey.generate(1024)
    server.refuse_with = paramiko.BadHostKeyException("10.0.0.1", key, key)
    with pytest.raises(TransportError, match="does not match known_hosts"):
        ssh.run("true")
    server.refuse_with = OSError("Connection refused")
    with pytest.raises(Unreachable, match="cannot connect"):
        ssh.run("true")


@pytest.mark.parametrize("error, kind, message", [
    (socket.timeout("timed out"), Unreachable, "cannot connect to 10.0.0.1: timed out after 2.5s"),
    (ConnectionRefusedError(111, "Connection refused"), Unreachable, "Connection refused"),
    (paramiko.SSHException("Error reading SSH protocol banner"), Unreachable, "banner"),
    (EOFError(), Unreachable, "cannot connect to 10.0.0.1: EOFError"),
    (paramiko.ssh_exception.NoValidConnectionsError({("10.0.0.1", 22): ConnectionRefusedError(111, "Connection refused")}),
     Unreachable, "cannot connect to 10.0.0.1: Connection refused$"),
    (paramiko.AuthenticationException("Authentication failed."), TransportError, "cannot log in"),
])
def test_connect_failures_say_whether_a_retry_can_help(server, error, kind, message):
    """Unreachable (worth a retry: logs -f, dash) versus a refused key or login (final)."""
    node = Node(name="fake", transport="ssh", pct=("pct",), address="10.0.0.1", connect_timeout=2.5)
    ssh = SSHTransport(node, connection_factory=server.connection)
    server.refuse_with = error
    with pytest.raises(TransportError, match=message) as caught:
        ssh.run("true")
    assert (type(caught.value) is Unreachable) == (kind is Unreachable)
    assert ssh.connect_attempts == 1


def test_a_silent_partition_ends_the_command_after_three_keepalives(server):
    """Packets vanish: TCP would wait many minutes; the keepalive probe gives up after 3 intervals."""
    node = Node(name="fake", transport="ssh", pct=("pct",), address="10.0.0.1", keepalive=1)
    ssh = SSHTransport(node, connection_factory=server.connection)
    ssh.run("true")
    server.connections[0].client.transport.partitioned = True
    with pytest.raises(ConnectionLost, match="connection lost"):
        ssh.run("sleep 60")
    assert server.connections[0].client.transport.probes >= 1
    assert ssh.run("echo back").stdout == "back\n" and ssh.connections_opened == 2


def test_a_connection_idle_for_longer_than_three_keepalives_is_not_dead(server):
    """Silence counts while a command waits, not while nobody used the connection."""
    node = Node(name="fake", transport="ssh", pct=("pct",), address="10.0.0.1", keepalive=1)
    ssh = SSHTransport(node, connection_factory=server.connection)
    ssh.run("true")
    ssh._alive.last_heard -= 10  # idle for 10 s
    assert ssh.run("sleep 0.5; echo fine").stdout == "fine\n" and ssh.connections_opened == 1


def test_a_quiet_command_on_a_live_link_is_kept(server):
    """The server answers the probes: a command silent for longer than 3 keepalives runs on."""
    node = Node(name="fake", transport="ssh", pct=("pct",), address="10.0.0.1", keepalive=1)
    ssh = SSHTransport(node, connection_factory=server.connection)
    assert ssh.run("sleep 4; echo done").stdout == "done\n"
    assert server.connections[0].client.transport.probes >= 2 and ssh.connections_opened == 1


def test_container_over_fake_ssh(container):
    checks.assert_argv_round_trip(container, ["it's", "$(id)", "{i}: {lines[i]}", "a\nb", ""])
    checks.assert_binary_stdin_round_trip(container)
    checks.assert_exec_check_raises(container)


def test_push_pull_over_fake_ssh(container, tmp_path):
    checks.assert_push_pull_verified(container, tmp_path)


def test_concurrent_commands_share_one_connection(container, server):
    assert checks.run_concurrently(container, 6) == [f"{i}\n" for i in range(6)]
    assert len(server.connections) == 1


def test_fabric_connection_rejects_unknown_hosts_unless_disabled(tmp_path):
    known = tmp_path / "known_hosts"
    known.write_text("")
    strict = Node(name="n", transport="ssh", pct=("pct",), address="h", known_hosts=str(known))
    lax = Node(name="n", transport="ssh", pct=("pct",), address="h", strict_host_key_checking=False)
    assert isinstance(fabric_connection(strict).client._policy, paramiko.RejectPolicy)
    assert isinstance(fabric_connection(lax).client._policy, paramiko.WarningPolicy)
    missing_key = Node(name="n", transport="ssh", pct=("pct",), address="h", identity_file=str(tmp_path / "nokey"))
    with pytest.raises(TransportError, match="identity_file"):
        fabric_connection(missing_key)


class _FailingReader:
    """A local stdin source that breaks after its first chunk (disk error, progress callback, ...)."""

    def __init__(self):
        self.calls = 0

    def read(self, size: int = -1) -> bytes:
        self.calls += 1
        if self.calls > 1:
            raise OSError("local read failed")
        return b"first chunk\n"


def test_local_stdin_error_is_raised_not_left_waiting(ssh):
    """The remote command still waits for the rest of stdin; the caller gets the local error.
    (The timeout only keeps a regression from hanging the suite.)"""
    with pytest.raises(OSError, match="local read failed"):
        ssh.run("cat > /dev/null", stdin=_FailingReader(), timeout=10)


def test_line_callback_error_stops_the_command(ssh):
    """`dflash-ops exec ... | head`: writing a line fails, so nobody reads the channel any more;
    the caller gets that error instead of waiting for a command that can never finish."""

    def closed_pipe(line: bytes) -> None:
        raise BrokenPipeError("stdout closed")

    with pytest.raises(BrokenPipeError, match="stdout closed"):
        ssh.run("yes", on_line=closed_pipe, timeout=10)


def test_no_line_arrives_after_a_dropped_command_raised(ssh, server):
    """Output buffered before the drop is still being read when run() raises; delivering it
    afterwards put lines behind the offset a follower had taken (logs -f repeated them)."""
    received = []

    def slow_reader(line):
        if len(received) == 100:  # the shell has filled the pipe by now
            server.connections[-1].client.transport.drop()
        received.append(line)
        threading.Event().wait(0.002)

    with pytest.raises(ConnectionLost):
        ssh.run("i=0; while [ $i -lt 5000 ]; do echo line $i; i=$((i+1)); done; sleep 30", on_line=slow_reader)
    seen = len(received)
    threading.Event().wait(0.5)
    assert len(received) == seen
