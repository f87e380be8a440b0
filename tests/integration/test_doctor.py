"""`dflash-ops doctor` end to end on the simulated node (pct stand-in), a tiny /dev/shm, and a node without pct."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from dflash_ops.cli import app
from dflash_ops.simnode import containers as simct
from dflash_ops.simnode.containers import PCT_SCRIPT as _SIM_PCT_SCRIPT
from tests.conftest import unavailable, write_sim_inventory

pytestmark = pytest.mark.lxc_tier

REPO = Path(__file__).resolve().parents[2]
TINY_CPU = REPO / "trainer" / "configs" / "tiny-cpu.yaml"
runner = CliRunner()


def cli(*args: str):
    return runner.invoke(app, list(args))


def rows(stdout: str) -> dict[str, list[str]]:
    """check name -> [symbol, measured, needed, fix] from the printed table (columns by header position)."""
    found = {}
    starts = None
    for line in stdout.splitlines():
        if line.strip().startswith("check ") and " measured " in line:
            starts = [line.index(w) for w in (" check", " measured", " needed", " fix")]
            starts = [s + 1 for s in starts]
        elif starts and line[:1] in ("✔", "✘", "!"):
            cells = [line[a:b].strip() for a, b in zip(starts, starts[1:] + [len(line)])]
            found[cells[0]] = [line[0], *cells[1:]]
    return found


def edit_inventory(path: Path, **target_keys) -> Path:
    doc = yaml.safe_load(path.read_text())
    doc["targets"]["host200"].update(target_keys)
    path.write_text(yaml.safe_dump(doc))
    return path


def test_doctor_on_the_simulated_node_passes_a_cpu_run(sim_inventory):
    result = cli("doctor", "host200", "--config", str(TINY_CPU), "--inventory", str(sim_inventory))
    assert result.exit_code == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[0] == "host200 (node sim, CT 200): WARN"  # nothing deployed yet
    table = rows(result.stdout)
    assert table["container"][0] == "✔" and table["gpu passthrough"][0] == "✔"
    assert table["GPUs in container"][0] == "✔" and table["GPUs in container"][1].startswith("no GPU (nvidia-smi not found)")
    assert table["release + venv"][0] == "!" and table["release + venv"][3] == "dflash-ops deploy host200"
    assert "checkpoints of" in table["disk at base_dir"][2] and table["/dev/shm"][0] == "✔"
    hosts = cli("hosts", "--inventory", str(sim_inventory))
    assert "warn (! release + venv)" in hosts.stdout and " ago" in hosts.stdout


def test_doctor_json_and_gpus_the_node_does_not_have(sim_inventory):
    edit_inventory(sim_inventory, gpus=[0, 1])
    result = cli("doctor", "host200", "--json", "--inventory", str(sim_inventory))
    assert result.exit_code == 1
    (report,) = json.loads(result.stdout)
    by_name = {c["name"]: c for c in report["checks"]}
    assert report["verdict"] == "fail" and report["facts"]["gpus"] == [0, 1]
    assert by_name["gpu passthrough"]["status"] == "fail"
    assert by_name["gpu passthrough"]["fix"] == ("on node sim: pct set 200 --dev0 /dev/nvidia0 --dev1 /dev/nvidia1 "
                                                 "--dev2 /dev/nvidiactl --dev3 /dev/nvidia-uvm (then restart the CT)")
    assert by_name["GPUs in container"]["status"] == "fail" and by_name["GPUs to torch"]["status"] == "fail"
    # the same target for a CPU config: the GPUs are held but not used, so the run can go
    cpu = cli("doctor", "host200", "--config", str(TINY_CPU), "--inventory", str(sim_inventory))
    assert cpu.exit_code == 0, cpu.stdout


def test_stopped_container_and_run_start_refusal(sim_inventory):
    pct = [sys.executable, str(_SIM_PCT_SCRIPT), "--state-root", str(sim_inventory.parent / "sim")]
    subprocess.run([*pct, "status", "200"], check=True, capture_output=True)
    subprocess.run([*pct, "stop", "200"], check=True)
    result = cli("doctor", "host200", "--inventory", str(sim_inventory))
    assert result.exit_code == 1 and rows(result.stdout)["container"][0] == "✘"
    assert rows(result.stdout)["container"][1:] == ["stopped", "running", "on node sim: pct start 200"]
    start = cli("run", "start", "host200", "--config", str(TINY_CPU), "--inventory", str(sim_inventory))
    assert start.exit_code == 1
    assert start.stderr.splitlines()[-1] == ("dflash-ops: error: refusing to start on host200, doctor failed: "
                                             "container: stopped (needs running); fix it or pass --force")
    forced = cli("run", "start", "host200", "--config", str(TINY_CPU), "--force", "--inventory", str(sim_inventory))
    assert "--force: starting although doctor failed: container" in forced.stderr
    assert "not running" in forced.stderr and forced.exit_code != 0  # the real refusal, from pct itself


def test_pct_config_prints_like_pct(tmp_path):
    pct = [sys.executable, str(_SIM_PCT_SCRIPT), "--state-root", str(tmp_path)]
    created = subprocess.run([*pct, "create", "201", "local:vztmpl/debian.tar.zst", "--hostname", "gpu",
                              "--sim-packages", ""], capture_output=True, text=True)
    assert created.returncode == 0, created.stderr
    with open(tmp_path / "lxc" / "201.conf", "a") as conf:
        conf.write("lxc.cgroup2.devices.allow = c 195:* rwm\n"
                   "lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file\ndev0: /dev/nvidia-uvm\n"
                   "[before-upgrade]\nhostname: old\n")
    done = subprocess.run([*pct, "config", "201"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    options = [line for line in lines if not line.startswith("lxc.")]
    assert options == sorted(options) and "hostname: gpu" in options and "dev0: /dev/nvidia-uvm" in options
    assert "hostname: old" not in lines and not any(line.startswith("#") for line in lines)
    assert lines[-2:] == ["lxc.cgroup2.devices.allow: c 195:* rwm",
                          "lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file"]
    missing = subprocess.run([*pct, "config", "202"], capture_output=True, text=True)
    assert missing.returncode == 255 and "lxc/202.conf' does not exist" in missing.stderr
    assert subprocess.run([*pct, "config"], capture_output=True, text=True).stderr.startswith("400 not enough")


def _dev_shm_inventory(directory: Path, mount: str, lxc_entry: str) -> Path:
    """CT 200 with another /dev/shm: in a real LXC container (its own /dev/shm) as an admin would
    give it one, `lxc_entry` as an `lxc.mount.entry` in its config, then a restart; a directory
    container sees the node's /dev/shm, so the stand-in runs behind `unshare -m` and `mount`
    (a shell command given the pct argv as "$@") gives every pct command another one."""
    path = write_sim_inventory(directory)
    doc = yaml.safe_load(path.read_text())
    sim_root = doc["nodes"]["sim"]["sim_root"]
    pct = [sys.executable, str(_SIM_PCT_SCRIPT), "--state-root", sim_root]
    if simct.backend_of(sim_root, 200) == "lxc":
        with open(Path(sim_root) / "lxc" / "200.conf", "a") as conf:
            conf.write(f"lxc.mount.entry: {lxc_entry}\n")
        for command in ("stop", "start"):
            subprocess.run([*pct, command, "200"], check=True, capture_output=True)
        return path
    del doc["nodes"]["sim"]["sim_root"]
    doc["nodes"]["sim"]["pct"] = ["unshare", "-m", "--propagation", "private", "sh", "-c", mount + ' && exec "$@"',
                                  "pct", *pct]
    path.write_text(yaml.safe_dump(doc))
    return path


def _tiny_shm_inventory(directory: Path) -> Path:
    """Every pct command sees a 1 MiB tmpfs on the container's /dev/shm."""
    return _dev_shm_inventory(directory, "mount -t tmpfs -o size=1m tmpfs /dev/shm",
                              "tmpfs dev/shm tmpfs rw,nosuid,nodev,size=1m,create=dir 0 0")


