"""The command layer through a real OpenSSH sshd on 127.0.0.1 (fixture `sshd_node`)."""

import json
import shlex
import subprocess

import pytest
from typer.testing import CliRunner

from dflash_ops.cli import app
from dflash_ops.container import Container
from dflash_ops.errors import ConnectionLost, TransportError
from dflash_ops.inventory import load_inventory
from dflash_ops.transport.ssh import SSHTransport
from tests import container_checks as checks
from tests.container_checks import ContainerTests

pytestmark = [pytest.mark.sshd, pytest.mark.lxc_tier]


@pytest.fixture(scope="module")
def container(sshd_node):
    target = load_inventory(sshd_node.inventory).target("host200")
    c = Container(target, SSHTransport(target.node))
    yield c
    c.transport.close()


class TestContainer(ContainerTests):
    pass


def test_one_connection_for_many_execs(sshd_node, container):
    container.exec(["true"], check=True)
    logins, opened, runs = sshd_node.accepted_logins(), container.transport.connections_opened, container.transport.commands_run
    for i in range(10):
        assert container.exec(["echo", str(i)]).stdout == f"{i}\n"
    assert checks.run_concurrently(container, 4) == [f"{i}\n" for i in range(4)]
    assert sshd_node.accepted_logins() == logins
    assert container.transport.connections_opened == opened
    assert container.transport.commands_run - runs == 14


def test_node_commands_read_the_nodes_own_login_bashrc(sshd_node):
    """sshd runs every command through the login's bash, which reads ~/.bashrc: the node's own
    (Debian's default, as on a fresh Proxmox node), not this machine's, which stays untouched."""
    if sshd_node.login_rc is None:
        pytest.skip("the login's shell reads no ~/.bashrc here (or not root): nothing to replace")
    node_rc, here = sshd_node.login_rc
    before = here.read_bytes()
    transport = SSHTransport(load_inventory(sshd_node.inventory).target("host200").node)
    try:
        seen = transport.run(shlex.join(["cat", "--", str(here)]))
    finally:
        transport.close()
    assert seen.ok and seen.stdout_bytes == node_rc.read_bytes()
    assert here.read_bytes() == before


def test_sudo_pct_node_container_environment_and_codes(sudo_sshd_node, tmp_path):
    """A non-root login whose pct is `sudo -n pct`: same container, same strictness."""
    target = load_inventory(sudo_sshd_node.inventory).target("host200")
    assert target.node.user != "root" and target.node.pct[:2] == ("sudo", "-n")
    c = Container(target, SSHTransport(target.node))
    try:
        checks.assert_container_environment(c)
        checks.assert_real_exit_codes(c, tmp_path)
        checks.assert_push_pull_verified(c, tmp_path)
    finally:
        c.transport.close()


def test_dropped_connection_mid_stream_then_reconnect(sshd_node, tmp_path):
    target = load_inventory(sshd_node.inventory).target("host200")
    transport = SSHTransport(target.node)
    c = Container(target, transport)
    try:
        c.exec(["true"], check=True)
        with pytest.raises(ConnectionLost):
            c.exec(["sh", "-c", "echo first; sleep 60"], on_line=lambda line: sshd_node.kill_sessions(), timeout=120)
        assert c.exec(["echo", "again"]).stdout == "again\n"
        assert transport.connections_opened == 2
    finally:
        transport.close()


def _node_with_known_hosts(sshd_node, text, tmp_path):
    known = tmp_path / "known_hosts"
    known.write_text(text)
    inv = sshd_node.inventory.read_text().replace(str(sshd_node.known_hosts), str(known))
    path = tmp_path / "inv.yaml"
    path.write_text(inv)
    return load_inventory(path).target("host200").node


def test_host_key_mismatch_is_refused(sshd_node, tmp_path):
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    kind, blob = (tmp_path / "other_key.pub").read_text().split()[:2]
    node = _node_with_known_hosts(sshd_node, f"[127.0.0.1]:{sshd_node.port} {kind} {blob}\n", tmp_path)
    with pytest.raises(TransportError, match="does not match known_hosts"):
        SSHTransport(node).run("true")


def test_unknown_host_is_refused(sshd_node, tmp_path):
    node = _node_with_known_hosts(sshd_node, "", tmp_path)
    with pytest.raises(TransportError, match="not found in known_hosts"):
        SSHTransport(node).run("true")


def test_cli_exec_through_sshd(sshd_node):
    args = ["it's", "$(id)", "{i}: {lines[i]}"]
    result = CliRunner().invoke(app, ["exec", "--inventory", str(sshd_node.inventory), "host200", "--", "python3",
                                      "-c", "import json,sys; print(json.dumps(sys.argv[1:]))", *args])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == args


@pytest.mark.parametrize("alias", ["pve-alias", "pve-jump"])
def test_ssh_config_alias_and_proxyjump(sshd_node, tmp_path, monkeypatch, alias):
    """A node that names only a ~/.ssh/config alias connects like `ssh alias` would, ProxyJump included."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    entry = (f"  HostName 127.0.0.1\n  Port {sshd_node.port}\n  User {sshd_node.user}\n"
             f"  IdentityFile {sshd_node.client_key}\n  IdentitiesOnly yes\n")
    (home / ".ssh" / "config").write_text(
        f"Host pve-alias\n{entry}Host pve-jump\n{entry}  ProxyJump pve-alias\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    inventory = tmp_path / "hosts.yaml"
    inventory.write_text(
        "nodes:\n"
        f"  pve1: {{transport: ssh, address: {alias}, known_hosts: {sshd_node.known_hosts}, "
        f"pct: {json.dumps(load_inventory(sshd_node.inventory).target('host200').node.pct[0])}}}\n"
        "targets:\n"
        f"  host200: {{node: pve1, ctid: 200, base_dir: {sshd_node.base_dir}}}\n")
    target = load_inventory(inventory).target("host200")
    assert target.node.port is None and target.node.user is None and target.node.identity_file is None
    logins = sshd_node.accepted_logins()
    transport = SSHTransport(target.node)
    try:
        assert Container(target, transport).exec(["echo", "via", alias], check=True).stdout == f"via {alias}\n"
    finally:
        transport.close()
    assert sshd_node.accepted_logins() - logins == (2 if alias == "pve-jump" else 1)


def test_cli_exec_timeout_kills_the_command_in_the_container(sshd_node):
    """Closing an SSH channel does not stop a quiet command; --timeout kills it inside the container."""
    marker = "300.0" + str(sshd_node.port)  # a sleep argument no other process has
    result = CliRunner().invoke(app, ["exec", "--inventory", str(sshd_node.inventory), "--timeout", "0.5",
                                      "host200", "--", "sleep", marker])
    assert result.exit_code == 124 and "timed out after 0.5s" in result.stderr
    assert not checks.processes_running(["sleep", marker])

