"""`runs.py queue-worker`, `unqueue`, `deliver` and the queued runs `list` shows (stdlib only,
python3.8+; #39). The queue's files are runqueue.py's; a queued run is started by `runs.py start`
itself (start_queued), with the arguments, config and release it was queued with.

Not a helper: a shared module shipped beside runs.py (dflash_ops/helpers/__init__.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from . import notify, run_events, run_protocol, run_start, runqueue

print_json = run_start.print_json
check_run_id, gpu_conflicts = run_protocol.check_run_id, run_start.gpu_conflicts
EXIT_REFUSED, EXIT_DIED_AT_START = run_protocol.EXIT_REFUSED, run_protocol.EXIT_DIED_AT_START
send_event, ensure_worker, ensure_deliverer = run_events.send_event, run_events.ensure_worker, run_events.ensure_deliverer


def queued_runs(base: str) -> list[dict]:
    """The queued runs as `list` shows them; a queue left without a worker gets one."""
    queued = runqueue.describe(base, lambda wanted: gpu_conflicts(base, wanted, ""))
    if queued:
        ensure_worker(base)
    ensure_deliverer(base)
    return queued


def start_queued(base: str, entry: dict, path: str) -> str | None:
    """The queue worker's start of one claimed entry: `runs.py start` with its saved arguments,
    config and release. None: started; "busy": a run took its GPUs meanwhile (it stays queued)."""
    import subprocess

    spec = notify.read_spec(path)
    if runqueue.stop_requested(path):  # `run stop` came while it was queued: it never starts
        send_event(base, spec, entry["run_id"], "stopped", reason="removed from the queue before it started")
        return "stopped by the operator before it started"
    problem = runqueue.entry_problem(entry)
    if problem is not None:
        send_event(base, spec, entry["run_id"], "failed", reason="could not start from the queue: " + problem)
        return problem
    argv = [sys.executable, run_events.runs_script(), "start", *entry.get("start_args", []),
            "--config", os.path.join(path, runqueue.CONFIG), "--release-root", str(entry.get("release_root")),
            "--wait", "5"]
    spec_path = os.path.join(path, notify.NOTIFY_FILE)
    if os.path.exists(spec_path):
        argv += ["--notify-file", spec_path]
    done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          close_fds=True)
    if done.returncode == 0:
        if runqueue.stop_requested(path):  # `run stop` came while it was starting: the run serves it
            run_dir = os.path.join(base, "runs", entry["run_id"])
            run_protocol.control_request(run_dir, "stop")
        return None
    lines = done.stdout.decode("utf-8", "replace").strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else {}
    except ValueError:
        answer = {}
    if done.returncode == EXIT_REFUSED and answer.get("conflicts"):
        return "busy"
    if done.returncode == EXIT_REFUSED and answer.get("exists"):
        return "its run directory exists already (started before the last worker ended)"
    reason = str(answer.get("error") or "runs.py start exited %d" % done.returncode)
    if done.returncode != EXIT_DIED_AT_START:  # else its supervisor has said so
        send_event(base, spec, entry["run_id"], "failed", reason="could not start from the queue: " + reason,
                   log_tail=answer.get("log_tail"))
    return reason


def cmd_queue_worker(args: argparse.Namespace) -> None:
    runqueue.run_worker(args.base, lambda wanted: gpu_conflicts(args.base, wanted, ""),
                        lambda entry, path: start_queued(args.base, entry, path))


def cmd_unqueue(args: argparse.Namespace) -> None:
    """Take a queued run out of the queue. `result`: removed, starting (the worker got it first:
    stop it as a run) or absent."""
    check_run_id(args.run_id)
    entry = runqueue.find(args.base, args.run_id)
    spec = notify.read_spec(entry["path"]) if entry else None
    runqueue.request_stop(args.base, args.run_id)  # the intent first: the worker may hold the entry now
    result = runqueue.remove(args.base, args.run_id)
    if result == "removed":
        send_event(args.base, spec, args.run_id, "stopped", reason="removed from the queue before it started")
    print_json({"run_id": args.run_id, "result": result})


def cmd_deliver(args: argparse.Namespace) -> None:
    """With a KEY: that destination's worker; without: dispatch and start the workers missing."""
    if args.key:
        notify.run_worker(args.base, args.key)
    else:
        ensure_deliverer(args.base)
