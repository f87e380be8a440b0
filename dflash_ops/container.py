"""A container on a node: exec / push / pull / helpers, through `pct`, over any Transport."""

from __future__ import annotations

import hashlib
import json
import re
import sys
import threading
import uuid
from functools import partial
from pathlib import Path
from typing import Any, Callable, Protocol

from dflash_ops import render
from dflash_ops.errors import (
    CommandTimeout,
    ConnectionLost,
    DflashOpsError,
    HelperFailed,
    RemoteCommandError,
    TransferError,
)
from dflash_ops.hashing import sha256_file
from dflash_ops.helpers import HELPERS_DIR, Bundle, bundle, helper_source
from dflash_ops.inventory import Target
from dflash_ops.render import Rendered
from dflash_ops.tarstream import build_tar, stream_size
from dflash_ops.transport.base import LineCallback, Result, Stdin, Transport

_HELPER_MISSING = b"dflash-ops: helper not installed\n"
_HELPER_MISSING_STATUS = 127


CONFIG_LOCK_ATTEMPTS = 3
# pve-common src/PVE/Tools.pm lock_file_full, for pve-config-VMID.lock (PVE::LXC::Config).
_CONFIG_LOCKED = re.compile(r"can't lock file '[^']*/pve-config-\d+\.lock' - got timeout")
_config_locks: dict[tuple[str, int], threading.Lock] = {}
_config_locks_guard = threading.Lock()


def _config_lock_for(target: Target) -> threading.Lock:
    with _config_locks_guard:
        return _config_locks.setdefault((target.node.name, target.ctid), threading.Lock())


def _config_locked(result: Result) -> bool:
    return not result.ok and _CONFIG_LOCKED.search(result.stderr) is not None


def _stderr_notice(text: str) -> None:
    sys.stderr.write(f"dflash-ops: {text}\n")


class ConfigLocked(TransferError):
    """pct push/pull kept failing because another task held the container's config lock."""


class ContainerAPI(Protocol):
    """What a container offers the layers above it (deploy, runs, patching, playbooks, doctor, tui).

    `Container` is the real one (pct over a Transport); tests pass doubles that run the helpers
    locally (tests/unit/runs_double.py).
    """

    @property
    def target(self) -> Target: ...

    @property
    def base_dir(self) -> str: ...

    def exec(self, argv: list[str], *, stdin: Stdin = None, on_line: LineCallback | None = None,
             on_stderr_line: LineCallback | None = None, timeout: float | None = None,
             check: bool = False) -> Result: ...

    def helper(self, name: str, args: list[str], *, stdin: Stdin = None, on_line: LineCallback | None = None,
               on_stderr_line: LineCallback | None = None, timeout: float | None = None,
               check: bool = False, python: str | None = None, helpers_root: str | None = None) -> Result: ...

    def helper_json(self, name: str, args: list[str], *, stdin: Stdin = None, timeout: float | None = None,
                    python: str | None = None, answers: tuple[int, ...] = ()) -> Any: ...

    def helper_path(self, name: str) -> str: ...

    def push(self, local: Path, remote: str) -> None: ...

    def pull(self, remote: str, local: Path) -> None: ...


