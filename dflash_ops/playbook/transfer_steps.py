"""Playbook step types that move data and run services (see playbook/registry.py).

    - push: {src: ../build/model, dest: "${base_dir}/data/model"}    a local file/tree into the container
    - fetch: {src: "${base_dir}/runs/r/export", dest: out/export}   a container file/tree out (local path)
    - local: [python, -m, trainer.data.synth, ...]                        an argv on this machine (cwd: the playbook's dir;
                                                                     argv[0] `python`: the python running dflash-ops)
    - serve: {name: engine, argv: [...], port: 30000}               start a server in the container, wait until
                                                                     GET http://127.0.0.1:PORT/v1/models answers;
                                                                     provides endpoint; stopped when the playbook
                                                                     ends, also on failure (keep_running: true keeps it)
    - stop-serve: {name: engine}                                     stop it earlier

Local paths are relative to the playbook's directory, like deploy's extra_paths.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from dflash_ops.extras import trainer_missing, trainer_module_in
from dflash_ops.playbook.registry import NUMBER, StepContext, StepFailed, StepType, register_step
from dflash_ops.progress import ByteBar
from dflash_ops.services import service_log, start_service, stop_service, wait_service
from dflash_ops.transfer import TransferSummary, fetch_path, push_path


def _push(ctx: StepContext, params: dict) -> dict:
    src = ctx.local_path(str(params["src"]))
    return {"pushed": _transfer(ctx, params, push_path, f"push {src.name}", src, str(params["dest"]))}


def _fetch(ctx: StepContext, params: dict) -> dict:
    dest = ctx.local_path(str(params["dest"]))
    return {"fetched": _transfer(ctx, params, fetch_path, f"fetch {dest.name}", str(params["src"]), dest)}


def _transfer(ctx: StepContext, params: dict, transfer: Callable[..., TransferSummary], label: str,
              src: str | Path, dest: str | Path) -> str:
    with ByteBar(label) as bar:
        summary = transfer(ctx.container, src, dest, force=bool(params.get("force", False)), on_progress=bar.update)
    ctx.results.append(summary.to_json())
    ctx.say(summary.line())
    return summary.dest


def _local(ctx: StepContext, params: dict) -> dict:
    argv = [str(a) for a in params["argv"]]
    if not argv:
        raise StepFailed("local: empty argv")
    if argv[0] == "python":  # the interpreter (and venv) running dflash-ops, wherever it is
        argv[0] = sys.executable
    try:
        proc = subprocess.Popen(argv, cwd=ctx.playbook_dir, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
    except OSError as e:
        raise StepFailed(f"cannot run {argv[0]}: {e.strerror or e}") from None
    assert proc.stdout is not None  # stdout=PIPE
    lines = []
    for raw in proc.stdout:
        line = raw.decode(errors="replace").rstrip("\n")
        lines.append(line)
        ctx.say(line)
    code = proc.wait()
    if code != 0 and params.get("check", True):
        module = trainer_module_in("\n".join(lines[-20:]))
        if module:
            raise StepFailed(str(trainer_missing(f"{argv!r} (exit status {code})", [module])))
        raise StepFailed(f"{argv!r} exited with status {code}")
    return {"exit_code": code, "stdout": "\n".join(lines).strip()}


def _serve(ctx: StepContext, params: dict) -> dict:
    name = str(params.get("name", "engine"))
    port = int(params["port"])
    argv = [str(a) for a in params["argv"]]
    env = {str(k): str(v) for k, v in (params.get("env") or {}).items()}
    record = start_service(ctx.container, name, argv, cwd=params.get("cwd"), env=env, port=port)
    if not params.get("keep_running", False):
        ctx.cleanups.append((f"stop service {name}", lambda: _stop(ctx, name)))
    ctx.say(f"service {name} started (pid {record.get('pid')}); log: {service_log(ctx.container, name)}")
    endpoint = f"http://127.0.0.1:{port}"
    url = endpoint + str(params.get("health", "/v1/models"))
    wait_service(ctx.container, name, url, timeout=float(params.get("timeout", 900)))
    ctx.say(f"service {name} answers {url}")
    return {"endpoint": endpoint, "service": name}


def _stop(ctx: StepContext, name: str) -> None:
    done = stop_service(ctx.container, name)
    ctx.say(f"service {name} stopped ({len(done.get('signalled', []))} processes signalled)")


def _stop_serve(ctx: StepContext, params: dict) -> None:
    name = str(params.get("name", "engine"))
    ctx.cleanups[:] = [(label, fn) for label, fn in ctx.cleanups if label != f"stop service {name}"]
    _stop(ctx, name)


register_step(StepType("push", _push, required=("src", "dest"), optional=("force",), provides=("pushed",),
                       types={"src": str, "dest": str, "force": bool},
                       help="copy a local file or tree to a container path (incremental, verified, resumable)"))
register_step(StepType("fetch", _fetch, required=("src", "dest"), optional=("force",), provides=("fetched",),
                       types={"src": str, "dest": str, "force": bool},
                       help="copy a container file or tree to a local path (incremental, verified, resumable)"))
register_step(StepType("local", _local, required=("argv",), optional=("check",), provides=("exit_code", "stdout"),
                       types={"argv": list, "check": bool}, shorthand="argv",
                       help="run an argv on this machine, in the playbook's directory"))
register_step(StepType("serve", _serve, required=("argv", "port"),
                       optional=("name", "health", "timeout", "cwd", "env", "keep_running"),
                       provides=("endpoint", "service"),
                       types={"argv": list, "port": int, "name": str, "health": str, "timeout": NUMBER,
                              "cwd": str, "env": dict, "keep_running": bool},
                       help="start a serving engine in the container and wait until it answers"))
register_step(StepType("stop-serve", _stop_serve, optional=("name",), types={"name": str}, shorthand="name",
                       help="stop a service a serve step started"))