def _mount_namespaces_work() -> str | None:
    if os.geteuid() != 0:
        return "not root"
    done = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                           "mount -t tmpfs -o size=1m tmpfs /dev/shm"], capture_output=True, text=True)
    return None if done.returncode == 0 else f"unshare -m + mount failed: {done.stderr.strip()}"


@pytest.fixture
def tiny_shm(tmp_path) -> Path:
    unavailable(_mount_namespaces_work(), "the tiny /dev/shm test")
    return _tiny_shm_inventory(tmp_path / "simnode")


def test_tiny_dev_shm_fails_with_the_fix(tiny_shm):
    result = cli("doctor", "host200", "--config", str(TINY_CPU), "--inventory", str(tiny_shm))
    assert result.exit_code == 1, result.stdout + result.stderr
    shm = rows(result.stdout)["/dev/shm"]
    assert shm[0] == "✘" and shm[1] == "1 MiB (1 MiB free) at /dev/shm" and shm[2] == "64 MiB free (CPU run)"
    assert shm[3] == ("in the container: mount -o remount,size=1G /dev/shm; to keep it, add `lxc.mount.entry: tmpfs dev/shm "
            "tmpfs rw,nosuid,nodev,size=1G,create=dir 0 0` to /etc/pve/lxc/200.conf")
    start = cli("run", "start", "host200", "--config", str(TINY_CPU), "--inventory", str(tiny_shm))
    assert start.exit_code == 1 and "doctor failed: /dev/shm: 1 MiB (1 MiB free)" in start.stderr
    assert not (Path(yaml.safe_load(tiny_shm.read_text())["targets"]["host200"]["base_dir"]) / "runs").exists()


