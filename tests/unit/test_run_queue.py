"""The run queue and run events, against the real `runs` helper, its queue worker and deliverer and
the fake trainer (LocalHelperContainer): three runs on one GPU start one after another, a kill -9
of the worker loses none, `run stop` takes one out, and a webhook on 127.0.0.1 that answers 500
twice first gets exactly one event per transition."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from dflash_ops import runs
from dflash_ops.helpers import nodefacts, runqueue
from dflash_ops.runs.lifecycle import queued_runs
from tests.http_sink import HttpSink
from tests.procs import alive
from tests.unit.runs_double import released_container

SHORT = "total_steps: 40\nstep_seconds: 0.02\n"
LONG = "total_steps: 1000000\nstep_seconds: 0.005\n"
# How often a wait looks again: each look is a `runs.py` helper process (~0.07 CPU-s), so at 20 looks
# a second the waiting cost more CPU than the runs waited for (the file: 29.5 CPU-s, at this 20.3)
POLL_S = 0.25


def kill_recorded(path: Path) -> None:
    """SIGKILL the process a worker.json names, if it is still that process."""
    doc = json.loads(path.read_text()) if path.exists() else {}
    if doc.get("pid") and nodefacts.process_matches(doc["pid"], doc.get("pid_start")):
        os.kill(doc["pid"], signal.SIGKILL)


@pytest.fixture
def container(tmp_path):
    with released_container(tmp_path) as c:
        c.target.gpus = [0]
        yield c
        for entry in runqueue.entries(c.base_dir):
            runqueue.remove(c.base_dir, entry["run_id"])
        kill_recorded(c.base / "runs" / ".queue" / "worker.json")
        for worker in (c.base / "runs" / ".notify" / "queues").glob("*/worker.json"):  # a delivery worker per destination
            kill_recorded(worker)
        for run in sorted((c.base / "runs").iterdir()):  # a run a test left going (a blocker it never stopped)
            if run.is_dir() and not run.name.startswith(".") and runs.run_status(c, run.name).alive:
                runs.stop_run(c, run.name, poll=POLL_S)


def start(container, tmp_path, text, run_id, **kwargs) -> str:
    config = tmp_path / f"{run_id}.yaml"
    config.write_text(text)
    return runs.start_run(container, config, run_id=run_id, **kwargs)


def wait(get, done, seconds=60.0):
    deadline = time.monotonic() + seconds
    while True:
        value = get()
        if done(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition never met in {seconds}s; last value {value!r}")
        time.sleep(POLL_S)


def launched_at(container, run_id) -> float:
    return json.loads((container.base / "runs" / run_id / "launch.json").read_text())["time"]


def ended_at(container, run_id) -> float:
    """The last heartbeat of a final run: its process ends right after."""
    return json.loads((container.base / "runs" / run_id / "status.json").read_text())["heartbeat"]


def test_three_runs_on_one_gpu_start_one_after_another(container, tmp_path):
    assert start(container, tmp_path, LONG, "q1", queue=True) == "q1"  # its GPU is free: it starts at once
    assert start(container, tmp_path, SHORT, "q2", queue=True) == "q2"
    assert start(container, tmp_path, SHORT, "q3", queue=True) == "q3"
    line = queued_runs(container)
    assert [(r.run_id, r.position) for r in line] == [("q2", 1), ("q3", 2)]
    assert any("q1" in why and "GPU 0" in why for why in line[0].waits_for)
    assert line[1].waits_for[-1] == "q2 is queued before it for GPU 0"
    status = runs.run_status(container, "q3")
    assert status.effective_state == "queued" and status.position == 2 and status.release is not None
    runs.stop_run(container, "q1", poll=POLL_S)
    for run_id in ("q1", "q2", "q3"):
        wait(lambda run_id=run_id: runs.run_status(container, run_id), lambda i: i.final and not i.alive)
    for before, after in (("q1", "q2"), ("q2", "q3")):
        gap = launched_at(container, after) - ended_at(container, before)
        assert 0 <= gap <= 10, f"{after} started {gap:.1f}s after {before} ended"
    assert [r.effective_state for r in runs.list_runs(container)] == ["stopped", "done", "done"]
    assert (container.base / "runs" / "q3" / "config.input.yaml").read_text() == SHORT


def test_a_queued_run_keeps_its_config_and_release(container, tmp_path):
    start(container, tmp_path, LONG, "blocker")
    start(container, tmp_path, SHORT + "log_lines: 2\n", "later", queue=True)
    (tmp_path / "later.yaml").write_text("total_steps: 1\n")  # the local file changes after queueing
    new = container.base / "releases" / "def456"
    os.symlink(container.base / "releases" / "abc123", new)  # a deploy switches current meanwhile
    (container.base / "current").unlink()
    (container.base / "current").symlink_to("releases/def456")
    runs.stop_run(container, "blocker", poll=POLL_S)
    info = wait(lambda: runs.run_status(container, "later"), lambda i: i.final and not i.alive)
    assert info.release == "abc123" and info.step == 40
    assert (container.base / "runs" / "later" / "config.input.yaml").read_text() == SHORT + "log_lines: 2\n"


def test_kill_9_of_the_queue_worker_loses_no_queued_run(container, tmp_path):
    start(container, tmp_path, LONG, "blocker")
    start(container, tmp_path, SHORT, "w1", queue=True)
    start(container, tmp_path, SHORT, "w2", queue=True)
    worker = container.base / "runs" / ".queue" / "worker.json"
    pid = wait(lambda: json.loads(worker.read_text())["pid"] if worker.exists() else None, bool, 10)
    os.kill(pid, signal.SIGKILL)
    wait(lambda: alive(pid), lambda a: not a, 10)
    assert [r.run_id for r in queued_runs(container)] == ["w1", "w2"]  # and that list started a new worker
    new_pid = wait(lambda: json.loads(worker.read_text())["pid"], lambda p: p != pid, 10)
    assert alive(new_pid)
    runs.stop_run(container, "blocker", poll=POLL_S)
    for run_id in ("w1", "w2"):
        assert wait(lambda run_id=run_id: runs.run_status(container, run_id),
                    lambda i: i.final and not i.alive).effective_state == "done"


def test_stop_of_a_queued_run_takes_it_out_of_the_queue(container, tmp_path):
    start(container, tmp_path, LONG, "blocker")
    start(container, tmp_path, SHORT, "gone", queue=True)
    start(container, tmp_path, SHORT, "kept", queue=True)
    info = runs.stop_run(container, "gone", poll=POLL_S)
    assert info.effective_state == "stopped" and "removed from the queue" in (info.reason or "")
    assert [(r.run_id, r.position) for r in queued_runs(container)] == [("kept", 1)]
    with pytest.raises(runs.RunNotFound):
        runs.run_status(container, "gone")
    with pytest.raises(runs.RunRefused, match="already exists"):
        start(container, tmp_path, SHORT, "kept", queue=True)
    runs.stop_run(container, "blocker", poll=POLL_S)
    wait(lambda: runs.run_status(container, "kept"), lambda i: i.final and not i.alive)
    assert not (container.base / "runs" / "gone").exists()


@pytest.fixture
def sink():
    s = HttpSink()
    yield s
    s.close()


def events_of(sink: HttpSink, run_id: str) -> list[str]:
    return [e["state"] for e in sink.delivered() if e["run_id"] == run_id]


def test_a_webhook_that_answers_500_twice_gets_one_event_per_transition(container, tmp_path, sink):
    sink.fail_first = [500, 500]
    spec = {"target": "local", "webhooks": [sink.url()], "commands": []}
    start(container, tmp_path, LONG, "blocker", notify=spec)
    # the two 500s go to the blocker's first event (its delivery retries before the next run exists)
    wait(lambda: events_of(sink, "blocker"), lambda e: e == ["started"], 30)
    start(container, tmp_path, SHORT, "next", queue=True, notify=spec)
    wait(lambda: events_of(sink, "next"), lambda e: e == ["queued"], 30)
    runs.stop_run(container, "blocker", poll=POLL_S)
    wait(lambda: runs.run_status(container, "next"), lambda i: i.final and not i.alive)
    wait(lambda: events_of(sink, "next"), lambda e: e == ["queued", "started", "done"], 30)
    wait(lambda: events_of(sink, "blocker"), lambda e: e == ["started", "stopped"], 30)
    assert [r.answered for r in sink.received[:3]] == [500, 500, 200]
    keys = [e["id"] for e in sink.delivered()]
    assert len(keys) == len(set(keys)) == 5  # one key per transition, the retried one sent under its own key
    assert len({r.headers["Idempotency-Key"] for r in sink.received}) == 5
    done = [e for e in sink.delivered() if e["state"] == "done"][0]
    assert done["step"] == 40 and done["target"] == "local"
    # the failed attempts are events of the run whose event they were, without the URL's secret
    metrics = (container.base / "runs" / "blocker" / "metrics.jsonl").read_text()
    failed = [json.loads(line) for line in metrics.splitlines() if '"notify_failed"' in line]
    assert [f["attempt"] for f in failed] == [1, 2] and "s3cret" not in metrics
    for run_id in ("blocker", "next"):
        launch = (container.base / "runs" / run_id / "launch.json").read_text()
        assert "s3cret" not in launch and "s3cret" not in (container.base / "runs" / run_id / "train.log").read_text()


def test_a_crash_sends_restart_then_failed_with_the_reason_and_log_tail(container, tmp_path, sink):
    spec = {"target": "local", "webhooks": [sink.url()], "commands": []}
    start(container, tmp_path, "total_steps: 100\ncrash_at_step: 5\n", "crashy", restart="on-failure:1", notify=spec)
    wait(lambda: events_of(sink, "crashy"), lambda e: e[-1:] == ["failed"], 60)
    assert events_of(sink, "crashy") == ["started", "restart", "failed"]
    failed = sink.delivered()[-1]
    assert failed["reason"] and "no restart left" in failed["reason"]
    assert failed["log_tail"] and failed["step"] == 5


def test_checkpoint_events_only_when_asked_one_per_checkpoint_written(container, tmp_path, sink):
    spec = {"target": "local", "webhooks": [sink.url()], "commands": [], "checkpoints": True}
    start(container, tmp_path, "total_steps: 30\nstep_seconds: 0.01\ncheckpoint_every: 10\n", "saver", notify=spec)
    wait(lambda: events_of(sink, "saver"), lambda e: e[-1:] == ["done"], 60)
    written = [json.loads(line) for line in (container.base / "runs" / "saver" / "metrics.jsonl").read_text().splitlines()]
    written = [e for e in written if e.get("event") == "checkpoint"]
    told = [e for e in sink.delivered() if e["run_id"] == "saver" and e["state"] == "checkpoint"]
    assert len(written) >= 3 and [e["step"] for e in told] == [e["step"] for e in written]
    assert told[0]["reason"] == f"{written[0]['path']} written"
    assert events_of(sink, "saver") == ["started", *["checkpoint"] * len(written), "done"]


def test_a_queued_entry_whose_gpus_disagree_with_its_start_arguments_is_dropped_not_retried(container, tmp_path, sink):
    """entry.json waits for GPU 1 while its start arguments say --gpus 0 (held): the worker found
    GPU 1 free, its start was refused as busy, and it retried many times a second forever, holding
    the queue behind it; a stop of it hung (issue 55). It is dropped once, as failed, naming both."""
    spec = {"target": "local", "webhooks": [sink.url()], "commands": []}
    start(container, tmp_path, LONG, "blocker")
    start(container, tmp_path, SHORT, "odd", queue=True, notify=spec)
    start(container, tmp_path, SHORT, "behind", queue=True)
    entry = Path(runqueue.find(container.base_dir, "odd")["path"]) / runqueue.ENTRY
    doc = json.loads(entry.read_text())
    entry.write_text(json.dumps(dict(doc, gpus=[1])))  # hand-edited, or written by another version
    wait(lambda: [r.run_id for r in queued_runs(container)], lambda ids: ids == ["behind"], 30)
    log = (container.base / "runs" / ".queue" / runqueue.WORKER_LOG).read_text()
    assert log.count("odd not started: entry.json waits for GPU 1 but its start arguments name --gpus 0") == 1
    wait(lambda: events_of(sink, "odd"), lambda e: e[-1:] == ["failed"], 30)
    assert "waits for GPU 1 but its start arguments name --gpus 0" in sink.delivered()[-1]["reason"]
    runs.stop_run(container, "blocker", poll=POLL_S)  # the run behind it was not held up
    assert wait(lambda: runs.run_status(container, "behind"), lambda i: i.final and not i.alive).effective_state == "done"


def test_a_busy_answer_is_looked_at_again_after_a_pause_not_at_once(tmp_path):
    """serve() retried a start refused as busy without sleeping: a tight loop."""
    base = str(tmp_path)
    runqueue.add(base, "r1", [0], ["--gpus", "0", "--run-id", "r1"], b"x: 1\n")
    order: list[str] = []

    def start_busy(entry, path):
        order.append("start")
        assert order.count("start") < 10, "retried without a pause"
        return "busy"

    def sleep(_s):
        order.append("sleep")
        if order.count("sleep") == 3:
            runqueue.remove(base, "r1")  # back in line (unclaimed) by now: the queue ends

    runqueue.serve(base, lambda _g: [], start_busy, poll=0.0, sleep=sleep)
    assert order[:6] == ["start", "sleep", "start", "sleep", "start", "sleep"]


def test_stop_of_a_queued_run_the_worker_holds_is_served_when_it_puts_it_back(container, tmp_path, sink):
    """`run stop` of a queued run that the worker held just then (claimed: "starting") recorded
    nothing; when the start was refused as busy the entry went back in line and the stop waited
    for a run that never came (issue 55). The intent is recorded in the entry; the worker serves it."""
    from dflash_ops.helpers import run_queue
    from dflash_ops.runs.helper import call_json

    spec = {"target": "local", "webhooks": [sink.url()], "commands": []}
    start(container, tmp_path, LONG, "blocker")
    start(container, tmp_path, SHORT, "held", queue=True, notify=spec)
    worker = container.base / "runs" / ".queue" / "worker.json"
    wait(lambda: worker.exists(), bool, 10)
    pid = json.loads(worker.read_text())["pid"]
    kill_recorded(worker)  # this test is the worker
    wait(lambda: alive(pid), lambda a: not a, 10)
    answers: list[str] = []

    calls: list[str] = []

    def start_racing_a_stop(entry, path):
        calls.append(entry["run_id"])
        assert len(calls) < 6, "the stop was never served"
        if not answers:  # the operator's stop lands while the worker holds the entry
            answers.append(call_json(container, ["unqueue", container.base_dir, "held"])["result"])
            return "busy"
        return run_queue.start_queued(container.base_dir, entry, path)

    slept: list[float] = []

    def sleep(s):
        slept.append(s)
        assert len(slept) < 5, "the stop was never served"

    # its GPU looks free at first (the blocker ends just then), so the worker claims it and starts it
    runqueue.serve(container.base_dir, lambda _wanted: [], start_racing_a_stop, poll=0.0, sleep=sleep)
    assert answers == ["starting"] and runqueue.entries(container.base_dir) == []
    assert not (container.base / "runs" / "held").exists()
    assert "held not started: stopped by the operator before it started" in (
        container.base / "runs" / ".queue" / runqueue.WORKER_LOG).read_text()
    wait(lambda: events_of(sink, "held"), lambda e: e[-1:] == ["stopped"], 30)
    assert events_of(sink, "held") == ["queued", "stopped"]


@pytest.mark.parametrize("restart", [None, "on-failure:2"])
def test_run_resume_keeps_the_runs_notifications(container, tmp_path, sink, restart):
    """`run resume` (and `patch --restart`, which resumes) named nobody and so removed notify.json:
    the resumed run's events went nowhere (issue 55). A resume keeps who hears of the run."""
    spec = {"target": "local", "webhooks": [sink.url()], "commands": []}
    start(container, tmp_path, "total_steps: 200\nstep_seconds: 0.01\ncheckpoint_every: 5\n", "told",
          notify=spec, restart=restart)
    wait(lambda: runs.run_status(container, "told"), lambda i: (i.step or 0) >= 6)
    runs.stop_run(container, "told", poll=POLL_S)
    wait(lambda: events_of(sink, "told"), lambda e: e == ["started", "stopped"], 30)
    runs.resume_run(container, "told")
    wait(lambda: runs.run_status(container, "told"), lambda i: i.final and not i.alive)
    wait(lambda: events_of(sink, "told"), lambda e: e == ["started", "stopped", "started", "done"], 30)
    assert (container.base / "runs" / "told" / "notify.json").exists()


