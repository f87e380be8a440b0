"""No silent phase (issue #53): a run names what it does in status.json from its first second, and a
stop acts in every phase - here during the demo's target fit, long before the first step boundary."""

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.trainer.tiny_config import tiny_config
from trainer.entry import train
from trainer.run.config import parse_config
from trainer.run.contract import eta_seconds, phase_text

FIT_FOREVER = tiny_config("""
model: {target: {tiny: {fit_steps: 1000000}}}
optim: {total_steps: 5}
""")


def status(run_dir: Path) -> dict:
    return json.loads((run_dir / "status.json").read_text())


def events(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == kind]


def stop_once_fitting(run: Path, ended: threading.Event) -> None:
    """What `run stop` writes, once status.json says the run fits its target (or the run ended)."""
    while not ended.is_set():
        try:
            phase = status(run).get("phase") or {}
        except (OSError, ValueError):  # not written yet
            phase = {}
        if phase.get("name") == "fitting the target" and (phase.get("done") or 0) >= 1:
            (run / "control" / ".stop.tmp").write_text(json.dumps({"id": "r1", "time": time.time()}))
            os.rename(run / "control" / ".stop.tmp", run / "control" / "stop")
            if not ended.wait(60):  # a hung test, not a timing assertion: the fit would go on for hours
                os.kill(os.getpid(), signal.SIGTERM)  # the run then stops for a signal, which the test refuses
            return
        time.sleep(0.05)


@contextlib.contextmanager
def sigterm_once(run: Path, ready: Callable[[dict], bool]) -> Iterator[None]:
    """A SIGTERM to this process, as `run stop` sends one to a trainer, from a thread once the run's
    status.json satisfies `ready`, while the body runs train() here (the trainer's handler: the same
    code a fresh process runs, without its ~5 CPU-seconds of imports). A run that would never get there
    or never stop is a hung test, not a timing assertion: after 120 s the thread writes control/stop,
    so the run stops for the control file, which the tests refuse. Afterwards SIGTERM's handler is this
    process's own again."""
    before, ended = signal.getsignal(signal.SIGTERM), threading.Event()

    def watch() -> None:
        deadline = time.monotonic() + 120
        while not ended.is_set() and time.monotonic() < deadline:
            try:
                now = status(run)
            except (OSError, ValueError):  # not written yet
                now = {}
            if ready(now):
                os.kill(os.getpid(), signal.SIGTERM)
                if ended.wait(120):
                    return
                break
            time.sleep(0.05)
        if not ended.is_set():
            (run / "control" / ".stop.tmp").write_text(json.dumps({"id": "hung", "time": time.time()}))
            os.rename(run / "control" / ".stop.tmp", run / "control" / "stop")

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        ended.set()
        watcher.join()
        signal.signal(signal.SIGTERM, before)


def test_a_stop_during_the_target_fit_stops_the_run_in_that_phase(tmp_path):
    """What `run stop` writes, served by the same code in the test's process (a fresh trainer process
    costs ~4 CPU-seconds of imports), written from a thread. The SIGTERM of `run stop --now` during the
    fit is tests/integration/test_runs_real_trainer.py's, which asserts stopped_during_the_fit too."""
    run, ended = tmp_path / "run", threading.Event()
    stopper = threading.Thread(target=stop_once_fitting, args=(run, ended), daemon=True)
    stopper.start()
    try:
        assert train(parse_config(FIT_FOREVER), run) == 0
    finally:
        ended.set()
        stopper.join()
    stopped_during_the_fit(run, "control")


def stopped_during_the_fit(run: Path, reason: str) -> None:
    """`run` (a FIT_FOREVER run, or one whose fit_steps is 1000000) stopped while fitting its target, for
    `reason` (control: the control file; signal: SIGTERM), says so in status.json, metrics.jsonl and its log."""
    st = status(run)
    assert st["state"] == "stopped" and st["step"] == 0 and st["last_checkpoint"] is None
    assert st["phase"]["name"] == "fitting the target" and st["phase"]["total"] == 1000000
    stop = events(run, "stop")[-1]
    assert stop["reason"] == reason
    assert stop["phase"].startswith("fitting the target ")
    assert not (run / "control" / "stop").exists()  # served: a resume is not stopped by it again
    log = (run / "train.log").read_text()
    assert "phase: tokenising" in log and "phase: fitting the target 0/1000000" in log
    assert "stopped while fitting the target" in log
    fit = [e for e in events(run, "phase") if e["name"] == "fitting the target"]
    assert fit and fit[0]["done"] == 0 and fit[0]["total"] == 1000000  # play and metrics -f see it


