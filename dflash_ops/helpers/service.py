"""Long-running services inside a container, e.g. the target's serving engine (stdlib only).

  service.py start [--cwd DIR] [--env K=V ...] [--port P] BASE NAME -- ARGV...
      Start ARGV detached in its own session (stdin /dev/null, stdout+stderr to
      BASE/services/NAME/service.log) and record pid + start time in service.json.
      Refuses (exit 3) while a service of that name still runs, or when something already
      listens on 127.0.0.1:P (a wait would take its answers for the new service's).
  service.py wait BASE NAME --url URL [--timeout S] [--poll S]
      Until GET URL answers 200 while the service runs (exit 0); exit 4 when the service died
      (with its log tail), exit 6 when S seconds passed. No proxy is used.
  service.py stop BASE NAME [--grace S]
      SIGTERM to every process of the session the service started (only processes whose
      session id is the recorded pid and that started after it), SIGKILL to what is left
      after S seconds. A service that is gone already is fine (exit 0).

Each prints one JSON object on stdout. Names: [A-Za-z0-9][A-Za-z0-9._-]*.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

if not __package__:  # run as a script: its directory becomes its package (as_package.py)
    import as_package

    as_package.enter(globals())
from . import nodefacts

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
CHILD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
LOG_TAIL_BYTES = 4000
EXIT_BAD = nodefacts.EXIT_BAD_INPUT  # (Failed's default)
EXIT_REFUSED = 3
EXIT_DIED = 4
EXIT_TIME_UP = 6


Failed = nodefacts.Refused
print_json = nodefacts.print_json
read_json = nodefacts.read_json
write_json_atomic = nodefacts.write_json_atomic
proc_stat = nodefacts.proc_stat


def service_dir(base: str, name: str) -> str:
    if not NAME_RE.match(name):
        raise Failed("bad service name %r" % name)
    return os.path.join(base, "services", name)


def record_path(base: str, name: str) -> str:
    return os.path.join(service_dir(base, name), "service.json")


def members(record: dict) -> list[int]:
    """Pids of the session the service's leader created, started no earlier than the leader.

    The leader's pid is the session id (start_new_session). While the leader lives, its start
    time must be the recorded one: a pid with another start time is someone else's process and
    nothing is signalled. Once it is gone, a pid still used as a session id cannot be handed out
    again, so processes in a session of that id are the service's own."""
    sid, start = record["pid"], record["pid_start"]
    leader = proc_stat(sid)
    if leader is not None and leader[2] != start:
        return []
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = proc_stat(int(entry))
        if stat is not None and stat[0] != "Z" and stat[1] == sid and stat[2] >= start:
            found.append(int(entry))
    return found


def log_tail(path: str) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - LOG_TAIL_BYTES))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def cmd_start(args: argparse.Namespace) -> None:
    directory = service_dir(args.base, args.name)
    os.makedirs(directory, exist_ok=True)
    old = read_json(record_path(args.base, args.name))
    if old and old.get("state") == "running" and members(old):
        raise Failed("service %s is already running (pid %d); stop it first (playbook step `stop-serve: %s`)"
                     % (args.name, old["pid"], args.name),
                     EXIT_REFUSED, pid=old["pid"])
    if not args.argv:
        raise Failed("no command to start")
    if args.port is not None and listening(args.port):
        raise Failed("something already listens on 127.0.0.1:%d (another server?); stop it or choose another port"
                     % args.port, EXIT_REFUSED)
    env = {"PATH": CHILD_PATH}
    for name in ("HOME", "LANG", "LC_ALL", "TZ", "TMPDIR", "HF_HOME", "HF_TOKEN", "CUDA_VISIBLE_DEVICES"):
        if name in os.environ:
            env[name] = os.environ[name]
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", key):
            raise Failed("--env wants KEY=VALUE, got %r" % item)
        env[key] = value
    log = os.path.join(directory, "service.log")
    with open(log, "ab") as out:
        out.write(("# dflash-ops service start %s: %s\n" % (time.strftime("%Y-%m-%dT%H:%M:%S"),
                                                         json.dumps(args.argv))).encode())
        out.flush()
        try:
            proc = subprocess.Popen(args.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    cwd=args.cwd, env=env, start_new_session=True, close_fds=True)
        except OSError as e:
            raise Failed("cannot start %s: %s" % (args.argv[0], e.strerror or e)) from None
    stat = proc_stat(proc.pid)
    record = {"name": args.name, "pid": proc.pid, "pid_start": stat[2] if stat else None, "argv": args.argv,
              "cwd": args.cwd, "log": log, "started": time.time(), "state": "running", "port": args.port}
    write_json_atomic(record_path(args.base, args.name), record)
    print_json(record)


