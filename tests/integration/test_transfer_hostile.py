"""push / fetch under hostile and unlucky input (issue 26): nothing destroyed, nothing silently missing.

The replace rule (helpers/tree.py `replace_refusal`): never /, a system directory, the working or
home directory, the target's base_dir or an ancestor of one of them, with or without --force, and
a refusal never suggests the flag. Symlinks are read like `rsync -L`; modes travel; a push checks
free space first and a failed one leaves nothing staged; fetch takes any file name and any number.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash_ops.cli import app
from dflash_ops.errors import TransferError
from dflash_ops.transfer import TransferRefused, fetch_path, push_path
from tests.conftest import unavailable, write_sim_inventory
from tests.integration.deploy_support import sim_container, transfer_tier
from tests.integration.test_transfer import make_tree, tree_of

pytestmark = pytest.mark.lxc_tier

runner = CliRunner()


@pytest.fixture(params=["sim", pytest.param("sshd", marks=pytest.mark.sshd)])
def tier(request, tmp_path):
    yield from transfer_tier(request, tmp_path)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# ---------------------------------------------------------------- the replace rule


def test_push_force_never_replaces_the_base_dir_or_an_ancestor_of_it(tier, tmp_path):
    container, _, _ = tier
    base = Path(container.base_dir)
    checkpoint = make_tree(base / "runs" / "r1" / "checkpoints" / "step_5", {"model.pt": b"weights"})
    src = make_tree(tmp_path / "src", {"a.txt": b"a\n"})
    for dest in (base.parent, base.parent.parent):
        with pytest.raises(TransferRefused) as refused:
            push_path(container, src, str(dest), force=True)
        message = str(refused.value)
        assert f"refusing to replace {dest}: it is an ancestor of the target's base_dir" in message
        assert "--force" not in message and "dflash" in message  # says what it holds, never the flag
    assert tree_of(checkpoint) == {"model.pt": b"weights"}
    for dest, why in (("/usr", "a system directory"), ("/etc/ssh", "a system directory"),
                      ("/root", "a system directory")):
        with pytest.raises(TransferRefused, match=f"refusing to replace {dest}: it is {why}"):
            push_path(container, src, dest, force=True)


def test_cli_push_force_onto_an_ancestor_of_base_dir_is_refused(tmp_path):
    inventory = write_sim_inventory(tmp_path / "simnode")
    base = tmp_path / "simnode" / "ct200" / "opt" / "dflash"
    make_tree(base / "releases" / "abc", {"trainer/x.py": b"x = 1\n"})
    src = make_tree(tmp_path / "src", {"a.txt": b"a\n"})
    done = runner.invoke(app, ["push", "--inventory", str(inventory), "host200", str(src), str(base.parent), "--force"])
    assert done.exit_code == 1
    assert done.output.startswith(f"dflash-ops: error: push to host200: refusing to replace {base.parent}: it is an "
                                  f"ancestor of the target's base_dir")
    assert "--force" not in done.output and len(done.output.strip().splitlines()) == 1
    assert (base / "releases" / "abc" / "trainer" / "x.py").read_bytes() == b"x = 1\n"


def test_fetch_never_replaces_the_working_or_home_directory(tmp_path, monkeypatch):
    container = sim_container(tmp_path)
    remote = make_tree(Path(container.base_dir).parent / "data" / "export", {"config.json": b"{}\n"})
    work = make_tree(tmp_path / "home" / "project", {"notes.txt": b"mine\n"})
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(work)
    for dest, why in ((".", "the working directory"), ("..", "the home directory"), ("~", "the home directory"),
                      (str(tmp_path), "an ancestor of the working directory"), ("/", "the root directory")):
        with pytest.raises(TransferRefused, match="refusing to replace .*: it is " + why) as refused:
            fetch_path(container, str(remote), dest, force=True)
        assert "--force" not in str(refused.value)
    assert tree_of(work) == {"notes.txt": b"mine\n"}
    assert sorted(os.listdir(tmp_path / "home")) == ["project"], "nothing staged beside them either"


def test_cli_fetch_to_root_or_cwd_is_one_clean_line(tmp_path, monkeypatch):
    inventory = write_sim_inventory(tmp_path / "simnode")
    remote = make_tree(tmp_path / "simnode" / "ct200" / "opt" / "data", {"a.txt": b"a\n"})
    monkeypatch.chdir(make_tree(tmp_path / "work", {"keep.txt": b"k\n"}))
    for dest, why in (("/", "the root directory"), (".", "the working directory")):
        done = runner.invoke(app, ["fetch", "--inventory", str(inventory), "host200", str(remote), dest, "--force"])
        assert done.exit_code == 1 and done.exception is None or isinstance(done.exception, SystemExit)
        assert done.output.startswith("dflash-ops: error: refusing to replace ") and f"it is {why}" in done.output
        assert len(done.output.strip().splitlines()) == 1
    assert tree_of(tmp_path / "work") == {"keep.txt": b"k\n"}


def test_force_replaces_an_earlier_output_of_another_command_only(tmp_path):
    """--force lets a fetch replace an earlier export (its marker lists every file there), not more."""
    container = sim_container(tmp_path)
    remote = make_tree(Path(container.base_dir).parent / "data" / "export", {"model.safetensors": b"new"})
    out = make_tree(tmp_path / "out", {"model.safetensors": b"old", "config.json": b"{}"})
    (tmp_path / ".out.dflash-export.json").write_text(json.dumps({"files": ["config.json", "model.safetensors"]}))
    with pytest.raises(TransferRefused, match=r"holds the output of an earlier export .*--force replaces it"):
        fetch_path(container, str(remote), out)
    (out / "mine.txt").write_bytes(b"mine")
    with pytest.raises(TransferRefused, match=r"holds 1 file \(mine.txt\), 4 bytes that no fetch wrote"):
        fetch_path(container, str(remote), out, force=True)
    (out / "mine.txt").unlink()
    fetch_path(container, str(remote), out, force=True)
    assert tree_of(out) == {"model.safetensors": b"new"}


# ---------------------------------------------------------------- symlinks: carried as files or refused by name


def test_symlinked_files_and_directories_are_carried_as_files(tier, tmp_path):
    container, data, _ = tier
    src = make_tree(tmp_path / "model", {"blobs/aaa": b"shard one", "blobs/bbb": b"shard two", "config.json": b"{}"})
    (src / "model-1.safetensors").symlink_to("blobs/aaa")
    (src / "model-2.safetensors").symlink_to(src / "blobs" / "bbb")  # absolute, still inside the tree
    (src / "tokenizer").symlink_to("blobs")
    summary = push_path(container, src, str(data / "model"))
    pushed = tree_of(data / "model")
    assert pushed["model-1.safetensors"] == b"shard one" and pushed["model-2.safetensors"] == b"shard two"
    assert pushed["tokenizer/aaa"] == b"shard one" and summary.files == 7
    assert not any(p.is_symlink() for p in (data / "model").rglob("*"))
    # and back out: the container's links are read the same way
    (data / "model" / "alias.json").symlink_to("config.json")
    back = tmp_path / "back"
    fetch_path(container, str(data / "model"), back)
    assert (back / "alias.json").read_bytes() == b"{}" and not (back / "alias.json").is_symlink()


def test_links_that_leave_the_tree_or_dangle_are_refused_by_name(tier, tmp_path):
    container, data, _ = tier
    cache = make_tree(tmp_path / "hub" / "models--org--m", {"blobs/h1": b"{}", "blobs/h2": b"weights"})
    snapshot = cache / "snapshots" / "rev1"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").symlink_to("../../blobs/h1")  # a Hugging Face cache snapshot
    (snapshot / "model.safetensors").symlink_to("../../blobs/h2")
    with pytest.raises(TransferRefused, match=r"2 entries cannot be carried: config.json -> ../../blobs/h1 \(leaves "
                                              r"the tree\); model.safetensors -> ../../blobs/h2 \(leaves the tree\)"):
        push_path(container, snapshot, str(data / "m"))
    assert not (data / "m").exists() and not list(data.glob(".m*")) if data.exists() else True
    summary = push_path(container, cache, str(data / "cache"))  # the whole repo: every link stays inside
    assert tree_of(data / "cache")["snapshots/rev1/model.safetensors"] == b"weights" and summary.files == 4
    src = make_tree(tmp_path / "src", {"a.txt": b"a"})
    (src / "gone.bin").symlink_to("nowhere.bin")
    (src / "loop").symlink_to(".")
    with pytest.raises(TransferRefused, match=r"gone.bin -> nowhere.bin \(dangling or a loop\); loop \(a link back "
                                              r"into its own directory\)"):
        push_path(container, src, str(data / "src"))
    # the container side reads its trees the same way: a fetch names what it cannot carry
    remote = make_tree(data / "remote", {"a.txt": b"a"})
    (remote / "passwd").symlink_to("/etc/passwd")
    with pytest.raises(TransferRefused, match=r"passwd -> /etc/passwd \(leaves the tree\)"):
        fetch_path(container, str(remote), tmp_path / "fetched")
    assert not (tmp_path / "fetched").exists()


# ---------------------------------------------------------------- permission bits


def test_modes_travel_both_ways_and_private_stays_private(tier, tmp_path):
    container, data, _ = tier
    src = make_tree(tmp_path / "src", {"id_ed25519": b"secret", "run.sh": b"#!/bin/sh\n", "data.txt": b"d"})
    (src / "id_ed25519").chmod(0o600)
    (src / "run.sh").chmod(0o755)
    (src / "data.txt").chmod(0o640)
    dest = data / "tree"
    push_path(container, src, str(dest))
    assert {p.name: _mode(p) for p in dest.iterdir()} == {"id_ed25519": 0o600, "run.sh": 0o755, "data.txt": 0o640}
    (src / "run.sh").chmod(0o700)  # only a mode changed: not up to date, nothing to send
    again = push_path(container, src, str(dest))
    assert not again.up_to_date and again.bytes_sent == 0 and _mode(dest / "run.sh") == 0o700
    assert push_path(container, src, str(dest)).up_to_date
    single = tmp_path / "key"
    single.write_bytes(b"k")
    single.chmod(0o600)
    push_path(container, single, str(data / "key"))
    assert _mode(data / "key") == 0o600
    back = tmp_path / "back"
    fetch_path(container, str(dest), back)
    assert {p.name: _mode(p) for p in back.iterdir()} == {"id_ed25519": 0o600, "run.sh": 0o700, "data.txt": 0o640}
    (dest / "data.txt").chmod(0o600)
    assert not fetch_path(container, str(dest), back).up_to_date and _mode(back / "data.txt") == 0o600


# ---------------------------------------------------------------- free space, and nothing left staged


@pytest.fixture
def small_disk(tmp_path):
    """A 100 MiB tmpfs inside the container's data directory (needs root; CI=true: a failure),
    mounted before the container is created: an LXC container sees it as a mount point of its own."""
    disk = tmp_path / "simnode" / "ct200" / "opt" / "data" / "small"  # beside sim_container's base_dir
    disk.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=100m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        unavailable(f"cannot mount a tmpfs: {mounted.stderr.decode().strip()}", "the free-space test")
    container = sim_container(tmp_path)
    assert Path(container.base_dir).parent / "data" / "small" == disk
    yield container, disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def test_push_checks_free_space_first_and_a_failed_push_leaves_nothing_staged(small_disk, tmp_path):
    container, disk = small_disk
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        f.truncate(40 << 20)  # 40 MiB + the 64 MiB margin do not fit in 100 MiB
    with pytest.raises(TransferRefused, match=r"not enough space for this push: it needs 41.9 MB \(\+ 67.5 MB margin\)"
                                              r" at .*small, 104.9 MB is free there; nothing was sent"):
        push_path(container, big, f"{disk}/model/big.bin")
    assert os.listdir(disk) == []
    src = tmp_path / "w.bin"
    src.write_bytes(os.urandom(8 << 20))
    push_path(container, src, f"{disk}/w.bin")
    src.write_bytes(os.urandom(8 << 20))
    filler = disk / "someone-else.bin"

    def fill(done: int, total: int) -> None:  # another writer takes the space while the push streams
        if not filler.exists():
            st = os.statvfs(disk)
            with open(filler, "wb") as f:
                f.write(b"\0" * (st.f_bavail * st.f_frsize - (1 << 20)))

    with pytest.raises(TransferError, match="No space left on device"):
        push_path(container, src, f"{disk}/w.bin", on_progress=fill)
    assert sorted(os.listdir(disk)) == ["someone-else.bin", "w.bin"], "the stage was removed"
    filler.unlink()
    assert push_path(container, src, f"{disk}/w.bin").files_sent == 1
    assert (disk / "w.bin").read_bytes() == src.read_bytes()


# ---------------------------------------------------------------- fetch: any name, any number


def test_fetch_takes_names_that_are_not_utf8_and_many_long_paths(tier, tmp_path):
    container, data, _ = tier
    remote = data / "odd"
    make_tree(remote, {"plain.txt": b"p"})
    with open(os.path.join(os.fsencode(remote), b"caf\xe9.txt"), "wb") as f:
        f.write(b"latin-1 name")
    deep = "d" * 100 + "/" + "e" * 100
    make_tree(remote, {f"{deep}/{'f' * 40}{i:04d}.json": b"%d" % i for i in range(700)})  # > 128 KiB of names
    local = tmp_path / "odd"
    summary = fetch_path(container, str(remote), local)
    assert summary.files == 702
    assert open(os.path.join(os.fsencode(local), b"caf\xe9.txt"), "rb").read() == b"latin-1 name"
    assert (local / deep / f"{'f' * 40}0699.json").read_bytes() == b"699"
    assert fetch_path(container, str(remote), local).up_to_date


def test_a_private_directory_stays_private_both_ways(tier, tmp_path):
    """A 0644 file inside a 0700 directory is private: the directory's mode travels too."""
    container, data, _ = tier
    src = make_tree(tmp_path / "keys", {"ssh/id_ed25519": b"secret", "README": b"r"})
    (src / "ssh").chmod(0o700)
    src.chmod(0o750)
    dest = data / "keys"
    push_path(container, src, str(dest))
    assert (_mode(dest), _mode(dest / "ssh"), _mode(dest / "ssh" / "id_ed25519")) == (0o750, 0o700, 0o644)
    (src / "ssh").chmod(0o750)
    assert not push_path(container, src, str(dest)).up_to_date and _mode(dest / "ssh") == 0o750
    (dest / "ssh").chmod(0o700)
    back = tmp_path / "back"
    fetch_path(container, str(dest), back)
    assert (_mode(back), _mode(back / "ssh")) == (0o750, 0o700)


def test_a_push_that_fails_on_this_side_leaves_nothing_staged(tier, tmp_path):
    """A local file that shrinks while it is sent fails the push; what was staged is removed."""
    container, data, _ = tier
    src = make_tree(tmp_path / "src", {"big.bin": os.urandom(4 << 20), "a.txt": b"a"})

    def shrink(done: int, total: int) -> None:
        if done >= 1 << 20 and (src / "big.bin").stat().st_size > 100:
            with open(src / "big.bin", "r+b") as f:
                f.truncate(100)

    with pytest.raises(TransferError, match="shrank"):
        push_path(container, src, str(data / "model"), on_progress=shrink)
    assert not (data / "model").exists() and not list(data.glob(".model*"))

