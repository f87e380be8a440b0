"""Start, list, control and stop runs on one container, through the `runs` helper."""

from __future__ import annotations

import json
import posixpath
import re
import time
from pathlib import Path

from dflash_ops.runs.follow import follow_file
from dflash_ops.runs.helper import call, call_json, run_dir
from dflash_ops.runs.info import RunError, RunInfo, RunNotFound

REQUEST_KINDS = ("checkpoint", "stop")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,100}$")


def list_runs(container) -> list[RunInfo]:
    """Every run of the container, one helper call."""
    doc = call_json(container, ["list", container.base_dir])
    return [RunInfo.from_json(r) for r in doc["runs"]]


def run_status(container, run_id: str) -> RunInfo:
    doc = call_json(container, ["list", container.base_dir, "--run", run_id])
    return RunInfo.from_json(doc["runs"][0])


def new_run_id(name: str | None = None, now: float | None = None) -> str:
    prefix = name or "run"
    if not NAME_RE.match(prefix):
        raise ValueError(f"run name {prefix!r}: use letters, digits, '.', '_' and '-'")
    return f"{prefix}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(now))}"


def _release_root(container) -> str:
    return posixpath.join(container.base_dir, "current")


def _gpu_args(container, gpus: list[int] | None) -> list[str]:
    if gpus is None:
        gpus = getattr(container.target, "gpus", None)
    return ["--gpus", ",".join(str(g) for g in gpus)] if gpus else []


def _start(container, run_id: str, extra: list[str], stdin: bytes | None, gpus: list[int] | None) -> dict:
    args = ["start", "--base", container.base_dir, "--run-id", run_id,
            "--release-root", _release_root(container), "--python", container.target.python,
            *extra, *_gpu_args(container, gpus)]
    return call_json(container, args, stdin=stdin)


def start_run(container, config_path_local: Path | str, name: str | None = None,
              resume: str | int | None = None, gpus: list[int] | None = None,
              run_id: str | None = None) -> str:
    """Start a run from the current release; the config travels on the helper's stdin.

    Fresh run: id `<name or "run">-YYYYmmdd-HHMMSS` unless run_id is given. With `resume`
    ("latest" or a step) run_id must name an existing, stopped run: it restarts from that
    checkpoint with this new config. `gpus` defaults to the target's GPUs; the helper refuses
    (GpusBusy) when a live run holds one of them.
    """
    config = Path(config_path_local).read_bytes()
    if resume is not None and run_id is None:
        raise ValueError("resuming with a new config needs the run_id of the run to resume")
    run_id = run_id or new_run_id(name)
    extra = ["--config", "-"]
    if resume is not None:
        extra += ["--resume", str(resume)]
    return _start(container, run_id, extra, config, gpus)["run_id"]


def resume_run(container, run_id: str, from_step: int | None = None, gpus: list[int] | None = None) -> str:
    """Restart a run that is not alive from its latest (or given) checkpoint, on the current release."""
    extra = ["--resume", "latest" if from_step is None else str(from_step)]
    return _start(container, run_id, extra, None, gpus)["run_id"]


def request(container, run_id: str, kind: str) -> str:
    """Drop control/<kind> into the run; returns the request id (a pending one is reused)."""
    if kind not in REQUEST_KINDS:
        raise ValueError(f"request kind must be one of {REQUEST_KINDS}, not {kind!r}")
    return call(container, ["control", run_dir(container, run_id), kind]).stdout.strip()


def signal_run(container, run_id: str, signal: str) -> bool:
    """Send TERM or KILL to the run's recorded process (only if its pid_start matches)."""
    return call_json(container, ["signal", run_dir(container, run_id), signal])["sent"]


def wait_for_checkpoint(container, run_id: str, request_id: str, timeout: float = 600.0,
                        poll: float = 1.0) -> str:
    """Wait until the trainer's `checkpoint` event carries request_id; returns its path."""
    deadline = time.monotonic() + timeout
    offset = 0
    while True:
        served: list[str] = []

        def look(line: bytes) -> None:
            try:
                event = json.loads(line)
            except ValueError:
                return
            if event.get("event") == "checkpoint" and event.get("request") == request_id:
                served.append(event.get("path"))

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


def wait_until_final(container, run_id: str, timeout: float = 600.0, poll: float = 1.0) -> RunInfo:
    deadline = time.monotonic() + timeout
    while True:
        info = run_status(container, run_id)
        if info.final:
            return info
        if time.monotonic() > deadline:
            raise TimeoutError(f"run {run_id} still {info.effective_state} after {timeout:g}s")
        time.sleep(poll)


def stop_run(container, run_id: str, now: bool = False, wait: bool = True,
             timeout: float = 600.0, poll: float = 1.0) -> RunInfo:
    """Stop a run: by a `stop` request (final checkpoint, state stopped), or with now=True by
    SIGKILL of the verified pid (no checkpoint; for a trainer that no longer answers)."""
    if now:
        signal_run(container, run_id, "KILL")
    else:
        request(container, run_id, "stop")
    if not wait:
        return run_status(container, run_id)
    return wait_until_final(container, run_id, timeout=timeout, poll=poll)

