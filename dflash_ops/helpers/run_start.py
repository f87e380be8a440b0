"""`runs.py start`: check a run's GPUs and run directory under the start lock, build the
trainer's command line (trainer_argv, the one place it is built: the start, a resume and the
supervisor's restarts all use it), start the trainer, directly or under `runs.py supervise`, and
record launch.json (stdlib only, python3.8+).

Not a helper: a shared module shipped beside runs.py (dflash_ops/helpers/__init__.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

from . import nodefacts, notify, run_events, run_protocol, runqueue, venvs

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (~10 ms at start on 3.8)
if TYPE_CHECKING:
    import subprocess

CHILD_PATH_TAIL = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PASSED_THROUGH_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "HF_HOME", "HF_TOKEN", "TMPDIR", "TZ")
DEFAULT_RESTARTS = 3
RUNS_SCRIPT = "runs.py"  # the dispatcher beside this file: the supervisor runs as `runs.py supervise`

Refused = nodefacts.Refused
print_json = nodefacts.print_json
read_json = nodefacts.read_json
write_atomic = nodefacts.write_atomic
EXIT_REFUSED, EXIT_NOT_DEPLOYED = run_protocol.EXIT_REFUSED, run_protocol.EXIT_NOT_DEPLOYED
EXIT_DIED_AT_START, LOG_TAIL_LINES = run_protocol.EXIT_DIED_AT_START, run_protocol.LOG_TAIL_LINES
RESTARTS_FILE, NO_RESTART = run_protocol.RESTARTS_FILE, run_protocol.NO_RESTART
check_run_id, run_dirs, run_gpus = run_protocol.check_run_id, run_protocol.run_dirs, run_protocol.run_gpus
oom_kills, tail_lines = run_protocol.oom_kills, run_protocol.tail_lines


def set_aside_stale_requests(run_dir: str) -> list[str]:
    """Control requests left by a trainer that was killed before it served them: a stale
    `stop` would stop the resumed run at its first step. They are renamed (kept, not
    deleted) to control/.KIND.stale-TIME; returns the kinds set aside."""
    control = os.path.join(run_dir, "control")
    stale = []
    for kind in ("stop", "checkpoint"):
        path = os.path.join(control, kind)
        if os.path.isfile(path):
            os.rename(path, os.path.join(control, ".%s.stale-%d" % (kind, time.time() * 1000)))
            stale.append(kind)
    return stale



def gpu_conflicts(base: str, wanted: list[int], own_run_dir: str) -> list[dict]:
    conflicts = []
    for run_dir in run_dirs(base):
        if os.path.abspath(run_dir) == os.path.abspath(own_run_dir):
            continue
        status = read_json(os.path.join(run_dir, "status.json"))
        pid = nodefacts.live_pid(run_dir, status)  # the trainer's, or between two attempts its supervisor's
        if pid is None:
            continue
        held = sorted(set(run_gpus(run_dir, status)) & set(wanted))
        if held:
            conflicts.append({"run_id": os.path.basename(run_dir), "pid": pid, "gpus": held})
    return conflicts


def release_hash(release_root: str) -> str:
    doc = read_json(os.path.join(release_root, ".dflash-release.json"))
    if doc and isinstance(doc.get("hash"), str) and doc["hash"]:
        return doc["hash"]
    return "dev"


def release_python(base: str, release_root: str, fallback: str) -> str:
    """The release's venv python (docs/container-layout.md), else the given python."""
    doc = read_json(os.path.join(release_root, ".dflash-release.json")) or {}
    python = venvs.release_python(base, doc)
    if python is None:
        return fallback
    if not os.path.exists(python):
        raise Refused("release %s names venv %s but %s is missing; redeploy" % (
            doc.get("hash"), venvs.release_venv(doc), python), code=EXIT_NOT_DEPLOYED)
    return python


def child_env(python: str, gpus: list[int], extra: list[str]) -> dict[str, str]:
    env = {
        "PATH": os.path.dirname(os.path.abspath(python)) + ":" + CHILD_PATH_TAIL,
        "HOME": os.environ.get("HOME") or "/root",
        "LANG": "C.UTF-8",
        "PYTHONUNBUFFERED": "1",
    }
    for key in PASSED_THROUGH_ENV:
        if key in os.environ:
            env[key] = os.environ[key]
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    for item in extra:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise Refused("--env wants KEY=VALUE, got %r" % item)
        env[key] = value
    return env


