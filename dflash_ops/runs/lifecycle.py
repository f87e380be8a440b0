"""Start, list, control and stop runs on one container, through the `runs` helper."""

from __future__ import annotations

import json
import posixpath
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from dflash_ops.errors import UsageError
from dflash_ops.helpers import nodefacts
from dflash_ops.runs.events import BadLine, parse_event
from dflash_ops.runs.follow import follow_file
from dflash_ops.runs.helper import call, call_json, check_run_id, run_dir
from dflash_ops.runs.info import NotDeployed, RunError, RunInfo, RunNotFound, RunRefused
from trainer.run.contract import phase_text

if TYPE_CHECKING:
    from dflash_ops.container import ContainerAPI

REQUEST_KINDS = ("checkpoint", "stop")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,100}$")


def list_runs(container: ContainerAPI) -> list[RunInfo]:
    """Every run of the container, one helper call."""
    doc = call_json(container, ["list", container.base_dir])
    return [RunInfo.from_json(r) for r in doc["runs"]]


def run_status(container: ContainerAPI, run_id: str) -> RunInfo:
    doc = call_json(container, ["list", container.base_dir, "--run", check_run_id(run_id)])
    return RunInfo.from_json(doc["runs"][0])


def latest_run(runs: list[RunInfo]) -> RunInfo | None:
    """The run launched last (launch.json time, else its status' start time, else its id)."""
    if not runs:
        return None
    return max(runs, key=lambda r: (r.launched or r.started or 0.0, r.run_id))


def resolve_run(container: ContainerAPI, run_id: str | None) -> RunInfo:
    """The status of run_id, or of the target's latest run when run_id is None."""
    if run_id is not None:
        return run_status(container, run_id)
    latest = latest_run(list_runs(container))
    if latest is None:
        raise RunNotFound(f"no runs on {container.target.name} yet: start one with `dflash-ops run start`")
    return latest


def new_run_id(name: str | None = None, now: float | None = None) -> str:
    prefix = name or "run"
    if not NAME_RE.match(prefix):
        raise RunError(f"run name {prefix!r}: use letters, digits, '.', '_' and '-'")
    return f"{prefix}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(now))}"


def parse_gpus(text: str) -> list[int]:
    """`--gpus 0,1` -> [0, 1], by the grammar the runs helper applies (nodefacts.parse_gpus): an
    empty item, a sign, a space or a duplicate is refused, since dropping one silently would let
    two runs claim the same GPU. An empty `--gpus` is refused too (leave the option out instead)."""
    try:
        gpus = nodefacts.parse_gpus(text)
    except ValueError as e:
        raise RunError(str(e)) from None
    if not gpus:
        raise RunError("--gpus '': expected comma-separated GPU indices, e.g. 0,1")
    return gpus


def check_gpus(gpus: object) -> list[int]:
    if not isinstance(gpus, (list, tuple)) or not all(type(g) is int and 0 <= g < 10000 for g in gpus):
        raise RunError(f"gpus {gpus!r}: expected a list of GPU indices (integers >= 0), e.g. [0, 1]")
    if len(set(gpus)) != len(gpus):
        raise RunError(f"gpus {list(gpus)!r} names a GPU twice")
    return list(gpus)


def _gpu_args(container: ContainerAPI, gpus: list[int] | None) -> list[str]:
    if gpus is None:
        gpus = getattr(container.target, "gpus", None)
    return ["--gpus", ",".join(str(g) for g in check_gpus(gpus))] if gpus else []


def _start(container: ContainerAPI, run_id: str, extra: list[str], stdin: bytes | None, gpus: list[int] | None) -> dict:
    release_root = posixpath.join(container.base_dir, "current")
    args = ["start", "--base", container.base_dir, "--run-id", run_id,
            "--release-root", release_root, "--python", container.target.python,
            *extra, *_gpu_args(container, gpus)]
    try:
        return call_json(container, args, stdin=stdin)
    except NotDeployed as e:
        name = container.target.name
        what = f"nothing is deployed on {name} yet (no {release_root})" if e.details.get("not_deployed") else str(e)
        raise NotDeployed(f"{what}: run `dflash-ops deploy {name}` first", e.details) from None


RESTART_RE = re.compile(r"^(no|on-failure(:[0-9]{1,4})?)$")


def check_restart(policy: str | None) -> list[str]:
    """`--restart no|on-failure|on-failure:N` as the runs helper's arguments ([] for none)."""
    if policy is None:
        return []
    if not RESTART_RE.match(policy):
        raise UsageError(f"--restart {policy!r}: use no, on-failure (3 restarts) or on-failure:N")
    return ["--restart", policy]