class Container:
    """A pct container on a node, over any Transport; implements ContainerAPI."""

    def __init__(self, target: Target, transport: Transport, *, helpers_in_place: bool = False):
        self._target = target
        self.transport = transport
        self.helpers_in_place = helpers_in_place  # this machine is the container: run the packaged helpers
        self._installed_helpers: set[str] = set()
        self.notice: Callable[[str], None] = _stderr_notice  # what ops tells the user while it works

    @property
    def target(self) -> Target:
        return self._target

    @property
    def base_dir(self) -> str:
        return self._target.base_dir

    def render(self, argv: list[str]) -> Rendered:
        return render.pct_exec(self._target.node.pct, self._target.ctid, argv)

    def exec(self, argv: list[str], *, stdin: Stdin = None, on_line: LineCallback | None = None,
             on_stderr_line: LineCallback | None = None, timeout: float | None = None, check: bool = False) -> Result:
        result = self.transport.run(
            self.render(argv).command,
            stdin=stdin,
            on_line=on_line,
            on_stderr_line=on_stderr_line,
            timeout=timeout,
        )
        if check and not result.ok:
            raise RemoteCommandError(list(argv), result.exit_code, result.stderr)
        return result

    def _pct(self, subcommand: str, *args: str) -> list[str]:
        if not self._target.node.pct:  # `pct: none`: the node is the container
            return _WITHOUT_PCT[subcommand](*args)
        return list(render.pct_argv(self._target.node.pct, subcommand, self._target.ctid, *args))

    def push(self, local: Path, remote: str) -> None:
        """Copy a local file to `remote` in the container (parent must exist), verified by sha256."""
        _require_absolute(remote)
        want = sha256_file(Path(local))

        def attempt() -> Result:
            node_tmp = _node_temp_path()
            self.transport.put(Path(local), node_tmp)
            return self.transport.run(
                render.node_sequence(
                    self._pct("push", node_tmp, remote),
                    self._pct("exec", "--", "sha256sum", "--", remote),
                    always=["rm", "-f", node_tmp],
                ).command
            )

        result = self._holding_config_lock(f"push {remote}", attempt)
        got = _parse_sha256(result)
        if got != want:
            why = _why(result) if got is None else f"checksum mismatch ({_why(result)})"
            raise TransferError(f"push {local} -> {self._target.name}:{remote} failed: {why}")

    def pull(self, remote: str, local: Path) -> None:
        """Copy `remote` from the container to a local file, verified by sha256.

        The node-side copy goes into a directory of the login user's own (mode 700): with
        `sudo pct`, pct writes it as root, and only in a directory the login owns can the
        login's cleanup delete a root-owned file (in /tmp's sticky directory it cannot, and
        the copy leaked). --perms 644 lets the login read it there; nobody else can enter.
        """
        _require_absolute(remote)
        node_dir = _node_temp_path()
        node_tmp = f"{node_dir}/pulled"

        def attempt() -> Result:
            return self.transport.run(
                render.node_sequence(
                    ["mkdir", "-p", "-m", "700", "--", node_dir],
                    self._pct("pull", remote, node_tmp, "--perms", "644"),
                    self._pct("exec", "--", "sha256sum", "--", remote),
                ).command
            )

        try:
            result = self._holding_config_lock(f"pull {remote}", attempt)
            want = _parse_sha256(result)
            if want is None:
                raise TransferError(f"pull {self._target.name}:{remote} failed: {_why(result)}")
            self.transport.get(node_tmp, Path(local))
        finally:
            self.transport.run(render.node_command(["rm", "-rf", "--", node_dir]))
        got = sha256_file(Path(local))
        if got != want:
            Path(local).unlink(missing_ok=True)
            raise TransferError(f"pull {self._target.name}:{remote} -> {local}: checksum mismatch")

    def _holding_config_lock(self, what: str, attempt: Callable[[], Result]) -> Result:
        """Run a pct push/pull `attempt`, one at a time per container from this process.

        pct push/pull hold the container's config lock for the whole copy and a second one
        waits 10 s, then fails ("can't lock file ... - got timeout"). Ours are serialised here,
        so a timeout means another task on the node holds the lock (a backup, a `pct set`, an
        operator's own pct push): say so, and try again, CONFIG_LOCK_ATTEMPTS times in all.
        """
        with _config_lock_for(self._target):
            for n in range(1, CONFIG_LOCK_ATTEMPTS + 1):
                result = attempt()
                if not _config_locked(result):
                    return result
                if n < CONFIG_LOCK_ATTEMPTS:
                    self.notice(f"{self._target.name}: {what}: CT {self._target.ctid}'s config is locked by "
                                f"another task on node {self._target.node.name!r}; retrying ({n}/{CONFIG_LOCK_ATTEMPTS})")
        raise ConfigLocked(f"{what} on {self._target.name}: CT {self._target.ctid}'s config stayed locked by another "
                           f"task on node {self._target.node.name!r} ({CONFIG_LOCK_ATTEMPTS} tries, pct waits 10 s "
                           f"each): {_why(result)}")

    def push_tree(self, local_dir: Path, remote_dir: str, files: list[str] | None = None) -> int:
        """Send a tree (or the listed relative files, by content) as one tar stream into
        `remote_dir` (created if missing); returns the bytes sent."""
        _require_absolute(remote_dir)
        local_dir = Path(local_dir)
        if files is None:
            files = sorted(str(p.relative_to(local_dir)) for p in local_dir.rglob("*") if p.is_file())
        with build_tar([(rel, local_dir / rel) for rel in files]) as tar:
            size = stream_size(tar)
            self.exec(render.script(["mkdir", "-p", "--", remote_dir], ["tar", "-x", "-f", "-", "-C", remote_dir]),
                      stdin=tar, check=True)
        return size

    def helper(self, name: str, args: list[str], *, stdin: Stdin = None, on_line: LineCallback | None = None,
               on_stderr_line: LineCallback | None = None, timeout: float | None = None, check: bool = False,
               python: str | None = None, helpers_root: str | None = None) -> Result:
        """Run helper `name` ('-' -> '_' in the file name), installing it once per content hash
        (with the shared modules it imports: dflash_ops/helpers/__init__.py).

        Known installed: one pct exec. Otherwise the first call tries to run it and reports a
        missing file in the same exec; only then is it sent (one exec for its bundle) and run. A call
        with stdin cannot try (a missing helper would leave its stdin half read): it asks whether the
        file is there first (one exec), as `run start` does on every call from a new process. `python`
        (default: the target's) runs it, e.g. a release's venv python. `helpers_root` installs
        it elsewhere than BASE/helpers (the doctor, when base_dir cannot be written).
        """
        source = helper_source(name)
        if source is None:
            raise DflashOpsError(f"unknown helper {name!r} (no {name.replace('-', '_')}.py helper in {HELPERS_DIR})")
        run = partial(self.exec, stdin=stdin, on_line=on_line, on_stderr_line=on_stderr_line, timeout=timeout,
                      check=check)
        if self.helpers_in_place:  # nothing is installed into the directory it reads
            return run([python or self._target.python, str(source), *args])
        found = bundle(name)
        directory = f"{helpers_root or self.base_dir + '/helpers'}/{found.digest}"
        remote = f"{directory}/{found.script}"
        argv = [python or self._target.python, remote, *args]
        if remote in self._installed_helpers:
            return run(argv)
        if stdin is None:
            probe = ["sh", "-c", 'if [ -f "$1" ]; then shift; exec "$@"; fi; printf %s "$0" >&2; exit 127',
                     _HELPER_MISSING.decode(), remote, *argv]
            result = self.exec(probe, on_stderr_line=_without_marker(on_stderr_line), check=False,
                               on_line=on_line, timeout=timeout)
            if not (result.exit_code == _HELPER_MISSING_STATUS and result.stderr_bytes == _HELPER_MISSING):
                self._installed_helpers.add(remote)
                if check and not result.ok:
                    raise RemoteCommandError(argv, result.exit_code, result.stderr)
                return result
        elif self.exec(["test", "-f", remote], timeout=timeout).ok:
            self._installed_helpers.add(remote)
            return run(argv)
        self._install_helper(found, directory)
        self._installed_helpers.add(remote)
        return run(argv)

    def helper_json(self, name: str, args: list[str], *, stdin: Stdin = None, timeout: float | None = None,
                    python: str | None = None, answers: tuple[int, ...] = ()) -> Any:
        """Run helper `name` and read its answer: the JSON document on its last stdout line.

        Exit statuses in `answers` are answers too (their document is returned); any other
        non-zero status, or no JSON at all, raises HelperFailed carrying the helper's error document.
        """
        return helper_answer(name, args, self.helper(name, args, stdin=stdin, timeout=timeout, python=python), answers)

    def helper_path(self, name: str) -> str:
        """Where helper `name` runs from: BASE/helpers/<its bundle's hash>/<file>."""
        return f"{self.base_dir}/{bundle(name).rel()}"

    def _install_helper(self, found: Bundle, directory: str) -> None:
        """The helper's bundle into `directory` in one exec (one tar stream, unpacked beside it),
        verified; the helper itself moved into place last, so that its presence (what a call
        probes for) means the shared modules beside it are there too."""
        staging = f"{directory}/.install-{uuid.uuid4().hex[:8]}"
        names = [filename for filename, _content in found.files]
        with build_tar([], extra=found.files) as tar:
            result = self.exec(
                render.script(
                    ["mkdir", "-p", "--", staging],
                    ["tar", "-x", "-f", "-", "-C", staging],
                    ["sha256sum", "--", *(f"{staging}/{name}" for name in names)],
                    *(["mv", "-f", "--", f"{staging}/{name}", f"{directory}/{name}"] for name in names),
                    ["rmdir", "--", staging],
                ),
                stdin=tar,
            )
        sums = [line.split(maxsplit=1)[0] for line in result.stdout.splitlines() if line.strip()]
        for (filename, content), got in zip(found.files, sums + [""] * len(found.files)):
            if got != hashlib.sha256(content).hexdigest():
                raise TransferError(f"installing helper {directory}/{filename} on {self._target.name} failed: "
                                    f"{_why(result)}")


