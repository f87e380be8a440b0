"""One venv schema: the `venv:` mapping (inventory.VenvConfig) and the venvs' layout on disk
(dflash_ops/helpers/venvs.py), read alike by every side, and by the previous release's helpers."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from dflash_ops.deploy.venv_spec import UV_MODES, VenvSpec
from dflash_ops.errors import UsageError
from dflash_ops.helpers import bundle, doctor, release_store, run_start, venvs
from dflash_ops.inventory import InventoryError, load_inventory
from dflash_ops.patching import rollout
from tests.unit.test_helpers_previous_release import previous_helpers

GOOD = """\
nodes:
  pve1: {transport: local, pct: simulated}
targets:
  host200:
    node: pve1
    ctid: 200
    base_dir: /opt/dflash
"""


# ---------------------------------------------------------------- the `venv:` mapping


@pytest.mark.parametrize("mapping, message", [
    ({"index": "no"}, "venv: index must be a valid boolean, got 'no'"),
    ({"wheelhous": "wheels"}, "venv: unknown key 'wheelhous' (did you mean 'wheelhouse'?)"),
    ({"uv": "fast"}, "venv: uv must be 'auto', 'always' or 'never', got 'fast'"),
])
def test_a_playbook_venv_mapping_is_checked_as_the_inventory_checks_it(tmp_path, mapping, message):
    """A deploy step's `venv:` (VenvSpec.from_config) once took index: "no" as true; now the
    inventory's schema decides for both, with the same words."""
    with pytest.raises(UsageError) as raised:
        VenvSpec.from_config(mapping)
    assert str(raised.value) == message
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(GOOD + f"    venv: {json.dumps(mapping)}\n")
    with pytest.raises(InventoryError) as loaded:
        load_inventory(inventory)
    assert str(loaded.value).endswith("target 'host200': " + message)


def test_a_venv_mapping_builds_the_spec_with_paths_from_the_base(tmp_path):
    spec = VenvSpec.from_config({"requirements": "req.txt", "system_site_packages": False, "uv": "never",
                                 "index": False}, base=tmp_path)
    assert spec == VenvSpec(requirements=tmp_path / "req.txt", system_site_packages=False, uv="never", index=False)
    assert VenvSpec.from_config(None) == VenvSpec()
    assert UV_MODES == ("auto", "always", "never")


# ---------------------------------------------------------------- the layout on disk


def test_every_side_reads_a_releases_venv_alike(tmp_path):
    """run start, doctor, patch rollouts and the release store name one python for one release
    manifest; the shapes releases were deployed with (a path, null, no key) read as before."""
    base = tmp_path / "base"
    (base / "venvs" / "abc" / "bin").mkdir(parents=True)
    (base / "venvs" / "abc" / "bin" / "python").write_text("")
    release = base / "current"
    release.mkdir()
    container = SimpleNamespace(base_dir=str(base), target=SimpleNamespace(python="python3"))
    for doc, expected in [({"venv": "venvs/abc"}, str(base / "venvs" / "abc" / "bin" / "python")),
                          ({"venv": None}, None), ({}, None), ({"venv": ""}, None), ({"venv": 3}, None)]:
        (release / ".dflash-release.json").write_text(json.dumps(dict(doc, hash="h")))
        assert venvs.release_python(str(base), doc) == expected
        assert run_start.release_python(str(base), str(release), "python3") == (expected or "python3")
        assert doctor.release_facts(str(base)).get("venv_python") == expected
        assert rollout.release_python(container, doc) == (expected or "python3")
    (tmp_path / "r.txt").write_text("torch\n")
    spec = VenvSpec(requirements=tmp_path / "r.txt")
    assert spec.rel_path() == venvs.rel_path(spec.lock_hash()) == f"venvs/{spec.lock_hash()}"


def _ensure(helpers_dir: Path, base: Path, lock: str) -> dict:
    """The venv helper of `helpers_dir` builds (or reuses) the venv of an empty requirements lock."""
    stream = io.BytesIO()
    with tarfile.open(fileobj=stream, mode="w") as tar:
        info = tarfile.TarInfo("requirements.txt")
        tar.addfile(info, io.BytesIO(b""))
    done = subprocess.run([sys.executable, str(helpers_dir / "venv.py"), "ensure", str(base), lock, "--uv", "never"],
                          input=stream.getvalue(), capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()
    return json.loads(done.stdout)


def _query(helpers_dir: Path, base: Path, venv: str) -> dict:
    done = subprocess.run([sys.executable, str(helpers_dir / "release_store.py"), "query", str(base), "--release", "x",
                           "--venv", venv], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _installed(name: str, into: Path) -> Path:
    found = bundle(name)
    into.mkdir(parents=True, exist_ok=True)
    for filename, content in found.files:
        (into / filename).write_bytes(content)
    return into


def test_a_venv_built_by_the_previous_release_is_reused_and_the_other_way_round(tmp_path):
    old = previous_helpers(tmp_path / "old")
    new = _installed("release-store", _installed("venv", tmp_path / "new"))
    base = tmp_path / "base"
    built = _ensure(old, base, "lock1")
    assert built["venv"] == venvs.rel_path("lock1") and built["built"] is True
    assert venvs.is_complete(str(base), built["venv"])
    assert _query(new, base, built["venv"])["venv_ready"] is True
    assert _ensure(new, base, "lock1")["built"] is False  # the old venv is this release's too
    ours = _ensure(new, base, "lock2")
    assert ours["built"] is True and _query(old, base, ours["venv"])["venv_ready"] is True
    assert _ensure(old, base, "lock2")["built"] is False
    meta = json.loads((base / ours["venv"] / venvs.META).read_text())
    old_meta = json.loads((base / built["venv"] / venvs.META).read_text())
    assert set(meta) == set(old_meta) and meta["lock"] == "lock2" and meta["version"] == old_meta["version"]
    assert release_store.cmd_query(SimpleNamespace(base=str(base), release="x", venv="venvs/none",
                                                   helper=[]))["venv_ready"] is False
