"""What ops knows about one run: status.json (docs/run-directory.md) plus fields the helper derives."""

from __future__ import annotations

import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable

from dflash_ops.errors import DflashOpsError
from dflash_ops.helpers.nodefacts import FINAL_STATES  # the helpers decide what is final; named once

__all__ = ["FINAL_STATES", "GpusBusy", "NotDeployed", "RunError", "RunInfo", "RunNotFound", "RunRefused"]


class RunError(DflashOpsError):
    """A run operation failed; `details` is the helper's JSON error document (may be empty)."""

    def __init__(self, message: str, details: dict[str, Any] | None = None):
        super().__init__(message)
        self.details = details or {}


class RunNotFound(RunError):
    pass


class RunRefused(RunError):
    """The helper refused (exit 3): the run exists already, is still running, or GPUs are busy."""


class GpusBusy(RunRefused):
    """Refused: a live run holds a requested GPU (details["conflicts"] names them)."""


class NotDeployed(RunError):
    """The target has no `current` release to run."""


@dataclass
class RunInfo:
    run_id: str
    state: str | None = None  # as status.json says; effective_state is the helper's verdict
    # derived by the runs helper (helpers/runs.py describe_run)
    effective_state: str = "unknown"
    checkpoints: list[int] = field(default_factory=list)
    alive: bool = False
    has_status: bool = False
    reason: str | None = None
    # killed by the container's memory limit (its memory cgroup counted an OOM kill after the launch):
    # a restart policy must not retry it unchanged
    oom_killed: bool = False
    log_tail: str | None = None
    release: str | None = None
    heartbeat_age: float | None = None
    launched: float | None = None
    supervised: bool = False  # a `runs.py supervise` parent restarts the trainer after a crash
    restart_policy: str | None = None  # "on-failure:N" (run start --restart)
    restarts: list[dict[str, Any]] = field(default_factory=list)  # {attempt, n, time, reason, exit_code, step, from}
    # status.json's fields (docs/run-directory.md)
    version: int | None = None
    pid: int | None = None
    pid_start: int | None = None
    step: int | None = None
    total_steps: int | None = None
    started: float | None = None
    heartbeat: float | None = None
    loss: float | None = None
    acc: float | None = None
    tau: float | None = None
    tau_lookup: float | None = None  # optional: τ of n-gram prompt lookup on the same prompts
    tau_ratio: float | None = None  # optional: tau / tau_lookup
    tokens_per_s: float | None = None
    tokens_per_s_steady: float | None = None  # optional in status.json
    pad_share: float | None = None  # optional in status.json
    gpus: list[int] = field(default_factory=list)
    last_checkpoint: str | None = None
    recompiles: int | None = None
    error: dict[str, Any] | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)
    # fields of the document whose value is not of the field's type (dropped: the field reads as
    # absent), e.g. ["loss: 'x' is not float"]: a hand-edited or foreign status.json
    bad_fields: list[str] = field(default_factory=list, repr=False)

    @property
    def final(self) -> bool:
        return self.effective_state in FINAL_STATES

    @classmethod
    def from_json(cls, doc: dict[str, Any] | str) -> "RunInfo":
        """Build from the helper's per-run document; unknown keys stay in `raw` only."""
        parsed: dict[str, Any] = json.loads(doc) if isinstance(doc, str) else doc
        values: dict[str, Any] = {}
        bad: list[str] = []
        for name, check in _CHECKS.items():
            value = parsed.get(name)
            if value is None:
                continue
            if check(value):
                values[name] = value
            else:
                bad.append(f"{name}: {value!r:.40} is not {_TYPE_NAMES[name]}")
        if not isinstance(values.get("run_id"), str):
            values["run_id"] = str(parsed.get("run_id"))
        return cls(**values, raw=dict(parsed), bad_fields=bad)


def _checker(tp: Any) -> Callable[[Any], bool]:
    """A check for a value of the field type `tp` (str, int, float, bool, list[X], dict[...], X | None)."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _checker(args[0])
    if origin is list:
        item = _checker(args[0])
        return lambda v: isinstance(v, list) and all(item(x) for x in v)
    if origin is dict or tp is dict:
        return lambda v: isinstance(v, dict)
    if tp is float:
        return lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    if tp is int:
        return lambda v: isinstance(v, int) and not isinstance(v, bool)
    return lambda v: isinstance(v, tp)


_HINTS = {name: tp for name, tp in typing.get_type_hints(RunInfo).items() if name not in ("raw", "bad_fields")}
_CHECKS = {name: _checker(tp) for name, tp in _HINTS.items()}
_TYPE_NAMES = {name: getattr(tp, "__name__", None) if isinstance(tp, type) else str(tp).replace("typing.", "").replace(" | None", "")
               for name, tp in _HINTS.items()}