def cmd_start(args: argparse.Namespace) -> None:
    check_run_id(args.run_id)
    release_root = os.path.realpath(args.release_root)
    if not os.path.isdir(release_root):
        raise Refused("nothing deployed: %s does not exist" % args.release_root, code=EXIT_NOT_DEPLOYED, not_deployed=True)
    python = release_python(args.base, release_root, args.python)
    runs_root = os.path.join(args.base, "runs")
    run_dir = os.path.join(runs_root, args.run_id)
    try:
        gpus = nodefacts.parse_gpus(args.gpus)
    except ValueError as e:
        raise Refused(str(e)) from None
    config_bytes = None
    spec = None
    if args.notify_stdin:  # stdin: the spec's JSON line, then the config (the secret never is an argument)
        line, _, rest = sys.stdin.buffer.read().partition(b"\n")
        spec = run_events.check_notify(line.decode("utf-8", "replace"), "--notify-stdin")
        if args.config == "-":
            config_bytes = rest
    elif args.notify_file:
        spec = run_events.check_notify(read_bytes(args.notify_file).decode("utf-8", "replace"), args.notify_file)
    if config_bytes is None and args.config is not None:
        config_bytes = sys.stdin.buffer.read() if args.config == "-" else read_bytes(args.config)
    if args.resume is None and config_bytes is None:
        raise Refused("--config is required to start a fresh run")
    if args.group is not None and not (args.nnodes and args.rdzv_endpoint and args.local_addr):
        raise Refused("--group needs --nnodes, --rdzv-endpoint and --local-addr")
    if args.group is not None and args.queue:
        raise Refused("--queue: a run across hosts is not queued (its ranks must start together)")
    if spec is None and args.resume is not None:
        # a resume (`run resume`, `patch --restart`) keeps who hears of the run: it was the run's
        # duty before, and a resume that names nobody new must not switch its events off
        spec = notify.read_spec(run_dir)
    max_restarts = parse_restart(args.restart)
    if spec is not None and max_restarts is None:
        max_restarts = 0  # supervised all the same: the supervisor sees the end and sends its event
    lock = nodefacts.start_lock(runs_root)
    try:
        queued = queue_if_held(args, run_dir, release_root, gpus, config_bytes, spec) if args.queue else None
        child = None if queued else launch(args, run_dir, release_root, python, gpus, config_bytes, max_restarts, spec)
    finally:
        os.close(lock)  # the child's launch.json is written: the next start sees its GPUs
    if child is None:
        assert queued is not None
        run_events.ensure_worker(args.base)
        run_events.send_event(args.base, spec, args.run_id, "queued", reason="; ".join(queued["waits_for"]))
        print_json(queued)
        return

    status_path = os.path.join(run_dir, "status.json")
    launch_path = os.path.join(run_dir, "launch.json")
    deadline = time.time() + args.wait
    while time.time() < deadline:
        code = child.poll()  # the trainer, or its supervisor (which exits with the trainer's status)
        status = read_json(status_path)
        trainer = child.pid if max_restarts is None else (read_json(launch_path) or {}).get("pid")
        if status is not None and trainer is not None and status.get("pid") == trainer:
            break
        if code is not None:
            tail = tail_lines(os.path.join(run_dir, "train.log"), LOG_TAIL_LINES)
            raise Refused("trainer exited with status %d before writing status.json" % code, code=EXIT_DIED_AT_START,
                          exit_code=code, log_tail=tail, run_id=args.run_id)
        time.sleep(0.02)
    print_json({"run_id": args.run_id, "pid": (read_json(launch_path) or {}).get("pid") or child.pid,
                "run_dir": run_dir, "state": (read_json(status_path) or {}).get("state", "starting"),
                "restart": args.restart or "no"})


def parse_restart(text: str | None) -> int | None:
    """--restart no|on-failure|on-failure:N -> None (not supervised) or N restarts at most."""
    if text in (None, "", "no"):
        return None
    m = re.match(r"^on-failure(?::([0-9]{1,4}))?$", text or "")
    if not m:
        raise Refused("--restart wants no, on-failure or on-failure:N, got %r" % text)
    return DEFAULT_RESTARTS if m.group(1) is None else int(m.group(1))


