"""`runs.py list`: what a run directory says about its run, with what only the node can tell
(is the process alive, is a supervisor restarting it, was it OOM-killed), as one JSON object per
run (stdlib only, python3.8+). dflash_ops/runs/info.py RunInfo reads it.

Not a helper: a shared module shipped beside runs.py (dflash_ops/helpers/__init__.py).
"""

from __future__ import annotations

import os

from . import nodefacts, notify, run_protocol

read_json = nodefacts.read_json
read_json_checked = nodefacts.read_json_checked
LOG_TAIL_LINES, RESTARTS_FILE = run_protocol.LOG_TAIL_LINES, run_protocol.RESTARTS_FILE
run_gpus, complete_checkpoints = run_protocol.run_gpus, run_protocol.complete_checkpoints
oom_kills, tail_lines = run_protocol.oom_kills, run_protocol.tail_lines


def describe_run(run_dir: str, now: float) -> dict:
    status, broken = read_json_checked(os.path.join(run_dir, "status.json"))
    info = dict(status or {})
    info["run_id"] = os.path.basename(run_dir)
    info["has_status"] = status is not None
    info["broken"] = broken
    alive = nodefacts.process_matches(*nodefacts.run_process(run_dir, status))
    info["alive"] = alive
    info["gpus"] = run_gpus(run_dir, status)
    launch = read_json(os.path.join(run_dir, "launch.json")) or {}
    info["launched"] = launch.get("time")
    restarts = read_json(os.path.join(run_dir, RESTARTS_FILE))
    info["restart_policy"] = restarts.get("policy") if restarts else None
    info["restarts"] = restarts.get("restarts", []) if restarts else []
    supervised = nodefacts.run_supervisor(run_dir) is not None
    info["supervised"] = supervised
    info["group"] = read_json(os.path.join(run_dir, "group.json"))
    # between two attempts the trainer is gone and status.json is the last attempt's (a rank of a
    # group: its status.json holds the rank's pid, not the launcher's that launch.json records)
    between = supervised and not (alive and (info["group"] is not None or (status or {}).get("pid") == launch.get("pid")))
    heartbeat = info.get("heartbeat")
    info["heartbeat_age"] = (now - heartbeat) if isinstance(heartbeat, (int, float)) else None
    try:
        with open(os.path.join(run_dir, "release"), "rb") as f:
            info["release"] = f.read().decode("utf-8", "replace").strip() or None
    except OSError:
        info["release"] = None
    checkpoints = complete_checkpoints(run_dir)
    info["checkpoints"] = [c["step"] for c in checkpoints]
    if not info.get("last_checkpoint") and checkpoints:
        info["last_checkpoint"] = checkpoints[-1]["path"]
    state = info.get("state")
    info["reason"] = None
    info["log_tail"] = None
    if not isinstance(state, str):
        state = info["state"] = None
    if broken:
        info["effective_state"] = "broken"
        info["reason"] = broken + ("; the process still runs" if alive else "")
    elif between and state not in ("stopped", "done"):
        info["alive"] = True
        last = info["restarts"][-1] if info["restarts"] else None
        if last and restarts and (last.get("time") or 0) >= (launch.get("time") or 0):
            info["effective_state"] = "restarting"
            info["reason"] = "restart %s of %s after: %s" % (last.get("n", last.get("attempt")), restarts.get("max"),
                                                             last["reason"])
        else:  # the first attempt of this start has not written its status yet
            info["effective_state"] = "starting"
    elif state in nodefacts.FINAL_STATES:
        info["effective_state"] = state
        info["alive"] = alive or supervised  # a supervisor still ending counts: not over yet
    elif alive:
        info["effective_state"] = state or "starting"
    else:
        info["effective_state"] = "failed"
        info["reason"] = ("process died without saying so" if status is not None
                          else "no status.json and no live process")
        at_launch, now_count = launch.get("oom_kills"), oom_kills()
        if isinstance(at_launch, int) and now_count is not None and now_count > at_launch:
            info["oom_killed"] = True
            info["reason"] = ("OOM kill: the container's memory limit was hit (its memory cgroup counted "
                              "%d OOM kill(s) since the launch)" % (now_count - at_launch))
    recorded = launch.get("supervisor")
    info["unsupervised"] = None
    if restarts and isinstance(recorded, dict) and not supervised and info["effective_state"] not in nodefacts.FINAL_STATES:
        ended = restarts.get("supervisor_stopped")
        why = (ended.get("reason") if isinstance(ended, dict) else None) or \
            "its supervisor (pid %s) is gone without a word (killed by a signal?)" % recorded.get("pid")
        info["unsupervised"] = "no longer supervised: %s" % why  # a crash now is not restarted
        info["reason"] = "%s; %s" % (info["reason"], info["unsupervised"]) if info["reason"] else info["unsupervised"]
    # what was not told of it (dropped, given up, left at a stop) and what waits to be: run status says so
    info["notify"] = notify.run_summary(os.path.dirname(os.path.dirname(os.path.abspath(run_dir))), info["run_id"])
    if state == "failed" or info["effective_state"] == "failed":
        info["log_tail"] = tail_lines(os.path.join(run_dir, "train.log"), LOG_TAIL_LINES)
    return info


