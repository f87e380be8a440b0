"""`dflash-ops provision` and `doctor --fix` on the simulated node with fixture GPUs (simnode/gpus.py).

The node has two GPUs and the NVIDIA kernel module 550.54.14 (/proc/driver/nvidia/version, /dev/nvidia*,
an installer of that version); its containers are directories or real LXC containers (sim_backend()).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from dflash_ops import runs
from dflash_ops.cli import app
from dflash_ops.container import Container
from dflash_ops.deploy.push import deploy_target
from dflash_ops.inventory import load_inventory
from dflash_ops.provision import ProvisionError, Request, provision
from dflash_ops.simnode import gpus as simgpus
from dflash_ops.simnode.containers import PCT_SCRIPT
from dflash_ops.transport.local import LocalTransport
from tests.integration.deploy_support import fake_package
from tests.integration.test_doctor import rows

pytestmark = pytest.mark.lxc_tier

REPO = Path(__file__).resolve().parents[2]
TINY_CPU = str(REPO / "trainer" / "configs" / "tiny-cpu.yaml")
DRIVER, UPGRADED = "550.54.14", "550.90.07"
runner = CliRunner()

INVENTORY = """\
# the admin's notes: kept by --write-inventory
nodes:
  sim: {{transport: local, pct: simulated, sim_root: {root}, sim_backend: {backend}}}  # the simulated node
targets:
  # the GPU container, not created yet
  host500: {{node: sim, ctid: 500, gpus: [0, 1]}}
