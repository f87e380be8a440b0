"""Behaviour every tier must show, run against a Container (simulated node, mocked SSH, real sshd)."""

from __future__ import annotations

import json
import threading
import uuid
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_ops import render
from dflash_ops.container import Container
from dflash_ops.errors import RemoteCommandError, TransferError
from dflash_ops.helpers import bundle

ECHO_ARGV = str(Path(__file__).resolve().parent / "echo_argv.py")


def in_container_dir(container: Container, name: str) -> Path:
    """A path beside the container's base_dir that this machine and the container both see (a
    directory container's paths are this machine's; an LXC container of the test tiers has its test
    directory bound at the same path)."""
    directory = Path(container.base_dir).parent
    directory.mkdir(parents=True, exist_ok=True)
    return directory / name


def echo_argv(container: Container) -> str:
    """tests/echo_argv.py where the container can run it."""
    path = in_container_dir(container, "echo_argv.py")
    if not path.exists():
        path.write_bytes(Path(ECHO_ARGV).read_bytes())
    return str(path)


def assert_argv_round_trip(container: Container, argv: list[str]) -> None:
    result = container.exec(["python3", echo_argv(container), *argv], check=True)
    assert json.loads(result.stdout) == argv


def assert_lines_stream_before_exit(container: Container, flag: Path) -> None:
    """The command waits for a file the test creates on seeing the first line: no line, no end."""
    seen: list[bytes] = []

    def on_line(line: bytes) -> None:
        seen.append(line)
        if len(seen) == 1:
            flag.write_text("go")

    script = 'echo first; while [ ! -e "$0" ]; do sleep 0.05; done; printf "second\\npartial"'
    result = container.exec(["sh", "-c", script, str(flag)], on_line=on_line, timeout=120)
    assert result.ok
    assert seen == [b"first\n", b"second\n", b"partial"]
    assert result.stdout_bytes == b"first\nsecond\npartial"


def assert_binary_stdin_round_trip(container: Container) -> None:
    data = bytes(range(256)) * 512
    result = container.exec(["cat"], stdin=data)
    assert result.ok and result.stdout_bytes == data


def assert_real_exit_codes(container: Container, tmp: Path) -> None:
    """lxc-attach's statuses: 127 missing command, 126 not executable, 128+N killed by signal N."""
    missing = container.exec(["no-such-command-xyz"])
    assert missing.exit_code == 127
    assert missing.stderr.endswith('No such file or directory - Failed to exec "no-such-command-xyz"\n')
    assert missing.stderr.startswith(f"lxc-attach: {container.target.ctid}: ")
    script = container.base_dir + "/not-executable.sh"
    container.exec(["mkdir", "-p", container.base_dir], check=True)
    container.exec(["sh", "-c", 'printf "#!/bin/sh\\necho hi\\n" > "$0"; chmod 644 "$0"', script], check=True)
    not_exec = container.exec([script])
    assert not_exec.exit_code == 126 and 'Permission denied - Failed to exec' in not_exec.stderr
    assert container.exec(["sh", "-c", "exit 42"]).exit_code == 42
    assert container.exec(["sh", "-c", "kill -9 $$"]).exit_code == 137  # a direct child, killed
    assert container.exec(["sh", "-c", "kill -TERM $$"]).exit_code == 143


