"""Playbook step types for runs: start, follow, wait, checkpoint, stop (see playbook/registry.py).

    - start: {config: trainer/configs/tiny-cpu.yaml}     provides run_id, run_dir
      (set: {model.target.path: /models/m}: dotted config keys to override)
    - start: {config: C, targets: ["${target}", host300]}   one run across hosts (a rank per target)
    - follow: {run_id: "${run_id}"}                      progress bar until the run is final;
                                                         provides state, step, final_loss, tau
    - wait: {run_id: "${run_id}", step: 50}              until step >= 50 (or state: X, or final)
    - checkpoint: {run_id: "${run_id}", wait: true}      provides checkpoint
    - stop: {run_id: "${run_id}"}                        final checkpoint; provides state, step
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from dflash_ops.playbook.registry import NUMBER, StepContext, StepFailed, StepType, register_step
from dflash_ops.runs import checkpoint_run, follow_file, run_status, start_run, stop_run
from dflash_ops.runs.events import BadLine, parse_event
from dflash_ops.runs.info import RunInfo
from dflash_ops.runs.lifecycle import check_gpus
from dflash_ops.yamlfile import read_yaml_node
from trainer.run import yamlsafe
from trainer.run.contract import phase_text

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

DEFAULT_TIMEOUT = 3600.0


def resolve_config(ctx: StepContext, config: str) -> Path:
    """A relative config path: from the current directory, else the playbook's directory or its parent."""
    path = Path(config)
    candidates = [path] if path.is_absolute() else [path, ctx.playbook_dir / path, ctx.playbook_dir.parent / path]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise StepFailed(f"config {config!r} not found (looked in: {', '.join(str(c) for c in candidates)})")


def with_settings(config: Path, settings: dict) -> bytes:
    """The config's YAML with dotted keys set, e.g. {"model.target.path": "/models/Qwen3-8B"}.

    The trainer validates the result when the run starts (unknown keys, types, ranges)."""
    loader, node = read_yaml_node(config, "trainer config", StepFailed)
    doc = loader.construct_object(node, deep=True) if node is not None else {}
    if not isinstance(doc, dict):
        raise StepFailed(f"{config}:1: a trainer config is a mapping; set: cannot apply")
    for dotted, value in settings.items():
        keys = str(dotted).split(".")
        node = doc
        for key in keys[:-1]:
            child = node.get(key)
            if child is None:
                child = node[key] = {}
            if not isinstance(child, dict):
                raise StepFailed(f"set {dotted}: {key} is not a mapping in {config}")
            node = child
        node[keys[-1]] = value
    return yamlsafe.dump(doc).encode()


def _start(ctx: StepContext, params: dict) -> dict:
    config = resolve_config(ctx, str(params["config"]))
    gpus = check_gpus(params["gpus"]) if params.get("gpus") is not None else None
    settings = params.get("set") or {}
    targets = params.get("targets")
    if targets is not None and (ctx.open_target is None or params.get("run_id") is not None):
        raise StepFailed("start over several targets: needs the inventory (dflash-ops play) and no run_id")
    restart = params.get("restart")
    if targets is not None and restart not in (None, "no"):
        raise StepFailed("start over several targets: restart is not supported across hosts yet")
    with tempfile.TemporaryDirectory(prefix="dflash-config-") as tmp:
        sent = config
        if settings:
            sent = Path(tmp) / config.name
            sent.write_bytes(with_settings(config, settings))
        if targets is not None:
            from dflash_ops.runs.group import start_group

            names = [str(t) for t in targets]
            opened = [ctx.container if n == ctx.target else ctx.open_target(n) for n in names]  # type: ignore[misc]
            run_id = start_group(opened, names, sent, name=params.get("name"), gpus=gpus)
        else:
            run_id = start_run(ctx.container, sent, name=params.get("name"), gpus=gpus, run_id=params.get("run_id"),
                               restart=restart)
    where = f" on {', '.join(str(t) for t in targets)}" if targets is not None else ""
    ctx.say(f"started {run_id}{where} ({config}{', with ' + ', '.join(settings) if settings else ''})")
    return {"run_id": run_id, "run_dir": f"{ctx.container.base_dir}/runs/{run_id}"}


class RunProgress:
    """Reads metrics.jsonl events: a rich progress bar over step events; remembers the last loss and tau."""

    def __init__(self, run_id: str, bar: Progress | None = None) -> None:
        self.run_id = run_id
        self.bar = bar
        self.task: TaskID | None = None
        self.total: int | None = None
        self.step = 0
        self.loss: float | None = None
        self.tau: float | None = None
        self.phase = "starting"  # what the run does (its `phase` events), shown until the first loss

    def on_line(self, line: bytes) -> None:
        event = parse_event(line)
        if isinstance(event, BadLine):
            return
        kind = event.get("event")
        if kind == "start":
            self.total = event.get("total_steps")
            self.step = event.get("step") or 0
        elif kind == "step":
            self.step = event.get("step", self.step)
            self.loss = event.get("loss", self.loss)
        elif kind == "eval":
            self.tau = event.get("tau", self.tau)
        elif kind == "phase":
            self.phase = phase_text(event) or self.phase
        self._draw()

    def _draw(self) -> None:
        if self.bar is None:
            return
        loss = f"loss {self.loss:.4f}" if isinstance(self.loss, (int, float)) else self.phase
        if self.task is None:
            self.task = self.bar.add_task(self.run_id, total=self.total, loss=loss)
        self.bar.update(self.task, completed=self.step, total=self.total, loss=loss)


