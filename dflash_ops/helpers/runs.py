"""Run-directory helper: runs inside the container (python3.8+, stdlib only).

Invoked with plain arguments by the operator's side (see docs/run-lifecycle.md):

  runs.py list BASE [--run ID]
  runs.py follow PATH --offset N [--tail-lines N] [--follow] [--poll S] [--until-final RUNDIR]
                 [--max-seconds S]
  runs.py control RUNDIR checkpoint|stop
  runs.py start --base BASE --run-id ID --config FILE|- --release-root DIR --python PY
                [--resume latest|STEP] [--gpus 0,1] [--env KEY=VALUE ...] [--wait S]
                [--restart no|on-failure[:N]]
      PY is the fallback: the release's venv python (BASE/<venv>/bin/python from
      .dflash-release.json) is used when the release names one.
      A rank of a run across hosts adds --group JSON --nnodes N --rdzv-endpoint HOST:PORT
      --local-addr ADDR [--store-host]: the trainer starts under `python -m trainer launch`
      (torchrun) and RUNDIR/group.json records the group (docs/multi-node.md).
      With --restart on-failure:N the trainer runs under `runs.py supervise` (below), which
      resumes it from its latest checkpoint after a crash, at most N times.
  runs.py supervise RUNDIR           (stdin: the launch document, then EOF = go) the parent of the
      trainer: waits for it; after a crash (non-zero exit, a signal, an OOM kill, a lost peer)
      that was not an operator's stop, and while restarts are left, records the restart and its
      reason (RUNDIR/restarts.json, a `restart` event in metrics.jsonl, a line in train.log)
      and starts it again with --resume latest. A stop request or a signal sent through this
      helper leaves control/.no-restart: that ends supervision for good.
      --queue: when the GPUs are held (or wanted by an earlier queued run), the run is queued in
      the container instead (runqueue.py) and the queue worker starts it; --notify-stdin: stdin's
      first line is the notification spec (notify.py), the rest the config; --notify-file PATH
      reads it from a file; either runs the trainer under `supervise`, which sends the events.
  runs.py queue-worker BASE          (detached) start queued runs as their GPUs come free
  runs.py unqueue BASE ID            take a queued run out of the queue (`run stop` of a queued run)
  runs.py deliver BASE [KEY]         (detached) deliver one destination's queue of run events
                                     (no KEY: dispatch the outbox, start the workers missing)
  runs.py address [--toward ADDR]    this container's address (the one routed toward ADDR)
  runs.py free-port --address ADDR   a TCP port free on ADDR now (for the rendezvous)
  runs.py signal RUNDIR TERM|KILL
  runs.py checkpoints RUNDIR
  runs.py hash-files ROOT PATH...

Exit status: 0 success, else one of the EXIT_* of run_protocol.py (dflash_ops/runs/helper.py imports
them from here). Errors are one JSON object {"error": ...} on stdout (and the message on stderr).

This file is the dispatcher and the small tools; the large ones live in shared modules shipped beside
it (dflash_ops/helpers/__init__.py RUN_PARTS): run_protocol.py (exit statuses, run id rules, the run
directory's readers), run_describe.py (list), run_follow.py (follow), run_start.py (start, and the
trainer's argv, built once) and run_supervise.py (supervise).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Callable

if not __package__:  # run as a script: its directory becomes its package (as_package.py)
    import as_package

    as_package.enter(globals())
from . import nodefacts, run_describe, run_events, run_follow, run_protocol, run_queue, run_start, run_supervise

# Exit statuses, named once for both sides (run_protocol.py): dflash_ops.runs maps them to its exceptions.
EXIT_NOT_FOUND, EXIT_REFUSED = run_protocol.EXIT_NOT_FOUND, run_protocol.EXIT_REFUSED
EXIT_DIED_AT_START, EXIT_NOT_DEPLOYED = run_protocol.EXIT_DIED_AT_START, run_protocol.EXIT_NOT_DEPLOYED
EXIT_TIME_UP, EXIT_TRUNCATED = run_protocol.EXIT_TIME_UP, run_protocol.EXIT_TRUNCATED
EXIT_BROKEN_PIPE = run_protocol.EXIT_BROKEN_PIPE
CHUNK = 1 << 20

Refused = nodefacts.Refused
print_json = nodefacts.print_json
read_json = nodefacts.read_json
read_json_checked = nodefacts.read_json_checked
check_run_id, check_run_dir = run_protocol.check_run_id, run_protocol.check_run_dir
RUN_ID_RE, run_dirs = run_protocol.RUN_ID_RE, run_protocol.run_dirs
complete_checkpoints, forbid_restarts = run_protocol.complete_checkpoints, run_protocol.forbid_restarts
describe_run = run_describe.describe_run


def told(run_dir: str, info: dict) -> dict:
    """The run as described, its final event told when nobody told it (run_events.tell_derived_final)."""
    run_events.tell_derived_final(run_dir, info)
    return info


def cmd_list(args: argparse.Namespace) -> None:
    now = time.time()
    queued = run_queue.queued_runs(args.base)  # not yet runs: no run directory
    # a run the queue worker is starting has a run directory before its launch.json: still queued
    starting = {q["run_id"] for q in queued
                if not os.path.exists(os.path.join(args.base, "runs", q["run_id"], "launch.json"))}
    if args.run:
        run_dir = os.path.join(args.base, "runs", check_run_id(args.run))
        waiting = [q for q in queued if q["run_id"] == args.run]
        if waiting and args.run in starting:
            runs = waiting
        elif not os.path.isdir(run_dir):
            raise Refused("no run %r under %s" % (args.run, os.path.join(args.base, "runs")))
        else:
            runs = [told(run_dir, describe_run(run_dir, now))]
    else:
        runs = [told(d, describe_run(d, now)) for d in run_dirs(args.base)
                if RUN_ID_RE.match(os.path.basename(d)) and os.path.basename(d) not in starting]
        runs += [q for q in queued if q["run_id"] in starting]
    print_json({"version": 1, "time": now, "runs": runs})


# ---------------------------------------------------------------- control requests

def cmd_control(args: argparse.Namespace) -> None:
    """Create control/<kind> atomically; a request already pending is reused (its id printed)."""
    check_run_dir(args.run_dir)
    if not os.path.isdir(args.run_dir):
        raise Refused("no run directory %s" % args.run_dir)
    sys.stdout.write(run_protocol.control_request(args.run_dir, args.kind) + "\n")



def cmd_address(args: argparse.Namespace) -> None:
    """The address other hosts reach this container at: the source address of a route toward
    --toward (a UDP connect sends nothing), else the hostname's address."""
    import socket  # here, not at the top: only address and free-port use it, not the list, start... of every poll

    if args.toward:
        address = sockname(socket.SOCK_DGRAM, "connect", (args.toward, 9),
                           "no route from this container toward %s" % args.toward)[0]
    else:
        try:
            address = socket.gethostbyname(socket.gethostname())
        except OSError as e:
            raise Refused("cannot tell this container's address: %s" % (e.strerror or e)) from None
    print_json({"address": address, "hostname": socket.gethostname()})


