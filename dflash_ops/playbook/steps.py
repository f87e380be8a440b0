"""The registry of playbook step types.

A step type is a name (the step's key in YAML), the parameters it takes, the variables it
provides to later steps, and a function `run(ctx, params) -> dict | None` (the returned dict
becomes variables). Adding a step type is one `register_step(StepType(...))` call.

The run-lifecycle steps (start, wait, checkpoint, stop, follow) are declared here as slots
with their parameters, so playbooks using them validate today; their `run` is bound to a
`dflash_ops.runs` function by `bind_run_step(name, func)` once that library exists.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from dflash_ops import render
from dflash_ops.errors import CommandTimeout, DflashOpsError, RemoteCommandError


class StepFailed(DflashOpsError):
    """A playbook step could not do its job."""


@dataclass
class StepContext:
    """What a running step sees: its target's container and the variables so far."""

    container: Any
    target: str
    variables: dict[str, Any]
    playbook_dir: Path
    say: Callable[[str], None] = print
    results: list[dict] = field(default_factory=list)


StepRun = Callable[[StepContext, dict], "dict | None"]


@dataclass(frozen=True)
class StepType:
    name: str
    run: StepRun
    required: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    provides: tuple[str, ...] = ()
    types: dict[str, type | tuple[type, ...]] = field(default_factory=dict)
    shorthand: str | None = None  # `exec: [a, b]` means `exec: {argv: [a, b]}`
    help: str = ""

    @property
    def params(self) -> tuple[str, ...]:
        return self.required + self.optional


STEP_TYPES: dict[str, StepType] = {}


def register_step(step_type: StepType, *, replace_existing: bool = False) -> None:
    if step_type.name in STEP_TYPES and not replace_existing:
        raise ValueError(f"step type {step_type.name!r} is already registered")
    STEP_TYPES[step_type.name] = step_type


def _deploy(ctx: StepContext, params: dict) -> dict:
    """Deploy with the target's inventory settings (as `dflash-ops deploy` does); the step's
    `extra_paths` add to them, its `keep` and `venv` override them."""
    from dflash_ops.deploy.push import deploy_target, target_options
    from dflash_ops.deploy.venv_spec import VenvSpec

    extra = [p if Path(p).is_absolute() else ctx.playbook_dir / p for p in params.get("extra_paths", [])]
    keep = int(params["keep"]) if "keep" in params else None
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be at least 1 (the current release), got {keep}")
    options = target_options(ctx.container.target, extra_paths=extra, keep=keep)
    if "venv" in params:
        venv_config = params["venv"]
        options["venv"] = None if venv_config is False else VenvSpec.from_config(venv_config or {}, base=ctx.playbook_dir)
    summary = deploy_target(ctx.container, **options)
    ctx.results.append(summary.to_json())
    ctx.say(f"release {summary.release} ({summary.action}; {summary.files_sent} files, "
            f"{summary.bytes_sent} bytes sent; venv {summary.venv_action})")
    base = ctx.container.base_dir
    python = f"{base}/{summary.venv}/bin/python" if summary.venv else ctx.container.target.python
    return {"release": summary.release, "release_python": python}


def _exec(ctx: StepContext, params: dict) -> dict:
    argv = [str(a) for a in params["argv"]]
    timeout = params.get("timeout")
    command, transport_timeout = (argv, None) if timeout is None else render.killed_after(float(timeout), argv)
    result = ctx.container.exec(command, timeout=transport_timeout,
                                on_line=lambda line: ctx.say(line.decode(errors="replace").rstrip("\n")))
    if timeout is not None and result.exit_code in render.TIMED_OUT:
        raise CommandTimeout(render.node_command(argv), float(timeout))
    if params.get("check", True) and not result.ok:
        raise RemoteCommandError(argv, result.exit_code, result.stderr)
    return {"exit_code": result.exit_code, "stdout": result.stdout.strip()}


def _sleep(ctx: StepContext, params: dict) -> None:
    time.sleep(float(params["seconds"]))


def _echo(ctx: StepContext, params: dict) -> None:
    ctx.say(str(params["message"]))


_NUMBER = (int, float)
register_step(StepType("deploy", _deploy, optional=("extra_paths", "keep", "venv"), provides=("release", "release_python"),
                       types={"extra_paths": list, "keep": int, "venv": (dict, bool)},
                       help="push the code release, helpers and venv; `current` points at it"))
register_step(StepType("exec", _exec, required=("argv",), optional=("check", "timeout"), provides=("exit_code", "stdout"),
                       types={"argv": list, "check": bool, "timeout": _NUMBER}, shorthand="argv",
                       help="run an argv in the container (a list, never a shell string)"))
register_step(StepType("sleep", _sleep, required=("seconds",), types={"seconds": _NUMBER}, shorthand="seconds",
                       help="pause for a number of seconds"))
register_step(StepType("echo", _echo, required=("message",), shorthand="message", help="print a message"))


def _not_wired(name: str, library_function: str) -> StepRun:
    def run(ctx: StepContext, params: dict) -> None:
        raise StepFailed(f"step {name!r} is not wired yet: it needs dflash_ops.runs.{library_function}")

    return run


RUN_STEP_SLOTS: dict[str, tuple[str, StepType]] = {
    "start": ("start_run", StepType("start", _not_wired("start", "start_run"), required=("config",),
                                    optional=("run_id", "args", "gpus"), provides=("run_id",),
                                    types={"args": list, "gpus": list}, help="start a detached training run")),
    "wait": ("wait_for_checkpoint", StepType("wait", _not_wired("wait", "wait_for_checkpoint"), required=("run_id",),
                                             optional=("state", "step", "timeout"), types={"timeout": _NUMBER},
                                             help="wait for a run to reach a state or step")),
    "checkpoint": ("request", StepType("checkpoint", _not_wired("checkpoint", "request"), required=("run_id",),
                                       optional=("wait", "timeout"), provides=("checkpoint",),
                                       types={"wait": bool, "timeout": _NUMBER}, help="ask a run for a checkpoint")),
    "stop": ("stop_run", StepType("stop", _not_wired("stop", "stop_run"), required=("run_id",), optional=("timeout",),
                                  types={"timeout": _NUMBER}, help="stop a run (final checkpoint first)")),
    "follow": ("follow_file", StepType("follow", _not_wired("follow", "follow_file"), required=("run_id",),
                                       optional=("file", "until", "timeout"), provides=("final_loss", "tau", "state"),
                                       types={"timeout": _NUMBER}, help="follow a run's log/metrics until it ends")),
}
for _library_function, _slot in RUN_STEP_SLOTS.values():
    register_step(_slot)


def bind_run_step(name: str, run: StepRun) -> None:
    """Give a run-lifecycle slot its implementation, keeping its declared parameters."""
    register_step(replace(STEP_TYPES[name], run=run), replace_existing=True)

import dflash_ops.playbook.run_steps  # noqa: E402,F401  (registers start/follow/wait/checkpoint/stop; needs the names above)
