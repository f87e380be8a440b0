"""Run ids, pids, GPUs and control files that are hostile or left over (fake trainer, real helper)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash_ops import runs
from dflash_ops.cli import app
from dflash_ops.runs import GpusBusy, RunError, RunRefused
from dflash_ops.runs.lifecycle import parse_gpus
from tests.conftest import write_sim_inventory
from tests.procs import start_ticks
from tests.unit.runs_double import HELPERS, eventually

LONG = "total_steps: 1000000\nstep_seconds: 0.005\n"


@pytest.fixture
def bystander():
    """A process dflash-ops did not start (it must never be signalled)."""
    proc = subprocess.Popen(["sleep", "300"])
    yield proc
    proc.kill()
    proc.wait()


def _config(tmp_path, text=LONG) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("run_id", ["../x", "/etc", "..", ".hidden", "-rf", "a/b", "a\nb", "", "x" * 200])
def test_bad_run_ids_are_refused_before_any_path_join(container, run_id):
    for call in (lambda: runs.run_status(container, run_id), lambda: runs.signal_run(container, run_id, "KILL"),
                 lambda: runs.request(container, run_id, "stop"),
                 lambda: runs.follow_file(container, run_id, "train.log", lambda line: None)):
        with pytest.raises(RunError, match="bad run id"):
            call()
    assert container.calls == []  # nothing reached the container


@pytest.mark.parametrize("argv", [["logs", "host200", "../../etc"], ["run", "stop", "--kill", "host200", "../x"],
                                  ["run", "status", "host200", "/abs"], ["pull", "host200", "../x", "dest"]])
def test_cli_refuses_bad_run_ids_with_one_line(tmp_path, argv):
    result = CliRunner().invoke(app, [*argv, "--inventory", str(write_sim_inventory(tmp_path / "sim"))])
    assert result.exit_code == 1
    assert result.stderr.count("\n") == 1 and "bad run id" in result.stderr, result.stderr
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_helper_refuses_a_run_dir_outside_runs(tmp_path, bystander):
    planted = tmp_path / "elsewhere" / "x"
    planted.mkdir(parents=True)
    (planted / "launch.json").write_text(json.dumps({"pid": bystander.pid, "pid_start": start_ticks(bystander.pid),
                                                     "argv": ["sleep", "300"]}))
    done = subprocess.run([sys.executable, str(HELPERS / "runs.py"), "signal", str(planted), "KILL"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "not a run directory" in done.stderr
    assert bystander.poll() is None


@pytest.mark.parametrize("planted", ["status", "status+launch", "launch-other-argv"])
def test_a_planted_pid_is_never_signalled(container, bystander, planted):
    run_dir = container.base / "runs" / "planted"
    run_dir.mkdir(parents=True)
    doc = {"state": "running", "pid": bystander.pid, "pid_start": start_ticks(bystander.pid)}
    if "status" in planted:
        (run_dir / "status.json").write_text(json.dumps(doc))
    if "launch" in planted:  # right pid and start time, but not the command dflash-ops launched
        argv = [sys.executable, "-m", "trainer", "--run-dir", str(run_dir)]
        (run_dir / "launch.json").write_text(json.dumps(dict(doc, argv=argv)))
    assert runs.signal_run(container, "planted", "KILL") is False
    runs.stop_run(container, "planted", kill=True, wait=False)
    assert bystander.poll() is None


def test_the_launched_trainer_is_still_signalled(container, tmp_path):
    run_id = runs.start_run(container, _config(tmp_path), run_id="mine")
    assert runs.signal_run(container, run_id, "KILL") is True
    eventually(lambda: not runs.run_status(container, run_id).alive, "the trainer to die")


@pytest.mark.parametrize("content", ["[1, 2]", '"running"', "42", "null", "{torn"])
def test_a_status_json_that_is_not_an_object_marks_that_run_broken(container, tmp_path, content):
    (container.base / "runs" / "good").mkdir(parents=True)
    (container.base / "runs" / "good" / "status.json").write_text('{"state": "done", "step": 5}')
    (container.base / "runs" / "bad").mkdir(parents=True)
    (container.base / "runs" / "bad" / "status.json").write_text(content)
    listed = {r.run_id: r for r in runs.list_runs(container)}
    assert listed["good"].effective_state == "done" and listed["good"].step == 5
    assert listed["bad"].effective_state == "broken" and "status.json" in listed["bad"].reason


def test_run_list_cli_shows_the_other_runs_beside_a_broken_one(tmp_path):
    inventory = write_sim_inventory(tmp_path / "sim")
    runs_dir = tmp_path / "sim" / "ct200" / "opt" / "dflash" / "runs"
    for name, text in (("good", '{"state": "done", "step": 5}'), ("bad", "[1, 2]")):
        (runs_dir / name).mkdir(parents=True)
        (runs_dir / name / "status.json").write_text(text)
    result = CliRunner().invoke(app, ["run", "list", "host200", "--inventory", str(inventory)])
    assert result.exit_code == 0, result.output
    assert "good" in result.stdout and "done" in result.stdout
    assert "bad" in result.stdout and "broken" in result.stdout


@pytest.mark.parametrize("text", [",", "-1", "0,0", "a", "0,,1", "0 1", "1.5", "٣", "0, 0"])
def test_gpu_lists_that_are_not_distinct_indices_are_refused(text, tmp_path):
    with pytest.raises(RunError):
        parse_gpus(text)
    config = _config(tmp_path)
    result = CliRunner().invoke(app, ["run", "start", "host200", "--config", str(config), "--gpus", text,
                                      "--inventory", str(write_sim_inventory(tmp_path / "sim"))])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and "--gpus" in result.stderr


@pytest.mark.parametrize("text", [",", "-1", "0,0", "x", "0,"])
def test_helper_refuses_bad_gpu_lists(container, tmp_path, text):
    done = subprocess.run([sys.executable, str(HELPERS / "runs.py"), "start", "--base", str(container.base),
                           "--run-id", "g", "--config", str(_config(tmp_path)), "--release-root",
                           str(container.base / "current"), "--python", sys.executable, "--gpus", text],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "--gpus" in done.stderr
    assert not (container.base / "runs" / "g").exists()


def test_concurrent_starts_never_share_a_gpu(container, tmp_path):
    config = _config(tmp_path)
    outcomes: list[object] = []

    def one(i: int) -> None:
        try:
            outcomes.append(runs.start_run(container, config, run_id=f"race{i}", gpus=[0]))
        except GpusBusy as e:
            outcomes.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    started = [o for o in outcomes if isinstance(o, str)]
    assert len(outcomes) == 4 and len(started) == 1, outcomes


def test_a_stale_stop_request_does_not_stop_the_resumed_run(container, tmp_path):
    run_id = runs.start_run(container, _config(tmp_path), run_id="stale")
    runs.checkpoint_run(container, run_id, wait=True, timeout=60, poll=0.02)
    runs.signal_run(container, run_id, "KILL")
    eventually(lambda: not runs.run_status(container, run_id).alive, "the trainer to die")
    runs.request(container, run_id, "stop")  # the request the killed trainer never served
    control = container.base / "runs" / run_id / "control"
    assert (control / "stop").exists()
    runs.resume_run(container, run_id)
    first = runs.run_status(container, run_id).step or 0
    eventually(lambda: (runs.run_status(container, run_id).step or 0) > first + 20, "steps after the resume")
    info = runs.run_status(container, run_id)
    assert info.alive and info.effective_state == "running"
    assert not (control / "stop").exists() and [p.name.split("-")[0] for p in control.glob(".stop.stale-*")] == [
        ".stop.stale"]
    # a stop asked for after the resume is served as usual
    assert runs.stop_run(container, run_id, poll=0.02).effective_state == "stopped"


def test_resume_of_a_running_run_is_refused(container, tmp_path):
    run_id = runs.start_run(container, _config(tmp_path), run_id="busy")
    with pytest.raises(RunRefused, match="still running"):
        runs.resume_run(container, run_id, from_step=0)
    assert os.path.exists(container.base / "runs" / run_id / "launch.json")


# ---------------------------------------------------------------- pull: old complete state or new, never a mix


def _finished_run(container, tmp_path, run_id, steps=3, size=20000):
    runs.start_run(container, _config(tmp_path, f"total_steps: {steps}\ncheckpoint_bytes: {size}\n"), run_id=run_id)
    runs.wait_until_final(container, run_id, poll=0.02)
    return container.base / "runs" / run_id / "checkpoints" / f"step_{steps}"


def test_a_failed_pull_never_mixes_into_an_earlier_complete_pull(container, tmp_path):
    first = _finished_run(container, tmp_path, "one")
    dest = tmp_path / "dest"
    got = runs.pull_checkpoint(container, "one", "latest", dest)
    before = {p.relative_to(got): p.read_bytes() for p in got.rglob("*") if p.is_file()}
    _finished_run(container, tmp_path, "two", size=30000)  # same step number, another checkpoint
    with pytest.raises(RunError, match="holds something else"):
        runs.pull_checkpoint(container, "two", "latest", dest)
    assert {p.relative_to(got): p.read_bytes() for p in got.rglob("*") if p.is_file()} == before
    assert first.exists()


def test_a_failed_pull_leaves_no_step_dir_and_the_next_one_completes(container, tmp_path):
    remote = _finished_run(container, tmp_path, "flaky")
    good = (remote / "state.bin").read_bytes()
    (remote / "state.bin").write_bytes(b"rot")
    dest = tmp_path / "dest"
    with pytest.raises(RunError, match="damaged"):
        runs.pull_checkpoint(container, "flaky", "latest", dest)
    assert not (dest / "step_3").exists()  # nothing that looks complete
    (remote / "state.bin").write_bytes(good)
    got = runs.pull_checkpoint(container, "flaky", "latest", dest)
    assert (got / "state.bin").read_bytes() == good and (got / "manifest.json").exists()
    assert sorted(p.name for p in dest.iterdir()) == ["step_3"]


def test_pull_into_a_file_is_one_line(container, tmp_path):
    _finished_run(container, tmp_path, "f")
    afile = tmp_path / "afile"
    afile.write_text("mine")
    with pytest.raises(RunError, match="is a file, not a directory"):
        runs.pull_checkpoint(container, "f", "latest", afile)
    assert afile.read_text() == "mine"


def test_cli_pull_into_a_file_is_one_line(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("mine")
    result = CliRunner().invoke(app, ["pull", "host200", "somerun", str(afile),
                                      "--inventory", str(write_sim_inventory(tmp_path / "sim"))])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1 and "is a file" in result.stderr