def trainer_argv(args: argparse.Namespace, python: str, config: str, run_dir: str, resume: str | None) -> list[str]:
    """The trainer's command line, the one place it is built: `python -m trainer`, under
    `python -m trainer launch` (torchrun) for a rank of a run across hosts, resuming from `resume`
    (a step, `latest`) when given. The start runs it; the supervisor restarts with resume="latest",
    or None when no checkpoint exists yet."""
    argv = [python, "-m", "trainer"]
    if args.group is not None:
        argv += ["launch", "--nnodes", str(args.nnodes), "--rdzv-endpoint", args.rdzv_endpoint,
                 "--rdzv-id", args.run_id, "--local-addr", args.local_addr]
        argv += ["--store-host"] if args.store_host else []
    argv += ["--config", config, "--run-dir", run_dir]
    return argv + (["--resume", resume] if resume is not None else [])


def launch(args: argparse.Namespace, run_dir: str, release_root: str, python: str, gpus: list[int],
           config_bytes: bytes | None, max_restarts: int | None = None,
           spec: dict | None = None) -> subprocess.Popen[bytes]:
    """Check GPUs and the run directory, then start the trainer and record launch.json
    (called under start_lock). Returns the trainer's process; it logs to RUNDIR/train.log."""
    conflicts = gpu_conflicts(args.base, gpus, run_dir)
    if conflicts:
        names = ", ".join("%s (pid %d) holds GPU %s" % (c["run_id"], c["pid"], ",".join(map(str, c["gpus"])))
                          for c in conflicts)
        raise Refused("GPUs busy: " + names, code=EXIT_REFUSED, conflicts=conflicts)
    config_input = os.path.join(run_dir, "config.input.yaml")
    stale = []
    if args.resume is None:
        try:
            os.mkdir(run_dir)
        except FileExistsError:
            raise Refused("run %s already exists; resume it instead" % args.run_id, code=EXIT_REFUSED, exists=True) from None
        assert config_bytes is not None  # cmd_start refuses a fresh run without --config
        write_atomic(config_input, config_bytes)
    else:
        if not os.path.isdir(run_dir):
            raise Refused("no run %s to resume" % args.run_id)
        status = read_json(os.path.join(run_dir, "status.json"))
        pid, pid_start = nodefacts.run_process(run_dir, status)
        if pid is not None and nodefacts.process_matches(pid, pid_start):
            raise Refused("run %s is still running (pid %d)" % (args.run_id, pid), code=EXIT_REFUSED, running_pid=pid)
        supervisor = nodefacts.run_supervisor(run_dir)
        if supervisor is not None:
            raise Refused("run %s is being restarted by its supervisor (pid %d); stop it first"
                          % (args.run_id, supervisor), code=EXIT_REFUSED, running_pid=supervisor)
        stale = set_aside_stale_requests(run_dir)
        if config_bytes is not None:
            write_atomic(config_input, config_bytes)
        if not os.path.exists(config_input):
            config_input = os.path.join(run_dir, "config.yaml")
    release = release_hash(release_root)
    write_atomic(os.path.join(run_dir, "release"), (release + "\n").encode())
    if spec is not None:
        notify.write_spec(run_dir, spec)
    elif os.path.exists(os.path.join(run_dir, notify.NOTIFY_FILE)):
        os.unlink(os.path.join(run_dir, notify.NOTIFY_FILE))  # an unreadable spec (a resume keeps a readable one)

    if args.group is not None:
        write_atomic(os.path.join(run_dir, "group.json"), json.dumps(args.group, sort_keys=True).encode())
    argv = trainer_argv(args, python, config_input, run_dir, args.resume)
    no_restart = os.path.join(run_dir, "control", NO_RESTART)
    if os.path.exists(no_restart):
        os.unlink(no_restart)  # an operator's start or resume: the last stop is served
    record = {"gpus": gpus, "release_root": release_root, "release": release, "time": time.time(),
              "resume": args.resume, "oom_kills": oom_kills()}
    with open(os.path.join(run_dir, "train.log"), "ab") as log, open(os.devnull, "rb") as devnull:
        for kind in stale:
            log.write(("# dflash-ops: set aside a %s request left from before this start\n" % kind).encode())
        log.write(("# dflash-ops start %s: %s\n" % (time.strftime("%Y-%m-%d %H:%M:%S"), " ".join(argv))).encode())
        log.flush()
        import subprocess  # here, not at the top: `list` and `follow` start faster without it

        env = child_env(python, gpus, args.env)
        if max_restarts is None:
            child = subprocess.Popen(argv, cwd=release_root, env=env, stdin=devnull, stdout=log,
                                     stderr=subprocess.STDOUT, close_fds=True, start_new_session=True)
            record.update(pid=child.pid, pid_start=nodefacts.process_start_ticks(child.pid), argv=argv)
        else:  # the supervisor starts the trainer once launch.json names it (its stdin's EOF says go)
            runs_script = os.path.join(os.path.dirname(os.path.abspath(__file__)), RUNS_SCRIPT)
            child = subprocess.Popen([sys.executable, runs_script, "supervise", run_dir],
                                     cwd=release_root, env=env, stdin=subprocess.PIPE, stdout=log,
                                     stderr=subprocess.STDOUT, close_fds=True, start_new_session=True)
            record["supervisor"] = {"pid": child.pid, "pid_start": nodefacts.process_start_ticks(child.pid)}
            old = read_json(os.path.join(run_dir, RESTARTS_FILE)) if args.resume is not None else None
            history = old.get("restarts") if old and isinstance(old.get("restarts"), list) else []
            # the run's history is kept; this start gets N restarts of its own
            named = "no" if parse_restart(args.restart) is None else "on-failure:%d" % max_restarts
            policy = {"policy": named, "max": max_restarts, "restarts": history}
            write_atomic(os.path.join(run_dir, RESTARTS_FILE), json.dumps(policy, sort_keys=True).encode())
    write_atomic(os.path.join(run_dir, "launch.json"), json.dumps(record, sort_keys=True).encode())
    if max_restarts is not None:
        assert child.stdin is not None
        # a rank restarts with `--resume auto`: the ranks agree on the newest checkpoint a host
        # holds (a fresh start when none does); this host's own checkpoints do not decide it
        restart_from, fresh_from = ("auto", "auto") if args.group is not None else ("latest", None)
        child.stdin.write(json.dumps({"argv": argv, "max": max_restarts, "group": args.group,
                                      "restart_argv": trainer_argv(args, python, config_input, run_dir, restart_from),
                                      "fresh_argv": trainer_argv(args, python, config_input, run_dir, fresh_from)}).encode())
        child.stdin.close()
    return child