def cmd_free_port(args: argparse.Namespace) -> None:
    import socket

    port = sockname(socket.SOCK_STREAM, "bind", (args.address, 0),
                    "cannot bind a port on %s in this container" % args.address)[1]
    print_json({"address": args.address, "port": port})


def sockname(kind: int, op: str, address: tuple[str, int], failure: str) -> tuple:
    """The local (address, port) of an IPv4 socket after its `op` ("connect" or "bind") to address."""
    import socket

    with socket.socket(socket.AF_INET, kind) as s:
        try:
            getattr(s, op)(address)
            return s.getsockname()
        except OSError as e:
            raise Refused("%s: %s" % (failure, e.strerror or e)) from None



# ---------------------------------------------------------------- signals, checkpoints, hashes

def launched_process(run_dir: str) -> tuple[int | None, str | None]:
    """(pid, why not) of the trainer this helper started for run_dir, verified: launch.json (ops'
    own record, never the trainer-written status.json) names a pid whose start time and
    command line are still the ones recorded at launch. Any doubt means: not ours."""
    launch, problem = read_json_checked(os.path.join(run_dir, "launch.json"))
    if launch is None:
        return None, problem or "no launch.json: not started by dflash-ops"
    pid, pid_start, argv = launch.get("pid"), launch.get("pid_start"), launch.get("argv")
    if not (isinstance(pid, int) and pid > 1 and isinstance(pid_start, int) and isinstance(argv, list) and argv):
        return None, "launch.json does not identify a process"
    if nodefacts.process_start_ticks(pid) != pid_start:
        return None, "not running"
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            cmdline = f.read().split(b"\0")[:-1]
    except OSError:
        return None, "not running"
    # argv[0] is the python that was started; it may be a wrapper that exec'ed the real one
    want = [a.encode("utf-8", "surrogateescape") for a in argv[1:] if isinstance(a, str)]
    if len(want) != len(argv) - 1 or cmdline[len(cmdline) - len(want):] != want or len(cmdline) <= len(want):
        return None, "pid %d runs another command than the one launched" % pid
    return pid, None


