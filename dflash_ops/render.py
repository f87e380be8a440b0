"""The ONLY place where command strings are built from argvs.

Layers, innermost first::

    container argv   ["python3", "-c", code]
    (optional)       ["bash", "-c", script]      script() - only for cd / env / redirection / &
    pct layer        [*pct, "exec", "200", "--", *argv]
    node command     shlex.join(pct_argv)         the one string sshd hands to the login shell

Everything else in dflash_ops passes lists of strings around and calls these functions.
"""

from __future__ import annotations

import shlex
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dflash_ops.errors import DflashOpsError


@dataclass(frozen=True)
class Rendered:
    """Every layer of one command, so --print-command can show each exactly."""

    argv: tuple[str, ...]  # what the container process receives as its argv
    pct_argv: tuple[str, ...]  # what runs on the node
    command: str  # what goes over the wire: the node's login shell parses this string

    def layers(self) -> list[tuple[str, str]]:
        return [
            ("container argv", repr(list(self.argv))),
            ("pct layer", repr(list(self.pct_argv))),
            ("node command (sent over SSH)", self.command),
        ]


class ArgNotSendable(DflashOpsError, ValueError):
    """An argument no exec can carry (a NUL byte)."""


def _check_argv(argv: Sequence[str]) -> tuple[str, ...]:
    if isinstance(argv, str):
        raise TypeError("an argv is a list of strings, not a string")
    if not argv:
        raise ValueError("empty argv")
    for arg in argv:
        if not isinstance(arg, str):
            raise TypeError(f"argv element {arg!r} is not a string")
        if "\0" in arg:
            raise ArgNotSendable(f"argument {arg[:40]!r}... contains a NUL byte, which no argv can carry "
                                 "(C strings end there): pass such data on stdin or in a file")
    return tuple(argv)


MAX_ARG_STRLEN = 131072  # Linux: one argv/env string, NUL included (32 pages); sshd runs `sh -c COMMAND`


class ArgvTooLong(DflashOpsError):
    """The rendered node command cannot be exec'ed: it exceeds the kernel's per-argument limit."""


def _check_size(command: str) -> str:
    size = len(command.encode("utf-8", "surrogateescape"))
    if size >= MAX_ARG_STRLEN:
        raise ArgvTooLong(
            f"the command is {size} bytes once quoted for the node's shell, over the kernel's limit of "
            f"{MAX_ARG_STRLEN - 1} bytes for one argument (MAX_ARG_STRLEN; sshd hands it to `sh -c` as one): "
            "nothing was sent; pass large data on stdin or in a file instead")
    return command


def node_command(argv: Sequence[str]) -> str:
    """The string a POSIX login shell turns back into exactly `argv` (refused when the kernel
    could not exec it: ArgvTooLong)."""
    return _check_size(shlex.join(_check_argv(argv)))


def pct_argv(pct: Sequence[str], subcommand: str, ctid: int | str, *args: str) -> tuple[str, ...]:
    """`pct SUBCOMMAND CTID ARGS...` with the node's pct prefix (e.g. ("sudo", "pct"))."""
    if not pct:
        raise ValueError(f"`pct {subcommand}` on a node without pct")
    return _check_argv([*pct, subcommand, str(ctid), *args])


def pct_exec(pct: Sequence[str], ctid: int | str, argv: Sequence[str]) -> Rendered:
    """`pct exec CTID -- ARGV`: argv reaches the container process untouched (no shell there).

    A node without pct (empty prefix, inventory `pct: none`) runs argv itself."""
    argv = _check_argv(argv)
    if not pct:
        return Rendered(argv=argv, pct_argv=argv, command=node_command(argv))
    node_argv = pct_argv(pct, "exec", ctid, "--", *argv)
    return Rendered(argv=argv, pct_argv=node_argv, command=node_command(node_argv))


KILL_GRACE_S = 5  # killed_after(): SIGTERM first, SIGKILL this many seconds later
TIMED_OUT = (124, 128 + 9)  # timeout(1)'s statuses: TERM ended it / it needed KILL


def killed_after(seconds: float, argv: Sequence[str]) -> tuple[list[str], float]:
    """`argv` under coreutils `timeout` inside the container, and the transport's backstop timeout.

    A quiet command must be killed where it runs: over SSH, closing the channel on timeout
    would leave it running. Exit status TIMED_OUT means the limit was hit.
    """
    wrapped = ["timeout", f"--kill-after={KILL_GRACE_S}", f"{seconds:g}", *_check_argv(argv)]
    return wrapped, seconds + KILL_GRACE_S + 10


# The environment variable that tags one `exec`'s processes inside the container (inherited by the
# whole tree, also by children that start their own process group or session, as `timeout` does).
EXEC_TAG = "DFLASH_OPS_EXEC"


def tagged(token: str, argv: Sequence[str]) -> list[str]:
    """`argv` run by `env` with EXEC_TAG=token in its environment (exit statuses are argv's; env's
    own 126/127 for a command it cannot run are lxc-attach's too). env would take a command name
    holding "=" for one more assignment: such a command is exec'ed by sh instead."""
    argv = _check_argv(argv)
    if "=" in argv[0]:
        return ["env", f"{EXEC_TAG}={token}", "sh", "-c", 'exec "$@"', "sh", *argv]
    return ["env", f"{EXEC_TAG}={token}", *argv]


