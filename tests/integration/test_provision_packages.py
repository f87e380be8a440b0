"""#54 item 3: a node with its NVIDIA driver from the distribution's packages gives its GPU container the
same user-space packages at exactly its version, from the container's own apt sources, held.

The simulated node (simnode/aptrepo.py) lists nvidia-kernel-dkms, libnvidia-ml1, libcuda1 and
nvidia-smi 550.54.14-1 in its dpkg status database, and its apt repository holds real .debs of them
(made by dpkg-deb); an LXC container reaches the repository at /srv/dflash-sim-apt and its admin
(the test) makes that its only apt source. Real apt and dpkg in the container do the rest. A
directory container has no apt of its own: refused before anything changes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dflash_ops.simnode import aptrepo
from dflash_ops.simnode import gpus as simgpus
from dflash_ops.simnode.containers import stop_all
from dflash_ops.simnode.rootfs import unavailable_reason
from tests.conftest import unavailable
from tests.integration.test_doctor import rows
from tests.integration.test_provision import DRIVER, INVENTORY, TINY_CPU, UPGRADED, cli, container, pct

pytestmark = pytest.mark.lxc_tier
V1, V2 = aptrepo.debian_version(DRIVER), aptrepo.debian_version(UPGRADED)
PACKAGES = ("libcuda1", "libnvidia-ml1", "nvidia-smi")


def _node(tmp_path: Path, backend: str) -> Path:
    root = tmp_path / "sim"
    simgpus.install_gpus(root, 2, DRIVER, driver_from="packages")
    path = tmp_path / "inventory.yaml"
    path.write_text(INVENTORY.format(root=root, backend=backend))
    return path


@pytest.fixture
def lxc_node(tmp_path):
    unavailable(unavailable_reason(), "the LXC backend")
    path = _node(tmp_path, "lxc")
    yield path
    stop_all(tmp_path / "sim")


def _sim_root(inventory: Path) -> str:
    return yaml.safe_load(inventory.read_text())["nodes"]["sim"]["sim_root"]


def _only_the_node_repository(inventory: Path) -> None:
    """The container's admin: the node's repository is its only apt source (no network needed)."""
    c = container(inventory)
    c.exec(["sh", "-c", 'rm -f /etc/apt/sources.list /etc/apt/sources.list.d/* && echo "$1" > '
            "/etc/apt/sources.list.d/nvidia.list", "sh", aptrepo.SOURCE_LINE], check=True)


def _dpkg(inventory: Path, *names: str) -> dict[str, str]:
    """{package: 'VERSION STATUS-ABBREV'} of the packages the container's own dpkg has a version of."""
    out = container(inventory).exec(["sh", "-c", 'dpkg-query -W -f "\\${Package} \\${Version} \\${db:Status-Abbrev}\\n" '
                                     '"$@" 2>/dev/null; exit 0', "sh", *names]).stdout
    return {words[0]: " ".join(words[1:]) for words in map(str.split, out.splitlines()) if len(words) == 3}


