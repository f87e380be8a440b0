"""Local transport + pct stand-in: the whole command layer without SSH."""

import subprocess
import threading
from pathlib import Path

import pytest

from dflash_ops import render
from dflash_ops.connect import open_container
from dflash_ops.errors import CommandTimeout, TransferError
from dflash_ops.inventory import load_inventory
from tests.conftest import write_listed_sim_inventory, write_sim_inventory
from tests.container_checks import ContainerTests
from tests.procs import alive
from tests.unit.runs_double import eventually


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    return open_container(load_inventory(write_sim_inventory(tmp_path_factory.mktemp("sim"))), "host200")


class TestContainer(ContainerTests):
    argv_examples = 40  # a local command is cheap


def test_stdin_from_a_binary_file_object(container, tmp_path):
    payload = tmp_path / "in.bin"
    payload.write_bytes(bytes(range(256)) * 1000)
    with open(payload, "rb") as f:
        assert container.exec(["sha256sum"], stdin=f).stdout.split()[0] == \
            subprocess.run(["sha256sum", str(payload)], capture_output=True, text=True).stdout.split()[0]


def test_timeout_kills_the_process_group(container, tmp_path):
    marker, pid_file = tmp_path / "survived", tmp_path / "pid"
    with pytest.raises(CommandTimeout):
        container.exec(["sh", "-c", 'echo $$ > "$1"; sleep 2; touch "$0"', str(marker), str(pid_file)], timeout=0.5)
    if pid_file.exists():  # else the shell was killed before it began (a loaded machine)
        pid = int(pid_file.read_text())
        eventually(lambda: not alive(pid), f"the timed-out shell {pid} to be gone")  # a survivor touches first
    assert not marker.exists()


def pct(container, *args):
    return container.transport.run(render.node_command([*container.target.node.pct, *args]))


def test_pct_list_status_and_messages(container):
    listing = pct(container, "list").stdout.splitlines()
    assert listing[0] == "VMID       Status     Lock         Name                "
    assert listing[1].split() == ["200", "running", "host200"]
    assert pct(container, "status", "200").stdout == "status: running\n"
    assert pct(container, "start", "200").stderr == "CT 200 already running\n"
    bad = pct(container, "exec", "12", "--", "true")
    assert bad.exit_code == 255 and "vmid: invalid format" in bad.stderr
    missing_cmd = pct(container, "exec", "200", "--")
    assert (missing_cmd.exit_code, missing_cmd.stderr) == (
        255, "missing command at /usr/share/perl5/PVE/CLI/pct.pm line 246.\n")
    unknown = pct(container, "frobnicate")
    assert unknown.exit_code == 255 and unknown.stderr.startswith("ERROR: unknown command 'pct frobnicate'")


def _does_not_exist(result, ctid):
    return (result.exit_code == 255 and result.stderr.startswith("Configuration file 'nodes/")
            and result.stderr.endswith(f"/lxc/{ctid}.conf' does not exist\n"))


def test_destroyed_container_does_not_exist(tmp_path):
    c = open_container(load_inventory(write_sim_inventory(tmp_path, ctids=(201,), packages=())), "host201")
    assert pct(c, "stop", "201").ok and pct(c, "destroy", "201").ok
    assert _does_not_exist(c.exec(["true"]), 201)


def test_a_container_exists_only_once_created(tmp_path):
    """A mistyped ctid no longer deploys fine: every command gets pct's own message."""
    c = open_container(load_inventory(write_sim_inventory(tmp_path, ctids=(202,), create=False)), "host202")
    assert _does_not_exist(c.exec(["true"]), 202)
    assert _does_not_exist(pct(c, "status", "202"), 202)
    assert _does_not_exist(pct(c, "start", "202"), 202)
    assert pct(c, "list").stdout == ""
    local = tmp_path / "f"
    local.write_text("x")
    push = pct(c, "push", "202", str(local), "/tmp/never")
    assert (push.exit_code, push.stderr) == (255, "can only push files to a running CT\n")
    pull = pct(c, "pull", "202", "/etc/hostname", str(tmp_path / "never"))
    assert (pull.exit_code, pull.stderr) == (
        255, "can only pull files from a running VM at /usr/share/perl5/PVE/CLI/pct.pm line 664.\n")
    assert not (tmp_path / "never").exists()
    with pytest.raises(TransferError, match="can only push files to a running CT"):
        c.push(local, c.base_dir + "/f")
    created = pct(c, "create", "202", "local:vztmpl/x.tar.zst", "--sim-packages", "")
    assert created.ok and pct(c, "status", "202").stdout == "status: stopped\n"
    again = pct(c, "create", "202", "local:vztmpl/x.tar.zst")
    assert again.exit_code == 255 and again.stderr.startswith("CT 202 already exists on node ")


def test_push_respects_perms(container, tmp_path):
    local = tmp_path / "f"
    local.write_text("x")
    remote = container.base_dir + "/perm-file"
    container.exec(["mkdir", "-p", container.base_dir], check=True)
    result = pct(container, "push", "200", str(local), remote, "--perms", "600")
    assert result.ok
    assert container.exec(["stat", "-c", "%a", remote]).stdout == "600\n"


