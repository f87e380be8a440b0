"""Services in a container: start a long-running command detached, wait until it answers, stop it.

    start_service(container, "engine", ["python3", "-m", "sglang.launch_server", ...])
    wait_service(container, "engine", "http://127.0.0.1:30000/v1/models", timeout=900)
    stop_service(container, "engine")

The `service` helper starts the argv in its own session and records pid and start time under
BASE/services/NAME/; stop signals only that session's processes (never a pid it did not
start). The log is BASE/services/NAME/service.log.
"""

from __future__ import annotations

import posixpath
import re

from dflash_ops.container import ContainerAPI
from dflash_ops.errors import DflashOpsError, HelperFailed

HELPER = "service"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
LOG_LINES_SHOWN = 12


class ServiceError(DflashOpsError):
    """A service could not be started, did not come up, or could not be stopped."""


def service_log(container: ContainerAPI, name: str) -> str:
    return posixpath.join(container.base_dir, "services", name, "service.log")


def _call(container: ContainerAPI, args: list[str], *, timeout: float | None = None) -> dict:
    try:
        return container.helper_json(HELPER, args, timeout=timeout)
    except HelperFailed as e:
        message = e.reason
        tail = [line for line in (e.document.get("log_tail") or "").splitlines()
                if line.strip() and not line.startswith("# dflash-ops")][-LOG_LINES_SHOWN:]
        if tail:
            message += "; the end of its log:\n" + "\n".join("  " + line for line in tail)
        raise ServiceError(message) from None


def _check_name(name: str) -> str:
    if not NAME_RE.match(name):
        raise ServiceError(f"bad service name {name!r} (letters, digits, . _ -)")
    return name


def start_service(container: ContainerAPI, name: str, argv: list[str], *, cwd: str | None = None,
                  env: dict[str, str] | None = None, port: int | None = None) -> dict:
    """Start `argv` detached; returns the helper's record (pid, pid_start, log). With `port`,
    refuses when something already listens there (its answers would pass for the service's)."""
    args = ["start"]  # options before the positionals: everything after NAME is the argv
    if cwd is not None:
        args += ["--cwd", cwd]
    if port is not None:
        args += ["--port", str(int(port))]
    for key, value in (env or {}).items():
        args += ["--env", f"{key}={value}"]
    args += [container.base_dir, _check_name(name)]
    if not argv or not all(isinstance(a, str) for a in argv):
        raise ServiceError("a service command is a non-empty list of strings (an argv)")
    return _call(container, [*args, "--", *argv])


def wait_service(container: ContainerAPI, name: str, url: str, *, timeout: float = 900.0, poll: float = 1.0) -> dict:
    """Until `url` (inside the container) answers 200; ServiceError with the log's tail when the
    service died or `timeout` passed."""
    args = ["wait", container.base_dir, _check_name(name), "--url", url, "--timeout", f"{timeout:g}",
            "--poll", f"{poll:g}"]
    return _call(container, args, timeout=timeout + 60)


def stop_service(container: ContainerAPI, name: str, *, grace: float = 20.0) -> dict:
    """SIGTERM the service's own processes, SIGKILL what is left after `grace` seconds."""
    return _call(container, ["stop", container.base_dir, _check_name(name), "--grace", f"{grace:g}"],
                 timeout=grace + 60)
