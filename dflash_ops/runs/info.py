"""What ops knows about one run: status.json (its fields: trainer/run/contract.py) plus fields the helper derives."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

from dflash_ops.errors import DflashOpsError
from trainer.run import contract
from trainer.run.contract import FINAL_STATES  # the run directory contract decides what is final

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
    """One run as the runs helper's `list` describes it (helpers/run_describe.py describe_run).

    status.json's fields are the run directory contract's (trainer/run/contract.py STATUS_FIELDS,
    named and typed there once): read them as attributes (info.loss, info.tau_ratio), each None
    when absent or of another type; `status` holds them. The fields declared below are the ones the
    helper derives on the node."""

    run_id: str
    effective_state: str = "unknown"  # the helper's verdict; status.json's own is `state`
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
    unsupervised: str | None = None  # "no longer supervised: why" (a --restart run whose supervisor is gone)
    restarts: list[dict[str, Any]] = field(default_factory=list)  # {attempt, n, time, reason, exit_code, step, from}
    # a queued run (effective_state "queued", helpers/runqueue.py): its place in line (1 = next), when it was
    # queued and what it waits for (runs holding its GPUs, runs queued before it on them)
    position: int | None = None
    queued: float | None = None
    waits_for: list[str] = field(default_factory=list)
    gpus: list[int] = field(default_factory=list)  # launch.json's, else status.json's
    # its notifications (helpers/notify.py run_summary): counts dropped / gave_up / undelivered,
    # waiting (queued for a destination now), last {event, notify, to, error, time}; None: all told
    notify: dict[str, Any] | None = None
    status: dict[str, Any] = field(default_factory=dict)  # contract.status_fields of the document
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    def __getattr__(self, name: str) -> Any:
        """A status field of the contract (None when the run's status.json lacks it)."""
        if name in contract.status_field_names():
            return self.__dict__.get("status", {}).get(name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def final(self) -> bool:
        return self.effective_state in FINAL_STATES

    @classmethod
    def from_json(cls, doc: dict[str, Any] | str) -> "RunInfo":
        """Build from the helper's per-run document; unknown keys stay in `raw` only."""
        parsed: dict[str, Any] = json.loads(doc) if isinstance(doc, str) else doc
        derived = {f.name for f in fields(cls)} - {"status", "raw"}
        values = {k: v for k, v in parsed.items() if k in derived and v is not None}
        return cls(**values, status=contract.status_fields(parsed), raw=dict(parsed))