"""


def cli(*args: str, code: int | None = 0, input: str | None = None):
    result = runner.invoke(app, list(args), input=input)
    if code is not None:
        assert result.exit_code == code, result.stdout + result.stderr
    return result


def pct(inventory: Path, *args: str) -> subprocess.CompletedProcess:
    root = yaml.safe_load(inventory.read_text())["nodes"]["sim"]["sim_root"]
    return subprocess.run([sys.executable, str(PCT_SCRIPT), "--state-root", root, *args], capture_output=True, text=True)


def conf(inventory: Path) -> Path:
    return Path(yaml.safe_load(inventory.read_text())["nodes"]["sim"]["sim_root"]) / "lxc" / "500.conf"


def container(inventory: Path) -> Container:
    return Container(load_inventory(inventory).target("host500"), LocalTransport())


def test_provision_from_nothing_to_doctor_passing_then_a_rerun_changes_nothing(node):
    before = cli("provision", "host500", "--gpus", "all", "--dry-run", "--inventory", str(node)).stdout
    assert pct(node, "status", "500").returncode == 255  # --dry-run created nothing
    assert "# pct create 500 from local:vztmpl/dflash-sim-debian.tar.zst" in before
    assert "node command (sent over SSH): " in before and "+dev0: /dev/nvidia0    (pct set)" in before
    assert "+lxc.prlimit.memlock: unlimited" in before and before.rstrip().splitlines()[-1].startswith(
        "provision host500: 4 changes (would change: pct create 500")

    done = cli("provision", "host500", "--gpus", "all", "--inventory", str(node)).stdout
    assert "install the NVIDIA user-space 550.54.14 without the kernel module (was: none)" in done
    config = pct(node, "config", "500").stdout.splitlines()
    for i, dev in enumerate(["nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"]):
        assert f"dev{i}: /dev/{dev}" in config
    assert config[-3:] == ["lxc.mount.entry: tmpfs dev/shm tmpfs rw,nosuid,nodev,size=1G,create=dir 0 0",
                           "lxc.prlimit.memlock: unlimited", "lxc.prlimit.nofile: 1048576"]
    assert pct(node, "status", "500").stdout == "status: running\n"

    doctor = cli("doctor", "host500", "--config", TINY_CPU, "--inventory", str(node)).stdout
    table = rows(doctor)
    assert table["driver user-space"][:3] == ["✔", "container 550.54.14; node kernel module 550.54.14",
                                              "550.54.14 (= node kernel module)"]
    assert table["gpu passthrough"][1] == "nvidia-uvm, nvidia-uvm-tools, nvidia0, nvidia1, nvidiactl"
    assert not [name for name, row in table.items() if row[0] == "✘"]

    again = cli("provision", "host500", "--gpus", "all", "--inventory", str(node)).stdout
    assert again.splitlines() == ["provision host500: 0 changes (as wanted already)"]


def test_a_host_driver_upgrade_is_named_by_doctor_and_fixed_by_doctor_fix(node):
    cli("provision", "host500", "--gpus", "all", "--inventory", str(node))
    config = conf(node).read_text()
    simgpus.upgrade_driver(yaml.safe_load(node.read_text())["nodes"]["sim"]["sim_root"], UPGRADED)
    named = cli("doctor", "host500", "--config", TINY_CPU, "--inventory", str(node), code=1).stdout
    assert rows(named)["driver user-space"] == [
        "✘", f"container {DRIVER}; node kernel module {UPGRADED}", f"{UPGRADED} (= node kernel module)",
        f"dflash-ops doctor host500 --fix (installs NVIDIA-Linux-x86_64-{UPGRADED}.run in the container with "
        "--no-kernel-module)"]
    fixed = cli("doctor", "host500", "--config", TINY_CPU, "--fix", "--inventory", str(node))
    assert f"install the NVIDIA user-space {UPGRADED} without the kernel module (was: {DRIVER})" in fixed.stderr
    assert rows(fixed.stdout)["driver user-space"][0] == "✔"
    assert conf(node).read_text() == config  # only the user-space was reinstalled
    assert cli("provision", "host500", "--gpus", "all", "--inventory", str(node)).stdout.startswith(
        "provision host500: 0 changes")


def test_a_version_that_cannot_be_had_is_one_line_naming_it_and_where_it_was_looked_for(node):
    cli("provision", "host500", "--gpus", "all", "--inventory", str(node))
    root = yaml.safe_load(node.read_text())["nodes"]["sim"]["sim_root"]
    simgpus.upgrade_driver(root, UPGRADED)
    (Path(root) / "node" / "var/lib/dflash-ops/nvidia" / f"NVIDIA-Linux-x86_64-{UPGRADED}.run").unlink()
    failed = cli("provision", "host500", "--gpus", "all", "--inventory", str(node), code=1)
    assert failed.stderr == (
        f"dflash-ops: error: NVIDIA user-space {UPGRADED} (the kernel module of node sim) is needed in CT 500 (it has "
        f"{DRIVER}): no NVIDIA-Linux-x86_64-{UPGRADED}.run on the node in /var/lib/dflash-ops/nvidia, /root, "
        f"/opt/nvidia; put that exact version's installer there (download.nvidia.com/XFree86/Linux-x86_64/{UPGRADED}/)\n")


def test_foreign_lxc_lines_are_kept_and_our_own_line_is_replaced_in_place(node):
    cli("provision", "host500", "--inventory", str(node))  # no GPUs: the container and nothing else
    with conf(node).open("a") as f:  # the admin's lines, and a comment (pct keeps it as description)
        f.write("lxc.cgroup2.devices.allow: c 226:* rwm\nlxc.prlimit.nofile = 4096\n# the admin's note\n")
    pct(node, "set", "500", "--cores", "2")  # pct rewrites the file: the note moves up, `=` becomes `: `
    assert conf(node).read_text().splitlines()[1] == "# the admin's note"  # after the stand-in's own
    out = cli("provision", "host500", "--gpus", "0", "--shm", "4", "--yes", "--inventory", str(node))
    assert "kept the config's own `lxc.prlimit.nofile: 4096` (not written by dflash-ops)" in out.stderr
    assert "restart CT 500" in out.stdout  # it was running: restarted for its devices and /dev/shm
    lxc = [line for line in pct(node, "config", "500").stdout.splitlines() if line.startswith("lxc.")]
    assert lxc == ["lxc.cgroup2.devices.allow: c 226:* rwm", "lxc.prlimit.nofile: 4096",
                   "lxc.mount.entry: tmpfs dev/shm tmpfs rw,nosuid,nodev,size=4G,create=dir 0 0",
                   "lxc.prlimit.memlock: unlimited"]
    cli("provision", "host500", "--gpus", "0", "--shm", "2", "--yes", "--inventory", str(node))
    lxc = [line for line in pct(node, "config", "500").stdout.splitlines() if line.startswith("lxc.")]
    assert lxc == ["lxc.cgroup2.devices.allow: c 226:* rwm", "lxc.prlimit.nofile: 4096",
                   "lxc.mount.entry: tmpfs dev/shm tmpfs rw,nosuid,nodev,size=2G,create=dir 0 0",  # ours, in place
                   "lxc.prlimit.memlock: unlimited"]
    owned = json.loads((Path(yaml.safe_load(node.read_text())["nodes"]["sim"]["sim_root"]) / "node"
                        / "var/lib/dflash-ops/provision/500.json").read_text())
    assert owned["lines"] == [["lxc.mount.entry", "tmpfs dev/shm tmpfs rw,nosuid,nodev,size=2G,create=dir 0 0"],
                              ["lxc.prlimit.memlock", "unlimited"]]


def test_a_running_container_is_restarted_only_when_the_user_says_so(node):
    cli("provision", "host500", "--gpus", "0", "--inventory", str(node))
    config = conf(node).read_text()
    declined = cli("provision", "host500", "--gpus", "0", "--shm", "2", "--inventory", str(node), code=1, input="n\n")
    assert "CT 500 is running: restart it to apply the new config?" in declined.stdout
    assert declined.stderr.endswith("CT 500 not restarted, nothing changed: rerun with --yes to restart it\n")
    assert conf(node).read_text() == config
    cli("provision", "host500", "--gpus", "0", "--shm", "2", "--inventory", str(node), input="y\n")
    assert "size=2G" in conf(node).read_text()


def test_a_locked_container_is_refused_with_the_reason(node):
    cli("provision", "host500", "--gpus", "all", "--inventory", str(node))
    with conf(node).open("a") as f:
        f.write("lock: backup\n")
    config = conf(node).read_text()
    refused = cli("provision", "host500", "--gpus", "all", "--shm", "3", "--yes", "--inventory", str(node), code=1)
    assert refused.stderr == ("dflash-ops: error: CT 500 is locked (backup): provision changes nothing while a backup "
                              "holds it (`pct unlock 500` only when none runs)\n")
    assert conf(node).read_text() == config
    assert pct(node, "set", "500", "--cores", "1").stderr == "CT is locked (backup)\n"  # as pct refuses it


def test_a_container_with_a_live_run_of_ours_is_not_restarted(node, tmp_path):
    cli("provision", "host500", "--gpus", "0", "--inventory", str(node))
    c = container(node)
    deploy_target(c, source=fake_package(tmp_path), venv=None)
    config = tmp_path / "run.yaml"
    config.write_text("total_steps: 1000000\nstep_seconds: 0.005\n")
    # --force: the preflight's GPU checks fail on this machine (the fake trainer needs no GPU)
    run_id = cli("run", "start", "host500", "--config", str(config), "--gpus", "0", "--force",
                 "--inventory", str(node)).stdout.strip()
    try:
        before = conf(node).read_text()
        refused = cli("provision", "host500", "--gpus", "0", "--shm", "2", "--yes", "--inventory", str(node), code=1)
        assert f"CT 500 has a live run of ours: {run_id} (GPU 0): provision does not restart it" in refused.stderr
        assert conf(node).read_text() == before
    finally:
        for info in runs.list_runs(c):
            if info.alive:
                runs.signal_run(c, info.run_id, "KILL")


def test_write_inventory_keeps_comments_and_order(node):
    text = node.read_text()
    cli("provision", "host501", "--write-inventory", "--node", "sim", "--ctid", "501", "--gpus", "all",
        "--inventory", str(node))
    written = node.read_text()
    assert written.startswith(text)  # every line of the admin's file as it was
    assert written[len(text):] == "  host501: {node: sim, ctid: 501, gpus: [0, 1]}\n"
    assert load_inventory(node).target("host501").gpus == (0, 1)
    missing = cli("provision", "host502", "--inventory", str(node), code=1)
    assert "no target 'host502'" in missing.stderr


def test_an_old_node_gets_bind_mounts_and_cgroup_allow_lines(node):
    root = yaml.safe_load(node.read_text())["nodes"]["sim"]["sim_root"]
    simgpus.install_gpus(root, 2, DRIVER, pve="pve-manager/7.4-17/513c62be (running kernel: 5.15.131-2-pve)")
    cli("provision", "host500", "--gpus", "1", "--inventory", str(node))
    lines = pct(node, "config", "500").stdout.splitlines()
    assert not [line for line in lines if line.startswith("dev")]
    assert [line for line in lines if line.startswith("lxc.")] == [
        "lxc.cgroup2.devices.allow: c 195:* rwm", f"lxc.cgroup2.devices.allow: c {simgpus.UVM_MAJOR}:* rwm",
        "lxc.mount.entry: /dev/nvidia1 dev/nvidia1 none bind,optional,create=file",
        "lxc.mount.entry: /dev/nvidiactl dev/nvidiactl none bind,optional,create=file",
        "lxc.mount.entry: /dev/nvidia-uvm dev/nvidia-uvm none bind,optional,create=file",
        "lxc.mount.entry: /dev/nvidia-uvm-tools dev/nvidia-uvm-tools none bind,optional,create=file",
        "lxc.mount.entry: tmpfs dev/shm tmpfs rw,nosuid,nodev,size=1G,create=dir 0 0",
        "lxc.prlimit.memlock: unlimited", "lxc.prlimit.nofile: 1048576"]
    assert cli("provision", "host500", "--gpus", "1", "--inventory", str(node)).stdout.startswith(
        "provision host500: 0 changes")


def test_gpus_the_node_lacks_and_a_node_without_the_module(node):
    c = container(node)
    with pytest.raises(ProvisionError, match=r"^GPU 5 is not on node sim \(it has /dev/nvidia0, /dev/nvidia1\)$"):
        provision(c, Request(gpus=(5,)))
    simgpus.install_gpus(yaml.safe_load(node.read_text())["nodes"]["sim"]["sim_root"], 0, None)
    with pytest.raises(ProvisionError, match="node sim has no NVIDIA kernel module loaded"):
        provision(c, Request(gpus="all"))
    assert pct(node, "status", "500").returncode == 255  # refused before anything was created
    with pytest.raises(ProvisionError, match="does not exist on node sim: dflash-ops provision host500 creates it"):
        provision(c, Request(create=False))


def test_pct_set_writes_the_config_as_pct_does(tmp_path):
    root = tmp_path / "sim"
    simgpus.install_gpus(root, 1, DRIVER)
    stand_in = [sys.executable, str(PCT_SCRIPT), "--state-root", str(root)]
    assert subprocess.run([*stand_in, "create", "510", "local:vztmpl/x.tar.zst", "--sim-packages", "",
                           "--sim-backend", "directory", "--rootfs", "local-lvm:8"]).returncode == 0
    path = root / "lxc" / "510.conf"
    path.write_text(path.read_text() + "lxc.apparmor.profile = unconfined\n[snap1]\nhostname: old\n")
    done = subprocess.run([*stand_in, "set", "510", "--dev0", "/dev/nvidia0,gid=44", "--memory", "2048"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = path.read_text().splitlines()
    assert lines[0].startswith("# dflash-ops simulated container")  # '#' lines: the description, first
    options = lines[1:lines.index("lxc.apparmor.profile: unconfined")]
    assert options == sorted(options) and "dev0: /dev/nvidia0,gid=44" in options and "memory: 2048" in options
    assert "rootfs: local-lvm:vm-510-disk-0,size=8G" in options
    assert lines[-2:] == ["[snap1]", "hostname: old"]
    bad = subprocess.run([*stand_in, "set", "510", "--dev1", "nvidia1"], capture_output=True, text=True)
    assert bad.returncode == 255 and "dev1: invalid format - nvidia1 is not a device path" in bad.stderr
    subprocess.run([*stand_in, "set", "510", "--dev1", "/dev/nvidia7"], check=True)
    start = subprocess.run([*stand_in, "start", "510"], capture_output=True, text=True)
    assert (start.returncode, start.stderr) == (255, "Device /dev/nvidia7 does not exist\n")


def test_dry_run_of_a_target_not_in_the_inventory_plans_it_and_writes_nothing(node):
    text = node.read_text().replace("host500: {node: sim, ctid: 500, gpus: [0, 1]}", "host600: {node: sim, ctid: 600}")
    node.write_text(text)
    out = cli("provision", "host500", "--write-inventory", "--node", "sim", "--ctid", "500", "--gpus", "all",
              "--dry-run", "--inventory", str(node)).stdout
    assert out.startswith(f"# would add host500 (node sim, ctid 500) to {node}")
    assert "# pct create 500 from local:vztmpl/dflash-sim-debian.tar.zst" in out
    assert out.rstrip().splitlines()[-1].startswith("provision host500: 4 changes (would change: pct create 500")
    assert node.read_text() == text and pct(node, "status", "500").returncode == 255


def test_dry_run_of_a_stopped_container_plans_its_start_as_the_real_run_does(node):
    """A dry run of a stopped container read python and the NVIDIA libraries through `pct exec`,
    which fails on it: it planned an apt-get install of python3 that the real run never does, then
    ended in "container '500' not running!" (issue 55). It plans the start, says what is checked
    once it runs, changes nothing, and counts the changes the real run makes."""
    cli("provision", "host500", "--gpus", "all", "--inventory", str(node))
    assert pct(node, "stop", "500").returncode == 0
    config = conf(node).read_text()
    dry = cli("provision", "host500", "--gpus", "all", "--dry-run", "--inventory", str(node)).stdout
    assert "# pct start 500" in dry and "apt-get" not in dry.replace("(apt-get)", "")
    assert "# then, in CT 500 once started (it is stopped): python3 and venv when missing" in dry
    assert dry.rstrip().splitlines()[-1] == "provision host500: 1 change (would change: pct start 500)"
    assert pct(node, "status", "500").stdout == "status: stopped\n" and conf(node).read_text() == config
    real = cli("provision", "host500", "--gpus", "all", "--inventory", str(node)).stdout
    assert real.rstrip().splitlines()[-1] == "provision host500: 1 change (changed: pct start 500)"


@pytest.mark.parametrize("option, value", [("--shm", "-1"), ("--shm", "0"), ("--cores", "0"), ("--memory", "-5")])
def test_a_size_out_of_range_is_refused_before_anything_is_written(node, option, value):
    """`provision --shm -1` wrote size=-1G into the container's config and it did not start again
    (issue 55): the range is checked where the value enters, and nothing is created or written."""
    refused = cli("provision", "host500", "--inventory", str(node), option, value, "--yes", code=2)
    assert f"Invalid value for '{option}'" in refused.stderr and "Traceback" not in refused.stderr
    assert not conf(node).exists()
    with pytest.raises(ValueError, match=f"{option.lstrip('-').replace('shm', 'shm_gib').replace('memory', 'memory_mib')} "
                                         "must be an integer of at least"):
        Request(**{option.lstrip("-").replace("shm", "shm_gib").replace("memory", "memory_mib"): int(value)})


def test_provision_without_gpus_passes_no_nvidia_device_node_and_a_rerun_installs_nothing(node):
    """`provision` without --gpus passed the node's NVIDIA control and UVM nodes into the CPU
    container, and a rerun then installed the driver's user-space in it (issue 55)."""
    first = cli("provision", "host500", "--inventory", str(node)).stdout
    config = pct(node, "config", "500").stdout
    assert "nvidia" not in config, config
    assert "NVIDIA user-space" not in first
    again = cli("provision", "host500", "--inventory", str(node)).stdout
    assert "NVIDIA user-space" not in again and "nvidia" not in pct(node, "config", "500").stdout
    assert "0 changes" in again.rstrip().splitlines()[-1] or "nothing" in again.rstrip().splitlines()[-1], again
