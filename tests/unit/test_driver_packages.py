"""The NVIDIA driver from the distribution's packages (#54 item 3): what is read from dpkg and apt, and
provision over a mocked SSH refusing a node or container it cannot serve before anything changes.
The install itself runs in real LXC containers (tests/integration/test_provision_packages.py)."""

from __future__ import annotations

import pytest

from dflash_ops.container import Container
from dflash_ops.doctor.node import DriverPackages, parse_dpkg, upstream_version
from dflash_ops.inventory import Node, Target
from dflash_ops.provision import ProvisionError, Request, provision
from dflash_ops.provision.driverpkgs import parse_available, pinned_by
from dflash_ops.provision.node import read_node
from dflash_ops.simnode import aptrepo
from dflash_ops.simnode import gpus as simgpus
from dflash_ops.simnode.containers import stand_in_argv
from dflash_ops.simnode.kind import SimulatedNode
from dflash_ops.simnode.pct import Node as SimNode
from dflash_ops.transport.ssh import SSHTransport
from tests.unit.fake_ssh import FakeServer

# dpkg-query -W -f '${Package}\t${Version}\t${db:Status-Abbrev}\n' on a node: a package dpkg only
# knows of (rc: removed, its config files kept) is not installed.
NODE_DPKG = ("nvidia-kernel-dkms\t550.54.14-1~deb12u1\tii \nlibcuda1\t550.54.14-1~deb12u1\tii \n"
             "libnvidia-ml1\t550.54.14-1~deb12u1\thi \nnvidia-smi\t535.183.01-1~deb12u1\trc \nlibnvidia-nvvm4\t\tun \n")

# apt-cache madison, the marker, apt-cache policy (no arguments): as a Debian 12 container prints them
AVAILABLE = """\
  libcuda1 | 550.54.14-1~deb12u1 | http://deb.debian.org/debian bookworm/non-free amd64 Packages
  libcuda1 | 535.183.01-1~deb12u1 | http://deb.debian.org/debian bookworm/non-free amd64 Packages
nvidia-smi | 535.183.01-1~deb12u1 | file:/srv/nvidia ./ Packages
--- dflash-ops apt sources
Package files:
 100 /var/lib/dpkg/status
     release a=now
 500 file:/srv/nvidia ./ Packages
     release c=
 500 http://deb.debian.org/debian bookworm/non-free amd64 Packages
     release v=12.8,o=Debian,a=stable,n=bookworm,l=Debian,c=non-free,b=amd64
Pinned packages:
"""


def test_dpkg_lines_say_version_installed_and_held():
    found = parse_dpkg(NODE_DPKG)
    assert found["libnvidia-ml1"].held and found["libnvidia-ml1"].installed
    assert not found["libcuda1"].held and not found["nvidia-smi"].installed
    assert "libnvidia-nvvm4" not in found  # dpkg knows the name, no version of it
    packages = DriverPackages.from_dpkg(found)
    assert packages.installed == {"libcuda1": "550.54.14-1~deb12u1", "libnvidia-ml1": "550.54.14-1~deb12u1",
                                  "nvidia-kernel-dkms": "550.54.14-1~deb12u1"}
    assert packages.version == "550.54.14-1~deb12u1" and packages.problem("pve1", "550.54.14") is None
    # what a container gets: the node's user-space packages, never the kernel module's
    assert packages.for_container() == ("libcuda1", "libnvidia-ml1")
    assert DriverPackages({"nvidia-smi": "550.54.14-1"}).for_container() == ("libcuda1", "libnvidia-ml1", "nvidia-smi")
    assert DriverPackages().version is None