def test_doctor_on_a_node_without_pct(tmp_path):
    inventory = tmp_path / "hosts.yaml"
    inventory.write_text(yaml.safe_dump({
        "nodes": {"box": {"transport": "local", "pct": "none"}},
        "targets": {"here": {"node": "box", "base_dir": str(tmp_path / "base"), "python": sys.executable}},
    }))
    result = cli("doctor", "here", "--config", str(TINY_CPU), "--inventory", str(inventory))
    assert result.exit_code == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[0] == "here (node box, no pct): WARN"
    table = rows(result.stdout)
    assert "gpu passthrough" not in table and table["container"][0] == "✔"
    assert table["container"][1] == "no pct: the target is the node itself"
    echoed = cli("exec", "here", "--inventory", str(inventory), "--", "echo", "$HOME")
    assert echoed.exit_code == 0 and echoed.stdout == "$HOME\n"
    hosts = cli("hosts", "--inventory", str(inventory))
    assert "running (no pct)" in hosts.stdout
    deployed = cli("deploy", "here", "--no-venv", "--inventory", str(inventory))
    assert deployed.exit_code == 0, deployed.stdout + deployed.stderr
    again = cli("doctor", "here", "--config", str(TINY_CPU), "--fast", "--inventory", str(inventory))  # torch: found, not imported again
    assert again.exit_code == 0 and rows(again.stdout)["release + venv"][0] == "✔"
    assert (tmp_path / "base" / "current" / "trainer" / "run" / "config.py").is_file()


@pytest.mark.sshd
def test_doctor_over_a_real_sshd(sshd_node):
    result = cli("doctor", "host200", "--config", str(TINY_CPU), "--inventory", str(sshd_node.inventory))
    assert result.exit_code == 0, result.stdout + result.stderr
    table = rows(result.stdout)
    assert table["container"][0] == "✔" and table["gpu passthrough"][1] == "no /dev/nvidia* entries"
    offset = table["clock offset"]
    assert offset[0] == "✔" and offset[1].endswith("s) vs this machine")