@dataclass(frozen=True)
class ExecPlan:
    """One tagged exec (`dflash-ops exec`, a playbook step): what the user asked for, the argv the
    container runs (under coreutils `timeout` when there is a limit, then tagged), the transport's
    backstop timeout and the tag. The real run (container.exec_killed_after) and `--print-command`
    both take it from exec_plan(), so what is printed is what runs."""

    command: tuple[str, ...]  # the argv as given
    argv: tuple[str, ...]  # what the container process receives: tagged(token, killed_after(...) or command)
    backstop: float | None  # the transport gives up after this many seconds (None: never)
    token: str  # EXEC_TAG=token marks the command's whole process tree (kill_tagged)
    timeout: float | None = None

    def layers(self) -> list[tuple[str, str]]:
        """The plan's own lines of --print-command (the container argv and below: Rendered.layers)."""
        lines = [("command", repr(list(self.command)))]
        if self.timeout is not None:
            lines.append(("timeout", f"coreutils timeout inside the container: TERM after {self.timeout:g} s, "
                                     f"KILL {KILL_GRACE_S} s later (exit 124 or 137)"))
        lines.append(("tag", f"{EXEC_TAG}={self.token} (a fresh token each run: one more exec kills every process "
                             "carrying it when the call ends early)"))
        lines.append(("backstop", "none" if self.backstop is None else f"the transport gives up after {self.backstop:g} s"))
        return lines


def exec_plan(argv: Sequence[str], timeout: float | None = None, token: str | None = None) -> ExecPlan:
    """The one plan of a tagged exec (ExecPlan); `token` defaults to a fresh random one."""
    command = _check_argv(argv)
    wrapped, backstop = (list(command), None) if timeout is None else killed_after(timeout, command)
    token = token or uuid.uuid4().hex
    return ExecPlan(command=command, argv=tuple(tagged(token, wrapped)), backstop=backstop, token=token,
                    timeout=timeout)


# Kills every process in the container whose environment holds EXEC_TAG=TOKEN ($1), found by one GNU
# grep over every /proc/PID/environ (NUL-separated entries, -z). Stop them all first, then kill: killed
# one by one in /proc's order, a child could die before its parent, whose shell would then run its next
# command ("sleep 1000; echo survived" printed "survived" under `timeout`). Stop passes repeat until one
# finds the same processes as the pass before (all stopped, none forked since; at most 20 passes).
# Needs only sh and grep.
_KILL_TAGGED = r"""t="$1"; me=$$; last=; pass=0
while [ $pass -lt 20 ]; do
  pids=
  for e in $(grep -lxzF -- "$t" /proc/[0-9]*/environ 2>/dev/null); do
    p=${e#/proc/}; p=${p%/environ}
    [ "$p" = "$me" ] || { kill -STOP "$p" 2>/dev/null; pids="$pids $p"; }
  done
  [ "$pids" = "$last" ] && break
  last=$pids; pass=$((pass + 1))
done
for p in $last; do kill -KILL "$p" 2>/dev/null; done
exit 0"""


def kill_tagged(token: str) -> list[str]:
    """The container command that kills what `tagged(token, ...)` started, its whole tree."""
    return ["sh", "-c", _KILL_TAGGED, "kill-tagged", f"{EXEC_TAG}={token}"]


def script(
    *steps: Sequence[str],
    cwd: str | None = None,
    env: Mapping[str, str] | None = None,
    stdout: str | None = None,
    stderr: str | None = None,
    append: bool = False,
    background: bool = False,
) -> list[str]:
    """`["bash", "-c", SCRIPT]` running `steps` (argvs) one after another, stopping at the first failure.

    cwd: `cd` there first; env: exported before the steps; stdout/stderr: files the whole
    sequence writes to (stderr may be "&1"); append: >> instead of >; background: detach with
    setsid nohup, stdin from /dev/null, and print the pid of the detached process.
    """
    if not steps:
        raise ValueError("script() needs at least one step")
    body = " && ".join(shlex.join(_check_argv(step)) for step in steps)
    if len(steps) > 1 or background:
        body = "{ " + body + "; }"
    redirect = ">>" if append else ">"
    if stdout is not None:
        body += f" {redirect} {shlex.quote(stdout)}"
    if stderr is not None:
        body += " 2>&1" if stderr == "&1" else f" 2{redirect} {shlex.quote(stderr)}"
    if background:
        inner = body
        if stdout is None:
            inner += " > /dev/null"
        if stderr is None:
            inner += " 2> /dev/null"
        body = "setsid nohup bash -c " + shlex.quote(inner) + " < /dev/null > /dev/null 2>&1 & echo $!"
    lines = []
    for name, value in (env or {}).items():
        if not name.isidentifier():
            raise ValueError(f"not an environment variable name: {name!r}")
        lines.append(f"export {name}={shlex.quote(value)}")
    if cwd is not None:
        lines.append(f"cd {shlex.quote(cwd)}")
    lines.append(body)
    return ["bash", "-c", " && ".join(lines)]


def node_sequence(*argvs: Sequence[str], always: Sequence[str] | None = None) -> Rendered:
    """Several node-level commands in one round trip: `A && B`, then `always` whatever happened.

    The exit status is that of the `&&` chain, so cleanup (`rm -f TMP`) never hides a failure.
    """
    chain = " && ".join(node_command(a) for a in argvs)
    if always is None:
        command = chain
    else:
        command = "{ " + chain + "; }; status=$?; " + node_command(always) + "; exit $status"
    _check_size(command)
    return Rendered(argv=tuple(argvs[-1]), pct_argv=tuple(argvs[-1]), command=command)
