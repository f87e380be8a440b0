"""The inventory is the user's file: edited in place under a lock, from a re-read, after the new text
is checked; it lives outside the repository (dflash_ops/userfile.py, provision/inventory_file.py).

Each case of issue #55's audit (a 0600 file made world-readable, a symlink made a copy, a read-only
file written, parallel provisions losing targets, an invalid target written, YAML 1.1 booleans
written unquoted, a message naming a temporary copy) with variants.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

import dflash_ops
from dflash_ops.cli import app
from dflash_ops.errors import InventoryError
from dflash_ops.inventory import (
    default_inventory_path,
    load_inventory,
    packaged_inventory_path,
    user_inventory_path,
    writable_inventory_path,
)
from dflash_ops.provision.inventory_file import add_target, set_gpus

REPO = Path(dflash_ops.__file__).resolve().parent.parent

INVENTORY = """\
# my nodes (a comment the edit keeps)
nodes:
  pve1: {transport: ssh, address: 10.1.2.6, pct: pct}
  sim: {transport: local, pct: simulated, sim_root: /tmp/never-created-by-this-test}
notify:
targets:
  host200: {node: pve1, ctid: 200, base_dir: /opt/dflash}
"""


@pytest.fixture
def inv(tmp_path) -> Path:
    path = tmp_path / "hosts.yaml"
    path.write_text(INVENTORY.replace("notify:\n", ""))
    return path


def test_mode_and_inode_are_kept(inv):
    os.chmod(inv, 0o600)  # it may hold a webhook token
    before = os.stat(inv)
    assert add_target(inv, "host300", "pve1", 300, (0, 1), "/opt/dflash")
    after = os.stat(inv)
    assert stat.S_IMODE(after.st_mode) == 0o600 and after.st_ino == before.st_ino
    assert load_inventory(inv).target("host300").gpus == (0, 1)
    assert inv.read_text().startswith("# my nodes (a comment the edit keeps)\n")


def test_owner_and_group_are_kept_as_root(inv):
    if os.geteuid() != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true but this test needs root (chown)")
        pytest.skip("chown to another user needs root")
    os.chown(inv, 65534, 65534)
    assert add_target(inv, "host300", "pve1", 300, base_dir="/opt/dflash")
    st = os.stat(inv)
    assert (st.st_uid, st.st_gid) == (65534, 65534)


@pytest.mark.parametrize("relative", [True, False], ids=["relative-link", "absolute-link"])
def test_a_symlinked_inventory_stays_a_link_and_its_target_is_edited(tmp_path, relative):
    real_dir = tmp_path / "dotfiles"
    real_dir.mkdir()
    real = real_dir / "hosts.yaml"
    real.write_text(INVENTORY.replace("notify:\n", ""))
    link = tmp_path / "hosts.yaml"
    link.symlink_to(Path("dotfiles/hosts.yaml") if relative else real)
    assert add_target(link, "host300", "pve1", 300, base_dir="/opt/d")
    assert link.is_symlink() and os.readlink(link) == (("dotfiles/hosts.yaml") if relative else str(real))
    assert "host300" in load_inventory(real).targets


@pytest.mark.parametrize("mode", [0o444, 0o400, 0o440])
def test_a_read_only_inventory_is_not_written_even_by_root(inv, mode):
    os.chmod(inv, mode)
    text = inv.read_text()
    with pytest.raises(InventoryError, match=rf"^{inv}: read-only \(mode 0{mode:o}\): not written"):
        add_target(inv, "host300", "pve1", 300, base_dir="/opt/dflash")
    assert inv.read_text() == text and stat.S_IMODE(os.stat(inv).st_mode) == mode


def test_a_read_only_file_behind_a_symlink_names_the_link(tmp_path):
    real = tmp_path / "real.yaml"
    real.write_text(INVENTORY.replace("notify:\n", ""))
    os.chmod(real, 0o444)
    link = tmp_path / "hosts.yaml"
    link.symlink_to(real)
    with pytest.raises(InventoryError, match=rf"^{link}: read-only"):
        set_gpus(link, "host200", (0,))


@pytest.mark.parametrize("name, node, ctid, message", [
    ("host300", "pve1", 12, "ctid must be greater than or equal to 100, got 12"),
    ("host300", "pve9", 300, "unknown node 'pve9' (did you mean 'pve1'?)"),
    ("host300", "sim", 300, None),  # valid: a node of another kind
])
def test_a_target_is_validated_before_it_is_written(inv, name, node, ctid, message):
    text = inv.read_text()
    if message is None:
        assert add_target(inv, name, node, ctid, base_dir="/opt/dflash")
        assert load_inventory(inv).target(name).ctid == ctid
        return
    with pytest.raises(InventoryError) as err:
        add_target(inv, name, node, ctid, base_dir="/opt/dflash")
    assert str(err.value).startswith(f"{inv}:") and message in str(err.value)
    assert inv.read_text() == text  # nothing written: every later command still loads it


@pytest.mark.parametrize("name", ["on", "yes", "No", "off", "y", "true", "null", "~", "123", "1e3", "0x1F", "1:20"])
def test_yaml_1_1_scalars_are_written_quoted_and_read_back_as_strings(inv, name):
    """ruamel writes YAML 1.2 (where `on` is a string); the inventory's reader is YAML 1.1. A node
    and a target named so are written quoted and read back as the names they are."""
    inv.write_text(inv.read_text().replace("  sim:", f'  "{name}":'))
    assert add_target(inv, name, name, 300)  # a simulated node: its kind gives base_dir
    assert load_inventory(inv).target(name).node.name == name
    assert yaml.safe_load(inv.read_text())["targets"][name] == {"node": name, "ctid": 300}


def test_parallel_provisions_keep_each_others_targets(inv):
    """Eight processes add a target each at the same time: all eight are there."""
    code = ("import sys; from pathlib import Path; from dflash_ops.provision.inventory_file import add_target; "
            "add_target(Path(sys.argv[1]), sys.argv[2], 'pve1', int(sys.argv[3]), base_dir='/opt/dflash')")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(inv), f"host{300 + i}", str(300 + i)], env=env)
             for i in range(8)]
    assert [p.wait() for p in procs] == [0] * 8
    assert sorted(load_inventory(inv).targets) == ["host200", *(f"host{300 + i}" for i in range(8))]


def test_an_edit_uses_what_the_file_holds_under_the_lock_not_an_earlier_read(inv):
    loaded = load_inventory(inv)  # a command read it ...
    inv.write_text(inv.read_text() + "  host400: {node: pve1, ctid: 400, base_dir: /opt/dflash}\n")  # ... someone added a target since
    assert "host400" not in loaded.targets
    assert add_target(inv, "host300", "pve1", 300, base_dir="/opt/dflash")
    assert {"host200", "host300", "host400"} <= set(load_inventory(inv).targets)


def test_the_user_inventory_lives_outside_the_repository_and_is_seeded_from_the_default(tmp_path, monkeypatch):
    monkeypatch.delenv("DFLASH_OPS_INVENTORY", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    user = tmp_path / "config" / "dflash-ops" / "hosts.yaml"
    assert user_inventory_path() == user and default_inventory_path() == packaged_inventory_path()
    path, seeded = writable_inventory_path()
    assert (path, seeded) == (user, True) and user.read_bytes() == packaged_inventory_path().read_bytes()
    assert stat.S_IMODE(os.stat(user).st_mode) == 0o600
    assert writable_inventory_path() == (user, False) and default_inventory_path() == user
    explicit = tmp_path / "mine.yaml"
    assert writable_inventory_path(explicit) == (explicit, False)
    monkeypatch.setenv("DFLASH_OPS_INVENTORY", str(explicit))
    assert writable_inventory_path() == (explicit, False) and default_inventory_path() == explicit


def test_provision_write_inventory_edits_the_users_file_never_a_tracked_one(tmp_path, monkeypatch):
    """The tour's `provision --write-inventory` (a dry run first, then for real, failing at the node
    here: this test gives the simulated node no GPUs) leaves the repository's inventory as it is."""
    monkeypatch.delenv("DFLASH_OPS_INVENTORY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    tracked = packaged_inventory_path().read_bytes()
    user = tmp_path / "config" / "dflash-ops" / "hosts.yaml"
    dry = CliRunner().invoke(app, ["provision", "host500", "--write-inventory", "--node", "sim", "--ctid", "500",
                                   "--dry-run"])
    assert dry.stdout.startswith(f"# would add host500 (node sim, ctid 500) to {user}\n"), dry.output
    assert not user.exists()
    bad = CliRunner().invoke(app, ["provision", "on", "--write-inventory", "--node", "sim", "--ctid", "50"])
    assert bad.exit_code == 1 and bad.stderr.startswith(f"dflash-ops: error: {user}:") and "ctid must be" in bad.stderr
    assert "tmp" not in bad.stderr.replace(str(tmp_path), "") and "host500" not in user.read_text()
    assert packaged_inventory_path().read_bytes() == tracked


def test_the_dry_run_names_the_users_file_in_its_errors(inv):
    result = CliRunner().invoke(app, ["provision", "host300", "--write-inventory", "--node", "pve1", "--ctid", "7",
                                      "--dry-run", "--inventory", str(inv)])
    assert result.exit_code == 1
    assert result.stderr.startswith(f"dflash-ops: error: {inv}:") and "ctid must be greater" in result.stderr


def test_an_unknown_target_says_how_to_create_it(inv):
    with pytest.raises(InventoryError, match=r"to create it: dflash-ops provision host500 --write-inventory "
                                             r"--node NODE --ctid N --inventory "):
        load_inventory(inv).target("host500")
