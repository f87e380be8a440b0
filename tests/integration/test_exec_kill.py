"""`exec` given up on (Ctrl-C, a lost connection, --timeout) stops its command inside the container.

Killing the local `pct exec` is not enough: lxc-attach leaves the command running in the
container, sshd signals nothing when a connection without a terminal ends, and `timeout` puts
the command into a process group of its own. These tests fail on a dflash-ops that only kills
its local side (each leaves a `sleep` running).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import yaml

from dflash_ops import render
from dflash_ops.connect import open_container
from dflash_ops.container import exec_killed_after, kill_tagged
from dflash_ops.errors import ConnectionLost, TransportError
from dflash_ops.inventory import load_inventory
from dflash_ops.simnode import containers as simct
from dflash_ops.simnode import rootfs
from tests.conftest import unavailable, write_sim_inventory


def _sleepers(marker: str) -> list[int]:
    """Processes on this machine (containers' included) running `sleep MARKER`."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if cmdline.read_bytes().split(b"\0")[:2] == [b"sleep", marker.encode()]:
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


def _wait_for(predicate, what: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for: {what}")
        time.sleep(0.05)


def _marker() -> str:
    return f"{1000 + uuid.uuid4().int % 1000}.{uuid.uuid4().int % 10**6}"  # a sleep length no one else uses


@pytest.fixture(scope="module")
def lxc_inventory(tmp_path_factory) -> Path:
    unavailable(rootfs.unavailable_reason(), "the LXC backend")
    work = tmp_path_factory.mktemp("lxc-exec")
    root = work / "sim"
    simct.create(root, 200, hostname="host200", backend="lxc", packages=())
    path = work / "inventory.yaml"
    path.write_text(yaml.safe_dump({
        "nodes": {"sim": {"transport": "local", "pct": "simulated", "sim_root": str(root)}},
        "targets": {"host200": {"node": "sim", "ctid": 200}},
    }))
    yield path
    for args in (["stop", "200"], ["destroy", "200"]):
        subprocess.run([*simct.stand_in_argv(root), *args], capture_output=True)


@pytest.mark.parametrize("timeout", [None, 300])
def test_ctrl_c_stops_the_command_inside_an_lxc_container(lxc_inventory, timeout):
    """Ctrl-C on `dflash-ops exec`: no `sleep` is left in the container, also under --timeout
    (coreutils timeout runs it in a process group of its own, out of reach of the local kill)."""
    marker = _marker()
    argv = [sys.executable, "-m", "dflash_ops", "exec", "--inventory", str(lxc_inventory), "host200"]
    argv += ["--timeout", str(timeout)] if timeout else []
    proc = subprocess.Popen([*argv, "--", "sh", "-c", f"sleep {marker}; echo survived"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                            # as from a terminal: a suite started in the background has SIGINT ignored
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        _wait_for(lambda: _sleepers(marker), "the sleep to start in the container")
        proc.send_signal(signal.SIGINT)
        out, _err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0 and "survived" not in out
    _wait_for(lambda: not _sleepers(marker), f"no sleep left in the container (dflash-ops said: {_err!r})", 60)


def test_timeout_leaves_nothing_in_an_lxc_container(lxc_inventory):
    marker = _marker()
    result = subprocess.run([sys.executable, "-m", "dflash_ops", "exec", "--inventory", str(lxc_inventory), "host200",
                             "--timeout", "1", "--", "sh", "-c", f"sleep {marker} & sleep {marker}; wait"],
                            capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert result.returncode == 124, result.stderr
    _wait_for(lambda: not _sleepers(marker), "no sleep left in the container", 30)


def test_the_tagged_kill_stops_every_process_before_killing_any(tmp_path):
    """Killed one at a time in /proc's order, a child listed before its shell (pid 100 before 99)
    died first, and the shell ran its next command before its own kill came (4 of 4 runs before
    the fix, 800 processes listed between the two; under `exec --timeout` the test above printed
    "survived"). Stopped first, no process of the tree runs on."""
    unavailable(rootfs.unavailable_reason(), "the LXC backend")
    inventory = write_sim_inventory(tmp_path, backend="lxc", packages=())
    root, shared = tmp_path / "sim", tmp_path / "ct200"  # shared: bound at the same path in the container
    container = open_container(load_inventory(inventory), "host200")
    # a fresh container's pids count up from 1: use them up to 98, so that the tagged shell is 99
    container.exec(["sh", "-c", "n=$$; while [ $n -lt 98 ]; do /bin/true & n=$!; wait; done"], check=True)
    token = uuid.uuid4().hex
    script = (f"sleep {_marker()} & c=$!; i=0; while [ $i -lt 800 ]; do sleep 1000 & i=$((i+1)); done; "
              f"echo $$ $c > {shared}/pids; wait $c; echo survived > {shared}/survived")
    tree = subprocess.Popen([*simct.stand_in_argv(root), "exec", "200", "--", *render.tagged(token, ["sh", "-c", script])],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for(lambda: (shared / "pids").exists() and (shared / "pids").read_text().strip(), "the tree to start")
        assert (shared / "pids").read_text().split() == ["99", "100"]  # the child sorts first in /proc
        assert kill_tagged(container, token)
        tree.wait(60)
    finally:
        if tree.poll() is None:
            tree.kill()
        subprocess.run([*simct.stand_in_argv(root), "stop", "200"], capture_output=True)
    assert not (shared / "survived").exists()


@pytest.mark.sshd
def test_lost_connection_stops_the_command_inside_the_container(sshd_node):
    """The SSH connection dies under a running exec: the command does not go on by itself (sshd
    signals nothing without a terminal); dflash-ops reconnects and kills it."""
    container = open_container(load_inventory(sshd_node.inventory), "host200")
    marker = _marker()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            exec_killed_after(container, ["sh", "-c", f"sleep {marker}"], None)
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            failure.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    _wait_for(lambda: _sleepers(marker), "the sleep to start")
    sshd_node.kill_sessions()
    thread.join(120)
    assert failure and isinstance(failure[0], (ConnectionLost, TransportError)), failure
    _wait_for(lambda: not _sleepers(marker), "no sleep left in the container", 30)