def start_run(container: ContainerAPI, config_path_local: Path | str, name: str | None = None,
              resume: str | int | None = None, gpus: list[int] | None = None,
              run_id: str | None = None, restart: str | None = None, queue: bool = False,
              notify: dict | None = None) -> str:
    """Start a run from the current release; the config travels on the helper's stdin.

    Fresh run: id `<name or "run">-YYYYmmdd-HHMMSS` unless run_id is given. With `resume`
    ("latest" or a step) run_id must name an existing, stopped run: it restarts from that
    checkpoint with this new config. `gpus` defaults to the target's GPUs; the helper refuses
    (GpusBusy) when a live run holds one of them. `restart` ("on-failure:N"): a supervisor in
    the container resumes the run from its latest checkpoint after a crash, at most N times.
    `queue`: when its GPUs are held the run waits in the container's queue (its state `queued`)
    and starts by itself once they are free. `notify` (notify_spec()): who hears of its state
    changes; it travels on stdin, never as an argument (a webhook URL is a secret).
    """
    config = Path(config_path_local).read_bytes()
    if resume is not None and run_id is None:
        raise UsageError("resuming with a new config needs the run_id of the run to resume")
    if queue and resume is not None:
        raise UsageError("--queue starts a fresh run; resume a run when its GPUs are free")
    extra = ["--config", "-", *check_restart(restart), *(["--queue"] if queue else [])]
    if notify and (notify.get("webhooks") or notify.get("commands")):
        extra.append("--notify-stdin")
        config = json.dumps(notify, sort_keys=True).encode() + b"\n" + config
    if resume is not None:
        extra += ["--resume", str(resume)]
    if run_id is not None:
        return _start(container, check_run_id(run_id), extra, config, gpus)["run_id"]
    return launch_fresh(name, lambda candidate: _start(container, candidate, extra, config, gpus)["run_id"],
                        "; pass a run id or --name")


def launch_fresh(name: str | None, launch: Callable[[str], str], exhausted: str) -> str:
    """launch(run id) with a fresh id (new_run_id), then with -2 .. -9 appended while the helper
    answers that the id exists; `exhausted` ends the error when all of them do."""
    base_id = new_run_id(name)
    for attempt in range(1, 10):
        try:
            return launch(base_id if attempt == 1 else f"{base_id}-{attempt}")
        except RunRefused as e:
            if not e.details.get("exists"):
                raise
    raise RunRefused(f"run ids {base_id}..-9 all exist{exhausted}")


def resume_run(container: ContainerAPI, run_id: str, from_step: int | None = None, gpus: list[int] | None = None,
               restart: str | None = None) -> str:
    """Restart a run that is not alive from its latest (or given) checkpoint, on the current release.

    A run that finished (`done`) resumes only from an explicit step: from its latest
    checkpoint there is nothing left to train. `restart` defaults to the run's own policy."""
    info = run_status(container, run_id)
    if from_step is None and info.effective_state == "done":
        raise RunRefused(f"run {run_id} is done: nothing to resume (pass --from STEP, or --config with more steps)")
    extra = ["--resume", "latest" if from_step is None else str(from_step),
             *check_restart(restart if restart is not None else info.restart_policy)]
    return _start(container, run_id, extra, None, gpus)["run_id"]


def request(container: ContainerAPI, run_id: str, kind: str) -> str:
    """Drop control/<kind> into the run; returns the request id (a pending one is reused)."""
    if kind not in REQUEST_KINDS:
        raise UsageError(f"request kind must be one of {REQUEST_KINDS}, not {kind!r}")
    return call(container, ["control", run_dir(container, run_id), kind]).stdout.strip()


def signal_run(container: ContainerAPI, run_id: str, signal: str) -> bool:
    """Send TERM or KILL to the run's recorded process (only if its pid_start matches)."""
    return call_json(container, ["signal", run_dir(container, run_id), signal])["sent"]


