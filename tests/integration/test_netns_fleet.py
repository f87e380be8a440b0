"""The many-node fault tier: 8 Proxmox nodes, each in its own network namespace with its own
address, OpenSSH sshd and pct stand-in (dflash_ops.testing.netns), and real network faults.

Needs root, iproute2 and sshd; under CI=true a missing capability fails instead of skipping.
Every node's connect_timeout is 2 s and keepalive 1 s, so faults show within seconds.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash_ops import connect, runs
from dflash_ops.cli import app
from dflash_ops.connect import open_container
from dflash_ops.deploy.manifest import collect
from dflash_ops.deploy.push import deploy_many, deploy_target
from dflash_ops.inventory import load_inventory
from dflash_ops.testing.netns import Fleet, netns_unavailable_reason, start_fleet
from dflash_ops.transport.ssh import SSHTransport
from tests.conftest import unavailable
from tests.integration.deploy_support import fake_package

# One worker runs the module's tests one after another (xdist_group, --dist loadgroup): on their own they
# were spread over the workers between other modules' tests, and each stretch built the 8-node fleet
# again (4 builds of 5-9 s in a -n 3 run).
pytestmark = [pytest.mark.netns, pytest.mark.sshd, pytest.mark.lxc_tier, pytest.mark.xdist_group("netns")]

CONNECT_TIMEOUT = 2
DEPLOY_NODES = ("n0", "n1", "n2", "n3")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Fleet:
    unavailable(netns_unavailable_reason(), "the netns tier")
    fleet = start_fleet(tmp_path_factory.mktemp("fleet"), nodes=8, ctids=(200, 201), disk_mb=64,
                        connect_timeout=CONNECT_TIMEOUT, keepalive=1)
    yield fleet
    connect.close_all()
    fleet.close()


@pytest.fixture
def calm(fleet):
    """Each test starts and ends with every link up, unlimited, every sshd listening, disks free."""
    connect.close_all()
    yield fleet
    connect.close_all()
    for node in fleet.nodes:
        node.heal()
        node.unlimit()
        node.start_sshd()
        node.free_disk()


def cli(fleet: Fleet, *args: str, inventory: Path | None = None):
    return CliRunner().invoke(app, [*args, "--inventory", str(inventory or fleet.inventory)])


def package(tmp_path: Path, version: str, blob_bytes: int = 0) -> Path:
    source = fake_package(tmp_path / version)
    (source / "version.py").write_text(f"VERSION = {version!r}\n")
    if blob_bytes:
        (source / "blob.bin").write_bytes(os.urandom(blob_bytes))
    return source


def assert_current_is_complete(base: Path, source: Path) -> str:
    """`current` names a release holding every file of `source`, byte for byte; returns its hash."""
    release = collect(source=source)
    current = base / "current"
    assert current.is_symlink(), f"{base}: no current"
    root = current.resolve()
    assert root.name == release.hash, f"{base}: current is {root.name}, expected {release.hash}"
    for rel, digest in release.manifest.items():
        assert hashlib.sha256((root / rel).read_bytes()).hexdigest() == digest, f"{base}: {rel} differs"
    return root.name


def long_run(fleet: Fleet, target: str, tmp_path: Path, config: str) -> str:
    inv = load_inventory(fleet.inventory)
    container = open_container(inv, target)
    deploy_target(container, source=fake_package(tmp_path / target), venv=None)
    path = tmp_path / f"{target}.yaml"
    path.write_text(config)
    result = cli(fleet, "run", "start", target, "--config", str(path))
    assert result.exit_code == 0, result.stderr
    return result.stdout.strip()


def status_on_disk(fleet: Fleet, target: str, run_id: str) -> dict:
    """status.json read from this machine, past the network (the node's container is a directory)."""
    node = fleet.target_node(target)
    path = node.base_dir(int(target.rsplit("-", 1)[1])) / "runs" / run_id / "status.json"
    return json.loads(path.read_text())


def test_faults_do_what_they_say(calm):
    """The harness itself: addresses reachable from here and from other nodes, a partition is
    silence (connect times out), a killed sshd refuses, tbf is installed, a full disk is full."""
    n0, n1 = calm.nodes[0], calm.nodes[1]
    probe = f"import socket; print(socket.create_connection(({n1.address!r}, 22), timeout=5).recv(4))"
    assert n0.run(["python3", "-c", probe], capture_output=True, text=True, check=True).stdout == "b'SSH-'\n"
    with n1.partitioned():
        with pytest.raises(socket.timeout):
            socket.create_connection((n1.address, 22), timeout=1)
        assert n1.partitioned_now
    assert socket.create_connection((n1.address, 22), timeout=5).recv(4) == b"SSH-"
    n1.kill_sshd()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((n1.address, 22), timeout=5)
    n1.start_sshd()
    n1.limit_bandwidth("2mbit")
    shown = subprocess.run(["tc", "qdisc", "show", "dev", n1.veth], capture_output=True, text=True).stdout
    assert "tbf" in shown and "2Mbit" in shown
    n1.fill_disk(200)
    with pytest.raises(OSError, match="No space left"):
        (n1.base_dir(200).parent.parent / "one-more").write_bytes(b"x" * 65536)
    n1.free_disk()
    (n1.base_dir(200).parent.parent / "one-more").write_bytes(b"x" * 65536)


def test_deploy_to_8_targets_while_a_node_is_partitioned_mid_deploy(calm, tmp_path):
    """4 nodes x 2 targets; n2's link goes down while its tars stream: the others finish, n2's
    targets say so, a rerun completes them, and no node ever has a half release as `current`."""
    inv = load_inventory(calm.inventory)
    targets = [t for n in DEPLOY_NODES for t in calm.node(n).target_names()]
    old, new = package(tmp_path, "v1"), package(tmp_path, "v2", blob_bytes=1_500_000)

    def deploy_all(source, on_progress=None):
        return deploy_many(targets, lambda name: open_container(inv, name),
                           lambda c, name: deploy_target(c, source=source, venv=None,
                                                         on_progress=on_progress(name) if on_progress else None))

    assert all(s.ok for s in deploy_all(old))
    victim = calm.node("n2")
    victim.limit_bandwidth("4mbit")  # its streams take seconds: the partition lands mid-transfer
    cut = threading.Event()

    def progress(name):
        def on_progress(phase, n, total):
            if name.startswith("n2-") and not cut.is_set():
                cut.set()
                victim.partition(8)
        return on_progress

    summaries = {s.target: s for s in deploy_all(new, progress)}
    assert cut.is_set()
    for name, summary in summaries.items():
        if name.startswith("n2-"):
            assert not summary.ok and ("connection lost" in summary.error or "cannot connect" in summary.error), summary
        else:
            assert summary.ok and summary.action == "build", summary.error
    for name in targets:  # the partitioned node still serves the old release, complete
        node = calm.target_node(name)
        expected = old if name.startswith("n2-") else new
        assert_current_is_complete(node.base_dir(int(name[-3:])), expected)

    while victim.link_down:
        time.sleep(0.2)
    victim.unlimit()
    again = {s.target: s for s in deploy_all(new)}
    assert all(s.ok for s in again.values()), {n: s.error for n, s in again.items()}
    assert {n: s.action for n, s in again.items()} == {n: ("build" if n.startswith("n2-") else "none") for n in targets}
    for name in targets:
        assert_current_is_complete(calm.target_node(name).base_dir(int(name[-3:])), new)


@pytest.mark.slow
def test_logs_follow_across_a_20s_partition_ends_byte_identical(calm, tmp_path, monkeypatch):
    import dflash_ops.cli.runs as cli_runs

    target = "n4-200"
    run_id = long_run(calm, target, tmp_path, "total_steps: 1200\nstep_seconds: 0.025\nlog_lines: 2\n")
    node = calm.target_node(target)
    received: list[bytes] = []

    def record(line: bytes) -> None:
        received.append(line)
        if len(received) == 100:
            node.partition(20)

    monkeypatch.setattr(cli_runs, "write_stdout", record)
    connect.close_all()
    result = cli(calm, "logs", target, run_id, "-f")
    assert result.exit_code == 0, result.stderr
    assert "connection lost" in result.stderr and "retrying in" in result.stderr
    log = (node.base_dir(200) / "runs" / run_id / "train.log").read_bytes()
    assert b"".join(received) == log and received[-1] == b"done\n"


def test_a_run_keeps_training_while_the_operator_is_cut_off(calm, tmp_path):
    target = "n5-200"
    run_id = long_run(calm, target, tmp_path, "total_steps: 100000\nstep_seconds: 0.01\n")
    node = calm.target_node(target)
    while status_on_disk(calm, target, run_id).get("state") != "running":
        time.sleep(0.1)
    with node.partitioned():
        cut_off = cli(calm, "run", "status", target, run_id)
        assert cut_off.exit_code == 255 and "cannot connect" in cut_off.stderr  # the operator is cut off
        before = status_on_disk(calm, target, run_id)
        while status_on_disk(calm, target, run_id)["step"] < before["step"] + 50:
            time.sleep(0.1)
        during = status_on_disk(calm, target, run_id)
        assert during["state"] == "running" and during["heartbeat"] > before["heartbeat"]
    connect.close_all()
    after = json.loads(cli(calm, "run", "status", target, run_id, "--json").stdout)
    assert after["effective_state"] == "running" and after["step"] >= during["step"]
    stopped = cli(calm, "run", "stop", target, run_id)
    assert stopped.exit_code == 0 and "stopped" in stopped.stdout


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.anyio
async def test_dashboard_shows_the_node_disconnected_and_recovers(calm, tmp_path):
    from dflash_ops.cli.dash import inventory_source
    from dflash_ops.tui.app import DashApp

    target = "n6-200"
    run_id = long_run(calm, target, tmp_path, "total_steps: 100000\nstep_seconds: 0.01\n")
    node = calm.target_node(target)
    app = DashApp(inventory_source(calm.inventory, [target]), poll_s=0.5)

    async def wait_for(pilot, predicate, what: str) -> None:
        for _ in range(1200):
            if predicate():
                return
            await pilot.pause(0.05)
        raise AssertionError(f"gave up waiting for: {what}")

    async with app.run_test(size=(160, 40)) as pilot:
        await wait_for(pilot, lambda: app.links[target].connected and f"{target}/{run_id}" in app.rows, "the run")
        node.partition()
        try:
            await wait_for(pilot, lambda: not app.links[target].connected and app.links[target].error, "disconnected")
            shown = str(app._targets.content)
            assert f"✖ {target}" in shown and "cannot connect" in shown
            assert app.rows[f"{target}/{run_id}"].state == "running"  # the last known row stays, marked stale
        finally:
            node.heal()
        step = app.rows[f"{target}/{run_id}"].step
        await wait_for(pilot, lambda: app.links[target].connected and app.rows[f"{target}/{run_id}"].step > step,
                       "reconnected with fresh rows")
        assert f"● {target}" in str(app._targets.content)
    runs.signal_run(open_container(load_inventory(calm.inventory), target), run_id, "KILL")


def test_hosts_on_16_targets_answers_within_one_connect_timeout_when_nodes_are_dead(calm, monkeypatch):
    """n1 and n6 partitioned (connects time out), n3's sshd killed (refused): one connect attempt
    per node, all nodes at once, so the dead ones cost one connect timeout together."""
    partitioned, refused = {"n1", "n6"}, {"n3"}
    for name in partitioned:
        calm.node(name).partition()
    for name in refused:
        calm.node(name).kill_sshd()
    attempts: dict[str, list[tuple[float, float]]] = {}
    real_connect = SSHTransport.connect

    def recorded_connect(self):
        started = time.monotonic()
        try:
            return real_connect(self)
        finally:
            attempts.setdefault(self.node.name, []).append((started, time.monotonic()))

    monkeypatch.setattr(SSHTransport, "connect", recorded_connect)
    result = cli(calm, "hosts")
    assert result.exit_code == 0, result.stderr
    rows = {line.split()[0]: line for line in result.stdout.splitlines()[1:] if line.strip()}
    assert sorted(rows) == sorted(calm.targets()) and len(rows) == 16
    for target, line in rows.items():
        node = target.split("-")[0]
        if node in partitioned:
            assert f"unreachable (node '{node}': cannot connect to" in line
            assert f"timed out after {CONNECT_TIMEOUT}s" in line
        elif node in refused:
            assert "unreachable" in line and "Connection refused" in line
        else:
            assert line.split()[5] == "running", line  # target node ctid backend base_dir state doctor
    assert {name: len(a) for name, a in attempts.items()} == {n.name: 1 for n in calm.nodes}  # one connect per node
    transports = {name: connect.transport_for(load_inventory(calm.inventory).nodes[name]) for name in attempts}
    assert all(t.connect_attempts == 1 for t in transports.values())
    waits = [attempts[name][0] for name in partitioned]
    assert max(start for start, _end in waits) < min(end for _start, end in waits)  # timed out together
