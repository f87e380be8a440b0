"""deploy among entries it did not create, on a full disk, and with hostile --extra paths."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from dflash_ops.deploy.manifest import ReleasePathError, collect
from dflash_ops.deploy.push import deploy_target
from dflash_ops.errors import HelperFailed
from tests.conftest import unavailable
from tests.integration.deploy_support import make_package, sim_container

pytestmark = pytest.mark.lxc_tier

NO_VENV = None


def _base(container) -> Path:
    return Path(container.base_dir)


def _current(base: Path) -> str:
    return os.readlink(base / "current")


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_deploy_and_prune_never_delete_entries_they_did_not_create(tmp_path):
    package = make_package(tmp_path, files=3)
    container = sim_container(tmp_path)
    base = _base(container)
    dead = _dead_pid()
    theirs = {  # named like the old scratch files (".tmp-*", a dead pid at the end), or no release at all
        base / ".tmp-notes": "x", base / f".tmp-current-{dead}": "x", base / "releases" / f".tmp-data-{dead}": "x",
        base / "releases" / "my-backup" / "file": "x", base / "helpers" / f".tmp-keep-{dead}" / "f": "x",
        base / "releases" / f".tmp-release-{dead}-1-0123abcd" / "f": "scratch-shaped but not marked as ours",
    }
    for path, text in theirs.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for i in range(4):  # builds, switches and prunes down to --keep 1
        (package / "part0" / "mod0.py").write_text(f"VALUE = {i}\n")
        deploy_target(container, source=package, venv=NO_VENV, keep=1)
    for path, text in theirs.items():
        assert path.read_text() == text, path
    complete = [n for n in os.listdir(base / "releases") if (base / "releases" / n / ".dflash-release.json").exists()]
    assert complete == [_current(base).split("/")[1]]


def test_scratch_of_a_killed_deploy_is_removed_only_when_it_proves_it_is_ours(tmp_path):
    package = make_package(tmp_path, files=3)
    container = sim_container(tmp_path)
    base = _base(container)
    deploy_target(container, source=package, venv=NO_VENV)
    dead = _dead_pid()
    ours = base / "releases" / f".tmp-release-{dead}-12345-0123abcd"
    ours.mkdir()
    (ours / ".dflash-scratch").write_text(ours.name)
    (ours / "half-written.py").write_text("x")
    link = base / f".tmp-current-{dead}-12345-0123abcd"
    link.symlink_to("releases/whatever")
    (package / "part0" / "mod0.py").write_text("VALUE = 'next'\n")
    deploy_target(container, source=package, venv=NO_VENV)
    assert not ours.exists() and not os.path.lexists(link)


@pytest.fixture
def small_disk(tmp_path):
    """base_dir on a 3 MiB tmpfs (needs root; CI=true makes a missing capability a failure), mounted
    before the container is created: an LXC container sees it as a mount point of its own."""
    package = make_package(tmp_path, files=5)
    base = tmp_path / "simnode" / "ct200" / "opt" / "dflash"  # sim_container's base_dir
    base.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(base)], capture_output=True)
    if mounted.returncode != 0:
        unavailable(f"cannot mount a tmpfs: {mounted.stderr.decode().strip()}", "the full-disk test")
    container = sim_container(tmp_path)
    assert _base(container) == base
    yield container, package, base
    subprocess.run(["umount", "-l", str(base)], check=False)


def _used(base: Path) -> int:
    st = os.statvfs(base)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def test_a_full_disk_cleans_up_and_the_previous_release_keeps_serving(small_disk):
    container, package, base = small_disk
    first = deploy_target(container, source=package, venv=NO_VENV)
    used_before = _used(base)
    (package / "big.bin").write_bytes(os.urandom(4 << 20))  # more than the disk holds
    with pytest.raises(HelperFailed, match="No space left on device"):
        deploy_target(container, source=package, venv=NO_VENV)
    assert _current(base) == f"releases/{first.release}"
    assert (base / "current" / "trainer" / "part0" / "mod0.py").read_text() == "VALUE = 0\n"
    assert sorted(os.listdir(base / "releases")) == [first.release]  # no scratch left behind
    assert _used(base) <= used_before  # what it wrote is gone: the disk is not left full
    (package / "big.bin").unlink()
    (package / "part0" / "mod0.py").write_text("VALUE = 'after'\n")
    again = deploy_target(container, source=package, venv=NO_VENV)
    assert again.action == "build" and (base / "current" / "trainer" / "part0" / "mod0.py").read_text() == "VALUE = 'after'\n"


# ---------------------------------------------------------------- --extra paths


def test_a_fifo_under_extra_is_refused_instead_of_hanging(tmp_path):
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "ok.txt").write_text("ok")
    os.mkfifo(extra / "pipe")
    with pytest.raises(ReleasePathError, match="pipe.*not a regular file"):
        collect([extra], source=make_package(tmp_path))


def test_a_socket_under_extra_is_refused(tmp_path):
    extra = tmp_path / "extra"
    extra.mkdir()
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(extra / "sock"))
        with pytest.raises(ReleasePathError, match="not a regular file"):
            collect([extra], source=make_package(tmp_path))
    finally:
        sock.close()


def test_a_device_given_as_extra_is_refused(tmp_path):
    with pytest.raises(ReleasePathError, match="not a regular file"):
        collect(["/dev/zero"], source=make_package(tmp_path))


def test_a_symlink_under_extra_pointing_outside_is_refused(tmp_path):
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "passwd").symlink_to("/etc/passwd")
    with pytest.raises(ReleasePathError, match="points outside"):
        collect([extra], source=make_package(tmp_path))


def test_a_symlinked_directory_under_extra_is_refused_not_dropped(tmp_path):
    extra = tmp_path / "extra"
    (extra / "real").mkdir(parents=True)
    (extra / "real" / "f.txt").write_text("f")
    (extra / "alias").symlink_to("real")
    with pytest.raises(ReleasePathError, match="symlink to a directory"):
        collect([extra], source=make_package(tmp_path))


def test_a_symlink_inside_the_tree_ships_its_content(tmp_path):
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "real.txt").write_text("content")
    (extra / "alias.txt").symlink_to("real.txt")
    release = collect([extra], source=make_package(tmp_path))
    assert release.files["extra/alias.txt"].read_text() == "content"


def test_cli_deploy_with_a_fifo_extra_is_one_line(tmp_path):
    from typer.testing import CliRunner

    from dflash_ops.cli import app
    from tests.conftest import write_sim_inventory

    extra = tmp_path / "extra"
    extra.mkdir()
    os.mkfifo(extra / "pipe")
    result = CliRunner().invoke(app, ["deploy", "host200", "--no-venv", "--extra", str(extra),
                                      "--inventory", str(write_sim_inventory(tmp_path / "sim"))])
    assert result.exit_code == 1
    assert "not a regular file" in result.output and "Traceback" not in result.output


def test_extra_entries_keep_their_json_metadata(tmp_path):
    """Sanity: a normal --extra tree deploys whole."""
    package = make_package(tmp_path, files=2)
    extra = tmp_path / "extra"
    (extra / "sub").mkdir(parents=True)
    (extra / "sub" / "data.json").write_text(json.dumps({"a": 1}))
    container = sim_container(tmp_path)
    deploy_target(container, source=package, venv=NO_VENV, extra_paths=[extra])
    assert json.loads((_base(container) / "current" / "extra" / "sub" / "data.json").read_text()) == {"a": 1}
    shutil.rmtree(extra)