@pytest.mark.slow
def test_config_lock_waits_10s_then_ops_retries_and_says_so(tmp_path, monkeypatch):
    """pct push/pull hold the CT's config lock; a waiter gives up after 10 s with pct's message."""
    import fcntl

    from dflash_ops import container as container_module

    c = open_container(load_inventory(write_sim_inventory(tmp_path, ctids=(203,), packages=())), "host203")
    c.exec(["mkdir", "-p", c.base_dir], check=True)
    c.exec(["sh", "-c", 'echo data > "$0"', c.base_dir + "/f"], check=True)
    lock_file = tmp_path / "sim" / "lock" / "pve-config-203.lock"
    held = open(lock_file, "a")  # another task on the node (a backup, a pct set) holds it
    fcntl.flock(held, fcntl.LOCK_EX)
    notices: list[str] = []

    def release(text: str) -> None:
        notices.append(text)
        held.close()

    monkeypatch.setattr(container_module, "CONFIG_LOCK_ATTEMPTS", 1)
    with pytest.raises(container_module.ConfigLocked) as info:
        c.pull(c.base_dir + "/f", tmp_path / "never")
    assert ("trying to acquire lock... | can't lock file '/run/lock/lxc/pve-config-203.lock' - got timeout"
            in str(info.value))
    monkeypatch.setattr(container_module, "CONFIG_LOCK_ATTEMPTS", 3)
    c.notice = release
    c.pull(c.base_dir + "/f", tmp_path / "back")
    assert (tmp_path / "back").read_text() == "data\n"
    assert len(notices) == 1 and "config is locked by another task" in notices[0] and "retrying (1/3)" in notices[0]


def test_please_run_as_root_unless_the_nodes_root(tmp_path):
    """pve-common RESTEnvironment setup_default_cli_env: a non-root caller gets `please run as root`."""
    import os
    import shutil
    import tempfile

    from tests.conftest import unavailable

    unavailable(None if os.geteuid() == 0 and shutil.which("setpriv") else "needs root and setpriv to drop to a user")
    public = Path(tempfile.mkdtemp(prefix="dflash-ops-pct-"))  # reachable by 'nobody' (pytest's tmp is not)
    try:
        os.chmod(public, 0o755)
        script = shutil.copy(Path(__file__).resolve().parents[2] / "dflash_ops" / "simnode" / "pct.py", public)
        state = public / "state"
        state.mkdir()  # the node's root (this test, uid 0) owns it
        as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-I",
                     script, "--state-root", str(state)]
        refused = subprocess.run([*as_nobody, "list"], capture_output=True, text=True)
        assert (refused.returncode, refused.stderr) == (255, "please run as root\n")
        as_root = subprocess.run(["/usr/bin/python3", "-I", script, "--state-root", str(state), "list"],
                                 capture_output=True, text=True)
        assert (as_root.returncode, as_root.stderr) == (0, "")
    finally:
        shutil.rmtree(public, ignore_errors=True)


def test_sim_containers_are_created_on_first_use_and_nothing_else(tmp_path):
    """The embedded default's CT 200 appears on first use; a mistyped ctid on that node is refused."""
    import yaml

    sim_root = tmp_path / "sim"
    path = tmp_path / "inventory.yaml"
    python = str(sim_root / "ct" / "200" / "usr" / "bin" / "python3")
    path.write_text(yaml.safe_dump({
        "nodes": {"sim": {"transport": "local", "pct": "simulated", "sim_root": str(sim_root),
                          "sim_containers": [200]}},
        "targets": {"host200": {"node": "sim", "ctid": 200, "base_dir": str(tmp_path / "b200"), "python": python},
                    "typo": {"node": "sim", "ctid": 2000, "base_dir": str(tmp_path / "b2000")}},
    }))
    inventory = load_inventory(path)
    first = open_container(inventory, "host200")
    assert first.exec([python, "-c", "import torch"]).ok
    assert pct(first, "list").stdout.splitlines()[1].split() == ["200", "running", "host200"]
    assert _does_not_exist(open_container(inventory, "typo").exec(["true"]), 2000)


def test_a_listed_container_found_stopped_with_its_venv_gone_is_mended_and_started(tmp_path, capsys):
    """The embedded default's CT on a later first use: the machine restarted (or someone ran `pct
    stop`) and the venv whose packages its python links was removed: it is mended and started."""
    sim_root = tmp_path / "sim"
    inventory = load_inventory(write_listed_sim_inventory(tmp_path, "directory"))
    first = open_container(inventory, "host200")
    python = first.target.python
    [link] = (sim_root / "ct" / "200" / "usr" / "lib").glob("python3.*/site-packages/yaml")
    assert pct(first, "stop", "200").ok
    link.unlink()
    link.symlink_to(tmp_path / "removed-venv" / "yaml")
    assert not link.exists() and not first.exec(["true"]).ok  # what the next command met before

    again = open_container(inventory, "host200")
    assert pct(again, "status", "200").stdout == "status: running\n"
    assert link.resolve().exists() and again.exec([python, "-c", "import yaml"]).ok
    said = capsys.readouterr().err
    assert "simulated node: CT 200: 1 package links pointed into a site-packages that is gone" in said
    assert "simulated node: CT 200 was stopped (this machine restarted, or `pct stop`): started" in said
    open_container(inventory, "host200")
    assert "simulated node" not in capsys.readouterr().err  # nothing more to mend


def test_no_line_arrives_after_a_timed_out_command_raised():
    """The pipe's buffered output was still being delivered after CommandTimeout was raised."""
    from dflash_ops.transport.local import LocalTransport

    received: list[bytes] = []

    def slow_reader(line: bytes) -> None:
        received.append(line)
        threading.Event().wait(0.002)

    with pytest.raises(CommandTimeout):
        LocalTransport().run("i=0; while [ $i -lt 5000 ]; do echo line $i; i=$((i+1)); done; sleep 30",
                             on_line=slow_reader, timeout=0.3)
    seen = len(received)
    threading.Event().wait(0.5)
    assert len(received) == seen
