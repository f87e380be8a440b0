"""provision's rendered node commands through a real OpenSSH sshd (the sshd tier): the login shell
parses each one (pveversion, the flock'd config rewrite with its sh -c script, pct set/create/push,
the installer in the container) back into exactly its argv, and a rerun changes nothing."""

from __future__ import annotations

import dataclasses

import pytest

from dflash_ops.container import Container
from dflash_ops.inventory import load_inventory
from dflash_ops.provision import Request, provision
from dflash_ops.simnode import gpus as simgpus
from dflash_ops.simnode.kind import SimulatedNode
from dflash_ops.simnode.pct import Node as SimNode
from dflash_ops.transport.ssh import SSHTransport

pytestmark = [pytest.mark.sshd]
CTID = 520


def test_provision_over_sshd_then_a_rerun_changes_nothing(sshd_node):
    root = sshd_node.sim_root
    simgpus.install_gpus(root, 2, "550.54.14")
    host = load_inventory(sshd_node.inventory).target("host200")
    # the sshd node's pct is the stand-in behind a wrapper; its files are the stand-in's (the kind says where)
    kind = SimulatedNode(pct=host.node.pct, root=str(root), backend_choice="directory")
    node = dataclasses.replace(host.node, kind=kind)
    defaults = kind.target_defaults(CTID)
    target = dataclasses.replace(host, name="host520", node=node, ctid=CTID, base_dir=defaults["base_dir"],
                                 python=defaults["python"], gpus=(0, 1))
    transport = SSHTransport(node)
    try:
        c = Container(target, transport)
        lines: list[str] = []
        dry = provision(c, Request(gpus="all"), dry_run=True, say=lines.append)
        assert not SimNode(root).exists(str(CTID)) and dry.changes
        assert any(line.startswith("node command (sent over SSH): flock -w 10 ") for line in lines)
        done = provision(c, Request(gpus="all"), say=lambda line: None)
        assert any(change.startswith("install the NVIDIA user-space 550.54.14") for change in done.changes)
        config = SimNode(root).conf(str(CTID)).read_text()
        assert "dev0: /dev/nvidia0" in config and "lxc.prlimit.memlock: unlimited" in config
        libs = SimNode(root).ct_root(str(CTID)) / "usr/lib/x86_64-linux-gnu"
        assert sorted(p.name for p in libs.glob("lib*")) == ["libcuda.so.550.54.14", "libnvidia-ml.so.550.54.14"]
        assert provision(c, Request(gpus="all"), say=lambda line: None).changes == []
    finally:
        transport.close()
        SimNode(root).set_state(str(CTID), "stopped")


def test_a_device_group_idmap_and_boot_unit_over_sshd(sshd_node):
    """#54 items 1 and 2 through the login shell: gid=/mode= on every devN entry, the idmap lines, the
    node's /etc/subgid appended in place, the boot unit written and enabled; a rerun changes nothing."""
    from dflash_ops.provision.config import DeviceAccess

    root = sshd_node.sim_root
    simgpus.install_gpus(root, 2, "550.54.14")
    host = load_inventory(sshd_node.inventory).target("host200")
    kind = SimulatedNode(pct=host.node.pct, root=str(root), backend_choice="directory")
    node = dataclasses.replace(host.node, kind=kind)
    defaults = kind.target_defaults(CTID + 1)
    target = dataclasses.replace(host, name="host521", node=node, ctid=CTID + 1, base_dir=defaults["base_dir"],
                                 python=defaults["python"], gpus=(0, 1))
    request = Request(gpus="all", device=DeviceAccess(gid=44, mode="0660"), features="nesting=1", boot_unit="install")
    transport = SSHTransport(node)
    try:
        c = Container(target, transport)
        done = provision(c, request, yes=True, say=lambda line: None)
        assert any(change.endswith("add `root:44:1` to /etc/subgid") for change in done.changes), done.changes
        config = SimNode(root).conf(str(CTID + 1)).read_text()
        assert "dev0: /dev/nvidia0,gid=44,mode=0660" in config and "features: nesting=1" in config
        assert "lxc.idmap: g 44 44 1" in config
        assert "root:44:1\n" in (root / "node" / "etc" / "subgid").read_text()
        units = root / "node" / "etc" / "systemd" / "system"
        assert (units / "multi-user.target.wants" / "dflash-ops-nvidia-devices.service").is_symlink()
        assert provision(c, request, yes=True, say=lambda line: None).changes == []
    finally:
        transport.close()
        SimNode(root).set_state(str(CTID + 1), "stopped")


def test_the_nodes_driver_packages_over_sshd_into_an_lxc_container(sshd_node):
    """#54 item 3 through the login shell: the node's dpkg-query (its format's `${...}` and tabs), the
    container's dpkg-query, apt-cache, apt-get install PKG=V-REV and apt-mark hold in a real LXC
    container; a rerun changes nothing."""
    from dflash_ops.provision.driverpkgs import container_packages
    from dflash_ops.simnode import aptrepo
    from dflash_ops.simnode.rootfs import unavailable_reason
    from tests.conftest import unavailable

    unavailable(unavailable_reason(), "the LXC backend")
    root = sshd_node.sim_root
    simgpus.install_gpus(root, 2, "550.54.14", driver_from="packages")
    host = load_inventory(sshd_node.inventory).target("host200")
    ctid = CTID + 2
    kind = SimulatedNode(pct=host.node.pct, root=str(root), backend_choice="lxc")
    node = dataclasses.replace(host.node, kind=kind)
    defaults = kind.target_defaults(ctid)
    target = dataclasses.replace(host, name="host522", node=node, ctid=ctid, base_dir=defaults["base_dir"],
                                 python=defaults["python"], gpus=(0, 1))
    transport = SSHTransport(node)
    version = aptrepo.debian_version("550.54.14")
    packages = ("libcuda1", "libnvidia-ml1", "nvidia-smi")
    try:
        c = Container(target, transport)
        provision(c, Request(), say=lambda line: None)  # the container; then its admin's only source: the node's
        c.exec(["sh", "-c", 'rm -f /etc/apt/sources.list && echo "$1" > /etc/apt/sources.list.d/nvidia.list', "sh",
                aptrepo.SOURCE_LINE], check=True)
        done = provision(c, Request(gpus="all"), yes=True, say=lambda line: None)
        assert f"install the NVIDIA user-space {version} from the container's apt sources: libcuda1, libnvidia-ml1, " \
               "nvidia-smi (was: none); with nvidia-alternative, which they pin to it" in done.changes
        have = container_packages(c, packages)
        assert {p: (have[p].version, have[p].held) for p in have} == {p: (version, True) for p in packages}
        assert provision(c, Request(gpus="all"), yes=True, say=lambda line: None).changes == []
    finally:
        transport.close()
        SimNode(root).set_state(str(ctid), "stopped")
