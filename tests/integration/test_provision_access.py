"""GPUs for a non-root user (issue #54 item 1): `provision --device-gid/--device-mode` writes gid=/mode=
on every devN entry, an unprivileged container's group is mapped by lxc.idmap lines after the node's
/etc/subgid allows it (added only after a yes), `--features nesting=1`; doctor checks that the
target's `user:` opens the device nodes (in an LXC container: a real non-root user opening the
device files the stand-in makes from the entries, as pve-container does)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from dflash_ops.simnode import gpus as simgpus
from tests.conftest import sim_backend
from tests.integration.test_doctor import rows
from tests.integration.test_provision import DRIVER, TINY_CPU, cli, pct

pytestmark = pytest.mark.lxc_tier


VIDEO = 44  # Debian's `video` group


def subgid(inventory: Path) -> Path:
    return Path(yaml.safe_load(inventory.read_text())["nodes"]["sim"]["sim_root"]) / "node" / "etc" / "subgid"


def with_user(inventory: Path, user: str) -> None:
    text = re.sub(r"host500: \{node: sim, ctid: 500, gpus: \[0, 1\](, user: \w+)?\}",
                  f"host500: {{node: sim, ctid: 500, gpus: [0, 1], user: {user}}}", inventory.read_text())
    inventory.write_text(text)


def test_a_device_group_and_idmap_let_a_non_root_user_open_the_gpus(node):
    subgid(node).parent.mkdir(parents=True, exist_ok=True)
    subgid(node).write_text("root:100000:65536\n")
    (subgid(node).parent / "subuid").write_text("root:100000:65536\n")
    # the node's /etc/subgid must change: a "no" changes nothing anywhere
    declined = cli("provision", "host500", "--gpus", "all", "--device-gid", str(VIDEO), "--device-mode", "0660",
                   "--features", "nesting=1", "--inventory", str(node), code=1, input="n\n")
    assert "/etc/subgid does not let root map group 44 and was not changed" in declined.stderr
    assert subgid(node).read_text() == "root:100000:65536\n" and pct(node, "status", "500").returncode == 255

    dry = cli("provision", "host500", "--gpus", "all", "--device-gid", str(VIDEO), "--device-mode", "0660",
              "--features", "nesting=1", "--dry-run", "--inventory", str(node)).stdout
    assert "# node sim: add `root:44:1` to /etc/subgid" in dry and "+dev0: /dev/nvidia0,gid=44,mode=0660" in dry

    done = cli("provision", "host500", "--gpus", "all", "--device-gid", str(VIDEO), "--device-mode", "0660",
               "--features", "nesting=1", "--yes", "--inventory", str(node)).stdout
    assert "provision: node sim: add `root:44:1` to /etc/subgid" in done
    assert subgid(node).read_text() == "root:100000:65536\nroot:44:1\n"  # appended in place
    config = pct(node, "config", "500").stdout.splitlines()
    for i, dev in enumerate(["nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"]):
        assert f"dev{i}: /dev/{dev},gid=44,mode=0660" in config
    assert "features: nesting=1" in config and "unprivileged: 1" in config
    assert [line for line in config if line.startswith("lxc.idmap")] == [
        "lxc.idmap: u 0 100000 65536", "lxc.idmap: g 0 100000 44", "lxc.idmap: g 44 44 1",
        "lxc.idmap: g 45 100045 65491"]
    again = cli("provision", "host500", "--gpus", "all", "--device-gid", str(VIDEO), "--device-mode", "0660",
                "--features", "nesting=1", "--inventory", str(node)).stdout
    assert again.splitlines() == ["provision host500: 0 changes (as wanted already)"]
    if sim_backend() != "lxc":
        return  # a directory container has no device nodes of its own (docs/simulated-node.md)
    for user, groups in (("trainer", ["-G", "video"]), ("stranger", [])):
        made = pct(node, "exec", "500", "--", "useradd", "-M", *groups, user)
        assert made.returncode == 0, made.stderr
    with_user(node, "trainer")
    table = rows(cli("doctor", "host500", "--config", TINY_CPU, "--inventory", str(node)).stdout)
    assert table["device access"][:2] == ["✔", "trainer: 5 device node(s)"]
    with_user(node, "stranger")
    table = rows(cli("doctor", "host500", "--config", TINY_CPU, "--inventory", str(node), code=1).stdout)
    assert table["device access"][0] == "✘" and "nvidia0 (Permission denied)" in table["device access"][1]


@pytest.mark.skipif(sim_backend() != "lxc", reason="a directory container has no device nodes of its own")
def test_without_a_device_group_a_non_root_user_is_denied_and_doctor_says_how_to_fix_it(node):
    cli("provision", "host500", "--gpus", "all", "--inventory", str(node))
    assert pct(node, "exec", "500", "--", "useradd", "-M", "-G", "video", "trainer").returncode == 0
    with_user(node, "trainer")
    table = rows(cli("doctor", "host500", "--config", TINY_CPU, "--inventory", str(node), code=1).stdout)
    assert table["device access"][0] == "✘" and "nvidiactl (Permission denied)" in table["device access"][1]
    assert table["device access"][3].startswith("dflash-ops provision host500 --device-gid GROUP")
    # the fix, as doctor words it, with the group's name looked up in the container
    cli("provision", "host500", "--gpus", "all", "--device-gid", "video", "--device-mode", "0660", "--yes",
        "--inventory", str(node))
    table = rows(cli("doctor", "host500", "--config", TINY_CPU, "--inventory", str(node)).stdout)
    assert table["device access"][0] == "✔"


def test_bad_device_options_are_one_line_each(node):
    for args, message in ((["--device-mode", "999"], "--device-mode '999': an octal mode"),
                          (["--device-gid", "70000"], "--device-gid 70000: a gid of the container"),
                          (["--device-gid", "Bad Group"], "a number or a group name"),
                          (["--features", "nesting"], "--features 'nesting': pct's form")):
        result = cli("provision", "host500", "--gpus", "all", *args, "--inventory", str(node), code=2)
        assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_a_node_reboot_leaves_the_gpu_container_startable_with_the_boot_unit_and_not_without(node):
    """issue #54 item 2: after a reboot /dev/nvidia* are gone and `pct start` refuses a devN path that
    does not exist; the unit provision --boot-unit installs makes them again before pve-guests."""
    cli("provision", "host500", "--gpus", "all", "--inventory", str(node))
    assert pct(node, "set", "500", "--onboot", "1").returncode == 0
    table = rows(cli("doctor", "host500", "--config", TINY_CPU, "--inventory", str(node)).stdout)
    assert table["boot unit"][:2] == ["!", "dflash-ops-nvidia-devices.service on node sim: not-found"]
    assert table["boot unit"][3].startswith("dflash-ops provision host500 --boot-unit --yes")

    rebooted = cli("sim-reboot", "--inventory", str(node)).stdout
    assert rebooted == "simulated node sim: pve-guests: CT 500 not started: Device /dev/nvidia0 does not exist\n"
    assert pct(node, "status", "500").stdout == "status: stopped\n"
    refused = pct(node, "start", "500")
    assert (refused.returncode, refused.stderr) == (255, "Device /dev/nvidia0 does not exist\n")

    # what an admin does once (nvidia-smi on the node), then the unit, asked for (a "no" changes nothing)
    simgpus.install_gpus(Path(yaml.safe_load(node.read_text())["nodes"]["sim"]["sim_root"]), 2, DRIVER)
    assert pct(node, "start", "500").returncode == 0
    declined = cli("provision", "host500", "--gpus", "all", "--boot-unit", "--inventory", str(node), code=1,
                   input="n\n")
    assert declined.stderr.endswith("dflash-ops-nvidia-devices.service not installed, nothing changed: rerun with "
                                    "--yes to install it\n")
    unit = Path(yaml.safe_load(node.read_text())["nodes"]["sim"]["sim_root"]) / "node/etc/systemd/system"
    assert not unit.exists()
    dry = cli("provision", "host500", "--gpus", "all", "--boot-unit", "--dry-run", "--inventory", str(node)).stdout
    assert "# node sim: write /etc/systemd/system/dflash-ops-nvidia-devices.service" in dry
    assert "# node sim: systemctl enable dflash-ops-nvidia-devices.service" in dry
    fixed = cli("doctor", "host500", "--fix", "--yes", "--config", TINY_CPU, "--inventory", str(node))
    assert "host500: fixing boot unit" in fixed.stderr
    assert rows(fixed.stdout)["boot unit"][:2] == ["✔", "dflash-ops-nvidia-devices.service: enabled"]
    assert "Before=pve-guests.service" in (unit / "dflash-ops-nvidia-devices.service").read_text()

    rebooted = cli("sim-reboot", "--inventory", str(node)).stdout.splitlines()
    assert rebooted == ["simulated node sim: dflash-ops-nvidia-devices.service: made /dev/nvidia0, /dev/nvidia1, "
                        "/dev/nvidiactl, /dev/nvidia-uvm, /dev/nvidia-uvm-tools",
                        "simulated node sim: pve-guests: CT 500 started"]
    assert pct(node, "status", "500").stdout == "status: running\n"
    again = cli("provision", "host500", "--gpus", "all", "--boot-unit", "--inventory", str(node)).stdout
    assert again.splitlines() == ["provision host500: 0 changes (as wanted already)"]
