"""`python -m trainer export` never deletes what it did not write, and no checkpoint file runs code
(issue 26). The replace rule lives once, in trainer/run/destination.py: the trainer's export
applies it, and the operator's `tree` helper (push in the container, fetch here) uses the same file,
shipped beside the helper."""

import ast
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_ops.helpers import tree
from trainer.models.export import export_checkpoint
from trainer.run import checkpoint as ckpt
from trainer.run import destination

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def checkpoint(tiny, tmp_path):
    _, _, drafter, _ = tiny
    opt = torch.optim.AdamW(drafter.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    path, _ = ckpt.CheckpointManager(tmp_path / "run", 2).save(
        7, drafter.state_dict(), drafter.config.to_dict(), {"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, {})
    return Path(path)


def tree_of(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def export_cli(*args: str, cwd: Path | None = None, home: Path | None = None) -> subprocess.CompletedProcess:
    """`python -m trainer export ARGS` where `import torch` fails (runpy runs the same trainer/__main__.py
    that -m runs): a destination it may not replace is refused before torch is imported."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if home is not None:
        env["HOME"] = str(home)
    without_torch = "import runpy, sys; sys.modules['torch'] = None; runpy.run_module('trainer', run_name='__main__')"
    return subprocess.run([sys.executable, "-c", without_torch, "export", *args], capture_output=True, text=True,
                          cwd=cwd or REPO, env=env)


def test_export_never_deletes_what_it_did_not_write(checkpoint, tmp_path):
    models = tmp_path / "models"
    (models / "Qwen3-8B").mkdir(parents=True)
    (models / "Qwen3-8B" / "model.safetensors").write_bytes(b"the user's weights")
    for force in (False, True):
        with pytest.raises(destination.Refused, match=r"refusing to replace .*models: it holds 1 file "
                                                      r"\(Qwen3-8B/model.safetensors\), 18 bytes that no dflash-ops "
                                                      r"export wrote; move it away"):
            export_checkpoint(checkpoint, models, force=force)
    assert tree_of(models) == {"Qwen3-8B/model.safetensors": b"the user's weights"}
    out = export_checkpoint(checkpoint, tmp_path / "draft")
    first = tree_of(out)
    assert sorted(first) == ["config.json", "dflash2.py", "drafter.py", "layout.py", "model.safetensors", "modeling_dflash.py"]
    again = export_checkpoint(checkpoint, tmp_path / "draft")  # an earlier export: replaced
    assert tree_of(again) == first
    (out / "notes.md").write_text("mine")
    with pytest.raises(destination.Refused, match=r"holds 1 file \(notes.md\), 4 bytes that no export wrote"):
        export_checkpoint(checkpoint, tmp_path / "draft", force=True)
    assert (out / "notes.md").read_text() == "mine"


def test_force_replaces_an_earlier_fetch_but_nothing_else(checkpoint, tmp_path):
    fetched = tmp_path / "export"
    fetched.mkdir()
    (fetched / "config.json").write_text("{}")
    (tmp_path / ".export.dflash-fetch.json").write_text(json.dumps({"files": {"config.json": {}}}))
    with pytest.raises(destination.Refused, match=r"holds the output of an earlier fetch .*--force replaces it"):
        export_checkpoint(checkpoint, fetched)
    export_checkpoint(checkpoint, fetched, force=True)
    assert "model.safetensors" in tree_of(fetched)


def test_cli_out_dot_home_and_root_are_clean_errors(checkpoint, tmp_path, monkeypatch):
    work = tmp_path / "home" / "work"
    work.mkdir(parents=True)
    (work / "keep.txt").write_text("k")
    for out, why in ((".", "the working directory"), ("/", "the root directory")):  # the command line: exit 2
        done = export_cli("--checkpoint", str(checkpoint), "--out", out, cwd=work, home=tmp_path / "home")
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert done.stderr.startswith("export: refusing to replace ") and f"it is {why}" in done.stderr
        assert "--force" not in done.stderr
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(work)
    for out, why in (("~", "the home directory"), ("..", "the home directory"), (str(tmp_path), "an ancestor of")):
        with pytest.raises(destination.Refused, match=f"it is {why}"):
            export_checkpoint(checkpoint, out, force=True)
    assert (work / "keep.txt").read_text() == "k" and sorted(os.listdir(tmp_path / "home")) == ["work"]


class _Canary:
    """A pickle that creates a file when it is unpickled (what a hostile checkpoint would do)."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def _poison(checkpoint: Path, canary: Path) -> None:
    """Replace the optimizer and trainer state with code, and fix the manifest as an attacker would."""
    manifest = json.loads((checkpoint / ckpt.MANIFEST).read_text())
    for name in (ckpt.OPTIM_FILE, ckpt.STATE_FILE):
        torch.save({"state": _Canary(canary)}, checkpoint / name)
        data = (checkpoint / name).read_bytes()
        manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / ckpt.MANIFEST).write_text(json.dumps(manifest))


def test_no_checkpoint_file_runs_code(checkpoint, tmp_path):
    canary = tmp_path / "pwned"
    _poison(checkpoint, canary)
    export_checkpoint(checkpoint, tmp_path / "draft")  # reads only the weights and the drafter config
    assert not canary.exists()
    with pytest.raises(Exception, match="[Ww]eights only load failed|Unsupported global"):
        ckpt.load(checkpoint)
    assert not canary.exists()


def test_every_torch_load_is_weights_only_and_nothing_unpickles():
    """The principle over the code base, not only the known call sites."""
    offenders = []
    for root in ("trainer", "trainer_tools", "dflash_ops", "bench"):
        for path in sorted((REPO / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                    name = f"{getattr(node.func.value, 'id', '?')}.{node.func.attr}"
                    weights_only = [k for k in node.keywords if k.arg == "weights_only"]
                    if name == "torch.load" and not (weights_only and getattr(weights_only[0].value, "value", None) is True):
                        offenders.append(f"{path.relative_to(REPO)}:{node.lineno}: {name} without weights_only=True")
                    if name in ("pickle.load", "pickle.loads", "dill.load", "joblib.load"):
                        offenders.append(f"{path.relative_to(REPO)}:{node.lineno}: {name}")
    assert offenders == []


def test_the_operator_and_the_trainer_apply_one_rule(tmp_path, monkeypatch):
    """The tree helper (push, fetch) holds the trainer's rule itself, not a copy; what it refuses."""
    for name in ("replace_refusal", "protected_paths", "marker_path", "marker_files", "Refused", "SYSTEM_DIRS",
                 "SYSTEM_TREES", "OUTPUT_KINDS"):
        assert getattr(tree, name) is getattr(destination, name), name
    home, work = tmp_path / "home", tmp_path / "home" / "w"
    work.mkdir(parents=True)
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "a").write_text("a")
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    refused = {p: destination.replace_refusal(str(p), "export", own=None)
               for p in (Path("/"), Path("/usr/lib"), Path("/etc"), home, work, tmp_path, tmp_path / "theirs",
                         tmp_path / "empty", tmp_path / "absent")}
    assert refused.pop(tmp_path / "empty") is None and refused.pop(tmp_path / "absent") is None
    assert "holds 1 file (a)" in refused[tmp_path / "theirs"]
    assert all(refused.values()), refused


def test_the_tree_helper_ships_the_trainers_rule_and_runs_it_in_the_container(tmp_path):
    """The helper's bundle carries trainer/run/destination.py byte for byte (its hash covers it), and
    the helper run as a script from its installed directory refuses by that rule."""
    from dflash_ops.helpers import bundle

    tree_bundle = bundle("tree")
    files = dict(tree_bundle.files)
    assert files["destination.py"] == Path(destination.__file__).read_bytes()
    installed = tmp_path / "helpers"
    installed.mkdir()
    for name, content in tree_bundle.files:
        (installed / name).write_bytes(content)
    request = json.dumps({"kind": "tree", "files": {"a": {"size": 1, "sha256": "0" * 64}}})
    done = subprocess.run([sys.executable, str(installed / "tree.py"), "plan", str(tmp_path / "base"), "/etc"],
                          input=request, capture_output=True, text=True, cwd=tmp_path,
                          env={"PATH": os.environ["PATH"], "HOME": str(tmp_path)})
    assert done.returncode == tree.EXIT_REFUSED, done.stderr
    assert "/etc" in done.stdout + done.stderr


def test_a_model_directory_fixture_never_replaces_what_it_did_not_write(tmp_path):
    """trainer_tools' hub-format writer (bench/quality.py --out DIR writes DIR/model) follows the rule too."""
    from trainer_tools.fixtures.hub_model import write_hub_model

    mine = tmp_path / "model"
    mine.mkdir()
    (mine / "weights.bin").write_bytes(b"mine")
    with pytest.raises(destination.Refused, match=r"holds 1 file \(weights.bin\), 4 bytes that no dflash-ops "
                                                  r"hub-model wrote"):
        write_hub_model(mine, "qwen3")
    assert (mine / "weights.bin").read_bytes() == b"mine"


def test_an_export_removes_what_a_killed_export_left_and_nothing_else(checkpoint, tmp_path):
    """A killed export left `.NAME.tmp-PID` (a whole draft) beside its destination, forever."""
    import time

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    out = tmp_path / "draft"
    stale = tmp_path / f".draft.tmp-{dead_pid}"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"x" * 1000)
    aside = tmp_path / f".draft.old-{dead_pid}"  # the previous output moved aside: never removed here
    aside.mkdir()
    other = tmp_path / f".other.tmp-{dead_pid}"  # another destination's
    other.mkdir()
    live = subprocess.Popen(["sleep", "60"])
    try:
        time.sleep(0.05)
        writing = tmp_path / f".draft.tmp-{live.pid}"  # a live export's (written after it started)
        writing.mkdir()
        export_checkpoint(checkpoint, out)
        assert (out / "config.json").exists()
        assert not stale.exists() and aside.exists() and other.exists() and writing.exists()
    finally:
        live.kill()
        live.wait()