def test_doctor_on_an_unreachable_node_fails_its_targets_only(sim_inventory, tmp_path):
    doc = yaml.safe_load(sim_inventory.read_text())
    doc["nodes"]["gone"] = {"transport": "ssh", "address": "127.0.0.1", "port": 1, "connect_timeout": 2,
                            "strict_host_key_checking": False}
    doc["targets"]["far"] = {"node": "gone", "ctid": 300, "base_dir": "/opt/dflash"}
    sim_inventory.write_text(yaml.safe_dump(doc))
    result = cli("doctor", "host200", "far", "--config", str(TINY_CPU), "--inventory", str(sim_inventory))
    assert result.exit_code == 1
    reports = result.stdout.split("\nfar (")
    assert reports[0].splitlines()[0] == "host200 (node sim, CT 200): WARN"
    far = rows("far (" + reports[1])
    assert list(far) == ["container"] and far["container"][0] == "✘" and far["container"][1].startswith("unreachable")
    assert "check that node gone answers" in far["container"][3]
    assert "fail: container" in cli("hosts", "far", "--inventory", str(sim_inventory)).stdout


def test_a_container_without_the_python_named_in_the_inventory(sim_inventory):
    edit_inventory(sim_inventory, python="/no/such/python3")
    result = cli("doctor", "host200", "--inventory", str(sim_inventory))
    assert result.exit_code == 1
    python = rows(result.stdout)["python"]
    assert python[0] == "✘" and python[1].startswith("/no/such/python3: exit ")
    assert python[3] == "install python3 in the container, or set `python:` for host200 in the inventory"


def _plain_dir_shm_inventory(directory: Path) -> Path:
    """The container's /dev/shm is a plain directory of the node's disk (bind-mounted)."""
    plain = directory / "plain-shm"
    plain.mkdir(parents=True)
    return _dev_shm_inventory(directory, f"mount --bind {plain} /dev/shm", f"{plain} dev/shm none bind,create=dir 0 0")


def test_dev_shm_that_is_not_a_tmpfs_fails(tmp_path):
    """Before: the free space of the disk under a plain /dev/shm directory passed the check."""
    unavailable(_mount_namespaces_work(), "the plain /dev/shm test")
    inventory = _plain_dir_shm_inventory(tmp_path / "simnode")
    result = cli("doctor", "host200", "--fast", "--config", str(TINY_CPU), "--inventory", str(inventory))
    assert result.exit_code == 1, result.stdout + result.stderr
    shm = rows(result.stdout)["/dev/shm"]
    assert shm[0] == "✘" and shm[1].startswith("/dev/shm is not a tmpfs (it is ") and shm[2] == "a tmpfs with 64 MiB free"
    assert shm[3].startswith("in the container: mkdir -p /dev/shm && mount -t tmpfs -o size=1G tmpfs /dev/shm")


def test_read_only_base_dir_fails_with_the_fix(tmp_path):
    """Before: the helper could not be installed into base_dir and the report blamed the container."""
    base = tmp_path / "simnode" / "ct200" / "opt" / "dflash"  # write_sim_inventory's base_dir
    base.mkdir(parents=True)
    bound = subprocess.run(["sh", "-c", 'mount --bind "$0" "$0" && mount -o remount,ro,bind "$0"', str(base)],
                           capture_output=True, text=True)
    if bound.returncode != 0:
        unavailable(f"cannot bind-mount read-only: {bound.stderr.strip()}", "the read-only base_dir test")
    # mounted before the container is created: an LXC container gets it as a mount point of its own
    inventory = write_sim_inventory(tmp_path / "simnode")
    assert Path(yaml.safe_load(inventory.read_text())["targets"]["host200"]["base_dir"]) == base
    try:
        result = cli("doctor", "host200", "--fast", "--config", str(TINY_CPU), "--inventory", str(inventory))
    finally:
        subprocess.run(["umount", "-l", str(base)], check=False)
    assert result.exit_code == 1, result.stdout + result.stderr
    table = rows(result.stdout)
    assert table["container"][0] == "✔"
    disk = table["disk at base_dir"]
    assert disk[0] == "✘" and disk[1] == f"{base}: read-only (Read-only file system)"
    assert disk[3].startswith(f"in the container: mount -o remount,rw the filesystem holding {base}")