def cmd_signal(args: argparse.Namespace) -> None:
    check_run_dir(args.run_dir)
    if not os.path.isdir(args.run_dir):
        raise Refused("no run directory %s" % args.run_dir)
    # the intent first: a supervisor between two attempts (no trainer to signal now) reads it
    # before it starts the next one, and sends the signal to an attempt it started meanwhile
    forbid_restarts(args.run_dir, "SIG%s sent by the operator" % args.signal, signal=args.signal)
    pid, why = launched_process(args.run_dir)
    if pid is None:
        supervised = nodefacts.run_supervisor(args.run_dir) is not None
        print_json({"sent": False, "pid": None, "reason": why, "recorded": True, "supervised": supervised})
        return
    os.kill(pid, signal.SIGTERM if args.signal == "TERM" else signal.SIGKILL)
    print_json({"sent": True, "pid": pid, "signal": args.signal})


def cmd_checkpoints(args: argparse.Namespace) -> None:
    check_run_dir(args.run_dir)
    if not os.path.isdir(args.run_dir):
        raise Refused("no run directory %s" % args.run_dir)
    print_json(complete_checkpoints(args.run_dir))


def sha256_file(path: str) -> dict:
    import hashlib  # here, not at the top: loading OpenSSL is most of what `list` would spend on it

    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            size += len(block)
            h.update(block)
    return {"size": size, "sha256": h.hexdigest()}


def cmd_hash_files(args: argparse.Namespace) -> None:
    result: dict[str, dict] = {}
    for rel in args.paths:
        try:
            result[rel] = sha256_file(os.path.join(args.root, rel))
        except OSError as e:
            result[rel] = {"error": e.strerror or str(e)}
    print_json(result)


# ---------------------------------------------------------------- argument parsing

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="runs.py")
    sub = p.add_subparsers(dest="command", required=True)

    def command(name: str, func: Callable[[argparse.Namespace], int | None],
                *positionals: str) -> argparse.ArgumentParser:
        s = sub.add_parser(name)
        for positional in positionals:
            s.add_argument(positional)
        s.set_defaults(func=func)
        return s

    command("list", cmd_list, "base").add_argument("--run")

    s = command("follow", run_follow.cmd_follow, "path")
    s.add_argument("--offset", type=int, default=0)
    s.add_argument("--tail-lines", type=int)
    s.add_argument("--follow", action="store_true")
    s.add_argument("--poll", type=float, default=0.2)
    s.add_argument("--until-final", metavar="RUNDIR")
    s.add_argument("--max-seconds", type=float)

    command("control", cmd_control, "run_dir").add_argument("kind", choices=("checkpoint", "stop"))

    s = command("start", run_start.cmd_start)
    s.add_argument("--base", required=True)
    s.add_argument("--run-id", required=True)
    s.add_argument("--config")
    s.add_argument("--release-root", required=True)
    s.add_argument("--python", required=True)
    s.add_argument("--resume")
    s.add_argument("--gpus")
    s.add_argument("--env", action="append", default=[])
    s.add_argument("--wait", type=float, default=30.0)
    s.add_argument("--group", type=run_start.parse_group)
    s.add_argument("--nnodes", type=int)
    s.add_argument("--rdzv-endpoint")
    s.add_argument("--local-addr")
    s.add_argument("--store-host", action="store_true")
    s.add_argument("--restart")
    s.add_argument("--queue", action="store_true")
    s.add_argument("--notify-stdin", action="store_true")
    s.add_argument("--notify-file")

    command("supervise", run_supervise.cmd_supervise, "run_dir")
    command("queue-worker", run_queue.cmd_queue_worker, "base")
    command("unqueue", run_queue.cmd_unqueue, "base", "run_id")
    command("deliver", run_queue.cmd_deliver, "base").add_argument("key", nargs="?")

    command("address", cmd_address).add_argument("--toward")
    command("free-port", cmd_free_port).add_argument("--address", required=True)
    command("signal", cmd_signal, "run_dir").add_argument("signal", choices=("TERM", "KILL"))
    command("checkpoints", cmd_checkpoints, "run_dir")
    command("hash-files", cmd_hash_files, "root").add_argument("paths", nargs="+")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except Refused as e:
        return e.answer("runs.py %s" % args.command)
    except BrokenPipeError:
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
