"""provision's config planning: lines go before [snapshot] sections, an admin's line is never touched."""

from dflash_ops.doctor.node import parse_module_version
from dflash_ops.provision.config import RawConfig, plan_lxc, wanted_devn
from dflash_ops.provision.node import parse_pveversion

CONFIG = """#my container
arch: amd64
dev0: /dev/nvidia0
lxc.prlimit.nofile = 4096

[before-upgrade]
lxc.prlimit.memlock: 64
"""
SHM = ("lxc.mount.entry", "tmpfs dev/shm tmpfs rw,nosuid,nodev,size=1G,create=dir 0 0")


def test_lines_go_into_the_current_section_and_foreign_slots_are_left_alone():
    config = RawConfig.parse(CONFIG)
    plan = plan_lxc(config, [], [SHM, ("lxc.prlimit.memlock", "unlimited"), ("lxc.prlimit.nofile", "1048576")])
    assert plan.new_text == CONFIG.replace("lxc.prlimit.nofile = 4096\n", "lxc.prlimit.nofile = 4096\n"
                                           f"{SHM[0]}: {SHM[1]}\nlxc.prlimit.memlock: unlimited\n")
    assert plan.kept_foreign == [(("lxc.prlimit.nofile", "4096"), ("lxc.prlimit.nofile", "1048576"))]
    again = plan_lxc(RawConfig.parse(plan.new_text), plan.owned, [SHM, ("lxc.prlimit.memlock", "unlimited")])
    assert not again.changed and again.new_text == plan.new_text


def test_devn_slots_and_versions():
    config = RawConfig.parse(CONFIG)
    assert wanted_devn(config, ["/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl"]) == {
        "dev1": "/dev/nvidia1", "dev2": "/dev/nvidiactl"}
    assert parse_pveversion("pve-manager/8.2.4/faa83925c9641325 (running kernel: 6.8.12-1-pve)") == (8, 2, 4)
    assert parse_module_version("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build\n") \
        == "570.86.15"