_WITHOUT_PCT = {
    "push": lambda src, dst: ["cp", "--", src, dst],
    "pull": lambda src, dst: ["cp", "--", src, dst],
    "exec": lambda _separator, *argv: list(argv),
}


def exec_killed_after(container: ContainerAPI, argv: list[str], timeout: float | None, **kwargs: Any) -> Result:
    """container.exec(argv), stopped inside the container when it is given up on.

    With a timeout, under coreutils `timeout` inside the container (render.killed_after), raising
    CommandTimeout when the limit was hit. Killing the local `pct exec` does not stop a command in
    a container (lxc-attach leaves it running, and sshd signals nothing when an SSH connection
    without a terminal ends), so the command runs tagged (render.tagged) and, when this call ends
    by Ctrl-C, a lost connection or the transport's backstop timeout, one more exec kills every
    process carrying its tag: its whole tree, also children in process groups of their own.
    """
    return run_exec_plan(container, render.exec_plan(argv, timeout), **kwargs)


def run_exec_plan(container: ContainerAPI, plan: render.ExecPlan, **kwargs: Any) -> Result:
    """Run an exec plan (render.exec_plan, which `--print-command` prints): its argv, its backstop,
    and when the call ends early, kill_tagged with its token."""
    try:
        result = container.exec(list(plan.argv), timeout=plan.backstop, **kwargs)
    except (KeyboardInterrupt, ConnectionLost, CommandTimeout):  # the command may still run there
        kill_tagged(container, plan.token)
        raise
    if plan.timeout is not None and result.exit_code in render.TIMED_OUT:
        raise CommandTimeout(render.node_command(plan.command), plan.timeout)
    return result


