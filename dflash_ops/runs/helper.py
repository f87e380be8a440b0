"""Calling the `runs` helper script and the remote paths of a run."""

from __future__ import annotations

import posixpath
import re
from typing import Any

from dflash_ops.container import ContainerAPI, helper_failure
from dflash_ops.errors import HelperFailed
from dflash_ops.helpers.runs import EXIT_NOT_DEPLOYED, EXIT_NOT_FOUND, EXIT_REFUSED, EXIT_TIME_UP, EXIT_TRUNCATED
from dflash_ops.runs.info import GpusBusy, NotDeployed, RunError, RunNotFound, RunRefused
from dflash_ops.transport.base import Result

__all__ = ["EXIT_TIME_UP", "EXIT_TRUNCATED", "HELPER", "call", "call_json", "check_run_id", "run_dir", "run_error"]

HELPER = "runs"
RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # the helper's rule (helpers/runs.py)


def check_run_id(run_id: str) -> str:
    """A run id names one directory under runs/: refused before it reaches any path."""
    if not isinstance(run_id, str) or not RUN_ID_RE.match(run_id):
        raise RunError(f"bad run id {run_id!r}: a run id is letters, digits, '.', '_' and '-' (at most 128, "
                       "not starting with '.' or '-'); see `dflash-ops run list TARGET`")
    return run_id


def run_dir(container: ContainerAPI, run_id: str) -> str:
    return posixpath.join(container.base_dir, "runs", check_run_id(run_id))


START_TAIL_SHOWN = 8  # log lines shown when the trainer dies before it says anything


def call(container: ContainerAPI, args: list[str], *, answers: tuple[int, ...] = (), **kwargs: Any) -> Result:
    """Run the helper for its raw output (follow, control); on failure raise RunError (run_error).

    Exit statuses in `answers` are answers, not failures (the caller reads `exit_code`)."""
    result = container.helper(HELPER, args, **kwargs)
    if result.ok or result.exit_code in answers:
        return result
    raise run_error(helper_failure(HELPER, args, result))


def call_json(container: ContainerAPI, args: list[str], **kwargs: Any) -> Any:
    """The helper's JSON answer; on failure raise RunError (see run_error)."""
    try:
        return container.helper_json(HELPER, args, **kwargs)
    except HelperFailed as e:
        raise run_error(e) from None


def run_error(failure: HelperFailed) -> RunError:
    """The RunError for a failed helper call, by its exit status, carrying its JSON error document."""
    details = failure.document
    message = details.get("error") or failure.stderr.strip() or str(failure)
    if details.get("log_tail"):
        message += "; the end of its train.log:\n" + _last_lines(details["log_tail"], START_TAIL_SHOWN)
    error_type = {EXIT_NOT_FOUND: RunNotFound, EXIT_REFUSED: GpusBusy if details.get("conflicts") else RunRefused,
                  EXIT_NOT_DEPLOYED: NotDeployed}
    return error_type.get(failure.exit_code, RunError)(message, details)


def _last_lines(text: str, n: int) -> str:
    """The last n log lines, skipping ops' own `# dflash-ops start` banners."""
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("# dflash-ops")]
    return "\n".join("  " + line for line in lines[-n:])