def test_the_nodes_packages_are_installed_at_its_version_held_and_a_rerun_changes_nothing(lxc_node):
    plan = cli("provision", "host500", "--gpus", "all", "--dry-run", "--inventory", str(lxc_node)).stdout
    assert (f"# then, in the new container: python3 and venv when missing (apt-get), and the node's NVIDIA packages "
            f"libcuda1={V1} libnvidia-ml1={V1} nvidia-smi={V1} from the container's apt sources, held (apt-get "
            "install, apt-mark hold)") in plan
    cli("provision", "host500", "--inventory", str(lxc_node))  # the container, no GPUs yet
    _only_the_node_repository(lxc_node)
    # the mirror is ahead of the node (a newer point release): apt's candidates are not the node's version
    aptrepo.build_debs(Path(_sim_root(lxc_node)) / "node" / aptrepo.REPO_DIR.lstrip("/"), UPGRADED)
    dry = cli("provision", "host500", "--gpus", "all", "--yes", "--dry-run", "--inventory", str(lxc_node)).stdout
    assert "# apt-get update in CT 500" in dry
    assert (f"# install the NVIDIA user-space {V1} from the container's apt sources: libcuda1, libnvidia-ml1, "
            "nvidia-smi (was: none)") in dry
    assert (f"container argv: ['env', 'DEBIAN_FRONTEND=noninteractive', 'apt-get', 'install', '-y', "
            f"'--no-install-recommends', '--allow-downgrades', '--allow-change-held-packages', 'libcuda1={V1}', "
            f"'libnvidia-ml1={V1}', 'nvidia-smi={V1}']") in dry
    assert f"# hold libcuda1, libnvidia-ml1, nvidia-smi at {V1} (apt-mark hold)" in dry
    assert _dpkg(lxc_node, *PACKAGES) == {}  # the dry run installed nothing

    done = cli("provision", "host500", "--gpus", "all", "--yes", "--inventory", str(lxc_node)).stdout
    # the packages pin nvidia-alternative (= V1): named at V1 too, else apt takes its candidate V2 and gives up
    assert done.rstrip().endswith(f"install the NVIDIA user-space {V1} from the container's apt sources: libcuda1, "
                                  "libnvidia-ml1, nvidia-smi (was: none); with nvidia-alternative, which they pin to it)")
    # held ("hi"): an apt upgrade in the container cannot move them off the node's version; no kernel module
    assert _dpkg(lxc_node, *PACKAGES, "nvidia-alternative", "nvidia-kernel-dkms") == {
        **{p: f"{V1} hi" for p in PACKAGES}, "nvidia-alternative": f"{V1} ii"}
    c = container(lxc_node)
    assert c.exec(["nvidia-smi"]).stdout.startswith(f"NVIDIA-SMI {DRIVER}    Driver Version: {DRIVER}")
    assert c.exec(["ls", "/usr/lib/x86_64-linux-gnu/nvidia/current"]).stdout.split() == [
        f"libcuda.so.{DRIVER}", f"libnvidia-ml.so.{DRIVER}"]
    # the container's dpkg is its own: none of this machine's packages (lxc, mmdebstrap: .ci/run installs them here)
    assert _dpkg(lxc_node, "lxc", "mmdebstrap") == {}

    table = rows(cli("doctor", "host500", "--config", TINY_CPU, "--inventory", str(lxc_node)).stdout)
    assert table["driver user-space"][:3] == [
        "✔", f"container libcuda1 {V1}, libnvidia-ml1 {V1}, nvidia-smi {V1}",
        f"libcuda1, libnvidia-ml1, nvidia-smi {V1} held (= node's packages, module {DRIVER})"]
    again = cli("provision", "host500", "--gpus", "all", "--inventory", str(lxc_node)).stdout
    assert again.splitlines() == ["provision host500: 0 changes (as wanted already)"]

    c.exec(["apt-mark", "unhold", "nvidia-smi"], check=True)  # someone in the container
    named = rows(cli("doctor", "host500", "--config", TINY_CPU, "--inventory", str(lxc_node)).stdout)
    assert named["driver user-space"][0] == "!" and named["driver user-space"][1].endswith(f"nvidia-smi {V1} (not held)")
    fixed = cli("doctor", "host500", "--config", TINY_CPU, "--fix", "--inventory", str(lxc_node))
    assert f"provision: hold nvidia-smi at {V1} in CT 500" in fixed.stderr
    assert rows(fixed.stdout)["driver user-space"][0] == "✔"


