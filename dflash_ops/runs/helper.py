"""Calling the `runs` helper script and the remote paths of a run."""

from __future__ import annotations

import json
import posixpath
import re
from typing import Any

from dflash_ops.runs.info import GpusBusy, NotDeployed, RunError, RunNotFound, RunRefused

HELPER = "runs"
EXIT_NOT_FOUND = 2
EXIT_REFUSED = 3
EXIT_DIED_AT_START = 4
EXIT_NOT_DEPLOYED = 5
EXIT_TIME_UP = 6
EXIT_TRUNCATED = 7


def runs_root(container) -> str:
    return posixpath.join(container.base_dir, "runs")


RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # the helper's rule (helpers/runs.py)


def check_run_id(run_id: str) -> str:
    """A run id names one directory under runs/: refused before it reaches any path."""
    if not isinstance(run_id, str) or not RUN_ID_RE.match(run_id):
        raise RunError(f"bad run id {run_id!r}: a run id is letters, digits, '.', '_' and '-' (at most 128, "
                       "not starting with '.' or '-'); see `dflash-ops run list TARGET`")
    return run_id


def run_dir(container, run_id: str) -> str:
    return posixpath.join(runs_root(container), check_run_id(run_id))


START_TAIL_SHOWN = 8  # log lines shown when the trainer dies before it says anything


def call(container, args: list[str], *, also_ok: tuple[int, ...] = (), **kwargs):
    """Run the helper; on failure raise RunError carrying its JSON error document.

    Exit statuses in `also_ok` are answers, not failures (the caller reads `exit_code`)."""
    result = container.helper(HELPER, args, **kwargs)
    if result.ok or result.exit_code in also_ok:
        return result
    details = _error_document(result.stdout)
    message = details.get("error") or result.stderr.strip() or f"runs helper {args[0]} exited {result.exit_code}"
    if details.get("log_tail"):
        message += "; the end of its train.log:\n" + _last_lines(details["log_tail"], START_TAIL_SHOWN)
    error_type = {EXIT_NOT_FOUND: RunNotFound, EXIT_REFUSED: GpusBusy if details.get("conflicts") else RunRefused,
                  EXIT_NOT_DEPLOYED: NotDeployed}
    raise error_type.get(result.exit_code, RunError)(message, details)


def _last_lines(text: str, n: int) -> str:
    """The last n log lines, skipping ops' own `# dflash-ops start` banners."""
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("# dflash-ops")]
    return "\n".join("  " + line for line in lines[-n:])


def call_json(container, args: list[str], **kwargs) -> Any:
    return json.loads(call(container, args, **kwargs).stdout)


def _error_document(stdout: str) -> dict[str, Any]:
    for line in reversed(stdout.splitlines()):
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict):
            return doc
    return {}