# The same from an Ubuntu node (Ubuntu's restricted drivers, or NVIDIA's CUDA repository for Ubuntu): the
# branch and flavour are in the names; the prebuilt module package is versioned by the kernel.
UBUNTU_DPKG = ("nvidia-dkms-550\t550.120-0ubuntu0.24.04.1\tii \nlibnvidia-compute-550\t550.120-0ubuntu0.24.04.1\tii \n"
               "nvidia-utils-550\t550.120-0ubuntu0.24.04.1\thi \nnvidia-kernel-common-550\t550.120-0ubuntu0.24.04.1\tii \n"
               "libnvidia-compute-535\t535.183.01-0ubuntu0.24.04.1\trc \n"
               "linux-modules-nvidia-550-generic\t6.8.0-45.45+1\tii \n")
UBUNTU_SERVER_DPKG = ("nvidia-dkms-550-server-open\t550.127.05-0ubuntu0.22.04.1\tii \n"
                      "libnvidia-compute-550-server\t550.127.05-0ubuntu0.22.04.1\tii \n"
                      "nvidia-utils-550-server\t550.127.05-0ubuntu0.22.04.1\tii \n")


def test_ubuntus_names_carry_the_branch_and_are_read_as_debians_are():
    packages = DriverPackages.from_dpkg(parse_dpkg(UBUNTU_DPKG))
    # the removed 535 and the kernel-versioned module package are not the driver's packages
    assert packages.installed == {name: "550.120-0ubuntu0.24.04.1" for name in (
        "libnvidia-compute-550", "nvidia-dkms-550", "nvidia-kernel-common-550", "nvidia-utils-550")}
    assert packages.version == "550.120-0ubuntu0.24.04.1" and packages.problem("pve1", "550.120") is None
    assert packages.for_container() == ("libnvidia-compute-550", "nvidia-utils-550")
    assert packages.problem("pve1", "550.127.05").startswith("node pve1: its NVIDIA packages are 550.120-0ubuntu0.24.04.1")

    server = DriverPackages.from_dpkg(parse_dpkg(UBUNTU_SERVER_DPKG))
    assert server.version == "550.127.05-0ubuntu0.22.04.1" and server.problem("pve1", "550.127.05") is None
    assert server.for_container() == ("libnvidia-compute-550-server", "nvidia-utils-550-server")
    # a node with only the module's package: the container still gets what torch and NVML load, of its flavour
    assert DriverPackages({"nvidia-dkms-550-server-open": "550.127.05-0ubuntu1"}).for_container() == (
        "libnvidia-compute-550-server",)
    assert DriverPackages({"nvidia-kernel-dkms": "550.54.14-1"}).for_container() == ("libcuda1", "libnvidia-ml1")


def test_the_container_helper_reads_both_families_from_dpkgs_status(tmp_path):
    from dflash_ops.doctor import node as node_facts
    from dflash_ops.helpers import doctor as helper

    assert helper.USERSPACE_PACKAGES == node_facts.DRIVER_USERSPACE_PACKAGES
    assert helper.UBUNTU_USERSPACE.pattern == node_facts.UBUNTU_USERSPACE.pattern
    status = tmp_path / "var" / "lib" / "dpkg" / "status"
    status.parent.mkdir(parents=True)
    status.write_text("".join(f"Package: {name}\nStatus: {state}\nVersion: {version}\n\n" for name, state, version in [
        ("libnvidia-compute-550-server", "hold ok installed", "550.127.05-0ubuntu1"),
        ("nvidia-utils-550-server", "install ok installed", "550.127.05-0ubuntu1"),
        ("libcuda1", "hold ok installed", "550.54.14-1"),
        ("libnvidia-compute-535", "deinstall ok config-files", "535.183.01-0ubuntu1"),
        ("nvidia-dkms-550", "install ok installed", "550.127.05-0ubuntu1"),  # the module's: not the user space
        ("libc6", "install ok installed", "2.36-9")]))
    assert helper.userspace_packages(str(tmp_path)) == {
        "libnvidia-compute-550-server": ["550.127.05-0ubuntu1", True], "nvidia-utils-550-server": ["550.127.05-0ubuntu1", False],
        "libcuda1": ["550.54.14-1", True]}


