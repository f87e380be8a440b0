"""The node-side facts the helpers share (dflash_ops/helpers/nodefacts.py) and how they travel:
beside each helper that imports them, inside that helper's content hash."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import dflash_ops.helpers as helpers_pkg
from dflash_ops.helpers import bundle, helper_names, nodefacts, release_store
from tests.procs import start_ticks


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A process that runs until the test ends: a trainer whose pid a run directory names."""
    proc = subprocess.Popen(["sleep", "600"])
    yield proc
    proc.kill()
    proc.wait()


def dead_pid() -> tuple[int, int]:
    """(pid, start ticks) of a process that has exited and been reaped."""
    proc = subprocess.Popen(["sleep", "600"])
    ticks = start_ticks(proc.pid)
    proc.kill()
    proc.wait()
    return proc.pid, ticks


def write_run(run_dir: Path, status: dict | str | None = None, launch: dict | None = None) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    if status is not None:
        (run_dir / "status.json").write_text(status if isinstance(status, str) else json.dumps(status))
    if launch is not None:
        (run_dir / "launch.json").write_text(json.dumps(launch))
    return run_dir


def live(run_dir: Path) -> bool:
    return nodefacts.run_is_live(str(run_dir), nodefacts.read_json(str(run_dir / "status.json")))


def test_a_run_is_live_while_not_final_and_its_trainer_runs(tmp_path, sleeper):
    me = {"pid": sleeper.pid, "pid_start": start_ticks(sleeper.pid)}
    assert live(write_run(tmp_path / "running", {"state": "running", **me}))
    assert live(write_run(tmp_path / "no-start-time", {"state": "running", "pid": sleeper.pid}))
    # final: no more work, even while the process still tears down
    assert not live(write_run(tmp_path / "stopping", {"state": "stopped", **me}))
    # the pid now belongs to another process (another start time)
    assert not live(write_run(tmp_path / "reused", {"state": "running", "pid": sleeper.pid,
                                                    "pid_start": me["pid_start"] + 1}))
    pid, ticks = dead_pid()
    assert not live(write_run(tmp_path / "died", {"state": "running", "pid": pid, "pid_start": ticks}))


def test_between_two_attempts_the_supervisor_keeps_a_run_live(tmp_path, sleeper):
    """A run started with --restart: its trainer died, the supervisor (launch.json) restarts it."""
    pid, ticks = dead_pid()
    supervisor = {"pid": sleeper.pid, "pid_start": start_ticks(sleeper.pid)}
    run = write_run(tmp_path / "restarting", {"state": "running", "pid": pid, "pid_start": ticks},
                    launch={"pid": pid, "pid_start": ticks, "supervisor": supervisor})
    assert live(run) and nodefacts.live_pid(str(run), nodefacts.read_json(str(run / "status.json"))) == sleeper.pid
    gone = write_run(tmp_path / "gave-up", {"state": "running", "pid": pid, "pid_start": ticks},
                     launch={"pid": pid, "pid_start": ticks, "supervisor": {"pid": pid, "pid_start": ticks}})
    assert not live(gone)
    # a rank of a run across hosts (and a trainer that failed with an error) says `failed` before its
    # supervisor restarts it: still live (its GPUs and release stay held); stopped or done is over
    failed = write_run(tmp_path / "rank-failed", {"state": "failed", "pid": pid, "pid_start": ticks},
                       launch={"pid": pid, "pid_start": ticks, "supervisor": supervisor})
    assert live(failed)
    over = write_run(tmp_path / "rank-done", {"state": "done", "pid": pid, "pid_start": ticks},
                     launch={"pid": pid, "pid_start": ticks, "supervisor": supervisor})
    assert not live(over)


def test_before_status_json_launch_json_names_the_trainer(tmp_path, sleeper):
    """release_store counted every run without status.json as live, so a trainer that died before
    writing it kept its release from being pruned for good; the runs helper asked launch.json."""
    assert live(write_run(tmp_path / "starting", launch={"pid": sleeper.pid, "pid_start": start_ticks(sleeper.pid)}))
    assert live(write_run(tmp_path / "broken", "{half", launch={"pid": sleeper.pid}))
    pid, ticks = dead_pid()
    assert not live(write_run(tmp_path / "died-at-start", launch={"pid": pid, "pid_start": ticks}))
    assert not live(write_run(tmp_path / "nothing"))


