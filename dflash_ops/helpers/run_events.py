"""Run events and the container's background processes (stdlib only, python3.8+; #39).

The one place that sends a run's events (notify.py: the outbox, then a deliverer) and that keeps
the container's two background processes going: the queue worker (`runs.py queue-worker BASE`,
runqueue.py) while runs are queued, a delivery worker per destination (`runs.py deliver BASE KEY`) while its events wait.
Both are started detached, in their own session, so they outlive the helper call and the
operator's connection; a start, a list and the end of a supervised run start one when none runs
(after a kill -9, say).

Not a helper: a shared module shipped beside runs.py (dflash_ops/helpers/__init__.py).
"""

from __future__ import annotations

import json
import os
import sys

from . import nodefacts, notify, run_protocol, runqueue

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

Refused = nodefacts.Refused
RUNS_SCRIPT = "runs.py"  # the dispatcher beside this file
LOG_TAIL_LINES, tail_lines = run_protocol.LOG_TAIL_LINES, run_protocol.tail_lines


def runs_script() -> str:
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), RUNS_SCRIPT)


def spawn_detached(command: list[str], log_path: str) -> None:
    """Start `runs.py COMMAND...` in its own session (it outlives this call and the operator's
    connection), output appended to log_path."""
    import subprocess

    with open(os.devnull, "rb") as devnull, open(log_path, "ab") as out:
        subprocess.Popen([sys.executable, runs_script(), *command], stdin=devnull, stdout=out,
                         stderr=subprocess.STDOUT, close_fds=True, start_new_session=True, cwd="/")


def ensure_worker(base: str) -> None:
    """A queue worker runs while runs are queued: start one when none holds the worker lock (the
    first queued run, or after one was killed: every start and list comes here)."""
    if runqueue.entries(base) and not runqueue.worker_running(base):
        spawn_detached(["queue-worker", base], os.path.join(runqueue.queue_root(base), runqueue.WORKER_LOG))


def ensure_deliverer(base: str) -> None:
    """The outbox into the destinations' queues (notify.dispatch), and a worker for each queue
    that holds events and has none (the first event, or after one was killed or stopped)."""
    try:
        for key in notify.dispatch(base):
            if not notify.worker_running(base, key):
                spawn_detached(["deliver", base, key], os.path.join(notify.notify_root(base), "deliver.log"))
    except OSError as e:  # a full disk, say: `list` and a run's start go on; the next call tries again
        sys.stderr.write("runs.py: the notification outbox was not dispatched: %s\n" % (e,))


def send_event(base: str, spec: dict | None, run_id: str, state: str, step: object = None,
               reason: str | None = None, log_tail: str | None = None) -> None:
    """Queue one run event for delivery (notify.py). Never raises: telling comes after the run."""
    try:
        event = notify.make_event(run_id, (spec or {}).get("target") or "", state, step=step, reason=reason,
                                  log_tail=log_tail)
        if notify.emit(base, spec, event):
            ensure_deliverer(base)
    except Exception as e:  # noqa: BLE001 (a full disk or a broken spec must not end a start or a supervisor)
        sys.stderr.write("runs.py: the %s event of %s was not queued: %s\n" % (state, run_id, e))


FINAL_TOLD = ".final-told-%d"  # RUNDIR/.final-told-<launch ms>: this start's final event is queued


def launch_seq(run_dir: str) -> int:
    """This start's number (launch.json's time in ms; every start and resume writes a new one, the
    supervisor's attempts keep it): one final event per start, under one idempotency key."""
    launch = nodefacts.read_json(os.path.join(run_dir, "launch.json")) or {}
    started = launch.get("time")
    return int(started * 1000) if isinstance(started, (int, float)) and started == started else 0


def run_events(run_dir: str) -> Callable[..., None]:
    """tell(state, step=, reason=, log_tail=True) for the supervisor: an event of this run to whom
    RUNDIR/notify.json names (nobody: nothing happens); log_tail=True sends train.log's tail.

    A final state (stopped, failed, done) is told once per start, by whoever sees it first: the
    supervisor as the run ends, else (a container shutdown ended both) the next `list` that finds
    it final with nobody alive (tell_derived_final). Its id is `<run>/<state>/<launch ms>`: the
    same on every path, so a receiver drops a repeat by its Idempotency-Key."""
    base = os.path.dirname(os.path.dirname(os.path.abspath(run_dir)))
    run_id = os.path.basename(os.path.normpath(run_dir))

    def tell(state: str, step: object = None, reason: str | None = None, log_tail: bool = False) -> None:
        spec = notify.read_spec(run_dir)
        if spec is None:
            return
        tail = tail_lines(os.path.join(run_dir, "train.log"), LOG_TAIL_LINES) if log_tail else None
        if state in nodefacts.FINAL_STATES:
            seq = launch_seq(run_dir)
            marker = os.path.join(run_dir, FINAL_TOLD % seq)
            try:
                os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            except FileExistsError:
                return  # told already (by the supervisor, or a list that saw it first)
            except OSError:
                pass  # cannot record it: tell it all the same (the receiver drops a repeat by its key)
            try:
                event = notify.make_event(run_id, spec.get("target") or "", state, step=step, reason=reason,
                                          log_tail=tail, seq=seq)
                if notify.emit(base, spec, event):
                    ensure_deliverer(base)
            except Exception as e:  # noqa: BLE001 - as send_event: telling comes after the run
                if os.path.exists(marker):
                    os.unlink(marker)  # not queued: the next one who sees it tells it
                sys.stderr.write("runs.py: the %s event of %s was not queued: %s\n" % (state, run_id, e))
        else:
            send_event(base, spec, run_id, state, step=step, reason=reason, log_tail=tail)
        if state in nodefacts.FINAL_STATES:
            ensure_worker(base)  # the run's GPUs are free: a killed queue worker is replaced now

    return tell


def tell_derived_final(run_dir: str, info: dict) -> None:
    """A run `list` finds final with nobody alive (its trainer and supervisor gone) whose final
    event was never queued (a container shutdown took the supervisor down with the trainer, a
    supervisor killed by a signal): tell it now. A group's events are its first member's."""
    if not info.get("has_status") or info.get("alive") or info.get("effective_state") not in nodefacts.FINAL_STATES:
        return
    if not os.path.exists(os.path.join(run_dir, notify.NOTIFY_FILE)):
        return
    if os.path.exists(os.path.join(run_dir, FINAL_TOLD % launch_seq(run_dir))):
        return
    group = info.get("group")
    if isinstance(group, dict) and group.get("index") != 0:
        return
    state = info["effective_state"]
    reason = info.get("reason") or ("the run ended %s; its supervisor did not say so (a container shutdown?)" % state)
    run_events(run_dir)(state, step=info.get("step"), reason=reason, log_tail=state == "failed")


def check_notify(text: str, where: str) -> dict:
    try:
        return notify.check_spec(json.loads(text))
    except ValueError as e:  # BadSpec is a ValueError; so is bad JSON
        raise Refused("%s: %s" % (where, e if isinstance(e, notify.BadSpec) else "not a JSON notification spec")) from None