@pytest.mark.parametrize("version, upstream", [("550.54.14-1~deb12u1", "550.54.14"), ("1:550.54.14-1", "550.54.14"),
                                               ("535.183.01-1", "535.183.01"), ("570.86.15", "570.86.15")])
def test_the_upstream_part_of_a_package_version_is_the_modules_version(version, upstream):
    assert upstream_version(version) == upstream


def test_a_node_whose_packages_disagree_with_each_other_or_its_module_is_named():
    mixed = DriverPackages({"libcuda1": "550.54.14-1", "libnvidia-ml1": "550.90.07-1"})
    assert mixed.version is None
    assert mixed.problem("pve1", "550.54.14") == (
        "node pve1: its NVIDIA packages are of more than one version (libcuda1 550.54.14-1, libnvidia-ml1 "
        "550.90.07-1): finish the driver upgrade on the node (apt-get install of one version for all of them), "
        "then provision")
    ahead = DriverPackages({"libcuda1": "550.90.07-1"})
    assert ahead.problem("pve1", "550.54.14") == (
        "node pve1: its NVIDIA packages are 550.90.07-1 (libcuda1 550.90.07-1) but its loaded kernel module is "
        "550.54.14: reboot the node (or reload the nvidia module) so they agree, then provision")


def test_apts_versions_and_sources_are_read_from_madison_and_policy():
    versions, sources = parse_available(AVAILABLE)
    assert versions == {
        "libcuda1": [("550.54.14-1~deb12u1", "http://deb.debian.org/debian bookworm/non-free amd64"),
                     ("535.183.01-1~deb12u1", "http://deb.debian.org/debian bookworm/non-free amd64")],
        "nvidia-smi": [("535.183.01-1~deb12u1", "file:/srv/nvidia ./")]}
    assert sources == ["file:/srv/nvidia ./", "http://deb.debian.org/debian bookworm/non-free"]


def test_the_dependencies_a_package_pins_to_its_version_are_read_from_apt_cache_show():
    show = ("Package: libcuda1\nVersion: 535.183.01-1~deb12u1\nDepends: nvidia-support, nvidia-alternative (= "
            "535.183.01-1~deb12u1), libnvidia-ptxjitcompiler1 (= 535.183.01-1~deb12u1), libc6 (>= 2.34), "
            "libcuda1:i386 (= 535.183.01-1~deb12u1) | ia32-libs\nRecommends: nvidia-kernel-dkms (= 535.183.01-1~deb12u1)\n"
            "\nPackage: nvidia-smi\nPre-Depends: libnvidia-ml1:amd64 (= 535.183.01-1~deb12u1)\n")
    # an alternative pins nothing; Recommends are not installed (--no-install-recommends); another version is not it
    assert pinned_by(show, "535.183.01-1~deb12u1") == {"nvidia-alternative", "libnvidia-ptxjitcompiler1", "libnvidia-ml1"}
    assert pinned_by(show, "550.54.14-1") == set()


@pytest.fixture
def fake_ssh_node(tmp_path):
    """The simulated node with its driver from packages, behind the mocked SSH: node commands reach it
    as a real sshd would hand them to the node's shell; its containers would be directories."""
    root = tmp_path / "sim"
    simgpus.install_gpus(root, 2, "550.54.14", driver_from="packages")
    kind = SimulatedNode(pct=tuple(stand_in_argv(root)), root=str(root), backend_choice="directory")
    node = Node(name="pve1", transport="ssh", pct=kind.pct, address="10.0.0.1", kind=kind)
    transport = SSHTransport(node, connection_factory=FakeServer().connection)
    defaults = kind.target_defaults(500)
    target = Target(name="host500", node=node, ctid=500, base_dir=defaults["base_dir"], python=defaults["python"])
    yield root, Container(target, transport)
    transport.close()


