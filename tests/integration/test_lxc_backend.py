"""The simulated node's LXC backend: real containers behind the same pct messages and exit codes.

Needs root, Debian's lxc and the rootfs (`dflash-ops sim-rootfs`); skipped without them, a
failure under CI=true (.ci/run installs lxc and builds the rootfs).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from dflash_ops.connect import open_container
from dflash_ops.inventory import load_inventory
from dflash_ops.simnode import containers as simct
from dflash_ops.simnode import rootfs
from tests.conftest import unavailable, write_listed_sim_inventory


@pytest.fixture(scope="module")
def lxc_root(tmp_path_factory) -> Path:
    unavailable(rootfs.unavailable_reason(), "the LXC backend")
    root = tmp_path_factory.mktemp("lxc") / "sim"
    simct.create(root, 200, hostname="host200", backend="lxc")
    yield root
    for vmid in ("200", "201"):
        subprocess.run([*simct.stand_in_argv(root), "stop", vmid], capture_output=True)
        subprocess.run([*simct.stand_in_argv(root), "destroy", vmid], capture_output=True)


def pct(root: Path, *args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([*simct.stand_in_argv(root), *args], capture_output=True, text=True, **kwargs)


def test_a_real_container_behind_pct(lxc_root):
    """Its own init, hostname, PID namespace and python; pct's exit codes from lxc-attach."""
    assert pct(lxc_root, "exec", "200", "--", "cat", "/proc/1/comm").stdout == "init.lxc\n"
    assert pct(lxc_root, "exec", "200", "--", "hostname").stdout == "host200\n"
    ps = pct(lxc_root, "exec", "200", "--", "sh", "-c", "ls -d /proc/[0-9]* | wc -l").stdout
    assert int(ps) < 10  # its own PID namespace: init, sleep, this shell and ls
    python = pct(lxc_root, "exec", "200", "--", "python3", "-c", "import sys, torch; print(sys.prefix, torch.__file__)")
    assert python.stdout == "/usr /usr/local/lib/python3.11/dist-packages/torch/__init__.py\n", python.stderr
    assert pct(lxc_root, "exec", "200", "--", "touch", "/usr/local/lib/python3.11/dist-packages/torch/x").returncode == 1
    # only the trainer's packages and what they require, nothing else of the operator's interpreter
    for name in ("textual", "fabric", "paramiko", "dflash_ops", "pytest"):
        found = pct(lxc_root, "exec", "200", "--", "python3", "-c", f"import {name}")
        assert found.returncode == 1 and f"No module named '{name}'" in found.stderr, name
    assert pct(lxc_root, "exec", "200", "--", "no-such-command").returncode == 127
    assert pct(lxc_root, "exec", "200", "--", "/etc/passwd").returncode == 126
    assert pct(lxc_root, "exec", "200", "--", "sh", "-c", "kill -9 $$").returncode == 137
    env = pct(lxc_root, "exec", "200", "--", "env").stdout.splitlines()
    assert "PATH=/sbin:/bin:/usr/sbin:/usr/bin" in env and "container=lxc" in env
    assert pct(lxc_root, "status", "200").stdout == "status: running\n"
    assert pct(lxc_root, "list").stdout.splitlines()[1].split() == ["200", "running", "host200"]
    # no net0: only loopback, as a CT without one, and up (a service answers on 127.0.0.1; LXC made it down)
    assert pct(lxc_root, "exec", "200", "--", "ls", "/sys/class/net").stdout.split() == ["lo"]
    echo = ("import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
            "c = socket.create_connection(s.getsockname(), timeout=5); c.sendall(b'up'); print(s.accept()[0].recv(2))")
    assert pct(lxc_root, "exec", "200", "--", "python3", "-c", echo).stdout == "b'up'\n"


def test_push_pull_inside_the_container(lxc_root, tmp_path):
    """push writes into the container's own filesystem (not this machine's), pull reads it back."""
    src = tmp_path / "payload"
    src.write_bytes(os.urandom(100_000))
    assert pct(lxc_root, "push", "200", str(src), "/root/payload", "--perms", "0600").returncode == 0
    assert not Path("/root/payload").exists() or Path("/root/payload").read_bytes() != src.read_bytes()
    assert pct(lxc_root, "exec", "200", "--", "stat", "-c", "%a", "/root/payload").stdout == "600\n"
    assert simct.host_path(lxc_root, 200, "/root/payload").read_bytes() == src.read_bytes()
    back = tmp_path / "back"
    assert pct(lxc_root, "pull", "200", "/root/payload", str(back)).returncode == 0
    assert back.read_bytes() == src.read_bytes()
    missing = pct(lxc_root, "push", "200", str(src), "/no/such/dir/x")
    assert (missing.returncode, missing.stderr) == (0, "failed to create file: /no/such/dir/x: No such file or directory\n")
    gone = pct(lxc_root, "pull", "200", "/no/such/file", str(back))
    assert (gone.returncode, gone.stderr) == (0, "failed to open /no/such/file: No such file or directory\n")


