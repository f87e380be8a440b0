"""What the Trainer asks of the hosts a run spans: `Hosts`, and `OneHost`, the run on one host.

The Trainer holds one `Hosts` component (trainer.distributed.multihost.HostGroupMember across
hosts) and asks it everything that differs between one host and several: which share of a step
this host trains, how gradients meet, who writes checkpoints, what the hosts agree on at a step
boundary, where a resume reads from.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from trainer.run import checkpoint as ckpt
from trainer.run.control import Request

if TYPE_CHECKING:
    import torch

    from trainer.data.batches import Batch
    from trainer.models.masks import Blocks

Snapshot = Callable[["Request | None", bool], None]  # a checkpoint of this step boundary: (request or None, periodic)


class Hosts(Protocol):
    @property
    def is_writer(self) -> bool:
        """This host writes checkpoints and runs the evaluation."""

    def join(self) -> None:
        """Before anything is built (a host group starts here)."""

    def joined(self) -> None:
        """After the run's parts are built and restored."""

    def local_micro_batches(self, micro_batches: int) -> int:
        """Micro-batches this host trains per optimizer step."""

    def batch_source(self, next_batch: Callable[[], Batch], prepare: Callable[[Batch], Blocks],
                     ) -> tuple[Callable[[], Batch], Callable[[Batch], Blocks]]:
        """(next_batch, prepare) the prefetcher calls."""

    def across_hosts(self) -> Callable[[torch.Tensor], None] | None:
        """A function summing a flat gradient buffer over the hosts in place, or None on one host."""

    def resolve_resume(self, checkpoints: ckpt.CheckpointManager, which: str) -> Path | None:
        """--resume 'latest', 'auto' or a step -> the checkpoint directory to restore (None: 'auto'
        found none, the run starts fresh)."""

    def load(self, path: Path, map_location: str) -> dict:
        """A checkpoint's contents (trainer.run.checkpoint.load) on this host."""

    def at_boundary(self, step: int, checkpoints: list[Request], stop_request: Request | None, periodic: bool,
                    snapshot: Snapshot, stop: Callable[[str], None]) -> None:
        """At a step boundary of the threaded pipeline: serve checkpoint requests, a stop, or the
        periodic checkpoint (snapshot), stopping the pipeline with a reason (stop)."""

    def final_requests(self, requests: list[Request]) -> list[Request]:
        """Of the control requests found after the last step, those this host serves."""

    def error_record(self, record: dict) -> dict:
        """status.json's `error` for a failure of this host's run."""

    def stopped_with_peers(self, exc: BaseException) -> str | None:
        """The reason to end `stopped` when `exc` is how this host learnt of an operator's stop that the
        other hosts served first; None: `exc` is a failure."""

    def finish(self, status: dict[str, Any]) -> None:
        """After the run ended with status.json's `status`."""


class OneHost:
    """A run on one host: every hook is the plain thing."""

    is_writer = True

    def join(self) -> None:
        pass

    def joined(self) -> None:
        pass

    def local_micro_batches(self, micro_batches: int) -> int:
        return micro_batches

    def batch_source(self, next_batch: Callable[[], Batch], prepare: Callable[[Batch], Blocks],
                     ) -> tuple[Callable[[], Batch], Callable[[Batch], Blocks]]:
        return next_batch, prepare

    def across_hosts(self) -> Callable[[torch.Tensor], None] | None:
        return None

    def resolve_resume(self, checkpoints: ckpt.CheckpointManager, which: str) -> Path | None:
        return checkpoints.resolve(which)

    def load(self, path: Path, map_location: str) -> dict:
        return ckpt.load(path, map_location=map_location)

    def at_boundary(self, step: int, checkpoints: list[Request], stop_request: Request | None, periodic: bool,
                    snapshot: Snapshot, stop: Callable[[str], None]) -> None:
        for r in checkpoints:
            snapshot(r, False)
        if stop_request is not None:
            snapshot(stop_request, False)
            stop(stop_request.reason)
            return
        if periodic and not checkpoints:  # a requested checkpoint of this step serves as the periodic one
            snapshot(None, True)

    def final_requests(self, requests: list[Request]) -> list[Request]:
        return requests

    def error_record(self, record: dict) -> dict:
        return record

    def stopped_with_peers(self, exc: BaseException) -> str | None:
        return None

    def finish(self, status: dict[str, Any]) -> None:
        pass