def queue_if_held(args: argparse.Namespace, run_dir: str, release_root: str, gpus: list[int],
                  config_bytes: bytes | None, spec: dict | None) -> dict | None:
    """Under the start lock: queue this start (its answer) when a live run holds one of its GPUs or
    a run queued before wants one; None: it may start now. The release is resolved now, so the run
    starts on the code it was queued with (prune keeps it: release_store.live_run_releases)."""
    if args.resume is not None:
        raise Refused("--queue starts a fresh run; resume a run when its GPUs are free")
    if os.path.exists(run_dir) or runqueue.find(args.base, args.run_id):
        raise Refused("run %s already exists; resume it instead" % args.run_id, code=EXIT_REFUSED, exists=True)
    why = runqueue.waits_for(args.base, {"gpus": gpus}, runqueue.entries(args.base),
                             lambda wanted: gpu_conflicts(args.base, wanted, run_dir))
    if not why:
        return None
    assert config_bytes is not None  # cmd_start refuses a fresh run without --config
    start_args = ["--base", args.base, "--run-id", args.run_id, "--python", args.python]
    start_args += ["--gpus", ",".join(map(str, gpus))] if gpus else []
    start_args += [a for item in args.env for a in ("--env", item)]
    start_args += ["--restart", args.restart] if args.restart else []
    files = {notify.NOTIFY_FILE: json.dumps(spec, sort_keys=True).encode()} if spec else {}
    entry = runqueue.add(args.base, args.run_id, gpus, start_args, config_bytes, files,
                         release=release_hash(release_root), release_root=release_root, restart=args.restart)
    return {"run_id": args.run_id, "state": "queued", "position": entry.get("position"), "waits_for": why,
            "run_dir": run_dir, "restart": args.restart or "no"}


def parse_group(text: str) -> dict:
    try:
        group = json.loads(text)
    except ValueError:
        raise Refused("--group wants a JSON object, got %r" % text) from None
    if not isinstance(group, dict) or not isinstance(group.get("targets"), list) or not isinstance(group.get("index"), int):
        raise Refused("--group wants {\"targets\": [...], \"index\": N, ...}, got %r" % text)
    return group



def read_bytes(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise Refused("cannot read %s: %s" % (path, e.strerror)) from None

