"""Local transport + pct stand-in: the whole command layer without SSH."""

import subprocess
import sys

import pytest
from hypothesis import given, settings

from dflash_ops import render
from dflash_ops.connect import open_container
from dflash_ops.errors import CommandTimeout
from dflash_ops.inventory import load_inventory
from tests import container_checks as checks
from tests.conftest import write_sim_inventory


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    return open_container(load_inventory(write_sim_inventory(tmp_path_factory.mktemp("sim"))), "host200")


@settings(max_examples=40, deadline=None)
@given(checks.argv_strategy())
def test_argv_arrives_byte_for_byte(container, argv):
    checks.assert_argv_round_trip(container, argv)


def test_big_argument(container):
    checks.assert_argv_round_trip(container, [checks.BIG_ARGUMENT, "$(id)"])


def test_lines_stream_before_the_command_ends(container, tmp_path):
    checks.assert_lines_stream_before_exit(container, tmp_path / "flag")


def test_binary_stdin(container):
    checks.assert_binary_stdin_round_trip(container)


def test_stdin_from_a_binary_file_object(container, tmp_path):
    payload = tmp_path / "in.bin"
    payload.write_bytes(bytes(range(256)) * 1000)
    with open(payload, "rb") as f:
        assert container.exec(["sha256sum"], stdin=f).stdout.split()[0] == \
            subprocess.run(["sha256sum", str(payload)], capture_output=True, text=True).stdout.split()[0]


def test_stopped_container_refuses_exec(container):
    checks.assert_stopped_container_refuses(container)


def test_push_pull_verified(container, tmp_path):
    checks.assert_push_pull_verified(container, tmp_path)


def test_push_tree(container, tmp_path):
    checks.assert_push_tree(container, tmp_path)


def test_helper_installed_once(container):
    checks.assert_helper_installed_once(container)


def test_exec_check(container):
    checks.assert_exec_check_raises(container)


def test_exit_status_is_the_commands_own_and_128_plus_signal(container):
    assert container.exec(["sh", "-c", "exit 42"]).exit_code == 42
    assert container.exec(["sh", "-c", "kill -9 $$"]).exit_code == 137


def test_container_environment(container):
    out = container.exec(["sh", "-c", 'echo "$PATH"; command -v python3']).stdout.splitlines()
    assert out[0].endswith(":/sbin:/bin:/usr/sbin:/usr/bin")
    assert out[1] == out[0].split(":")[0] + "/python3"
    exe = container.exec(["python3", "-c", "import sys; print(sys.executable)"]).stdout.strip()
    assert exe == sys.executable


def test_timeout_kills_the_process_group(container, tmp_path):
    marker = tmp_path / "survived"
    with pytest.raises(CommandTimeout):
        container.exec(["sh", "-c", 'sleep 2; touch "$0"', str(marker)], timeout=0.5)
    subprocess.run(["sleep", "2.5"])
    assert not marker.exists()


def pct(container, *args):
    return container.transport.run(render.node_command([*container.target.node.pct, *args]))


def test_pct_list_status_and_messages(container):
    listing = pct(container, "list").stdout.splitlines()
    assert listing[0] == "VMID       Status     Lock         Name                "
    assert listing[1].split() == ["200", "running", "sim200"]
    assert pct(container, "status", "200").stdout == "status: running\n"
    assert pct(container, "start", "200").stderr == "CT 200 already running\n"
    bad = pct(container, "exec", "12", "--", "true")
    assert bad.exit_code == 255 and "vmid: invalid format" in bad.stderr
    missing_cmd = pct(container, "exec", "200", "--")
    assert (missing_cmd.exit_code, missing_cmd.stderr) == (255, "missing command\n")
    unknown = pct(container, "frobnicate")
    assert unknown.exit_code == 255 and unknown.stderr.startswith("ERROR: unknown command 'pct frobnicate'")


def test_destroyed_container_does_not_exist(tmp_path):
    c = open_container(load_inventory(write_sim_inventory(tmp_path, ctids=(201,))), "host201")
    assert pct(c, "stop", "201").ok and pct(c, "destroy", "201").ok
    result = c.exec(["true"])
    assert result.exit_code == 255
    assert result.stderr.startswith("Configuration file 'nodes/") and result.stderr.endswith("/lxc/201.conf' does not exist\n")


def test_push_respects_perms(container, tmp_path):
    local = tmp_path / "f"
    local.write_text("x")
    remote = container.base_dir + "/perm-file"
    container.exec(["mkdir", "-p", container.base_dir], check=True)
    result = pct(container, "push", "200", str(local), remote, "--perms", "600")
    assert result.ok
    assert container.exec(["stat", "-c", "%a", remote]).stdout == "600\n"