def listeners(port: int) -> set[int]:
    """Pids holding a socket that listens on TCP `port` (/proc/net/tcp{,6} and /proc/*/fd; empty
    where unreadable)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add("socket:[%s]" % fields[9])
    pids = set()
    for entry in os.listdir("/proc") if inodes else ():
        if not entry.isdigit():
            continue
        try:
            if any(os.readlink("/proc/%s/fd/%s" % (entry, fd)) in inodes for fd in os.listdir("/proc/%s/fd" % entry)):
                pids.add(int(entry))
        except OSError:
            continue
    return pids


def listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return True
    except OSError:
        return False


def running_record(base: str, name: str) -> dict:
    record = read_json(record_path(base, name))
    if not record or not isinstance(record.get("pid"), int) or not isinstance(record.get("pid_start"), int):
        raise Failed("no service %r was started here" % name)
    return record


def cmd_wait(args: argparse.Namespace) -> int:
    record = running_record(args.base, args.name)
    deadline = time.monotonic() + args.timeout
    last = "no answer yet"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never http_proxy for 127.0.0.1
    while True:
        try:
            with opener.open(args.url, timeout=5) as response:
                if response.status == 200 and nodefacts.process_matches(record["pid"], record["pid_start"]):
                    stranger = answered_by_another(record)
                    if stranger:
                        raise Failed(stranger, EXIT_REFUSED, log_tail=log_tail(record["log"]))
                    print_json({"ready": True, "url": args.url, "pid": record["pid"]})
                    return 0
                last = "HTTP %d" % response.status
        except urllib.error.HTTPError as e:
            last = "HTTP %d" % e.code
        except (urllib.error.URLError, OSError) as e:
            last = str(getattr(e, "reason", None) or e)
        if not nodefacts.process_matches(record["pid"], record["pid_start"]):
            raise Failed("service %s exited before %s answered" % (args.name, args.url), EXIT_DIED,
                         log_tail=log_tail(record["log"]))
        if time.monotonic() > deadline:
            raise Failed("service %s did not answer %s within %gs (last: %s)" % (args.name, args.url, args.timeout, last),
                         EXIT_TIME_UP, log_tail=log_tail(record["log"]))
        time.sleep(args.poll)


def answered_by_another(record: dict) -> str | None:
    """Readiness is proof: the process listening on the service's port must be one of its own
    (its session), not a server that happened to be there; None when it is (or cannot be told)."""
    port = record.get("port")
    if not isinstance(port, int):
        return None
    holders = listeners(port)
    if not holders or holders & set(members(record)):
        return None
    return ("127.0.0.1:%d is answered by pid %s, not by service %s (pid %d): another server took the port"
            % (port, ", ".join(str(p) for p in sorted(holders)), record["name"], record["pid"]))


def cmd_stop(args: argparse.Namespace) -> None:
    record = running_record(args.base, args.name)
    pids = signal_members(record, signal.SIGTERM)
    deadline = time.monotonic() + args.grace
    while members(record) and time.monotonic() < deadline:
        time.sleep(0.2)
    killed = signal_members(record, signal.SIGKILL)
    record["state"] = "stopped"
    record["stopped"] = time.time()
    write_json_atomic(record_path(args.base, args.name), record)
    print_json({"name": args.name, "signalled": pids, "killed": killed})


def signal_members(record: dict, sig: int) -> list[int]:
    """Send sig to the service's processes (see members); returns the pids it was sent to."""
    pids = members(record)
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass  # exited since it was listed
    return pids


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="service.py")
    sub = parser.add_subparsers(dest="cmd", required=True)
    start, wait, stop = (sub.add_parser(name) for name in ("start", "wait", "stop"))
    for s, func in ((start, cmd_start), (wait, cmd_wait), (stop, cmd_stop)):
        s.add_argument("base")
        s.add_argument("name")
        s.set_defaults(func=func)
    start.add_argument("--cwd", default=None)
    start.add_argument("--env", action="append", default=[])
    start.add_argument("--port", type=int, default=None)
    start.add_argument("argv", nargs=argparse.REMAINDER)
    wait.add_argument("--url", required=True)
    wait.add_argument("--timeout", type=float, default=900.0)
    wait.add_argument("--poll", type=float, default=1.0)
    stop.add_argument("--grace", type=float, default=20.0)
    args = parser.parse_args(argv)
    if args.cmd == "start" and args.argv[:1] == ["--"]:
        args.argv = args.argv[1:]
    try:
        return args.func(args) or 0
    except Failed as e:
        return e.answer("service.py")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
