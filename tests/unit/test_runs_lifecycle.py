"""Run lifecycle against the real `runs` helper and the fake trainer, through LocalHelperContainer."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from dflash_ops import runs
from dflash_ops.runs import GpusBusy, RunError, RunInfo, RunNotFound, RunRefused
from tests.procs import start_ticks
from tests.unit.runs_double import LocalHelperContainer, make_release

LONG = "total_steps: 1000000\nstep_seconds: 0.005\n"


def write_config(tmp_path: Path, text: str, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def start(container, tmp_path, text, **kwargs) -> str:
    return runs.start_run(container, write_config(tmp_path, text), **kwargs)


def test_start_detaches_and_list_reports_live_run(container, tmp_path):
    run_id = start(container, tmp_path, LONG + "dump_env: 1\n", name="exp1", gpus=[2, 3])
    assert run_id.startswith("exp1-")
    info = runs.run_status(container, run_id)
    assert info.alive and info.effective_state in ("starting", "running")
    assert info.release == "abc123"
    assert info.heartbeat_age is not None
    run_dir = container.base / "runs" / run_id
    assert (run_dir / "config.input.yaml").read_text() == LONG + "dump_env: 1\n"
    assert json.loads((run_dir / "launch.json").read_text())["gpus"] == [2, 3]
    seen = json.loads((run_dir / "env.json").read_text())
    assert seen["cwd"] == str((container.base / "releases" / "abc123").resolve())
    env = seen["env"]
    assert env["PATH"].split(":")[0] == os.path.dirname(sys.executable)
    assert env["PYTHONUNBUFFERED"] == "1"
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert "PYTEST_CURRENT_TEST" not in env  # the caller's environment is not inherited
    assert [r.run_id for r in runs.list_runs(container)] == [run_id]


def test_start_refuses_existing_run_and_busy_gpus(container, tmp_path):
    first = start(container, tmp_path, LONG, run_id="first", gpus=[0, 1])
    with pytest.raises(RunRefused, match="already exists"):
        start(container, tmp_path, LONG, run_id="first", gpus=[5])
    with pytest.raises(GpusBusy) as busy:
        start(container, tmp_path, LONG, run_id="second", gpus=[1, 2])
    assert "first" in str(busy.value) and "GPU 1" in str(busy.value)
    assert busy.value.details["conflicts"][0]["gpus"] == [1]
    assert not (container.base / "runs" / "second").exists()
    assert start(container, tmp_path, LONG, run_id="third", gpus=[2]) == "third"
    runs.stop_run(container, first, poll=0.05)
    assert start(container, tmp_path, LONG, run_id="fourth", gpus=[1]) == "fourth"


def test_start_reports_trainer_dying_before_status(container, tmp_path):
    with pytest.raises(RunError) as died:
        start(container, tmp_path, "exit_before_status: 1\n", run_id="bad")
    assert died.value.details["exit_code"] == 5
    assert "refusing to start" in died.value.details["log_tail"]
    assert "refusing to start" in str(died.value)  # the user sees why, not only an exit status
    assert "# dflash-ops start" not in str(died.value)
    info = runs.run_status(container, "bad")
    assert info.effective_state == "failed" and not info.has_status


def test_silent_death_is_reported_failed_with_log_tail(container, tmp_path):
    run_id = start(container, tmp_path, "total_steps: 100000\nvanish_at_step: 30\n", run_id="vanish")
    info = _wait(lambda: runs.run_status(container, run_id), lambda i: not i.alive)
    assert info.state == "running"
    assert info.effective_state == "failed"
    assert info.reason == "process died without saying so"
    assert "step 29 line 0" in info.log_tail


def test_trainer_crash_is_final_failed(container, tmp_path):
    run_id = start(container, tmp_path, "total_steps: 100\ncrash_at_step: 3\n", run_id="crash")
    info = runs.wait_until_final(container, run_id, poll=0.02)
    assert info.effective_state == "failed" and info.error["message"] == "fake crash at step 3"
    assert "RuntimeError" in info.log_tail


def test_checkpoint_request_stop_and_resume(container, tmp_path):
    run_id = start(container, tmp_path, "total_steps: 400\nstep_seconds: 0.005\nhold_at_step: 200\n", run_id="cycle")
    request_id = runs.request(container, run_id, "checkpoint")
    path = runs.wait_for_checkpoint(container, run_id, request_id, timeout=60, poll=0.02)
    assert path.startswith("checkpoints/step_")
    info = runs.stop_run(container, run_id, poll=0.02)
    assert info.effective_state == "stopped" and not info.alive
    assert info.last_checkpoint == f"checkpoints/step_{info.step}"
    assert info.checkpoints[-1] == info.step and int(path.split("_")[1]) in info.checkpoints
    stopped_at = info.step

    start(container, tmp_path, LONG, run_id="live")
    with pytest.raises(RunRefused, match="still running"):
        runs.resume_run(container, "live")
    runs.resume_run(container, run_id)
    done = runs.wait_until_final(container, run_id, poll=0.02)
    assert done.effective_state == "done" and done.step == 400
    events = [json.loads(l) for l in (container.base / "runs" / run_id / "metrics.jsonl").read_text().splitlines()]
    starts = [e for e in events if e["event"] == "start"]
    assert starts[1]["resumed_from"] == f"checkpoints/step_{stopped_at}"


def test_control_request_is_atomic_and_reused_while_pending(container, tmp_path):
    run_dir = container.base / "runs" / "idle"
    run_dir.mkdir(parents=True)
    first = runs.request(container, "idle", "checkpoint")
    again = runs.request(container, "idle", "checkpoint")
    assert first == again
    assert json.loads((run_dir / "control" / "checkpoint").read_text())["id"] == first
    assert os.listdir(run_dir / "control") == ["checkpoint"]
    with pytest.raises(RunNotFound):
        runs.request(container, "nosuchrun", "stop")


def test_signal_never_hits_a_reused_pid(container):
    run_dir = container.base / "runs" / "reused"
    run_dir.mkdir(parents=True)
    status = {"version": 1, "run_id": "reused", "state": "running", "pid": os.getpid(),
              "pid_start": start_ticks(os.getpid()) + 1}
    (run_dir / "status.json").write_text(json.dumps(status))
    assert runs.signal_run(container, "reused", "KILL") is False
    info = runs.run_status(container, "reused")
    assert not info.alive and info.effective_state == "failed"


def test_stop_kill_without_checkpoint(container, tmp_path):
    run_id = start(container, tmp_path, LONG, run_id="hung")
    info = runs.stop_run(container, run_id, kill=True, poll=0.02)
    assert info.effective_state == "failed" and info.checkpoints == []


def test_stop_now_is_sigterm_checkpoint_and_stopped(container, tmp_path):
    run_id = start(container, tmp_path, LONG, run_id="term")
    info = runs.stop_run(container, run_id, now=True, poll=0.02)
    assert info.effective_state == "stopped" and info.checkpoints == [info.step]
    events = [json.loads(l) for l in (container.base / "runs" / run_id / "metrics.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "stop" and events[-1]["reason"] == "signal"
    assert runs.stop_run(container, run_id).effective_state == "stopped"  # already final: nothing sent


def test_start_without_release_says_deploy_first(tmp_path):
    base = tmp_path / "empty"
    base.mkdir()
    with pytest.raises(runs.NotDeployed, match="run `dflash-ops deploy local` first"):
        start(LocalHelperContainer(base), tmp_path, LONG)


def test_generated_run_ids_never_collide(container, tmp_path):
    first = start(container, tmp_path, "total_steps: 1\n", name="same")
    second = start(container, tmp_path, "total_steps: 1\n", name="same")
    assert first != second and second.startswith("same-")


def test_latest_run_and_checkpoint_of_a_final_run(container, tmp_path):
    start(container, tmp_path, "total_steps: 2\n", run_id="older")
    time.sleep(0.01)
    start(container, tmp_path, "total_steps: 2\n", run_id="newer")
    assert runs.resolve_run(container, None).run_id == "newer"
    runs.wait_until_final(container, "newer", poll=0.02)
    with pytest.raises(RunError, match="only a live run can checkpoint"):
        runs.checkpoint_run(container, "newer")


def test_start_uses_the_release_venv_python(tmp_path):
    base = tmp_path / "venvbase"
    base.mkdir()
    root = make_release(base)
    venv_bin = base / "venvs" / "lock1" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").symlink_to(sys.executable)
    meta = json.loads((root / ".dflash-release.json").read_text())
    (root / ".dflash-release.json").write_text(json.dumps(dict(meta, venv="venvs/lock1")))
    c = LocalHelperContainer(base)
    run_id = start(c, tmp_path, "total_steps: 1\n", run_id="v")
    launch = json.loads((base / "runs" / run_id / "launch.json").read_text())
    assert launch["argv"][0] == str(venv_bin / "python")
    runs.wait_until_final(c, run_id, poll=0.02)


def test_run_status_of_missing_run(container):
    with pytest.raises(RunNotFound, match="no run 'ghost'"):
        runs.run_status(container, "ghost")


def test_runinfo_from_json_keeps_unknown_fields_raw():
    info = RunInfo.from_json('{"run_id": "r", "state": "done", "effective_state": "done", "future": 1}')
    assert info.final and info.raw["future"] == 1 and not hasattr(info, "future")


def test_pull_checkpoint_verifies_and_resumes(container, tmp_path):
    run_id = start(container, tmp_path, "total_steps: 7\ncheckpoint_bytes: 50000\n", run_id="pull")
    runs.wait_until_final(container, run_id, poll=0.02)
    remote = container.base / "runs" / run_id / "checkpoints" / "step_7"
    container.corrupt_pulls.add(str(remote / "state.bin"))
    dest = tmp_path / "local"
    got = runs.pull_checkpoint(container, run_id, "latest", dest)
    assert got == dest / "step_7"
    for rel in ("state.bin", "optim/adam.bin", "manifest.json"):
        assert (got / rel).read_bytes() == (remote / rel).read_bytes()
    assert not list(got.rglob(".*.part"))
    pulls = [c for c in container.calls if c[0] == "pull"]
    assert len(pulls) == 4  # state.bin twice (first copy corrupt), adam.bin and manifest once

    (got / "optim" / "adam.bin").write_bytes(b"half")  # a damaged local copy
    container.calls.clear()
    runs.pull_checkpoint(container, run_id, 7, dest)
    assert [c[1] for c in container.calls if c[0] == "pull"] == [str(remote / "optim" / "adam.bin"),
                                                                  str(remote / "manifest.json")]
    assert (got / "optim" / "adam.bin").read_bytes() == (remote / "optim" / "adam.bin").read_bytes()
    with pytest.raises(RunNotFound, match="has 7"):
        runs.pull_checkpoint(container, run_id, 3, dest)


def test_pull_reports_damaged_remote_checkpoint(container, tmp_path):
    run_id = start(container, tmp_path, "total_steps: 2\n", run_id="damaged")
    runs.wait_until_final(container, run_id, poll=0.02)
    (container.base / "runs" / run_id / "checkpoints" / "step_2" / "state.bin").write_bytes(b"rot")
    with pytest.raises(RunError, match="checkpoint itself is damaged"):
        runs.pull_checkpoint(container, run_id, "latest", tmp_path / "out")


def _wait(get, done, tries=2000):
    for _ in range(tries):
        value = get()
        if done(value):
            return value
        time.sleep(0.01)
    raise AssertionError(f"condition never met; last value {value!r}")


def test_a_done_run_resumes_only_from_an_explicit_step(container, tmp_path):
    run_id = start(container, tmp_path, "total_steps: 3\n", run_id="short")
    assert runs.wait_until_final(container, run_id, timeout=60, poll=0.02).effective_state == "done"
    with pytest.raises(runs.RunRefused, match="is done: nothing to resume"):
        runs.resume_run(container, run_id)
    assert runs.run_status(container, run_id).effective_state == "done"


def test_crash_reasons_the_supervisor_records():
    """What `run status` says a restart was for: a signal, a lost peer, the trainer's own error, an exit code."""
    from dflash_ops.helpers.run_supervise import crash_reason

    def status(message):
        return {"pid": 42, "state": "failed", "error": {"message": message, "thread": "main"}}

    assert crash_reason(-9, None, 42, None) == "killed by SIGKILL"
    assert crash_reason(-15, {"pid": 42, "state": "running"}, 42, None) == "killed by SIGTERM"
    assert crash_reason(1, status("[c10d] Connection reset by peer"), 42, None) == \
        "lost peer (exit 1): [c10d] Connection reset by peer"
    assert crash_reason(1, status("CUDA out of memory. Tried to allocate 2 GiB"), 42, None) == \
        "exit 1: CUDA out of memory. Tried to allocate 2 GiB"
    assert crash_reason(3, status("an older attempt's error"), 41, None) == "exit 3"  # not this trainer's status
