"""Run lifecycle on a container: start, list, follow, control, stop, resume, pull.

Transport-agnostic: every function takes a `container` (dflash_ops.container.ContainerAPI) and
talks to the stdlib helper `dflash_ops/helpers/runs.py` inside it. Protocol: docs/run-lifecycle.md.
"""

from dflash_ops.errors import ConnectionLost
from dflash_ops.runs.follow import FollowCallbacks, RetryPolicy, follow_file
from dflash_ops.runs.info import FINAL_STATES, GpusBusy, NotDeployed, RunError, RunInfo, RunNotFound, RunRefused
from dflash_ops.runs.lifecycle import (
    checkpoint_run,
    latest_run,
    list_runs,
    new_run_id,
    request,
    resolve_run,
    resume_run,
    run_status,
    signal_run,
    start_run,
    stop_run,
    wait_for_checkpoint,
    wait_until_final,
)
from dflash_ops.runs.pull import find_checkpoint, pull_checkpoint

__all__ = [
    "FINAL_STATES", "ConnectionLost", "FollowCallbacks", "GpusBusy", "NotDeployed", "RunError", "RunInfo", "RunNotFound",
    "RetryPolicy", "RunRefused", "checkpoint_run", "find_checkpoint", "follow_file", "latest_run", "list_runs",
    "new_run_id", "pull_checkpoint", "request", "resolve_run", "resume_run", "run_status",
    "signal_run", "start_run", "stop_run", "wait_for_checkpoint", "wait_until_final",
]