def wait_for_checkpoint(container: ContainerAPI, run_id: str, request_id: str, timeout: float = 600.0,
                        poll: float = 1.0) -> str:
    """Wait until the trainer's `checkpoint` event carries request_id; returns its path."""
    deadline = time.monotonic() + timeout
    offset = 0
    served: list[str] = []  # look() fills it; the loop returns as soon as it holds anything

    def look(line: bytes) -> None:
        event = parse_event(line)
        if isinstance(event, BadLine):
            return
        if event.get("event") == "checkpoint" and event.get("request") == request_id:
            served.append(str(event.get("path")))

    while True:
        try:
            offset = follow_file(container, run_id, "metrics.jsonl", look, offset=offset)
        except RunNotFound:
            pass  # no metrics.jsonl yet
        if served:
            return served[0]
        info = run_status(container, run_id)
        if info.final:
            raise RunError(f"run {run_id} ended ({info.effective_state}) before serving checkpoint request {request_id}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"checkpoint request {request_id} of run {run_id} not served within {timeout:g}s")
        time.sleep(poll)


def waiting_for(info: RunInfo) -> str:
    """What a stop waits for, from the run's own status: `state starting, phase fitting the target
    120/300` (run stop prints it while it waits)."""
    phase = phase_text(info.phase)
    if info.final:
        return f"{info.effective_state}; waiting for pid {info.pid} to exit"
    return f"state {info.effective_state}" + (f", phase {phase}" if phase else "") + (
        f", step {info.step}" if info.step else "")


def wait_until_final(container: ContainerAPI, run_id: str, timeout: float = 600.0, poll: float = 1.0,
                     on_wait: Callable[[RunInfo], None] | None = None) -> RunInfo:
    """Wait for a final state AND the trainer's exit (it writes `stopped` before it tears down),
    so that a resume right after never finds the run still running. on_wait: called with each
    status read while waiting (run stop says what it waits for)."""
    deadline = time.monotonic() + timeout
    while True:
        info = run_status(container, run_id)
        if info.final and not info.alive:
            return info
        if on_wait is not None:
            on_wait(info)
        if time.monotonic() > deadline:
            raise TimeoutError(f"run {run_id} not stopped after {timeout:g}s: {waiting_for(info)}")
        time.sleep(poll)


def checkpoint_run(container: ContainerAPI, run_id: str, wait: bool = False, timeout: float = 600.0,
                   poll: float = 1.0) -> tuple[str, str | None]:
    """Ask a live run for a checkpoint; returns (request id, checkpoint path when waited for)."""
    info = run_status(container, run_id)
    if info.final:
        raise RunError(f"run {run_id} is {info.effective_state}; only a live run can checkpoint")
    return request_checkpoint(container, run_id, wait, timeout, poll)


def request_checkpoint(container: ContainerAPI, run_id: str, wait: bool, timeout: float,
                       poll: float) -> tuple[str, str | None]:
    """(request id, checkpoint path when waited for) of a new checkpoint request."""
    request_id = request(container, run_id, "checkpoint")
    if not wait:
        return request_id, None
    return request_id, wait_for_checkpoint(container, run_id, request_id, timeout=timeout, poll=poll)


def stop_run(container: ContainerAPI, run_id: str, now: bool = False, kill: bool = False, wait: bool = True,
             timeout: float = 600.0, poll: float = 1.0, on_wait: Callable[[RunInfo], None] | None = None) -> RunInfo:
    """Stop a run and (by default) wait until its state is final.

    Default: a `stop` request, served at the next step boundary (final checkpoint, `stopped`).
    now=True: SIGTERM to the verified pid; the trainer checkpoints and stops at once, without
    waiting for the control poll. kill=True: SIGKILL (no checkpoint; for a trainer that no
    longer answers; the run then reads as failed).
    """
    info = run_status(container, run_id)
    if info.effective_state == "queued":
        info = unqueue(container, run_id, timeout=timeout, poll=poll)
        if info.effective_state == "stopped" and not info.has_status:
            return info
    if info.final and not info.alive:
        return info
    ask_to_stop(container, run_id, info, now=now, kill=kill)
    if not wait:
        return run_status(container, run_id)
    return wait_until_final(container, run_id, timeout=timeout, poll=poll, on_wait=on_wait)


def unqueue(container: ContainerAPI, run_id: str, timeout: float = 60.0, poll: float = 1.0) -> RunInfo:
    """Take a queued run out of its queue: a RunInfo `stopped` (removed before it started), or,
    when the queue worker was starting it just then, the run's status once it is a run."""
    removed = RunInfo(run_id=run_id, effective_state="stopped", reason="removed from the queue before it started")
    result = call_json(container, ["unqueue", container.base_dir, check_run_id(run_id)])["result"]
    if result == "removed":
        return removed
    deadline = time.monotonic() + timeout
    while True:
        try:
            info = run_status(container, run_id)
        except RunNotFound:
            if result == "starting":  # the worker held it, then served the stop recorded in it: never started
                return removed
            raise
        if info.effective_state != "queued":
            return info
        if time.monotonic() > deadline:
            raise TimeoutError(f"run {run_id} was being started from the queue and is still not a run after {timeout:g}s")
        time.sleep(poll)


def expected_starts(runs: list[RunInfo]) -> dict[str, float | None]:
    """Seconds until each queued run is expected to start: when the last run it waits for ends, from
    those runs' own ETAs (a queued run it waits for: that run's expected start, its length unknown
    until it trains: None). None when any of them has no ETA yet."""
    from dflash_ops.runs.report import run_eta

    by_id = {r.run_id: r for r in runs}
    out: dict[str, float | None] = {}
    for r in sorted((r for r in runs if r.effective_state == "queued"), key=lambda r: r.position or 0):
        ends: list[float | None] = []
        for name in r.waits_for:
            other = by_id.get(name.split()[0])
            if other is None:  # "being started": not a run
                ends.append(0.0)
            else:
                ends.append(None if other.effective_state == "queued" else run_eta(other))
        known = [e for e in ends if e is not None]
        out[r.run_id] = max(known, default=0.0) if len(known) == len(ends) else None
    return out


def queued_runs(container: ContainerAPI) -> list[RunInfo]:
    """The container's queue, first in line first (`run queue TARGET`)."""
    return sorted((r for r in list_runs(container) if r.effective_state == "queued"), key=lambda r: r.position or 0)


def ask_to_stop(container: ContainerAPI, run_id: str, info: RunInfo, now: bool, kill: bool) -> None:
    """KILL, TERM, or a stop request (when the run has not yet reached a final state)."""
    if kill:
        signal_run(container, run_id, "KILL")
    elif now:
        signal_run(container, run_id, "TERM")
    elif not info.final:
        request(container, run_id, "stop")