def assert_container_environment(container: Container) -> None:
    """pct's PATH exactly, container=lxc, nothing of the operator's venv, the container's python."""
    env = dict(line.split("=", 1) for line in container.exec(["env"], check=True).stdout.splitlines() if "=" in line)
    assert env["PATH"] == "/sbin:/bin:/usr/sbin:/usr/bin"
    assert env["container"] == "lxc"
    for leaked in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "SSL_CERT_FILE", "PYTEST_CURRENT_TEST"):
        assert leaked not in env
    # no signal ignored (the old stand-in passed on Python's ignored SIGPIPE and SIGXFSZ)
    status = container.exec(["sh", "-c", "grep SigIgn /proc/self/status"], check=True).stdout
    assert status.split() == ["SigIgn:", "0" * 16]
    python = container.target.python
    probe = container.exec([python, "-c", "import sys, json; print(json.dumps([sys.prefix, sys.path]))"], check=True)
    prefix, path = json.loads(probe.stdout)
    # the container's own interpreter: CT_ROOT/usr/bin/python3 (directory), Debian's python3 on pct's PATH (LXC)
    assert python.startswith(prefix + "/") if "/" in python else prefix == "/usr"
    assert not any("site-packages" in p and not p.startswith(prefix) for p in path)
    assert not container.exec([python, "-c", "import dflash_ops"]).ok  # the operator's code is not there
    assert container.exec([python, "-c", "import torch, yaml, safetensors"]).ok  # provisioned


def assert_push_pull_verified(container: Container, tmp: Path) -> None:
    local = tmp / "payload.bin"
    local.write_bytes(bytes(range(256)) * 100 + b"tail")
    remote_dir = container.base_dir + "/pushpull"
    container.exec(["mkdir", "-p", remote_dir], check=True)
    container.push(local, remote_dir + "/payload.bin")
    back = tmp / "back.bin"
    container.pull(remote_dir + "/payload.bin", back)
    assert back.read_bytes() == local.read_bytes()
    with pytest.raises(TransferError):  # pct push exits 0 here; only the checksum notices
        container.push(local, remote_dir + "/no/such/dir/payload.bin")
    with pytest.raises(TransferError):
        container.pull(remote_dir + "/missing.bin", tmp / "never.bin")
    assert not (tmp / "never.bin").exists()


def assert_exec_check_raises(container: Container) -> None:
    with pytest.raises(RemoteCommandError) as info:
        container.exec(["sh", "-c", "echo boom >&2; exit 7"], check=True)
    assert info.value.exit_code == 7 and "boom" in str(info.value)


def run_concurrently(container: Container, n: int) -> list[str]:
    out: list[str] = [""] * n

    def one(i: int) -> None:
        out[i] = container.exec(["echo", str(i)], check=True).stdout

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def argv_strategy():
    text = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=40)
    tricky = st.sampled_from(["", "it's", '"', "$(id)", "`id`", "{i}: {lines[i]}", "a\nb", "--", "-c", "*", "~", "\\", "é☃𝄞"])
    return st.lists(st.one_of(text, tricky), max_size=8)


BIG_ARGUMENT = ("x" * 999 + "'") * 100  # 100 kB with a quote every kB


