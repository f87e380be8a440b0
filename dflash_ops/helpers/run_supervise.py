"""`runs.py supervise`: the trainer's parent for a run started with --restart on-failure:N; it
restarts the trainer after a crash from its latest checkpoint (stdlib only, python3.8+; see
runs.py's docstring).

Not a helper: a shared module shipped beside runs.py (dflash_ops/helpers/__init__.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

if __package__:  # imported by the operator's side, as dflash_ops.helpers.run_supervise
    from . import nodefacts, run_events, run_protocol
else:  # run as a script: its shared modules lie beside runs.py (dflash_ops/helpers/__init__.py)
    import nodefacts  # type: ignore[no-redef]
    import run_events  # type: ignore[no-redef]
    import run_protocol  # type: ignore[no-redef]

RESTART_DELAY_S = 1.0

read_json = nodefacts.read_json
write_atomic = nodefacts.write_atomic
RESTARTS_FILE, NO_RESTART = run_protocol.RESTARTS_FILE, run_protocol.NO_RESTART
check_run_dir, complete_checkpoints = run_protocol.check_run_dir, run_protocol.complete_checkpoints
oom_kills = run_protocol.oom_kills


def crash_reason(code: int, status: dict | None, pid: int, oom_before: int | None) -> str:
    """Why the trainer ended, in words: an OOM kill, a signal, a lost peer, its own error, an exit code."""
    oom_after = oom_kills()
    if code < 0 and oom_before is not None and oom_after is not None and oom_after > oom_before:
        return "OOM kill (SIG%s; the container's memory cgroup counted an OOM kill)" % signal.Signals(-code).name
    error = (status or {}).get("error") if (status or {}).get("pid") == pid else None
    message = str(error.get("message") or "")[:300] if isinstance(error, dict) else ""
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


def append_line(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, text.encode("utf-8", "replace"))
    finally:
        os.close(fd)


def stop_requested(run_dir: str) -> bool:
    """An operator's stop (any form: control/stop, or the .no-restart every stop and signal leaves)."""
    control = os.path.join(run_dir, "control")
    return os.path.exists(os.path.join(control, NO_RESTART)) or os.path.exists(os.path.join(control, "stop"))


def say(log: str, text: str) -> None:
    """A line in train.log, else (a full disk) on stderr: a failed write of its own must not end
    the supervisor with a traceback before it said why it stops."""
    try:
        append_line(log, text)
    except OSError:
        sys.stderr.write(text)
        sys.stderr.flush()


class Terminated(Exception):
    """The supervisor got SIGTERM (SIGHUP and SIGINT stay as nohup and the shell left them: ignored)."""

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
    argv = plan["argv"]
    used = 0
    tell = run_events.run_events(run_dir)  # this run's events (notify.json; nobody named: nothing sent)
    while True:
        oom_before = oom_kills()
        with open(os.devnull, "rb") as devnull:
            child = subprocess.Popen(argv, stdin=devnull, close_fds=True)
        record = dict(read_json(launch_path) or {}, pid=child.pid, pid_start=nodefacts.process_start_ticks(child.pid), argv=argv,
                      oom_kills=oom_before)
        try:
            write_atomic(launch_path, json.dumps(record, sort_keys=True).encode())
        except OSError:
            child.wait()  # the attempt it started is still its to wait for
            raise
        if used == 0:
            tell("started")
        code = child.wait()
        status = read_json(os.path.join(run_dir, "status.json"))
        state = (status or {}).get("state") if (status or {}).get("pid") == child.pid else None
        step = (status or {}).get("step")
        if code == 0 or state in ("stopped", "done"):
            tell(state if state in ("stopped", "done") else "done", step=step)
            return 0
        if stop_requested(run_dir):
            append_line(log, "# dflash-ops supervise: trainer ended (exit %d) after an operator's stop: not restarted\n"
                        % code)
            tell("stopped", step=step, reason="stopped by the operator (exit %d)" % code)
            return 0
        if state is None:  # it never wrote status.json: a start failure (config, import), not a crash
            append_line(log, "# dflash-ops supervise: trainer exited %d before writing status.json: not restarted\n"
                        % code)
            tell("failed", reason="the trainer exited %d before writing status.json" % code, log_tail=True)
            return code if code > 0 else 128 - code
        reason = crash_reason(code, status, child.pid, oom_before)
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
                 "step": (status or {}).get("step"),
                 "from": checkpoints[-1]["path"] if checkpoints else None}
        policy.setdefault("restarts", []).append(entry)
        write_atomic(restarts_path, json.dumps(policy, sort_keys=True).encode())
        event = dict(entry, event="restart", max=plan["max"])
        append_line(os.path.join(run_dir, "metrics.jsonl"), json.dumps(event, sort_keys=True) + "\n")
        append_line(log, "# dflash-ops supervise %s: %s at step %s; restart %d of %d from %s\n" % (
            time.strftime("%Y-%m-%d %H:%M:%S"), reason, entry["step"], used, plan["max"],
            entry["from"] or "the start (no checkpoint yet)"))
        tell("restart", step=entry["step"], reason="restart %d of %d after: %s" % (used, plan["max"], reason))
        # a pending checkpoint request stays for the next attempt to serve (a stop one ended supervision above)
        time.sleep(RESTART_DELAY_S)
        if stop_requested(run_dir):  # `run stop --kill`/`--now` arrived between two attempts
            say(log, "# dflash-ops supervise: an operator's stop arrived before restart %d: not restarted\n" % used)
            tell("stopped", step=entry["step"], reason="stopped by the operator between two attempts")
            return 0


def write_status_failed(run_dir: str, status: dict | None, reason: str) -> None:
    """A trainer killed without a word leaves a live-looking status.json; say what happened."""
    doc = dict(status or {}, state="failed", error={"message": reason, "thread": "supervisor"})
    write_atomic(os.path.join(run_dir, "status.json"), json.dumps(doc, sort_keys=True).encode())