def test_stop_start_and_the_messages_of_a_stopped_container(lxc_root):
    assert pct(lxc_root, "stop", "200").returncode == 0
    assert pct(lxc_root, "status", "200").stdout == "status: stopped\n"
    stopped = pct(lxc_root, "exec", "200", "--", "true")
    assert (stopped.returncode, stopped.stderr) == (255, "container '200' not running!\n")
    assert pct(lxc_root, "push", "200", "/etc/hostname", "/x").stderr == "can only push files to a running CT\n"
    assert pct(lxc_root, "start", "200").returncode == 0
    assert pct(lxc_root, "exec", "200", "--", "cat", "/proc/1/comm").stdout == "init.lxc\n"
    assert pct(lxc_root, "start", "200").stderr == "CT 200 already running\n"


def test_memory_limit_from_create_options(lxc_root):
    """--memory becomes the container's memory cgroup limit; over it the kernel kills (137)."""
    simct.create(lxc_root, 201, hostname="small", backend="lxc", memory_mb=96, packages=())
    limit = pct(lxc_root, "exec", "201", "--", "cat", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
    assert limit.stdout == f"{96 << 20}\n", limit.stderr
    assert "memory: 96" in pct(lxc_root, "config", "201").stdout
    hog = pct(lxc_root, "exec", "201", "--", "python3", "-c", "b = bytearray(400 << 20); b[::4096] = b'x' * len(b[::4096])")
    assert hog.returncode == 137
    assert pct(lxc_root, "exec", "201", "--", "df", "--output=fstype", "/dev/shm").stdout.split()[-1] == "tmpfs"


def test_killing_pct_exec_leaves_the_command_running_as_on_a_node(lxc_root):
    """pct exec becomes lxc-attach; killing it (a lost SSH session, Ctrl-C on the node) does not
    stop the command inside the container: the tool has to (see test_exec_kill)."""
    proc = subprocess.Popen([*simct.stand_in_argv(lxc_root), "exec", "200", "--", "sleep", "1234"],
                            start_new_session=True)
    try:
        for _ in range(500):
            if "sleep 1234" in _container_commands(lxc_root):
                break
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait()
        assert "sleep 1234" in _container_commands(lxc_root)
    finally:
        pct(lxc_root, "exec", "200", "--", "pkill", "-f", "sleep 1234")


def _container_commands(root: Path) -> str:
    return pct(root, "exec", "200", "--", "ps", "-eo", "args").stdout


def test_the_node_kind_creates_listed_containers_as_lxc(tmp_path):
    """A `pct: simulated` node with sim_backend lxc: CT 200 appears on first use as a real
    container, and its target needs no base_dir or python (/opt/dflash and Debian's python3)."""
    unavailable(rootfs.unavailable_reason(), "the LXC backend")
    path, root = write_listed_sim_inventory(tmp_path, "lxc"), tmp_path / "sim"
    try:
        inventory = load_inventory(path)
        target = inventory.target("host200")
        assert (target.base_dir, target.python, target.node.kind.backend(200)) == ("/opt/dflash", "python3", "lxc")
        container = open_container(inventory, "host200")
        assert container.exec(["cat", "/proc/1/comm"]).stdout == "init.lxc\n"
        assert container.exec(["ls", "/sys/class/net"]).stdout.split() != ["lo"]  # listed CTs get a net0
    finally:
        pct(root, "stop", "200")
        pct(root, "destroy", "200")


def test_a_listed_lxc_container_found_stopped_with_its_packages_gone_is_mended_and_started(tmp_path):
    """After this machine restarts the default node's LXC CT is stopped, and the venv whose
    packages it binds may be gone: its next start binds this interpreter's again and the first
    use starts it, where `pct exec` said "container '200' not running!"."""
    unavailable(rootfs.unavailable_reason(), "the LXC backend")
    path, root = write_listed_sim_inventory(tmp_path, "lxc"), tmp_path / "sim"
    record = root / "ct" / "200" / "sim-packages.json"
    try:
        inventory = load_inventory(path)
        open_container(inventory, "host200")
        bound = json.loads(record.read_text())
        assert pct(root, "stop", "200").returncode == 0
        gone = {**bound, "files": [[top, str(tmp_path / "removed-venv" / top)] for top, _ in bound["files"]]}
        record.write_text(json.dumps(gone))
        assert "not running" in pct(root, "exec", "200", "--", "true").stderr  # what the next command met

        container = open_container(inventory, "host200")
        assert container.exec(["python3", "-c", "import yaml, torch"]).ok
        assert json.loads(record.read_text())["files"] == bound["files"]
    finally:
        pct(root, "stop", "200")
        pct(root, "destroy", "200")


# ---------------------------------------------------------------- what real containers do to the tool

def _no_venv_container(root: Path, ctid: int, tmp_path: Path, **venv) -> Path:
    """CT `ctid` as a fresh Debian CT: python3 without python3-venv (no ensurepip, no pip) and
    no trainer packages; an inventory whose target host<ctid> is it."""
    simct.create(root, ctid, hostname=f"host{ctid}", backend="lxc", packages=())
    removed = pct(root, "exec", str(ctid), "--", "apt-get", "remove", "-y", "-q", "python3-venv", "python3.11-venv")
    assert removed.returncode == 0, removed.stderr
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump({
        "nodes": {"sim": {"transport": "local", "pct": "simulated", "sim_root": str(root)}},
        "targets": {f"host{ctid}": {"node": "sim", "ctid": ctid, **({"venv": venv} if venv else {})}},
    }))
    return path


