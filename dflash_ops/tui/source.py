"""Where the dashboard's data comes from: the `DashSource` interface and its rows.

The dashboard never touches files, SSH or containers itself; it calls a `DashSource` from
worker threads. `dflash_ops.tui.remote` adapts `dflash_ops.runs` to the same five methods, for
inventory targets (RemoteSource) and run directories on this machine (LocalDirSource). Every
method may block and may raise (a dropped connection, an unreachable node); the dashboard shows
the failure on that target and retries with backoff (the same RetryPolicy that follow_file's
reconnects use).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Protocol

from trainer.run import contract

LogName = Literal["train.log", "metrics.jsonl"]
RequestKind = Literal["checkpoint", "stop"]


@dataclass(frozen=True)
class RunRow:
    """One run as its status.json (plus its `release` file) describes it.

    The status fields the dashboard draws are the run directory contract's (trainer/run/contract.py
    STATUS_FIELDS): row.loss, row.tau_ratio ... read `status` (None when absent). The fields below
    are the ones a row reshapes or adds: a new status field needs only the contract and a renderer."""

    target: str
    run_id: str
    state: str  # the helper's effective state: dead runs show failed
    step: int = 0
    release: str | None = None
    recompiles: int = 0
    gpus: tuple[int, ...] = ()
    error: str | None = None  # the helper's reason, else status.json's error message
    restarts: int = 0  # times the supervisor restarted the trainer (run start --restart)
    waits_for: str | None = None  # a queued run (state `queued #N`): the runs it waits for
    rank: int | None = None  # a run across hosts: this member's rank of `world`
    world: int | None = None
    status: dict[str, Any] = field(default_factory=dict, hash=False)  # contract.status_fields

    def __getattr__(self, name: str) -> Any:
        """A status field of the contract (None when the run's status.json lacks it)."""
        if name in contract.status_field_names():
            return self.__dict__.get("status", {}).get(name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


def group_fields(status: dict) -> dict:
    """rank/world of a rank of a run across hosts (status.json `distributed`), else {}."""
    d = status.get("distributed")
    if not isinstance(d, dict):
        return {}
    world = d.get("world_size", d.get("nnodes"))
    rank = d.get("rank")
    return {"rank": rank if isinstance(rank, int) else None, "world": world if isinstance(world, int) else None}


@dataclass(frozen=True)
class GpuSample:
    """One GPU seen from the host side (NVML / nvidia-smi); busy in percent."""

    index: int
    busy: float | None
    mem_gb: float | None
    mem_total_gb: float | None = None


def describe_error(error: BaseException) -> str:
    """`Type: message`, as the dashboard shows a failure."""
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


@dataclass(frozen=True)
class LinkState:
    """How a stream or a target is doing, as the UI shows it."""

    connected: bool
    error: str | None = None
    retry_in: float | None = None

    @classmethod
    def lost(cls, error: BaseException, retry_in: float) -> LinkState:
        """Disconnected by `error`, tried again in `retry_in` seconds."""
        return cls(False, describe_error(error), retry_in)

    def describe(self) -> str:
        if self.connected:
            return "live"
        if self.error is None:
            return "connecting"
        return f"disconnected: {self.error} (retry in {self.retry_in:g}s)"


# on_lines(lines, end_offset): complete lines (no newline) and the byte offset just past them.
OnLines = Callable[[list[str], int], None]
OnLink = Callable[[LinkState], None]


class DashSource(Protocol):
    def targets(self) -> list[str]:
        """Target names, in display order."""

    def list_runs(self, target: str) -> list[RunRow]:
        """Every run under the target's base dir. Polled every ~2 s per target."""

    def follow(self, target: str, run_id: str, name: LogName, on_lines: OnLines, stop: threading.Event,
               start: int | None = None, tail_lines: int = 200, on_link: OnLink | None = None) -> None:
        """Stream a run file's complete lines until `stop` is set.

        `start=None` begins with the last `tail_lines` lines; `start=N` resumes at byte
        offset N (the last `end_offset` handed to `on_lines`), so a reconnect neither
        loses nor repeats a line. Blocks. A source may ride out a dropped connection itself
        (RemoteSource does, by follow_file's RetryPolicy): it then reports each drop to
        `on_link` as LinkState.lost(error, retry_in) and each recovery as LinkState(True).
        What it raises (a drop it does not retry, a file not written yet) the caller retries.
        """

    def request(self, target: str, run_id: str, kind: RequestKind) -> str:
        """Drop a control request (run-directory contract); return its id."""

    def gpu_samples(self, target: str) -> list[GpuSample] | None:
        """The target's GPUs now, or None when it has no GPU."""


def gpu_samples_from_json(payload: dict) -> list[GpuSample] | None:
    """Turn the gpu_sample helper's JSON into samples (None = no GPU)."""
    gpus = payload.get("gpus")
    if gpus is None:
        return None
    return [GpuSample(int(g["index"]), g.get("busy"), g.get("mem_gb"), g.get("mem_total_gb")) for g in gpus]