@pytest.mark.parametrize("trainer_signal,final", [(signal.SIGTERM, "stopped"), (signal.SIGKILL, "failed")])
def test_a_run_ended_with_its_supervisor_still_gets_its_final_event(container, tmp_path, sink, trainer_signal, final):
    """A container shutdown ends the supervisor and the trainer together (SIGTERM to both; or
    worse, SIGKILL): the run ended and nobody was told (issue 55). The final state without its
    event is an event to send: the next `run status`/`list` tells it, once, under one key."""
    spec = {"target": "local", "webhooks": [sink.url()], "commands": []}
    start(container, tmp_path, LONG, "shut", notify=spec, restart="on-failure:2")
    wait(lambda: events_of(sink, "shut"), lambda e: e == ["started"], 30)
    wait(lambda: runs.run_status(container, "shut"), lambda i: (i.step or 0) >= 3)
    launch = json.loads((container.base / "runs" / "shut" / "launch.json").read_text())
    os.kill(launch["supervisor"]["pid"], signal.SIGKILL)  # gone first, as in a shutdown
    wait(lambda: alive(launch["supervisor"]["pid"]), lambda a: not a, 10)
    os.kill(launch["pid"], trainer_signal)
    info = wait(lambda: runs.run_status(container, "shut"), lambda i: i.final and not i.alive)
    assert info.effective_state == final
    wait(lambda: events_of(sink, "shut"), lambda e: e == ["started", final], 30)
    runs.list_runs(container)  # seen again: not told again
    time.sleep(1.5)
    assert events_of(sink, "shut") == ["started", final]
    told = [e for e in sink.delivered() if e["run_id"] == "shut"][-1]
    assert told["id"].startswith(f"shut/{final}/") and told["step"] >= 3