def _destroy(root: Path, ctid: int) -> None:
    pct(root, "stop", str(ctid))
    pct(root, "destroy", str(ctid))


def test_deploy_without_venv_support_refuses_with_the_fixing_command(lxc_root, tmp_path):
    """A python without ensurepip or pip (Debian without python3-venv) cannot build the venv: deploy
    says so in one line with the one command that fixes it, and doctor shows it as a check."""
    from typer.testing import CliRunner

    from dflash_ops.cli import app

    inventory = _no_venv_container(lxc_root, 202, tmp_path)
    try:
        result = CliRunner().invoke(app, ["deploy", "host202", "--inventory", str(inventory)])
        assert result.exit_code != 0
        assert "neither ensurepip nor pip" in result.stderr, result.stderr
        assert "fix: on node sim: pct exec 202 -- apt-get install -y python3-venv" in result.stderr
        doctor = CliRunner().invoke(app, ["doctor", "host202", "--inventory", str(inventory), "--json"])
        checks = {c["name"]: c for c in __import__("json").loads(doctor.stdout)[0]["checks"]}
        assert checks["python venv"]["status"] == "warn"
        assert checks["python venv"]["fix"].endswith("pct exec 202 -- apt-get install -y python3-venv)")
        assert checks["PID namespace"]["measured"].endswith("pid 1: init.lxc")
    finally:
        _destroy(lxc_root, 202)


def test_deploy_without_venv_support_bootstraps_pip_from_a_pushed_wheel(lxc_root, tmp_path):
    """The same container, with a pip wheel in the venv's wheelhouse: pip installs itself from it."""
    import ensurepip

    from dflash_ops.connect import open_container as open_target

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    bundled = Path(ensurepip.__file__).parent / "_bundled"
    for wheel in bundled.glob("pip-*.whl"):
        (wheels / wheel.name).write_bytes(wheel.read_bytes())
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("pip\n")
    inventory = _no_venv_container(lxc_root, 203, tmp_path, requirements=str(requirements), wheelhouse=str(wheels),
                                   index=False)
    try:
        from typer.testing import CliRunner

        from dflash_ops.cli import app

        result = CliRunner().invoke(app, ["deploy", "host203", "--inventory", str(inventory)])
        assert result.exit_code == 0, result.stderr
        container = open_target(load_inventory(inventory), "host203")
        pip = container.exec(["sh", "-c", "/opt/dflash/venvs/*/bin/python -m pip --version"])
        assert pip.ok and pip.stdout.startswith("pip "), pip.stderr
    finally:
        _destroy(lxc_root, 203)


def test_a_trainer_killed_by_the_memory_limit_ends_failed_with_the_reason(lxc_root, tmp_path):
    """The container's memory cgroup OOM-kills the trainer (SIGKILL, no word in status.json): the
    run ends `failed` with reason OOM kill and oom_killed set, which a restart policy can read.
    On the directory backend nothing limits it, and a vanished trainer says only that it died."""
    from dflash_ops import runs
    from tests.unit.runs_double import make_release

    simct.create(lxc_root, 204, hostname="host204", backend="lxc", memory_mb=128, packages=())
    try:
        path = tmp_path / "inventory.yaml"
        path.write_text(yaml.safe_dump({
            "nodes": {"sim": {"transport": "local", "pct": "simulated", "sim_root": str(lxc_root)}},
            "targets": {"host204": {"node": "sim", "ctid": 204}},
        }))
        container = open_container(load_inventory(path), "host204")
        local = tmp_path / "base"
        make_release(local)
        container.push_tree(local / "releases", "/opt/dflash/releases")
        container.exec(["ln", "-s", "releases/abc123", "/opt/dflash/current"], check=True)
        config = tmp_path / "config.txt"
        config.write_text("total_steps: 100000\nstep_seconds: 0.01\nhog_mib_at_step: 20 400\n")
        run_id = runs.start_run(container, config, run_id="hog")
        for _ in range(3000):
            info = runs.run_status(container, run_id)
            if not info.alive:
                break
            time.sleep(0.02)
        assert (info.effective_state, info.oom_killed) == ("failed", True), info
        assert info.reason.startswith("OOM kill: the container's memory limit was hit")
        assert "step 19 line 0" in info.log_tail
    finally:
        _destroy(lxc_root, 204)