def test_prune_keeps_the_release_of_a_starting_run_and_drops_one_that_died_at_start(tmp_path, sleeper):
    base = tmp_path / "base"
    pid, ticks = dead_pid()
    write_run(base / "runs" / "starting", launch={"pid": sleeper.pid, "pid_start": start_ticks(sleeper.pid)})
    write_run(base / "runs" / "died", launch={"pid": pid, "pid_start": ticks})
    (base / "runs" / "starting" / "release").write_text("aaa\n")
    (base / "runs" / "died" / "release").write_text("bbb\n")
    assert release_store.live_run_releases(str(base)) == {"aaa"}


def test_prune_waits_for_a_start_halfway_through(tmp_path):
    """A start writes the run's `release` before launch.json names its process; it holds the start
    lock meanwhile, and prune decides under the same lock."""
    base = tmp_path / "base"
    (base / "releases").mkdir(parents=True)
    lock = nodefacts.start_lock(str(base / "runs"))
    done = threading.Event()
    pruner = threading.Thread(target=lambda: (release_store.prune(str(base), 1), done.set()))
    pruner.start()
    try:
        assert not done.wait(0.5)
    finally:
        os.close(lock)
    pruner.join()
    assert done.is_set()


@pytest.mark.parametrize("text, gpus", [("0,1", [0, 1]), ("3,1", [1, 3]), ("", []), (None, [])])
def test_gpu_lists(text, gpus):
    assert nodefacts.parse_gpus(text) == gpus


@pytest.mark.parametrize("text", [",", "-1", "0,0", "a", "0,,1", "0 1", "1.5", "٣", "0, 0", "12345"])
def test_gpu_lists_refused(text):
    with pytest.raises(ValueError, match="--gpus"):
        nodefacts.parse_gpus(text)


def test_a_helper_ships_with_the_shared_modules_it_imports_and_its_hash_covers_them(tmp_path, monkeypatch):
    runs = bundle("runs")
    assert [name for name, _ in runs.files] == ["contract.py", "nodefacts.py", "notify.py", "run_protocol.py",
                                               "run_describe.py", "runqueue.py", "run_events.py", "run_follow.py", "venvs.py",
                                               "run_start.py", "run_queue.py", "run_supervise.py", "as_package.py",
                                               "runs.py"]  # depth first over the imports, each before what imports it
    assert [name for name, _ in bundle("gpu-sample").files] == ["gpu_sample.py"]
    assert "nodefacts" not in helper_names() and "runs" in helper_names()
    with pytest.raises(ValueError):
        bundle("nodefacts")  # shipped, never run

    copy = tmp_path / "helpers"
    shutil.copytree(helpers_pkg.HELPERS_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(helpers_pkg, "HELPERS_DIR", copy)
    assert bundle("runs").digest == runs.digest
    gpu_sample = bundle("gpu-sample").digest
    with (copy / "nodefacts.py").open("a") as f:
        f.write("\n# a change to the shared module\n")
    assert bundle("runs").digest != runs.digest  # a new version of each helper that imports it
    assert bundle("gpu-sample").digest == gpu_sample  # and of no other


def test_an_installed_bundle_runs_as_a_script_from_its_own_directory(tmp_path):
    one = bundle("runs")
    installed = tmp_path / one.rel().rpartition("/")[0]
    installed.mkdir(parents=True)
    for name, content in one.files:
        (installed / name).write_bytes(content)
    base = tmp_path / "base"
    write_run(base / "runs" / "r1", {"state": "done", "step": 3})
    done = subprocess.run([sys.executable, str(installed / "runs.py"), "list", str(base)], cwd=tmp_path,
                          capture_output=True, text=True, env={"PATH": os.environ["PATH"]})
    assert done.returncode == 0, done.stderr
    (run,) = json.loads(done.stdout)["runs"]
    assert run["run_id"] == "r1" and run["effective_state"] == "done" and run["alive"] is False


def test_a_helper_runs_in_place_from_the_package_with_the_trainers_contract(tmp_path):
    """Container.helpers_in_place: the script run from dflash_ops/helpers/ itself, whose contract.py is the
    trainer's (no copy beside it), from a directory where nothing puts this repository on the path."""
    base = tmp_path / "base"
    write_run(base / "runs" / "r1", {"state": "done", "step": 3})
    done = subprocess.run([sys.executable, str(helpers_pkg.HELPERS_DIR / "runs.py"), "list", str(base)], cwd=tmp_path,
                          capture_output=True, text=True, env={"PATH": os.environ["PATH"]})
    assert done.returncode == 0, done.stderr
    assert [run["run_id"] for run in json.loads(done.stdout)["runs"]] == ["r1"]
    assert not (helpers_pkg.HELPERS_DIR / "contract.py").exists()
