"""deploy on the simulated node: releases, helpers, venvs, failures that leave nothing behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_ops.deploy.push import deploy_target
from dflash_ops.deploy.venv_spec import VenvSpec
from dflash_ops.errors import HelperFailed
from tests.containers import process_inside
from tests.integration.deploy_support import make_package, sim_container, sshd_container

pytestmark = pytest.mark.lxc_tier

NO_VENV = None


def releases(base: Path) -> list[str]:
    return sorted(p.name for p in (base / "releases").iterdir())


def current(base: Path) -> str:
    return os.readlink(base / "current")


@pytest.fixture
def env(tmp_path):
    """Simulated node only (tests that reach into the container's files in detail)."""
    package = make_package(tmp_path, files=20)
    container = sim_container(tmp_path)
    return container, package, Path(container.base_dir)


@pytest.fixture(params=["sim", pytest.param("sshd", marks=pytest.mark.sshd)])
def tier_env(request, tmp_path):
    """The same deploy on the simulated node and through a real sshd."""
    package = make_package(tmp_path, files=20)
    if request.param == "sim":
        container = sim_container(tmp_path)
    else:
        container = sshd_container(request.getfixturevalue("sshd_node"))
    yield container, package, Path(container.base_dir)
    container.transport.close()


def test_first_deploy_builds_release_and_current_then_sends_nothing(tier_env):
    container, package, base = tier_env
    first = deploy_target(container, source=package, venv=NO_VENV)
    assert first.action == "build" and first.files_sent == first.files_total == 22
    assert current(base) == f"releases/{first.release}"
    meta = json.loads((base / "current" / ".dflash-release.json").read_text())
    assert meta["hash"] == first.release and meta["parent"] is None
    assert (base / "current" / "trainer" / "part3" / "mod3.py").read_text() == "VALUE = 3\n"
    assert not (base / "current" / "trainer" / "__pycache__").exists()
    helpers = {p.name for p in (base / "helpers").glob("*/*.py")}
    assert {"release_store.py", "venv.py", "inspect_source.py"} <= helpers

    second = deploy_target(container, source=package, venv=NO_VENV)
    assert (second.action, second.files_sent, second.bytes_sent, second.helpers_sent) == ("none", 0, 0, 0)
    assert second.release == first.release and second.pct_calls <= 3


def test_changing_one_file_sends_only_it(tier_env):
    container, package, base = tier_env
    first = deploy_target(container, source=package, venv=NO_VENV)
    (package / "part4" / "mod4.py").write_text("VALUE = 'changed'\n")
    second = deploy_target(container, source=package, venv=NO_VENV)
    assert second.action == "build" and second.files_sent == 1 and second.previous == first.release
    assert second.pct_calls <= 3
    assert current(base) == f"releases/{second.release}"
    assert (base / "current" / "trainer" / "part4" / "mod4.py").read_text() == "VALUE = 'changed'\n"
    assert (base / "releases" / first.release / "trainer" / "part4" / "mod4.py").read_text() == "VALUE = 4\n"
    meta = json.loads((base / "current" / ".dflash-release.json").read_text())
    assert meta["parent"] == first.release and len(meta["files"]) == 22


def test_failure_before_swap_leaves_previous_release_and_next_deploy_cleans(tier_env, monkeypatch):
    container, package, base = tier_env
    first = deploy_target(container, source=package, venv=NO_VENV)
    (package / "part1" / "mod1.py").write_text("VALUE = 'new'\n")
    real_helper = container.helper

    def failing(name, args, **kw):
        if args[0] == "apply":
            args = [*args, "--fail-before-swap"]
        return real_helper(name, args, **kw)

    monkeypatch.setattr(container, "helper", failing)
    with pytest.raises(HelperFailed, match="injected failure"):
        deploy_target(container, source=package, venv=NO_VENV)
    assert current(base) == f"releases/{first.release}"
    monkeypatch.undo()
    # the failed attempt took back the release it built (never current); the retry builds it again
    assert sorted(os.listdir(base / "releases")) == [first.release]
    again = deploy_target(container, source=package, venv=NO_VENV)
    assert again.action == "build" and current(base) == f"releases/{again.release}"


def test_corrupt_parent_file_fails_verification_and_leaves_nothing(env):
    container, package, base = env
    first = deploy_target(container, source=package, venv=NO_VENV)
    target = base / "releases" / first.release / "trainer" / "part2" / "mod2.py"
    os.chmod(target, 0o644)
    target.write_text("tampered\n")  # an unchanged file the next release would reuse
    (package / "part1" / "mod1.py").write_text("VALUE = 'new'\n")
    with pytest.raises(HelperFailed, match="sha256 mismatch"):
        deploy_target(container, source=package, venv=NO_VENV)
    assert current(base) == f"releases/{first.release}"
    assert not [n for n in releases(base) if n.startswith(".tmp-")]  # the failed build removed its tree
    target.write_text("VALUE = 2\n")
    deploy_target(container, source=package, venv=NO_VENV)
    assert not [n for n in releases(base) if n.startswith(".tmp-")]


def test_sigkill_mid_stream_leaves_previous_release_serving(tmp_path):
    """A real SIGKILL of a deploy subprocess while its tar is streaming."""
    package = make_package(tmp_path, files=10)
    big = package / "blob.bin"
    big.write_bytes(os.urandom(1024))
    container = sim_container(tmp_path)
    base = Path(container.base_dir)
    first = deploy_target(container, source=package, venv=NO_VENV)
    big.write_bytes(os.urandom(96 << 20))  # large enough that the stream is still running when killed
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.deploy_support", "deploy", str(tmp_path), str(package)],
        env={**os.environ, "PYTHONPATH": str(repo)}, stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout.readline() == b"streaming\n"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert current(base) == f"releases/{first.release}"
    assert [n for n in releases(base) if not n.startswith(".")] == [first.release]
    big.write_bytes(b"small again")
    after = deploy_target(container, source=package, venv=NO_VENV)
    assert after.action == "build" and not [n for n in releases(base) if n.startswith(".tmp-")]


def test_prune_keeps_n_and_never_the_live_runs_release(env):
    container, package, base = env
    hashes = []
    with process_inside(container) as trainer:  # the live run's process: a pid in the container
        for i in range(4):
            (package / "part0" / "mod0.py").write_text(f"VALUE = {i}\n")
            hashes.append(deploy_target(container, source=package, venv=NO_VENV, keep=2).release)
            if i == 0:
                run = base / "runs" / "r1"
                run.mkdir(parents=True)
                (run / "release").write_text(hashes[0] + "\n")
                (run / "status.json").write_text(json.dumps({"state": "running", "pid": trainer}))
        assert releases(base) == sorted([hashes[0], hashes[2], hashes[3]])
        (base / "runs" / "r1" / "status.json").write_text(json.dumps({"state": "done", "pid": trainer}))
    (package / "part0" / "mod0.py").write_text("VALUE = 'last'\n")
    last = deploy_target(container, source=package, venv=NO_VENV, keep=2).release
    assert releases(base) == sorted([hashes[3], last])


def test_dry_run_changes_nothing(tier_env):
    container, package, base = tier_env
    first = deploy_target(container, source=package, venv=NO_VENV)
    (package / "part1" / "mod1.py").write_text("VALUE = 'new'\n")
    before = sorted(str(p) for p in base.rglob("*") if "helpers" not in p.parts)
    plan = deploy_target(container, source=package, venv=VenvSpec(), dry_run=True)
    assert plan.dry_run and plan.action == "build" and plan.files_sent == 1 and plan.venv_action == "build"
    assert sorted(str(p) for p in base.rglob("*") if "helpers" not in p.parts) == before
    assert current(base) == f"releases/{first.release}"


def test_venv_built_once_per_lock_and_reused(env):
    container, package, base = env
    spec = VenvSpec(requirements=package / "requirements.txt")
    first = deploy_target(container, source=package, venv=spec)  # pyyaml: the parent venv has it, no pip
    assert first.venv_action == "built" and (base / first.venv / ".dflash-venv.json").exists()
    meta = json.loads((base / "current" / ".dflash-release.json").read_text())
    assert meta["venv"] == first.venv
    python = base / first.venv / "bin" / "python"
    probe = subprocess.run([str(python), "-c", "import yaml, sys; print(sys.prefix)"], capture_output=True, text=True)
    assert probe.returncode == 0 and probe.stdout.strip() == str(base / first.venv)
    (package / "part1" / "mod1.py").write_text("VALUE = 'new'\n")
    second = deploy_target(container, source=package, venv=spec)
    assert second.venv_action == "reused" and second.venv == first.venv
    assert [p.name for p in (base / "venvs").iterdir()] == [first.venv.split("/")[1]]


def test_failed_pip_leaves_no_venv_and_keeps_current(env):
    container, package, base = env
    first = deploy_target(container, source=package, venv=NO_VENV)
    (package / "requirements.txt").write_text("dflash-no-such-package==9.9\n")
    with pytest.raises(HelperFailed, match="venv"):
        deploy_target(container, source=package, venv=VenvSpec(requirements=package / "requirements.txt", index=False, uv="never"))
    assert current(base) == f"releases/{first.release}"
    assert list((base / "venvs").iterdir()) == []


def test_removed_file_is_absent_from_the_next_release(env):
    container, package, base = env
    deploy_target(container, source=package, venv=NO_VENV)
    (package / "part5" / "mod5.py").unlink()
    second = deploy_target(container, source=package, venv=NO_VENV)
    assert second.action == "build" and second.files_sent == 0
    assert not (base / "current" / "trainer" / "part5" / "mod5.py").exists()
    assert (base / "current" / "trainer" / "part6" / "mod6.py").exists()
    meta = json.loads((base / "current" / ".dflash-release.json").read_text())
    assert "trainer/part5/mod5.py" not in meta["files"] and meta["hash"] == second.release


def test_prune_killed_mid_removal_never_leaves_a_partial_release_that_counts_as_complete(env, monkeypatch):
    """A kill while prune deletes an old release must not leave `releases/<hash>` half-gone
    with its manifest still there: a later deploy of that hash would switch to it."""
    from dflash_ops.helpers import release_store as release_helper

    container, package, base = env
    old = deploy_target(container, source=package, venv=NO_VENV).release
    (package / "part0" / "mod0.py").write_text("VALUE = 'new'\n")
    deploy_target(container, source=package, venv=NO_VENV)
    real_rmtree = shutil.rmtree

    def killed_after_one_file(path, *args, **kwargs):
        victim = next(p for p in sorted(Path(path).rglob("*.py")))
        victim.unlink()
        raise KeyboardInterrupt("killed mid-prune")

    monkeypatch.setattr(release_helper.shutil, "rmtree", killed_after_one_file)
    with pytest.raises(KeyboardInterrupt):
        release_helper.prune(str(base), 1)
    monkeypatch.setattr(release_helper.shutil, "rmtree", real_rmtree)

    (package / "part0" / "mod0.py").write_text("VALUE = 0\n")
    again = deploy_target(container, source=package, venv=NO_VENV)
    assert again.release == old and again.action == "build"
    assert sorted(p.relative_to(base / "current").as_posix() for p in (base / "current").rglob("*.py")) == sorted(
        rel for rel in json.loads((base / "current" / ".dflash-release.json").read_text())["files"] if rel.endswith(".py"))