def test_a_run_reports_its_phases_and_token_progress(tmp_path):
    cfg = parse_config(tiny_config("optim: {total_steps: 6}\nrun: {log_every: 2}"))
    assert train(cfg, tmp_path / "run") == 0
    run = tmp_path / "run"
    log = (run / "train.log").read_text()
    names = [line.split("phase: ", 1)[1] for line in log.splitlines() if "phase: " in line]
    assert names == ["tokenising", "loading the target", "building the drafter", "compiling and warming up",
                     "training", "evaluating", "checkpointing", "finished"]
    recorded = events(run, "phase")
    assert [name for i, name in enumerate(e["name"] for e in recorded) if i == 0 or recorded[i - 1]["name"] != name] == names
    assert {"name": "tokenising", "done": 64, "total": 64} in [{k: e[k] for k in ("name", "done", "total")} for e in recorded]
    st = status(run)
    assert st["phase"]["name"] == "finished" and st["state"] == "done"
    steps = events(run, "step")
    counted = sum(e["tokens"] for e in steps)
    assert counted > 0 and st["tokens_done"] == counted and st["tokens_total"] == counted  # all 6 steps ran
    assert eta_seconds(st) is None  # final


def test_eta_is_the_tokens_to_go_over_the_recent_rate():
    live = {"state": "running", "tokens_done": 1000, "tokens_total": 5000, "tokens_per_s_recent": 100.0,
            "tokens_per_s": 50.0}
    assert eta_seconds(live) == 40.0
    assert eta_seconds({**live, "tokens_per_s_recent": None}) == 80.0  # the last window's rate
    assert eta_seconds({**live, "tokens_per_s_recent": None, "tokens_per_s": None}) is None
    assert eta_seconds({**live, "state": "done"}) is None
    assert phase_text({"name": "fitting the target", "done": 3, "total": 200}) == "fitting the target 3/200"
    assert phase_text({"name": "tokenising", "done": None}) == "tokenising"
    assert phase_text("garbage") == "" and phase_text({"name": 3}) == ""
    assert phase_text({"name": "x\x1b[2Jy" + "z" * 200}) == "x\ufffd[2Jy" + "z" * 74


def test_a_stop_during_the_final_evaluation_cuts_it_short_and_keeps_the_checkpoint(tmp_path):
    """`run stop`'s SIGTERM while the run evaluates (an evaluation that would run for hours), served by
    train() in the test's process (sigterm_once)."""
    run = tmp_path / "run"
    cfg = parse_config(tiny_config("optim: {total_steps: 2}\neval: {samples: 64, max_new_tokens: 100000, batch: 1}"))
    with sigterm_once(run, lambda now: (now.get("phase") or {}).get("name") == "evaluating"):
        assert train(cfg, run) == 0
    st = status(run)
    assert st["state"] == "stopped" and st["last_checkpoint"] == "checkpoints/step_2"
    assert events(run, "stop")[-1] == {**events(run, "stop")[-1], "reason": "signal", "phase": "evaluating"}
    assert not events(run, "eval")  # cut short: no τ recorded


def test_a_sigterm_between_the_last_step_and_the_final_evaluation_is_not_lost(tmp_path):
    """The window CI found: SIGTERM after the last step boundary, before the final evaluation arms. It
    used to wait for a step boundary that never came (the evaluation then ran to its end)."""
    from trainer.run.control import ControlPoller, SetupStop
    control = ControlPoller(tmp_path)
    before = signal.getsignal(signal.SIGTERM)
    try:
        control.install_sigterm()
        os.kill(os.getpid(), signal.SIGTERM)  # disarmed: noted, for the next step boundary
        with pytest.raises(SetupStop) as stop:
            control.arm_setup()
        assert stop.value.reason == "signal"
        assert not control.poll()  # served once, not again at a later boundary
        control.arm_setup()  # nothing pending: arms as before
        control.disarm_setup()
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_setup_stop_a_library_drops_is_served_at_the_next_step_boundary(tmp_path):
    """SIGTERM while setup is armed raises SetupStop wherever the main thread is; inside a weakref callback or
    a __del__ (torch._dynamo's weak-key dictionaries) Python prints it and drops it. The stop is not lost."""
    from trainer.run.control import ControlPoller, SetupStop
    control = ControlPoller(tmp_path)
    before = signal.getsignal(signal.SIGTERM)
    try:
        control.install_sigterm()
        control.arm_setup()
        try:  # what a weakref callback does with the exception its code raised
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)
        except SetupStop:
            pass
        control.disarm_setup()  # setup went on: training begins
        assert control.stop_pending()
        assert [(r.kind, r.reason) for r in control.poll()] == [("stop", "signal")]  # served at the step boundary
        with pytest.raises(SetupStop):  # or at once, where setup is armed again (the final evaluation)
            control.arm_setup()
    finally:
        control.disarm_setup()
        signal.signal(signal.SIGTERM, before)
