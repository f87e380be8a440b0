"""Behaviour every tier must show, run against a Container (simulated node, mocked SSH, real sshd)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from dflash_ops import render
from dflash_ops.container import Container
from dflash_ops.errors import RemoteCommandError, TransferError

ECHO_ARGV = str(Path(__file__).resolve().parent / "echo_argv.py")


def assert_argv_round_trip(container: Container, argv: list[str]) -> None:
    result = container.exec(["python3", ECHO_ARGV, *argv], check=True)
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


def assert_stopped_container_refuses(container: Container) -> None:
    pct = container.target.node.pct
    ctid = container.target.ctid
    run = container.transport.run
    assert run(render.node_command(render.pct_argv(pct, "stop", ctid))).ok
    try:
        result = container.exec(["true"])
        assert result.exit_code == 255
        assert result.stderr == f"Error: container '{ctid}' not running!\n"
        status = run(render.node_command(render.pct_argv(pct, "status", ctid)))
        assert status.stdout == "status: stopped\n"
    finally:
        assert run(render.node_command(render.pct_argv(pct, "start", ctid))).ok
    assert container.exec(["true"]).ok


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


def assert_push_tree(container: Container, tmp: Path) -> None:
    src = tmp / "tree"
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


def assert_helper_installed_once(container: Container) -> None:
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
    from hypothesis import strategies as st

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
