"""`runs.py supervise`: the trainer's parent for a run started with --restart on-failure:N; it
restarts the trainer after a crash from its latest checkpoint (stdlib only, python3.8+; see
runs.py's docstring).

A rank of a run across hosts (the plan names its group) is supervised the same way, its trainer
being the rank's launcher (`python -m trainer launch`): a rank that dies stops every rank (the
group's own failure handling), so every member's supervisor sees its launcher fail and starts it
again after RESTART_DELAY_S with `--resume auto`. The launchers meet again at the run's endpoint
(the store host's new store; trainer/distributed/launch.py) and the ranks agree there on the newest
complete checkpoint a host holds, read by its host and broadcast: every rank resumes from the same
step. Each member counts its own restarts (one per group restart: every rank fails once) and
records them in its restarts.json; the group's events are told by its first member only (index
0 of group.json), so a webhook hears of a group restart once.

Not a helper: a shared module shipped beside runs.py (dflash_ops/helpers/__init__.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

from . import nodefacts, notify, run_events, run_protocol

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    import subprocess
    from collections.abc import Callable

RESTART_DELAY_S = 1.0
WATCH_S = 0.5  # how often a group member's supervisor reads its rank's new events

read_json = nodefacts.read_json
write_atomic = nodefacts.write_atomic
RESTARTS_FILE, NO_RESTART = run_protocol.RESTARTS_FILE, run_protocol.NO_RESTART
check_run_dir, complete_checkpoints = run_protocol.check_run_dir, run_protocol.complete_checkpoints
oom_kills = run_protocol.oom_kills


def crash_reason(code: int, status: dict | None, pid: int, oom_before: int | None) -> str:
    """Why the trainer ended, in words: an OOM kill, a signal, a lost peer, its own error, an exit code."""
    oom_after = oom_kills()
    error = (status or {}).get("error") if (status or {}).get("pid") == pid else None
    message = str(error.get("message") or "")[:300] if isinstance(error, dict) else ""
    # a rank's launcher exits 1 and says how its rank ended: "the trainer process (pid N) killed by signal 9 (SIGKILL)"
    rank_killed = code > 0 and "killed by signal 9" in message
    if (code < 0 or rank_killed) and oom_before is not None and oom_after is not None and oom_after > oom_before:
        return "OOM kill (SIG%s; the container's memory cgroup counted an OOM kill)" % (
            signal.Signals(-code).name if code < 0 else "KILL")
    if code < 0:
        try:
            name = "SIG" + signal.Signals(-code).name.replace("SIG", "")
        except ValueError:
            name = "signal %d" % -code
        return "killed by %s" % name
    lost = ("peer", "connection reset", "connection closed", "broken pipe", "rendezvous", "timed out", "nccl", "gloo")
    if message and any(word in message.lower() for word in lost):
        return "lost peer (exit %d): %s" % (code, message)
    return "exit %d%s" % (code, ": " + message if message else "")


def attempt_status(status: dict | None, child_pid: int, began: float, group: bool) -> tuple[dict | None, bool]:
    """(this attempt's status.json, or None; whether the trainer itself wrote it). On one host the
    trainer is the child and writes its pid. A rank's launcher (the child) writes status.json
    first with its own pid, then its rank replaces it with the rank's: this attempt's is any
    status started since the attempt began (clocks of one host)."""
    if not status:
        return None, False
    if not group:
        return (status, True) if status.get("pid") == child_pid else (None, False)
    started = status.get("started")
    if not isinstance(started, (int, float)) or started < began - 1.0:
        return None, False
    return status, status.get("pid") != child_pid


def wait_watching(child: subprocess.Popen[bytes], metrics: str, offset: int,
                  on_event: Callable[[dict], None] | None) -> int:
    """child.wait(), reading the events the attempt appends to metrics.jsonl (from `offset`) for
    on_event meanwhile (None: just wait)."""
    if on_event is None:
        return child.wait()
    held = b""
    while True:
        code = child.poll()  # first: the lines written before the exit are read below, once more
        try:
            with open(metrics, "rb") as f:
                f.seek(offset)
                chunk = f.read(1 << 20)
        except OSError:
            chunk = b""
        offset += len(chunk)
        lines = (held + chunk).split(b"\n")
        held = lines.pop()
        for line in lines:
            try:
                event = json.loads(line.decode("utf-8", "replace"))
            except ValueError:
                continue
            if isinstance(event, dict):
                try:
                    on_event(event)
                except Exception as e:  # noqa: BLE001 - watching is extra: it must not end the supervision
                    sys.stderr.write("# dflash-ops supervise: reading an event failed: %r\n" % (e,))
        if code is not None and not chunk:
            return code
        if not chunk:
            time.sleep(WATCH_S)


def file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def append_line(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, text.encode("utf-8", "replace"))
    finally:
        os.close(fd)


def stop_requested(run_dir: str) -> bool:
    """An operator's stop (any form: control/stop, or the .no-restart every stop and signal leaves)."""
    return run_protocol.stop_intent(run_dir) is not None


def serve_stop(run_dir: str, log: str, child: subprocess.Popen[bytes]) -> None:
    """Re-read the operator's intent once this attempt is recorded in launch.json: a `run stop
    --now`/`--kill` that read the previous record (no trainer to signal) has left its signal here,
    and this attempt gets it; a stop request is the trainer's own to serve (control/stop)."""
    intent = run_protocol.stop_intent(run_dir)
    name = (intent or {}).get("signal")
    if name in ("TERM", "KILL") and child.poll() is None:
        say(log, "# dflash-ops supervise: an operator's SIG%s arrived while attempt pid %d started: sent to it\n"
            % (name, child.pid))
        os.kill(child.pid, signal.SIGTERM if name == "TERM" else signal.SIGKILL)


def say(log: str, text: str) -> None:
    """A line in train.log, else (a full disk) on stderr: a failed write of its own must not end
    the supervisor with a traceback before it said why it stops."""
    try:
        append_line(log, text)
    except OSError:
        sys.stderr.write(text)
        sys.stderr.flush()


class Terminated(BaseException):
    """The supervisor got SIGTERM (SIGHUP and SIGINT stay as nohup and the shell left them: ignored).
    A BaseException, like KeyboardInterrupt: no `except Exception` on the way swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _terminated(signum: int, _frame: object) -> None:
    raise Terminated(signum)


def cmd_supervise(args: argparse.Namespace) -> int:
    """The trainer's parent for a run with --restart (see the module docstring). Any of its own
    writes that fails (a full disk: OSError, whatever the errno) ends supervision with the reason
    said, after the trainer it started has ended; no attempt is started whose record failed. A
    terminating signal ends supervision too, said and recorded (`run status`: no longer supervised,
    terminated by SIGTERM); the trainer is left to its own signals (a container's shutdown sends
    it its own SIGTERM: checkpoint and stop)."""
    run_dir = check_run_dir(args.run_dir)
    log = os.path.join(run_dir, "train.log")
    signal.signal(signal.SIGTERM, _terminated)
    try:
        return _supervise(run_dir, log)
    except Terminated as e:
        name = signal.Signals(e.signum).name
        _stopped(run_dir, log, "terminated by %s" % name, "its supervisor was terminated by %s" % name)
        return 128 + e.signum
    except OSError as e:
        reason = "cannot write %s: %s" % (e.filename or "its files", e.strerror or e)
        _stopped(run_dir, log, reason, reason)
        return 75  # EX_TEMPFAIL: sysexits.h, "try again later" (free the disk, then run resume)


def _stopped(run_dir: str, log: str, said: str, recorded: str) -> None:
    """Supervision ends: said in train.log (else stderr), recorded in restarts.json (where it can be)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not cut the record short
    say(log, "# dflash-ops supervise: %s: supervision stopped, the run is not restarted\n" % said)
    try:
        policy = read_json(os.path.join(run_dir, RESTARTS_FILE)) or {}
        policy["supervisor_stopped"] = {"time": time.time(), "reason": recorded}
        write_atomic(os.path.join(run_dir, RESTARTS_FILE), json.dumps(policy, sort_keys=True).encode())
    except OSError:
        pass  # said on train.log or stderr above


def _supervise(run_dir: str, log: str) -> int:
    import subprocess

    plan = json.loads(sys.stdin.buffer.read().decode("utf-8"))  # EOF: launch.json names this supervisor
    launch_path = os.path.join(run_dir, "launch.json")
    restarts_path = os.path.join(run_dir, RESTARTS_FILE)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    group = plan.get("group") if isinstance(plan.get("group"), dict) else None
    argv = plan["argv"]
    used = 0
    tell_any = run_events.run_events(run_dir)  # this run's events (notify.json; nobody named: nothing sent)
    tell = tell_any
    if group is not None and group.get("index") != 0:
        tell = lambda *_a, **_k: None  # noqa: E731 - the group's first member tells the group's events
    spec = notify.read_spec(run_dir)
    # the optional checkpoint events: told where the checkpoint is written (a group's writer host)
    checkpoint_events = checkpoint_teller(tell_any) if spec and spec.get("checkpoints") else None
    while True:
        # re-read before every restart: a stop may have come at any time since the crash (the first
        # attempt's stop is served by serve_stop below: the start cleared the last one)
        if used and stop_requested(run_dir):
            say(log, "# dflash-ops supervise: an operator's stop arrived before restart %d: not restarted\n" % used)
            step = stopped_between(run_dir)
            tell("stopped", step=step, reason="stopped by the operator between two attempts")
            return 0
        oom_before = oom_kills()
        began = time.time()
        offset = file_size(metrics)
        with open(os.devnull, "rb") as devnull:
            child = subprocess.Popen(argv, stdin=devnull, close_fds=True)
        record = dict(read_json(launch_path) or {}, pid=child.pid, pid_start=nodefacts.process_start_ticks(child.pid), argv=argv,
                      oom_kills=oom_before, attempt_time=began)
        try:
            write_atomic(launch_path, json.dumps(record, sort_keys=True).encode())
        except OSError:
            child.wait()  # the attempt it started is still its to wait for
            raise
        serve_stop(run_dir, log, child)
        if used == 0:
            tell("started")
        code = wait_watching(child, metrics, offset,
                             both(source_of_restart(restarts_path) if group and used else None, checkpoint_events))
        status = read_json(os.path.join(run_dir, "status.json"))
        mine, wrote = attempt_status(status, child.pid, began, group is not None)
        while group is not None and wrote and mine and nodefacts.process_matches(mine.get("pid"), mine.get("pid_start")):
            # the launcher is gone (killed?) but its rank lives on with the group: it is the run
            time.sleep(WATCH_S)
            status = read_json(os.path.join(run_dir, "status.json"))
            mine, wrote = attempt_status(status, child.pid, began, True)
        state = (mine or {}).get("state")
        step = (mine or {}).get("step")
        if code == 0 or state in ("stopped", "done"):
            tell(state if state in ("stopped", "done") else "done", step=step)
            return 0
        if stop_requested(run_dir):
            append_line(log, "# dflash-ops supervise: trainer ended (exit %d) after an operator's stop: not restarted\n"
                        % code)
            tell("stopped", step=step, reason="stopped by the operator (exit %d)" % code)
            return 0
        if (state is None) if group is None else (not wrote and used == 0):
            # it never wrote status.json (one host), or the rank never started (the group's first
            # attempt: the rendezvous failed): a start failure (config, import, a host missing), not a crash
            what = "before writing status.json" if group is None else "before its rank started"
            append_line(log, "# dflash-ops supervise: trainer exited %d %s: not restarted\n" % (code, what))
            tell("failed", reason="the trainer exited %d %s" % (code, what), log_tail=True)
            return code if code > 0 else 128 - code
        reason = crash_reason(code, mine, (mine or {}).get("pid", child.pid), oom_before)
        policy = read_json(restarts_path) or {"max": plan["max"], "restarts": []}
        if used >= plan["max"]:
            policy["gave_up"] = {"time": time.time(), "reason": reason}
            write_atomic(restarts_path, json.dumps(policy, sort_keys=True).encode())
            append_line(log, "# dflash-ops supervise: %s; no restart left (%d used): the run stays failed\n"
                        % (reason, used))
            if state not in nodefacts.FINAL_STATES:  # killed before it could say so
                write_status_failed(run_dir, status, reason)
            tell("failed", step=step, reason=reason if not used else "%s; no restart left (%d used)" % (reason, used),
                 log_tail=True)
            return code if code > 0 else 128 - code
        used += 1
        checkpoints = complete_checkpoints(run_dir)
        argv = plan["restart_argv"] if checkpoints else plan["fresh_argv"]
        attempt = len(policy.get("restarts", [])) + 1
        entry = {"attempt": attempt, "n": used, "time": time.time(), "reason": reason, "exit_code": code,
                 "step": step, "from": checkpoints[-1]["path"] if checkpoints and group is None else None}
        if group is not None:
            entry["group"] = True  # `from` is filled in once the ranks agreed on it (source_of_restart)
        policy.setdefault("restarts", []).append(entry)
        write_atomic(restarts_path, json.dumps(policy, sort_keys=True).encode())
        event = dict(entry, event="restart", max=plan["max"])
        append_line(metrics, json.dumps(event, sort_keys=True) + "\n")
        source = entry["from"] or ("the start (no checkpoint yet)" if group is None else
                                   "the newest checkpoint a host of the group holds (every host's rank restarts)")
        append_line(log, "# dflash-ops supervise %s: %s at step %s; restart %d of %d from %s\n" % (
            time.strftime("%Y-%m-%d %H:%M:%S"), reason, entry["step"], used, plan["max"], source))
        tell("restart", step=entry["step"], reason="restart %d of %d after: %s" % (used, plan["max"], reason))
        # a pending checkpoint request stays for the next attempt to serve (a stop one ended supervision above)
        time.sleep(RESTART_DELAY_S)  # the stop check at the loop's top sees a stop that came meanwhile


def checkpoint_teller(tell: Callable[..., None]) -> Callable[[dict], None]:
    """The `checkpoint` event for each checkpoint the attempt writes (its metrics.jsonl event)."""
    def on_event(event: dict) -> None:
        if event.get("event") == "checkpoint" and event.get("path"):
            request = " (request %s)" % event["request"] if event.get("request") else ""
            tell("checkpoint", step=event.get("step"), reason="%s written%s" % (event["path"], request))

    return on_event


def both(*watchers: Callable[[dict], None] | None) -> Callable[[dict], None] | None:
    """One on_event for wait_watching calling each watcher given (None: none given)."""
    given = [w for w in watchers if w is not None]
    if not given:
        return None

    def on_event(event: dict) -> None:
        for watcher in given:
            watcher(event)

    return on_event


def source_of_restart(restarts_path: str) -> Callable[[dict], None]:
    """For a group's restarted attempt: when its rank says where it resumed from (its `start`
    event), the last restart entry gets it as `from` (or the start, when no host held a checkpoint)."""
    def on_event(event: dict) -> None:
        if event.get("event") != "start":
            return
        policy = read_json(restarts_path) or {}
        restarts = policy.get("restarts") or []
        if not restarts or restarts[-1].get("from"):
            return
        restarts[-1]["from"] = event.get("resumed_from") or "the start (no host held a checkpoint)"
        try:
            write_atomic(restarts_path, json.dumps(policy, sort_keys=True).encode())
        except OSError:
            pass  # only the record of where it resumed from is lost; the run goes on

    return on_event


def stopped_between(run_dir: str) -> int | None:
    """An operator's stop served between two attempts: status.json (the crashed attempt's, which
    would read as a crash) says `stopped`. Returns its step."""
    status_path = os.path.join(run_dir, "status.json")
    status = read_json(status_path)
    if status is not None and status.get("state") not in ("stopped", "done"):
        write_atomic(status_path, json.dumps(dict(status, state="stopped"), sort_keys=True).encode())
    return (status or {}).get("step")


def write_status_failed(run_dir: str, status: dict | None, reason: str) -> None:
    """A trainer killed without a word leaves a live-looking status.json; say what happened."""
    doc = dict(status or {}, state="failed", error={"message": reason, "thread": "supervisor"})
    write_atomic(os.path.join(run_dir, "status.json"), json.dumps(doc, sort_keys=True).encode())