def kill_tagged(container: ContainerAPI, token: str) -> bool:
    """Best effort: kill what exec_killed_after started with `token` (a new connection if the old one
    died). False when that could not be done (the node is unreachable): a note says so on stderr."""
    try:
        return container.exec(render.kill_tagged(token), timeout=60).ok
    except BaseException as e:  # noqa: BLE001 - a second Ctrl-C or a dead node: say what may be left
        sys.stderr.write(f"dflash-ops: could not stop the command inside the container ({type(e).__name__}); "
                         f"it may still run there (its environment holds {render.EXEC_TAG}={token})\n")
        return False


def helper_answer(name: str, args: list[str], result: Result, answers: tuple[int, ...] = ()) -> Any:
    """A helper call's JSON answer (see Container.helper_json), or HelperFailed."""
    document = last_json_line(result.stdout)
    if document is not None and (result.ok or result.exit_code in answers):
        return document
    raise helper_failure(name, args, result)


def helper_failure(name: str, args: list[str], result: Result) -> HelperFailed:
    """The HelperFailed for a helper call that failed, carrying the error document it printed."""
    document = last_json_line(result.stdout)
    return HelperFailed(name, args, result.exit_code, result.stderr, result.stdout,
                        document if isinstance(document, dict) else None)


def last_json_line(stdout: str) -> Any:
    """The JSON document on the last line of `stdout` that holds one (None when none does)."""
    for line in reversed(stdout.splitlines()):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None


def _without_marker(callback: LineCallback | None) -> LineCallback | None:
    if callback is None:
        return None

    def filtered(line: bytes) -> None:
        if line != _HELPER_MISSING:
            callback(line)

    return filtered


def _require_absolute(path: str) -> None:
    if not path.startswith("/"):
        raise DflashOpsError(f"container path must be absolute: {path!r}")


def _node_temp_path() -> str:
    return f"/tmp/dflash-ops-{uuid.uuid4().hex}"


def _parse_sha256(result: Result) -> str | None:
    if not result.ok:
        return None
    first = result.stdout.split(maxsplit=1)
    return first[0] if first and len(first[0]) == 64 else None


def _why(result: Result) -> str:
    said = (result.stderr.strip() or result.stdout.strip()).splitlines()[-3:]
    return " | ".join(said) if said else f"exit status {result.exit_code}"
