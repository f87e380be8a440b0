"""push / fetch of files and trees on the simulated node and through a real sshd (dropped connections too)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash_ops import transfer
from dflash_ops.cli import app
from dflash_ops.errors import ConnectionLost, TransferError
from dflash_ops.helpers import tree as tree_helper
from dflash_ops.inventory import load_inventory
from dflash_ops.transfer import TransferRefused, fetch_path, push_path
from tests.integration.deploy_support import sim_container, transfer_tier

pytestmark = pytest.mark.lxc_tier


@pytest.fixture(params=["sim", pytest.param("sshd", marks=pytest.mark.sshd)])
def tier(request, tmp_path):
    yield from transfer_tier(request, tmp_path)


def make_tree(root: Path, files: dict[str, bytes]) -> Path:
    for rel, content in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(content)
    return root


def tree_of(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


MODEL = {"config.json": b'{"model_type": "qwen3"}\n', "model-00001-of-00002.safetensors": os.urandom(300_000),
         "model-00002-of-00002.safetensors": os.urandom(200_000), "tokenizer/tokenizer.json": b"{}\n"}


def test_push_a_tree_then_only_what_changed(tier, tmp_path):
    container, data, _ = tier
    src = make_tree(tmp_path / "model", MODEL)
    dest = f"{data}/models/tiny"
    first = push_path(container, src, dest)
    assert (first.files, first.files_sent, first.bytes_sent) == (4, 4, first.bytes_total)
    assert tree_of(Path(dest)) == MODEL
    again = push_path(container, src, dest)
    assert again.up_to_date and again.bytes_sent == 0
    (src / "config.json").write_bytes(b'{"model_type": "qwen3", "changed": 1}\n')
    (src / "tokenizer" / "tokenizer.json").unlink()
    (src / "generation_config.json").write_bytes(b"{}\n")
    third = push_path(container, src, dest)
    assert third.files_sent == 2
    assert third.bytes_sent == len(b'{"model_type": "qwen3", "changed": 1}\n') + 3
    assert tree_of(Path(dest)) == tree_of(src)
    assert not list(Path(dest).parent.glob(".tiny*")), "no staging left behind"


def test_push_a_single_file(tier, tmp_path):
    container, data, _ = tier
    src = tmp_path / "prompts.jsonl"
    src.write_bytes(b'{"prompt": "hi"}\n' * 1000)
    dest = f"{data}/prompts.jsonl"
    assert push_path(container, src, dest).bytes_sent == src.stat().st_size
    assert Path(dest).read_bytes() == src.read_bytes()
    assert push_path(container, src, dest).up_to_date
    src.write_bytes(b'{"prompt": "bye"}\n')
    push_path(container, src, dest)
    assert Path(dest).read_bytes() == b'{"prompt": "bye"}\n'


def test_push_never_replaces_what_it_did_not_write(tier, tmp_path):
    container, data, _ = tier
    theirs = make_tree(data / "theirs", {"keep.txt": b"user data\n"})
    src = make_tree(tmp_path / "src", {"a.txt": b"a\n"})
    for force in (False, True):  # --force never replaces files no command wrote
        with pytest.raises(TransferRefused, match=r"it holds 1 file \(keep.txt\), 10 bytes that no dflash-ops push "
                                                  r"wrote; move it away or choose another destination$"):
            push_path(container, src, str(theirs), force=force)
    assert tree_of(theirs) == {"keep.txt": b"user data\n"}
    dest = data / "ours"
    push_path(container, src, str(dest))
    (dest / "regen.jsonl").write_bytes(b"written in the container later\n")
    for force in (False, True):
        with pytest.raises(TransferRefused, match=r"holds 1 file \(regen.jsonl\), 31 bytes that no push wrote and "
                                                  r"that would be lost; move it away"):
            push_path(container, src, str(dest), force=force)
    assert (dest / "regen.jsonl").exists()
    (dest / "regen.jsonl").unlink()
    (src / "b.txt").write_bytes(b"b\n")
    push_path(container, src, str(dest))
    assert tree_of(dest) == {"a.txt": b"a\n", "b.txt": b"b\n"}
    (theirs / "keep.txt").unlink()  # an empty directory may be replaced
    push_path(container, src, str(theirs))
    assert tree_of(theirs) == tree_of(src)


@pytest.mark.parametrize("dest, message", [
    ("/data/../etc", "may not contain '..'"),
    ("data/../../etc", "may not contain '..'"),  # a relative path is under base_dir, and stays there
    ("releases/x", "dflash-ops' own state"),
    ("/", "refusing container path"),
    ("{base}/releases/x", "dflash-ops' own state"),
    ("{base}", "dflash-ops' own state"),
])
def test_push_destinations_are_validated(tmp_path, dest, message):
    container = sim_container(tmp_path)
    src = make_tree(tmp_path / "src", {"a": b"a"})
    with pytest.raises(TransferRefused, match=message):
        push_path(container, src, dest.format(base=container.base_dir))


class DropAfter:
    """A progress callback that breaks the stream once after `limit` bytes (the sim tier's dropped
    connection: stdin ends early, as when sshd loses the client) or kills the sshd sessions."""

    def __init__(self, limit: int, node=None):
        self.limit, self.node, self.fired, self.totals = limit, node, False, []

    def __call__(self, done: int, total: int) -> None:
        self.totals.append((done, total))
        if not self.fired and done >= self.limit:
            self.fired = True
            if self.node is None:
                raise ConnectionLost("simulated drop")
            self.node.kill_sessions()


def test_a_dropped_push_leaves_the_old_tree_and_resumes(tier, tmp_path, monkeypatch):
    container, data, node = tier
    big = os.urandom(6 << 20)
    src = make_tree(tmp_path / "src", {"small.txt": b"v1\n", "weights.bin": big})
    dest = data / "model"
    push_path(container, src, str(dest))
    new_big = os.urandom(6 << 20)
    make_tree(src, {"small.txt": b"v2\n", "weights.bin": new_big})
    monkeypatch.setattr(transfer, "RESUME_ATTEMPTS", 0)
    with pytest.raises(TransferError, match="run the same push again to resume"):
        push_path(container, src, str(dest), on_progress=DropAfter(3 << 20, node))
    assert tree_of(dest) == {"small.txt": b"v1\n", "weights.bin": big}, "the old tree, complete"
    stage = dest.parent / ".model.dflash-push"
    os.close(tree_helper.lock_stage(str(stage)))  # the dropped receive may still be writing what was in flight
    staged = (stage / "tree" / "weights.bin.part").stat().st_size
    assert 0 < staged < len(new_big), "the connection dropped inside the file"
    monkeypatch.setattr(transfer, "RESUME_ATTEMPTS", 3)
    resumed = push_path(container, src, str(dest))
    assert tree_of(dest) == {"small.txt": b"v2\n", "weights.bin": new_big}
    assert resumed.bytes_sent == len(new_big) - staged, "only the rest of the file was sent"
    assert resumed.files_sent == 1, "small.txt had arrived whole before the drop"


def test_the_plan_waits_for_a_dropped_receive_still_writing_its_part(tmp_path):
    """sshd may hand a receive what was in flight after the client is gone: the resume's plan reads
    the .part once that receive lets go of the stage, so its offset is what was finally kept."""
    src = make_tree(tmp_path / "src", {"weights.bin": os.urandom(1 << 20)})
    request = tree_helper.manifest(str(src))
    dest = str(tmp_path / "data" / "model")
    os.makedirs(os.path.dirname(dest))
    stage = tree_helper.stage_dir(dest)
    part = Path(tree_helper.staged_path(stage, "weights.bin") + ".part")
    held = tree_helper.lock_stage(stage)
    part.parent.mkdir(parents=True)
    part.write_bytes(b"x" * 1000)
    planned: list[dict] = []
    planner = threading.Thread(target=lambda: planned.append(tree_helper.plan(str(tmp_path / "base"), dest, request)))
    planner.start()
    planner.join(0.5)
    assert not planned, "the plan read the stage while a receive held it"
    with open(part, "ab") as f:
        f.write(b"x" * 500)
    os.close(held)
    planner.join(30)
    assert planned[0]["steps"] == {"weights.bin": 1500}


def test_a_push_resumes_by_itself_after_a_drop(tier, tmp_path):
    container, data, node = tier
    src = make_tree(tmp_path / "src", {"weights.bin": os.urandom(6 << 20)})
    drop = DropAfter(3 << 20, node)
    summary = push_path(container, src, str(data / "model"), on_progress=drop)
    assert summary.resumed == 1 and drop.fired
    assert tree_of(data / "model") == tree_of(src)


def test_fetch_a_tree_and_a_file_incrementally(tier, tmp_path):
    container, data, _ = tier
    remote = make_tree(data / "export", {"config.json": b"{}\n", "model.safetensors": os.urandom(100_000),
                                         "code/dflash.py": b"x = 1\n"})
    local = tmp_path / "out" / "export"
    first = fetch_path(container, str(remote), local, chunk=32 << 10)
    assert tree_of(local) == tree_of(remote) and first.files_sent == 3
    assert fetch_path(container, str(remote), local).up_to_date
    (remote / "config.json").write_bytes(b'{"v": 2}\n')
    (remote / "code" / "dflash.py").unlink()
    second = fetch_path(container, str(remote), local)
    assert second.files_sent == 1 and second.bytes_sent == len(b'{"v": 2}\n')
    assert tree_of(local) == tree_of(remote)
    one = fetch_path(container, str(remote / "config.json"), tmp_path / "config.json")
    assert one.kind == "file" and (tmp_path / "config.json").read_bytes() == b'{"v": 2}\n'


def test_a_dropped_fetch_resumes(tier, tmp_path, monkeypatch):
    container, data, node = tier
    content = os.urandom(1 << 20)
    remote = make_tree(data / "regen", {"regen.jsonl": content})
    local = tmp_path / "regen"
    monkeypatch.setattr(transfer, "RESUME_ATTEMPTS", 0)
    drop = DropAfter(256 << 10, None)
    if node is not None:  # sshd: the connection dies while the next chunk is on its way
        drop = DropAfter(256 << 10, type("Later", (), {"kill_sessions": staticmethod(lambda: None)})())
        real_helper = container.helper

        def helper(name, args, **kwargs):
            if args[0] == "read" and drop.fired and not getattr(helper, "killed", False):
                helper.killed = True
                ask = kwargs["stdin"]

                def killed_before_the_question():  # the read runs, waiting for its path: the connection dies
                    assert node.kill_sessions()   # (killed at its first output line, it had sometimes answered)
                    yield ask

                kwargs["stdin"] = killed_before_the_question()
            return real_helper(name, args, **kwargs)

        monkeypatch.setattr(container, "helper", helper)
    with pytest.raises((TransferError, ConnectionLost)):
        fetch_path(container, str(remote), local, chunk=64 << 10, on_progress=drop)
    assert not local.exists(), "nothing at DEST until the copy is complete"
    monkeypatch.setattr(transfer, "RESUME_ATTEMPTS", 3)
    resumed = fetch_path(container, str(remote), local, chunk=64 << 10)
    assert tree_of(local) == {"regen.jsonl": content}
    assert 0 < resumed.bytes_sent < len(content)


def test_an_interrupted_fetch_leaves_the_old_copy_whole(tmp_path):
    """Never a mix: a fetch cut off in the middle (dropped, Ctrl-C) leaves the previous fetch's
    files exactly; the next fetch completes the new state, sending only what is missing."""
    container = sim_container(tmp_path)
    remote = make_tree(Path(container.base_dir).parent / "data" / "export",
                       {"config.json": b"v1\n", "model.safetensors": os.urandom(1 << 20)})
    local = tmp_path / "export"
    fetch_path(container, str(remote), local)
    old = tree_of(local)
    new = {"config.json": b"v2\n", "model.safetensors": os.urandom(1 << 20)}
    make_tree(remote, new)
    with pytest.raises(ConnectionLost):
        fetch_path(container, str(remote), local, chunk=64 << 10, on_progress=DropAfter(512 << 10))
    assert tree_of(local) == old
    resumed = fetch_path(container, str(remote), local, chunk=64 << 10)
    assert tree_of(local) == new
    assert 0 < resumed.bytes_sent < (1 << 20), "the staged part of the big file was kept"


def test_fetch_never_replaces_what_it_did_not_write(tier, tmp_path):
    container, data, _ = tier
    remote = make_tree(data / "export", {"a": b"a"})
    mine = make_tree(tmp_path / "mine", {"notes.txt": b"mine\n"})
    for force in (False, True):
        with pytest.raises(TransferRefused, match=r"holds 1 file \(notes.txt\), 5 bytes that no dflash-ops fetch wrote"):
            fetch_path(container, str(remote), mine, force=force)
    assert tree_of(mine) == {"notes.txt": b"mine\n"}
    ours = tmp_path / "ours"
    fetch_path(container, str(remote), ours)
    assert tree_of(ours) == {"a": b"a"}
    (ours / "added.txt").write_bytes(b"later\n")
    with pytest.raises(TransferRefused, match=r"holds 1 file \(added.txt\), 6 bytes that no fetch wrote"):
        fetch_path(container, str(remote), ours, force=True)
    with pytest.raises(TransferRefused, match="no such file or directory"):
        fetch_path(container, str(data / "missing"), tmp_path / "x")


def test_cli_push_and_fetch(tmp_path):
    from tests.conftest import write_sim_inventory

    inventory = write_sim_inventory(tmp_path / "simnode")
    data = tmp_path / "simnode" / "ct200" / "data"
    src = make_tree(tmp_path / "src", {"a.txt": b"a\n", "b/c.txt": b"c\n"})
    runner = CliRunner()
    pushed = runner.invoke(app, ["push", "--inventory", str(inventory), "host200", str(src), f"{data}/tree"])
    assert pushed.exit_code == 0, pushed.output
    assert f"{data}/tree: 2 files" in pushed.stdout and "sha256 verified" in pushed.stdout
    again = runner.invoke(app, ["push", "--inventory", str(inventory), "host200", str(src), f"{data}/tree", "--json"])
    assert json.loads(again.stdout)["up_to_date"] is True
    fetched = runner.invoke(app, ["fetch", "--inventory", str(inventory), "host200", f"{data}/tree", str(tmp_path / "back")])
    assert fetched.exit_code == 0, fetched.output
    assert tree_of(tmp_path / "back") == tree_of(src)
    assert "received 2 (" in fetched.stdout and "sent" not in fetched.stdout  # it said "sent" for what it received
    assert "sent 2 (" in pushed.stdout
    # a relative container path is under the target's base_dir (the same place on either backend)
    base = Path(load_inventory(inventory).target("host200").base_dir)
    relative = runner.invoke(app, ["push", "--inventory", str(inventory), "host200", str(src), "data/tree"])
    assert relative.exit_code == 0, relative.output
    assert relative.stdout.startswith(f"{base}/data/tree: 2 files") and tree_of(base / "data" / "tree") == tree_of(src)
    back = runner.invoke(app, ["fetch", "--inventory", str(inventory), "host200", "data/tree", str(tmp_path / "back2")])
    assert back.exit_code == 0, back.output
    assert tree_of(tmp_path / "back2") == tree_of(src)