def processes_running(argv: list[str]) -> list[int]:
    """Pids of this machine's processes whose argv is exactly `argv` (the containers are local)."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if cmdline.read_bytes().split(b"\0")[:-1] == [a.encode() for a in argv]:
                pids.append(int(cmdline.parent.name))
        except OSError:
            continue
    return pids


class ContainerTests:
    """The tests every tier runs, over its module's `container` fixture: a tier module subclasses
    this as `class TestContainer(ContainerTests)` (the same tests on every tier, written once)."""

    argv_examples = 30  # hypothesis examples of the argv round trip; a cheap tier may ask for more

    def test_argv_arrives_byte_for_byte(self, container):
        @settings(max_examples=self.argv_examples, deadline=None)
        @given(argv_strategy())
        def round_trip(argv):
            assert_argv_round_trip(container, argv)

        round_trip()

    def test_big_argument(self, container):
        assert_argv_round_trip(container, [BIG_ARGUMENT, "{i}: {lines[i]}", "$(id)"])

    def test_lines_stream_before_the_command_ends(self, container, tmp_path):
        assert_lines_stream_before_exit(container, in_container_dir(container, f"flag-{tmp_path.name}"))

    def test_binary_stdin(self, container):
        assert_binary_stdin_round_trip(container)

    def test_stopped_container_refuses_exec(self, container):
        pct = container.target.node.pct
        ctid = container.target.ctid
        run = container.transport.run
        assert run(render.node_command(render.pct_argv(pct, "stop", ctid))).ok
        try:
            result = container.exec(["true"])
            assert result.exit_code == 255
            # pve-container pct.pm exec (Proxmox dropped the "Error: " prefix this check once pinned)
            assert result.stderr == f"container '{ctid}' not running!\n"
            status = run(render.node_command(render.pct_argv(pct, "status", ctid)))
            assert status.stdout == "status: stopped\n"
        finally:
            assert run(render.node_command(render.pct_argv(pct, "start", ctid))).ok
        assert container.exec(["true"]).ok

    def test_push_pull_verified(self, container, tmp_path):
        assert_push_pull_verified(container, tmp_path)

    def test_push_tree(self, container, tmp_path):
        src = tmp_path / "tree"
        (src / "pkg" / "sub").mkdir(parents=True)
        (src / "pkg" / "__init__.py").write_text("x = 1\n")
        (src / "pkg" / "sub" / "data.bin").write_bytes(bytes(range(256)))
        (src / "odd name 'quoted'.txt").write_text("$(id)\n")
        remote = container.base_dir + "/tree"
        sent = container.push_tree(src, remote)
        assert sent > 0
        listing = container.exec(["find", remote, "-type", "f"], check=True).stdout.split("\n")
        assert sorted(p for p in listing if p) == sorted(
            [f"{remote}/pkg/__init__.py", f"{remote}/pkg/sub/data.bin", f"{remote}/odd name 'quoted'.txt"]
        )
        got = container.exec(["cat", f"{remote}/pkg/sub/data.bin"], check=True).stdout_bytes
        assert got == bytes(range(256))

    def test_exec_check(self, container):
        assert_exec_check_raises(container)

    def test_helper_installed_once(self, container):
        first = container.helper("inspect-source", ["json", "--lines", "1:3"], check=True)
        runs_before = container.transport.commands_run
        sent: list[bytes] = []
        second = container.helper("inspect-source", ["json", "--lines", "1:3"], check=True, on_line=sent.append)
        assert container.transport.commands_run - runs_before == 1
        assert first.stdout == second.stdout and second.stdout.startswith("# ")
        assert b"".join(sent) == second.stdout_bytes
        assert container.exec(["test", "-f", container.helper_path("inspect-source")]).ok
        with pytest.raises(RemoteCommandError):
            container.helper("inspect-source", ["no_such_module_xyz"], check=True)

    def test_a_helper_called_with_stdin_is_installed_once_in_one_exec(self, container):
        """A call with stdin (run start's config) cannot try the helper first; it asks whether the
        file is there. A new process (a new Container) finds the bundle installed: the probe and the
        call, not one exec for each of the bundle's 14 files as before, every `run start`."""
        root = f"{container.base_dir}/helpers-{uuid.uuid4().hex[:8]}"  # nothing installed there yet
        args = ["list", f"{container.base_dir}/no-runs-here"]
        for execs in (3, 2):  # probe, install (the whole bundle), call; then probe, call
            fresh = Container(container.target, container.transport)
            runs_before = container.transport.commands_run
            result = fresh.helper("runs", args, stdin=b"unread\n", helpers_root=root, check=True)
            assert container.transport.commands_run - runs_before == execs
            assert json.loads(result.stdout)["runs"] == []  # it ran, importing its shared modules
        directory = root + "/" + fresh.helper_path("runs").split("/")[-2]
        listed = set(container.exec(["ls", "-A", directory], check=True).stdout.split()) - {"__pycache__"}
        assert listed == {name for name, _content in bundle("runs").files}  # and no staging directory left

    def test_exit_status_is_the_commands_own_127_126_and_128_plus_signal(self, container, tmp_path):
        # over SSH a signal must arrive as lxc-attach's exit status 128+N, not as an SSH exit-signal
        assert_real_exit_codes(container, tmp_path)

    def test_container_environment(self, container, monkeypatch):
        monkeypatch.setenv("PYTHONPATH", "/leak")  # where the node's commands inherit this process' environment
        monkeypatch.setenv("SSL_CERT_FILE", "/leak")
        assert_container_environment(container)