def test_a_node_driver_upgrade_is_refused_until_the_sources_have_it_then_doctor_fix_moves_the_hold(lxc_node):
    cli("provision", "host500", "--inventory", str(lxc_node))
    _only_the_node_repository(lxc_node)
    cli("provision", "host500", "--gpus", "all", "--yes", "--inventory", str(lxc_node))
    assert _dpkg(lxc_node, *PACKAGES) == {p: f"{V1} hi" for p in PACKAGES}
    root = _sim_root(lxc_node)
    simgpus.upgrade_driver(root, UPGRADED, publish=False)  # the node's apt upgrade and reboot; the mirror lags

    named = rows(cli("doctor", "host500", "--config", TINY_CPU, "--inventory", str(lxc_node), code=1).stdout)
    assert named["driver user-space"] == [
        "✘", f"container libcuda1 {V1}, libnvidia-ml1 {V1}, nvidia-smi {V1}",
        f"libcuda1, libnvidia-ml1, nvidia-smi {V2} held (= node's packages, module {UPGRADED})",
        f"dflash-ops doctor host500 --fix (apt-get install libcuda1={V2} libnvidia-ml1={V2} nvidia-smi={V2} in the "
        "container, then apt-mark hold)"]
    refused = cli("provision", "host500", "--gpus", "all", "--inventory", str(lxc_node), code=1)
    assert refused.stderr == (
        f"dflash-ops: error: NVIDIA user-space {V2} (node sim's driver packages, module {UPGRADED}) is not in the apt "
        f"sources of CT 500 (file:{aptrepo.REPO_DIR} ./; they have libcuda1 {V1}, libnvidia-ml1 {V1}, nvidia-smi {V1}): "
        f"add a source that has {V2} to the container (Debian's non-free, or NVIDIA's CUDA repository for Debian), "
        "then rerun\n")
    assert _dpkg(lxc_node, *PACKAGES) == {p: f"{V1} hi" for p in PACKAGES}  # nothing moved

    aptrepo.build_debs(Path(root) / "node" / aptrepo.REPO_DIR.lstrip("/"), UPGRADED)  # the mirror catches up
    fixed = cli("doctor", "host500", "--config", TINY_CPU, "--fix", "--inventory", str(lxc_node), code=None)
    assert (f"provision: install the NVIDIA user-space {V2} from the container's apt sources: libcuda1, libnvidia-ml1, "
            f"nvidia-smi (was: libcuda1 {V1}, libnvidia-ml1 {V1}, nvidia-smi {V1})") in fixed.stderr
    assert rows(fixed.stdout)["driver user-space"][0] == "✔"
    assert _dpkg(lxc_node, *PACKAGES) == {p: f"{V2} hi" for p in PACKAGES}
    files = container(lxc_node).exec(["ls", "/usr/lib/x86_64-linux-gnu/nvidia/current"]).stdout.split()
    assert files == [f"libcuda.so.{UPGRADED}", f"libnvidia-ml.so.{UPGRADED}"]  # dpkg removed the old version's


def test_a_directory_container_or_a_node_awaiting_its_reboot_is_refused_before_anything_changes(tmp_path):
    """Both refusals come from what the node says (no LXC needed): the directory backend's container
    would get apt onto this machine; a node whose packages moved on but whose module did not."""
    inventory = _node(tmp_path, "directory")
    refused = cli("provision", "host500", "--gpus", "all", "--inventory", str(inventory), code=1)
    assert refused.stderr == (
        f"dflash-ops: error: node sim has its NVIDIA driver from packages, so CT 500 needs libcuda1={V1} "
        f"libnvidia-ml1={V1} nvidia-smi={V1} from apt, but its / is this machine's (a directory container of the "
        "simulated node): make it an LXC container (dflash-ops sim-remake host500 --backend lxc)\n")
    assert pct(inventory, "status", "500").returncode == 255  # nothing was made

    status = Path(_sim_root(inventory)) / "node" / aptrepo.STATUS.lstrip("/")
    status.write_text(aptrepo.node_status(UPGRADED))  # apt upgraded the node; it has not rebooted
    refused = cli("provision", "host500", "--gpus", "all", "--inventory", str(inventory), code=1)
    assert refused.stderr == (
        f"dflash-ops: error: node sim: its NVIDIA packages are {V2} (libcuda1 {V2}, libnvidia-ml1 {V2}, "
        f"nvidia-kernel-dkms {V2}, nvidia-smi {V2}) but its loaded kernel module is {DRIVER}: reboot the node (or "
        "reload the nvidia module) so they agree, then provision\n")
    assert pct(inventory, "status", "500").returncode == 255