def _progress_bar() -> Progress:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[loss]}"), TimeElapsedColumn(), console=Console(stderr=True))


def _follow(ctx: StepContext, params: dict) -> dict:
    run_id = str(params["run_id"])
    with _progress_bar() as bar:
        progress = RunProgress(run_id, bar)
        follow_file(ctx.container, run_id, "metrics.jsonl", progress.on_line, follow=True,
                    timeout=float(params.get("timeout", DEFAULT_TIMEOUT)))
    info = run_status(ctx.container, run_id)
    final_loss = progress.loss if progress.loss is not None else info.loss
    ctx.say(f"{run_id}: {info.effective_state} at step {info.step}; final loss {_fmt(final_loss)}, "
            f"acceptance length tau {_fmt(progress.tau)}")
    if info.effective_state == "failed":
        raise StepFailed(_failure(info))
    return {"state": info.effective_state, "step": info.step, "final_loss": _fmt(final_loss), "tau": _fmt(progress.tau)}


def _fmt(value: object) -> str:
    return f"{value:.4f}" if isinstance(value, (int, float)) else "n/a"


def _failure(info: RunInfo) -> str:
    why = info.reason or (info.error or {}).get("message") or "failed"
    tail = (info.log_tail or "").rstrip().splitlines()[-5:]
    return f"run {info.run_id} failed: {why}" + ("\n" + "\n".join(tail) if tail else "")


def _wait(ctx: StepContext, params: dict) -> dict:
    run_id = str(params["run_id"])
    deadline = time.monotonic() + float(params.get("timeout", DEFAULT_TIMEOUT))
    while True:
        info = run_status(ctx.container, run_id)
        reached = (("state" in params and info.effective_state == params["state"])
                   or ("step" in params and (info.step or 0) >= int(params["step"])))
        if reached or info.final:
            break
        if time.monotonic() > deadline:
            raise StepFailed(f"run {run_id} still {info.effective_state} at step {info.step} after the timeout")
        time.sleep(1.0)
    if not reached and (params.get("state") or params.get("step") is not None):
        raise StepFailed(f"run {run_id} ended {info.effective_state} at step {info.step} before the wait was met")
    ctx.say(f"{run_id}: {info.effective_state} at step {info.step}")
    return {"state": info.effective_state, "step": info.step}


def _checkpoint(ctx: StepContext, params: dict) -> dict:
    run_id = str(params["run_id"])
    request_id, path = checkpoint_run(ctx.container, run_id, wait=bool(params.get("wait", True)),
                                      timeout=float(params.get("timeout", DEFAULT_TIMEOUT)))
    ctx.say(f"{run_id}: checkpoint {path or 'requested'} ({request_id})")
    return {"checkpoint": path or ""}


def _stop(ctx: StepContext, params: dict) -> dict:
    run_id = str(params["run_id"])
    info = stop_run(ctx.container, run_id, now=bool(params.get("now", False)),
                    timeout=float(params.get("timeout", DEFAULT_TIMEOUT)))
    ctx.say(f"{run_id}: {info.effective_state} at step {info.step} ({info.last_checkpoint or 'no checkpoint'})")
    return {"state": info.effective_state, "step": info.step}


RUN_STEPS = [
    StepType("start", _start, required=("config",), optional=("name", "gpus", "run_id", "set", "targets", "restart"),
             provides=("run_id", "run_dir"), types={"gpus": list, "name": str, "run_id": str, "set": dict, "targets": list,
                                                    "restart": str},
             help="start a detached training run (set: dotted config keys to override; targets: one run across hosts; "
                  "restart: on-failure[:N] resumes it after a crash)"),
    StepType("follow", _follow, required=("run_id",), optional=("timeout",),
             provides=("state", "step", "final_loss", "tau"), types={"timeout": NUMBER},
             help="follow a run to its end with a progress bar; fails if the run fails"),
    StepType("wait", _wait, required=("run_id",), optional=("state", "step", "timeout"), provides=("state", "step"),
             types={"timeout": NUMBER, "step": int, "state": str},
             help="wait for a run to reach a state or a step (or any final state)"),
    StepType("checkpoint", _checkpoint, required=("run_id",), optional=("wait", "timeout"), provides=("checkpoint",),
             types={"wait": bool, "timeout": NUMBER}, help="ask a run for a checkpoint (and wait for it)"),
    StepType("stop", _stop, required=("run_id",), optional=("now", "timeout"), provides=("state", "step"),
             types={"now": bool, "timeout": NUMBER}, help="stop a run with a final checkpoint"),
]
for _step_type in RUN_STEPS:
    register_step(_step_type)
