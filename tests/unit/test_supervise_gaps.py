"""The --restart supervisor (helpers/run_supervise.py) run for real as `runs.py supervise`, with a
stand-in trainer that writes its status and crashes: the gaps between its states."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

RUNS = Path(__file__).resolve().parents[2] / "dflash_ops" / "helpers" / "runs.py"

# crashes at once, as a live-looking run (status `running`, its own pid), after counting itself
CRASHER = r"""
import json, os, sys
run = sys.argv[1]
with open(os.path.join(run, "attempts"), "a") as f:
    f.write("x")
json.dump({"pid": os.getpid(), "state": "running", "step": 1}, open(os.path.join(run, "status.json"), "w"))
if os.path.exists(os.path.join(run, "stop-me-after-crash")):
    open(os.path.join(run, "control", ".no-restart"), "w").write("{}")  # the stop lands in the gap
sys.exit(1)
"""



def run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "runs" / "r1"
    (run / "control").mkdir(parents=True)
    (run / "trainer.py").write_text(CRASHER)
    (run / "restarts.json").write_text(json.dumps({"policy": "on-failure:3", "max": 3, "restarts": []}))
    (run / "launch.json").write_text("{}")
    return run


def start(run: Path) -> subprocess.CompletedProcess:
    argv = [sys.executable, str(run / "trainer.py"), str(run)]
    plan = {"argv": argv, "max": 3, "restart_argv": argv, "fresh_argv": argv}
    return subprocess.run([sys.executable, str(RUNS), "supervise", str(run)], input=json.dumps(plan).encode(),
                          capture_output=True, timeout=120)


def test_a_stop_between_two_attempts_starts_no_new_attempt(tmp_path):
    run = run_dir(tmp_path)
    (run / "stop-me-after-crash").write_text("")
    # the stand-in leaves .no-restart as it dies: the supervisor finds it after the exit; make it
    # arrive only in the gap instead: after the exit check, before the next start
    (run / "trainer.py").write_text(CRASHER.replace(
        'open(os.path.join(run, "control", ".no-restart"), "w").write("{}")',
        'import subprocess; subprocess.Popen([sys.executable, "-c", "import time, sys; time.sleep(0.5); '
        'open(sys.argv[1], \'w\').write(\'{}\')", os.path.join(run, "control", ".no-restart")])'))
    done = start(run)
    assert done.returncode == 0, done.stderr
    assert (run / "attempts").read_text() == "x"  # no second attempt
    assert "an operator's stop arrived before restart 1: not restarted" in (run / "train.log").read_text()


def test_a_failed_write_of_its_own_ends_supervision_with_the_reason(tmp_path):
    """A real OSError from the real library: restarts.json's name taken by a directory (as root a
    read-only directory does not refuse; a full disk is the same errno-agnostic path)."""
    run = run_dir(tmp_path)
    done_once = run / "restarts.json"
    policy = done_once.read_text()
    done_once.unlink()
    (run / "restarts.json").mkdir()
    (run / "restarts.json" / "keep").write_text(policy)
    done = start(run)
    assert done.returncode == 75 and b"Traceback" not in done.stderr, done.stderr
    log = (run / "train.log").read_text()
    assert "supervision stopped, the run is not restarted" in log and "restarts.json" in log
    assert (run / "attempts").read_text() == "x"
    assert os.path.isdir(run / "restarts.json")


def _supervised_sleeper(run: Path) -> tuple[subprocess.Popen, int]:
    """A supervisor whose trainer sleeps (a live run), once the trainer has written its status."""
    import time

    from dflash_ops.helpers.nodefacts import process_start_ticks

    (run / "trainer.py").write_text(CRASHER.replace("sys.exit(1)", "import time; time.sleep(60)"))
    argv = [sys.executable, str(run / "trainer.py"), str(run)]
    sup = subprocess.Popen([sys.executable, str(RUNS), "supervise", str(run)], stdin=subprocess.PIPE)
    (run / "launch.json").write_text(json.dumps({"supervisor": {"pid": sup.pid, "pid_start": process_start_ticks(sup.pid)}}))
    assert sup.stdin is not None
    sup.stdin.write(json.dumps({"argv": argv, "max": 3, "restart_argv": argv, "fresh_argv": argv}).encode())
    sup.stdin.close()  # EOF: go
    for _ in range(600):
        launch = json.loads((run / "launch.json").read_text() or "{}")
        if launch.get("pid") and (run / "status.json").exists():
            return sup, launch["pid"]
        time.sleep(0.05)
    raise AssertionError("the trainer never started")


def test_a_supervisor_terminated_by_sigterm_says_so_and_run_status_tells(tmp_path):
    """SIGTERM (a `kill`, a service manager) used to end the supervisor without a word: the run
    read as "gone without a word (killed by a signal?)"."""
    import signal
    import time

    from dflash_ops.helpers.run_describe import describe_run
    from dflash_ops.runs.info import RunInfo

    run = run_dir(tmp_path)
    sup, trainer = _supervised_sleeper(run)
    try:
        sup.send_signal(signal.SIGTERM)
        assert sup.wait(timeout=60) == 128 + signal.SIGTERM
        assert "supervise: terminated by SIGTERM: supervision stopped" in (run / "train.log").read_text()
        stopped = json.loads((run / "restarts.json").read_text())["supervisor_stopped"]
        assert stopped["reason"] == "its supervisor was terminated by SIGTERM"
        info = RunInfo.from_json(describe_run(str(run), time.time()))
        assert info.unsupervised == "no longer supervised: its supervisor was terminated by SIGTERM"
        assert info.effective_state == "running"  # the trainer was left to its own signals
    finally:
        os.kill(trainer, signal.SIGKILL)


def test_a_supervisor_killed_by_a_signal_is_reported_by_run_status(tmp_path):
    import signal
    import time

    from dflash_ops.helpers.nodefacts import process_start_ticks
    from dflash_ops.helpers.run_describe import describe_run
    from dflash_ops.runs.info import RunInfo

    run = run_dir(tmp_path)
    (run / "trainer.py").write_text(CRASHER.replace("sys.exit(1)", "import time; time.sleep(60)"))
    argv = [sys.executable, str(run / "trainer.py"), str(run)]
    sup = subprocess.Popen([sys.executable, str(RUNS), "supervise", str(run)], stdin=subprocess.PIPE)
    (run / "launch.json").write_text(json.dumps({"supervisor": {"pid": sup.pid, "pid_start": process_start_ticks(sup.pid)}}))
    assert sup.stdin is not None
    sup.stdin.write(json.dumps({"argv": argv, "max": 3, "restart_argv": argv, "fresh_argv": argv}).encode())
    sup.stdin.close()  # EOF: go
    trainer = None
    for _ in range(600):
        launch = json.loads((run / "launch.json").read_text() or "{}")
        if launch.get("pid") and (run / "status.json").exists():
            trainer = launch["pid"]
            break
        time.sleep(0.05)
    assert trainer
    assert RunInfo.from_json(describe_run(str(run), time.time())).unsupervised is None
    sup.send_signal(signal.SIGKILL)
    sup.wait()
    try:
        info = RunInfo.from_json(describe_run(str(run), time.time()))
        from dflash_ops.runs.report import status_detail

        assert any(info.unsupervised in line for line in status_detail(info))  # the trainer still runs: said below the row
        assert info.unsupervised == f"no longer supervised: its supervisor (pid {sup.pid}) is gone without a word (killed by a signal?)"
    finally:
        os.kill(trainer, signal.SIGKILL)


def _crasher_then(run: Path, *helper_args: str) -> None:
    """The stand-in crashes once; a process it leaves waits for its exit, then (inside the
    supervisor's 1 s restart delay: no trainer to signal, launch.json still naming the dead one)
    runs `runs.py HELPER_ARGS`, as `run stop` does."""
    call = json.dumps([sys.executable, str(RUNS), *helper_args])
    waiter = ("import os, time, subprocess, json, sys\n"
              "while os.getppid() == int(sys.argv[2]): time.sleep(0.005)\n"
              "subprocess.run(json.loads(sys.argv[1]))\n")
    (run / "trainer.py").write_text(CRASHER.replace(
        'if os.path.exists(os.path.join(run, "stop-me-after-crash")):',
        'import subprocess; subprocess.Popen([sys.executable, "-c", %r, %r, str(os.getpid())])\nif False:'
        % (waiter, call)))


@pytest.mark.parametrize("how", [("signal", "TERM"), ("signal", "KILL"), ("control", "stop")])
def test_run_stop_in_any_form_between_two_attempts_is_served(tmp_path, how):
    """`run stop --now` / `--kill` between two attempts found no trainer to signal and recorded
    nothing: the supervisor restarted the run and it trained on (issue 55). The intent is recorded
    first; the supervisor reads it before the restart; the run reads `stopped`."""
    import time

    from dflash_ops.helpers.run_describe import describe_run

    run = run_dir(tmp_path)
    _crasher_then(run, how[0], str(run), how[1])
    done = start(run)
    assert done.returncode == 0, done.stderr
    for _ in range(200):  # the waiter's own call ends
        if (run / "control" / ".no-restart").exists():
            break
        time.sleep(0.05)
    intent = json.loads((run / "control" / ".no-restart").read_text())
    assert intent["signal"] == (how[1] if how[0] == "signal" else None)
    # in the gap (1 s): no second attempt; on a loaded machine the call may come after the restart,
    # whose attempt is then the last one (before: every restart was used, xxxx)
    assert len(json.loads((run / "restarts.json").read_text())["restarts"]) == 1
    assert (run / "attempts").read_text() in ("x", "xx")
    log = (run / "train.log").read_text()
    if "an operator's stop arrived before restart 1: not restarted" in log:
        info = describe_run(str(run), time.time())
        assert info["effective_state"] == "stopped" and not info["alive"]
    else:
        assert "after an operator's stop: not restarted" in log


def test_a_signal_that_read_the_last_attempts_record_reaches_the_next_attempt(tmp_path, monkeypatch):
    """The window after the supervisor's last stop check: it starts the next attempt while `run stop
    --now` reads launch.json still naming the dead trainer. The intent recorded first reaches the
    new attempt once it is recorded (the supervisor re-reads it), so the run stops instead of
    training on. The Popen of the supervisor is wrapped: the stop lands right after the spawn."""
    import io
    import subprocess as sp
    import time

    from dflash_ops.helpers import run_protocol, run_supervise

    run = run_dir(tmp_path)
    (run / "trainer.py").write_text(CRASHER.replace("sys.exit(1)", "import time; time.sleep(60)"))
    argv = [sys.executable, str(run / "trainer.py"), str(run)]
    real_popen = sp.Popen

    def popen_then_stop(*a, **k):
        child = real_popen(*a, **k)
        run_protocol.forbid_restarts(str(run), "SIGTERM sent by the operator", signal="TERM")  # the helper's record
        return child

    monkeypatch.setattr(sp, "Popen", popen_then_stop)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(json.dumps(
        {"argv": argv, "max": 3, "restart_argv": argv, "fresh_argv": argv}).encode())))
    began = time.monotonic()
    assert run_supervise._supervise(str(run), str(run / "train.log")) == 0
    assert time.monotonic() - began < 50  # the 60 s sleeper was signalled, not waited out
    log = (run / "train.log").read_text()
    assert "an operator's SIGTERM arrived while attempt pid" in log and "not restarted" in log
    attempts = run / "attempts"  # the one attempt may have died of the signal before counting itself
    assert not attempts.exists() or attempts.read_text() == "x"


# One member of a run across hosts: its launcher (the supervised child) writes status.json for its
# rank (another pid, started now), waits until every member's launcher is there (the group fails
# together: a rank's crash ends the others'), and exits 1.
GROUP_LAUNCHER = r"""
import json, os, subprocess, sys, time
run, shared, members = sys.argv[1], sys.argv[2], int(sys.argv[3])
with open(os.path.join(run, "attempts"), "a") as f:
    f.write("x")
rank = subprocess.Popen([sys.executable, "-c", "pass"]); rank.wait()  # the rank: gone with the group
json.dump({"pid": rank.pid, "state": "running", "step": 1, "started": time.time()},
          open(os.path.join(run, "status.json"), "w"))
attempt = len(open(os.path.join(run, "attempts")).read())
host = os.path.basename(os.path.dirname(os.path.dirname(run)))
open(os.path.join(shared, "%s-%d" % (host, attempt)), "w").close()
deadline = time.time() + 30  # bounded: a test that goes wrong ends
while len([n for n in os.listdir(shared) if n.endswith("-%d" % attempt)]) < members and time.time() < deadline:
    time.sleep(0.01)
STOP
sys.exit(1)
"""


@pytest.mark.parametrize("how", [("control", "stop"), ("signal", "TERM"), ("signal", "KILL")])
def test_a_group_stop_between_two_restart_attempts_is_served_on_every_member(tmp_path, how):
    """A group restart: every member's launcher fails, each supervisor records its restart and
    waits before the next attempt. A `run stop` sent then (to each member, as stop_group does: a
    stop request, or TERM / KILL with --now / --kill) found no trainer and was lost, and the group
    trained on (issue 55): each member records the intent first and its supervisor reads it before
    the restart; no member starts another attempt, and the group's first member tells `stopped`
    once (the others tell nothing)."""
    import time

    from dflash_ops.helpers.run_describe import describe_run

    shared = tmp_path / "barrier"
    shared.mkdir()
    told = tmp_path / "told.jsonl"
    runs = []
    for i in range(2):
        run = tmp_path / f"host{i}" / "runs" / "g1"
        (run / "control").mkdir(parents=True)
        (run / "restarts.json").write_text(json.dumps({"policy": "on-failure:3", "max": 3, "restarts": []}))
        (run / "launch.json").write_text(json.dumps({"time": time.time()}))
        (run / "group.json").write_text(json.dumps({"index": i, "size": 2}))
        runs.append(run)
    # the group's first member tells its events (a command here: it appends each to told.jsonl)
    append = "import sys; open(sys.argv[1], 'a').write(sys.stdin.read() + '\\n')"
    (runs[0] / "notify.json").write_text(json.dumps({"target": "host0", "webhooks": [],
                                                     "commands": [[sys.executable, "-c", append, str(told)]]}))
    # member 0's first launcher leaves a process that, once both launchers have exited (inside the
    # supervisors' 1 s wait before restart 1), sends the stop to every member
    calls = json.dumps([[sys.executable, str(RUNS), how[0], str(run), how[1]] for run in runs])
    waiter = ("import json, os, subprocess, sys, time\n"
              "while os.getppid() == int(sys.argv[2]): time.sleep(0.005)\n"
              "time.sleep(0.05)\n"
              "for call in json.loads(sys.argv[1]): subprocess.run(call)\n")
    stop = ("if os.path.basename(os.path.dirname(os.path.dirname(run))) == 'host0' and "
            "len(open(os.path.join(run, 'attempts')).read()) == 1:\n"
            "    subprocess.Popen([sys.executable, '-c', %r, %r, str(os.getpid())])" % (waiter, calls))
    for run in runs:
        (run / "trainer.py").write_text(GROUP_LAUNCHER.replace("STOP", stop))
    procs = []
    for i, run in enumerate(runs):
        argv = [sys.executable, str(run / "trainer.py"), str(run), str(shared), "2"]
        plan = {"argv": argv, "max": 3, "restart_argv": argv, "fresh_argv": argv, "group": {"index": i, "size": 2}}
        procs.append(subprocess.Popen([sys.executable, str(RUNS), "supervise", str(run)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        procs[-1].stdin.write(json.dumps(plan).encode())
        procs[-1].stdin.close()
    try:
        for p in procs:
            assert p.wait(timeout=120) == 0, p.stderr.read().decode()
    finally:
        for p in procs:  # what this test started ends with it
            if p.poll() is None:
                p.kill()
                p.wait()
    for run in runs:
        assert (run / "control" / ".no-restart").exists()
        log = (run / "train.log").read_text()
        # in the gap: no second attempt; on a loaded machine the stop may come after the restart,
        # whose attempt is then the last one (before: every restart was used, xxxx)
        assert (run / "attempts").read_text() in ("x", "xx"), log
        assert len(json.loads((run / "restarts.json").read_text())["restarts"]) == 1
        assert "an operator's stop arrived before restart 1" in log or "after an operator's stop" in log
        info = describe_run(str(run), time.time())
        assert info["effective_state"] == "stopped" and not info["alive"]
    for _ in range(400):  # the deliverer's command runs in its own process
        states = [json.loads(line)["state"] for line in told.read_text().splitlines()] if told.exists() else []
        if "stopped" in states:
            break
        time.sleep(0.05)
    assert states == ["started", "restart", "stopped"] or states == ["started", "restart", "stopped"][:len(states)]
    assert states.count("stopped") == 1
