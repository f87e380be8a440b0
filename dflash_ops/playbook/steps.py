"""The basic playbook step types: deploy, exec, sleep, echo (the run steps are in run_steps.py)."""

from __future__ import annotations

import time

from dflash_ops.container import exec_killed_after
from dflash_ops.errors import RemoteCommandError, UsageError
from dflash_ops.helpers import venvs
from dflash_ops.playbook.registry import NUMBER, StepContext, StepType, register_step


def _deploy(ctx: StepContext, params: dict) -> dict:
    """Deploy with the target's inventory settings (as `dflash-ops deploy` does); the step's
    `extra_paths` add to them, its `keep` and `venv` override them."""
    from dflash_ops.deploy.push import deploy_target, target_options
    from dflash_ops.deploy.venv_spec import VenvSpec

    extra = [ctx.local_path(str(p)) for p in params.get("extra_paths", [])]
    keep = int(params["keep"]) if "keep" in params else None
    if keep is not None and keep < 1:
        raise UsageError(f"keep must be at least 1 (the current release), got {keep}")
    container = ctx.container
    if params.get("target") not in (None, ctx.target):  # another target (a peer of a run across hosts)
        if ctx.open_target is None:
            raise UsageError("deploy to another target needs the inventory (dflash-ops play)")
        container = ctx.open_target(str(params["target"]))
    options = target_options(container.target, extra_paths=extra, keep=keep)
    if "venv" in params:
        venv_config = params["venv"]
        options["venv"] = None if venv_config is False else VenvSpec.from_config(venv_config or {}, base=ctx.playbook_dir)
    summary = deploy_target(container, **options)
    ctx.results.append(summary.to_json())
    ctx.say(f"release {summary.release} ({summary.action}; {summary.files_sent} files, "
            f"{summary.bytes_sent} bytes sent; venv {summary.venv_action})")
    base = container.base_dir
    python = venvs.python(base, summary.venv) if summary.venv else container.target.python
    return {"release": summary.release, "release_python": python}


def _exec(ctx: StepContext, params: dict) -> dict:
    argv = [str(a) for a in params["argv"]]
    timeout = params.get("timeout")
    def say(line: bytes) -> None:
        ctx.say(line.decode(errors="replace").rstrip("\n"))

    result = exec_killed_after(ctx.container, argv, None if timeout is None else float(timeout),
                               on_line=say, on_stderr_line=say)
    if params.get("check", True) and not result.ok:
        raise RemoteCommandError(argv, result.exit_code, result.stderr)
    return {"exit_code": result.exit_code, "stdout": result.stdout.strip()}


def _sleep(ctx: StepContext, params: dict) -> None:
    time.sleep(float(params["seconds"]))


def _echo(ctx: StepContext, params: dict) -> None:
    ctx.say(str(params["message"]))


register_step(StepType("deploy", _deploy, optional=("extra_paths", "keep", "venv", "target"),
                       provides=("release", "release_python"),
                       types={"extra_paths": list, "keep": int, "venv": (dict, bool), "target": str},
                       help="push the code release, helpers and venv; `current` points at it (target: another one)"))
register_step(StepType("exec", _exec, required=("argv",), optional=("check", "timeout"), provides=("exit_code", "stdout"),
                       types={"argv": list, "check": bool, "timeout": NUMBER}, shorthand="argv",
                       help="run an argv in the container (a list, never a shell string)"))
register_step(StepType("sleep", _sleep, required=("seconds",), types={"seconds": NUMBER}, shorthand="seconds",
                       help="pause for a number of seconds"))
register_step(StepType("echo", _echo, required=("message",), shorthand="message", help="print a message"))