def test_the_nodes_packages_are_read_over_ssh(fake_ssh_node):
    root, c = fake_ssh_node
    node = read_node("pve1", c.target.node.kind, c.transport)
    version = aptrepo.debian_version("550.54.14")
    assert node.module == "550.54.14" and node.gpus == (0, 1)
    assert node.packages.installed == {"libcuda1": version, "libnvidia-ml1": version, "nvidia-kernel-dkms": version,
                                       "nvidia-smi": version}


def test_an_ubuntu_nodes_packages_are_read_over_ssh_by_dpkg_query(fake_ssh_node):
    """dpkg-query itself (the node's, reading its status database) finds Ubuntu's names by their patterns."""
    root, c = fake_ssh_node
    version = "550.54.14-0ubuntu0.24.04.1"
    stanzas = [(name, "install ok installed", version) for name in (
        "libnvidia-compute-550-server", "nvidia-utils-550-server", "nvidia-dkms-550-server-open")]
    stanzas += [("linux-modules-nvidia-550-server-generic", "install ok installed", "6.8.0-45.45+1"),
                ("libnvidia-compute-535-server", "deinstall ok config-files", "535.183.01-0ubuntu1")]
    (root / "node" / aptrepo.STATUS.lstrip("/")).write_text("".join(
        f"Package: {name}\nStatus: {state}\nPriority: optional\nSection: libs\nMaintainer: Ubuntu\n"
        f"Architecture: amd64\nVersion: {v}\nDescription: {name}\n\n" for name, state, v in stanzas))
    node = read_node("pve1", c.target.node.kind, c.transport)
    assert node.packages.installed == {name: version for name, _, _ in stanzas[:3]}
    assert node.packages.problem("pve1", node.module) is None
    assert node.packages.for_container() == ("libnvidia-compute-550-server", "nvidia-utils-550-server")
    # provision names them, at the node's version (and refuses a directory container, as for Debian's)
    with pytest.raises(ProvisionError, match=r"needs libnvidia-compute-550-server=550\.54\.14-0ubuntu0\.24\.04\.1 "
                       r"nvidia-utils-550-server=550\.54\.14-0ubuntu0\.24\.04\.1 from apt"):
        provision(c, Request(gpus="all"), say=lambda line: None)


def test_provision_refuses_a_directory_container_and_a_node_awaiting_its_reboot_before_anything_changes(fake_ssh_node):
    root, c = fake_ssh_node
    with pytest.raises(ProvisionError, match=r"^node pve1 has its NVIDIA driver from packages, so CT 500 needs "
                       r"libcuda1=550\.54\.14-1 libnvidia-ml1=550\.54\.14-1 nvidia-smi=550\.54\.14-1 from apt, but its / "
                       r"is this machine's"):
        provision(c, Request(gpus="all"), say=lambda line: None)
    assert not SimNode(root).exists("500")
    (root / "node" / aptrepo.STATUS.lstrip("/")).write_text(aptrepo.node_status("550.90.07"))
    lines: list[str] = []
    with pytest.raises(ProvisionError, match=r"^node pve1: its NVIDIA packages are 550\.90\.07-1 .* but its loaded "
                       r"kernel module is 550\.54\.14: reboot the node"):
        provision(c, Request(gpus="all"), dry_run=True, say=lines.append)
    assert not SimNode(root).exists("500")
    # the dry run showed the node read that found them, as sent over SSH
    assert any(line.startswith("node command (sent over SSH): sh -c ") and "dpkg-query" in line for line in lines)


def test_a_node_without_packages_keeps_the_installer(fake_ssh_node):
    root, c = fake_ssh_node
    simgpus.install_gpus(root, 2, "550.54.14")  # the installer this time: no dpkg status of the driver
    node = read_node("pve1", c.target.node.kind, c.transport)
    assert node.packages == DriverPackages()
    done = provision(c, Request(gpus="all"), say=lambda line: None)
    assert "install the NVIDIA user-space 550.54.14 without the kernel module (was: none)" in done.changes
