"""The Trainer as one rank of a run across hosts (torchrun; docs/multi-node.md): its `Hosts` component.

What changes against one host, and nothing else:

* data: every host walks the same global micro-batch sequence (same seed, same anchors) and
  keeps its share, so a step trains exactly the micro-batches one host would, and every host's
  data position (checkpointed) is the same;
* gradients: the host's flat buffer is all-reduced over the hosts (trainer.distributed.group), STAT
  slots included: the loss is normalised over the whole global step;
* step boundaries: the hosts agree on stop/checkpoint requests (one tiny gloo all-reduce), so
  all stop at the same step; one rank (the writer: rank 0, or the rank that held the resumed
  checkpoint) writes checkpoints and runs the evaluation;
* resume: the ranks find which host holds the newest (or the asked) complete checkpoint; that
  host reads it and broadcasts it, so every rank restarts at the same step;
* failure: a rank that fails tells the others through the rendezvous store; a lost peer (no
  heartbeat, store gone, a collective that breaks) stops this rank with the reason in its
  status.json, and a rank stuck in a collective is ended after a short grace.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from trainer.data.batches import Batch
from trainer.distributed.group import GroupEnv, HostGroup, PeerLost, choose_backend
from trainer.distributed.hosts import Snapshot
from trainer.models.masks import Blocks
from trainer.run import checkpoint as ckpt
from trainer.run.config import TrainerConfig
from trainer.run.control import ControlPoller, Request
from trainer.run.rundir import RunDir
from trainer.run.stopping import PipelineFailed, StopSignal

STOP_CODES = {None: 0, "control": 1, "signal": 2}
STOP_REASONS = {code: reason for reason, code in STOP_CODES.items() if reason is not None}
EXIT_GRACE_S = 5.0  # after a peer is lost: time for the run to end by itself before the watchdog ends it


class HostShard:
    """Every host draws the whole global sequence of micro-batches (and their anchors, in order)
    and keeps those with `index % world == rank` of each step's `world` consecutive draws."""

    def __init__(self, next_batch: Callable[[], Batch], prepare: Callable[[Batch], Blocks], rank: int,
                 world: int) -> None:
        self.next_batch, self.prepare, self.rank, self.world = next_batch, prepare, rank, world
        self._blocks: dict[int, Blocks] = {}

    def next(self) -> Batch:
        kept = None
        for k in range(self.world):
            batch = self.next_batch()
            blocks = self.prepare(batch)
            if k == self.rank:
                kept = batch
                self._blocks[id(batch)] = blocks
        return kept  # type: ignore[return-value]  # rank < world: kept is set in the loop

    def blocks(self, batch: Batch) -> Blocks:
        return self._blocks.pop(id(batch))


class HostGroupMember:
    """This host's rank in a host group: the Trainer's `Hosts` component across hosts
    (trainer.distributed.hosts)."""

    def __init__(self, cfg: TrainerConfig, env: GroupEnv, rd: RunDir, control: ControlPoller, stop: StopSignal,
                 current_step: Callable[[], int]) -> None:
        d = cfg.distributed
        self.cfg, self.rd, self.control, self.stop, self.current_step = cfg, rd, control, stop, current_step
        self.group = HostGroup(env, choose_backend(d.backend, cfg.devices.drafter), d.timeout_s, d.peer_timeout_s,
                               d.socket_ifname)
        self.writer = 0
        self.lost: str | None = None
        self._lost_lock = threading.Lock()

    @property
    def is_writer(self) -> bool:
        return self.group.rank == self.writer

    # ------------------------------------------------------------------ joining the group
    def join(self) -> None:
        g, cfg = self.group, self.cfg
        if cfg.optim.micro_batches % g.world:
            raise ValueError(f"optim.micro_batches ({cfg.optim.micro_batches}) must be a multiple of the "
                             f"number of hosts ({g.world}): every host trains the same share of a step")
        self.rd.update(distributed={**g.describe(), "node": g.node, "joined": False})
        self.rd.log(f"joining the host group as rank {g.rank} of {g.world} ({g.backend}, rendezvous "
                    f"{g.env.master_addr}:{g.env.master_port})")
        g.start()
        g.watch(self._peer_lost)
        self.rd.update(distributed={**g.describe(), "joined": True})

    def joined(self) -> None:
        self.rd.update(distributed={**self.group.describe(), "joined": True, "writer": self.is_writer})

    def local_micro_batches(self, micro_batches: int) -> int:
        return micro_batches // self.group.world

    def batch_source(self, next_batch: Callable[[], Batch], prepare: Callable[[Batch], Blocks],
                     ) -> tuple[Callable[[], Batch], Callable[[Batch], Blocks]]:
        shard = HostShard(next_batch, prepare, self.group.rank, self.group.world)
        return shard.next, shard.blocks

    def across_hosts(self) -> Callable[[torch.Tensor], None]:
        return self.group.all_reduce_

    # ------------------------------------------------------------------ resume: one source, every rank
    def resolve_resume(self, checkpoints: ckpt.CheckpointManager, which: str) -> Path | None:
        """One step for every rank: 'latest' (and 'auto', a supervisor's restart of the group: None
        when no host holds one, every rank starts fresh) is the newest checkpoint a host holds
        complete (every file at its manifest's size: a half-written one is not offered); its host
        reads it and broadcasts it (load), so the ranks restart from the same state."""
        g = self.group
        held = g.all_gather_object(checkpoints.restorable_steps())
        if which in ("latest", "auto"):
            newest = max((max(s) for s in held if s), default=None)
            if newest is None:
                if which == "auto":
                    self.rd.log("no host holds a complete checkpoint: every rank starts from step 0")
                    return None
                raise ckpt.CheckpointError("no complete checkpoint on any host of the run")
            step = newest
        else:
            try:
                step = int(which)
            except ValueError:
                raise ckpt.CheckpointError(f"--resume takes 'latest', 'auto' or a step number, got {which!r}") from None
            if not any(step in s for s in held):
                have = ", ".join(f"rank {r}: {s}" for r, s in enumerate(held))
                raise ckpt.CheckpointError(f"no host holds a complete checkpoint step_{step} ({have})")
        self.writer = min(r for r, s in enumerate(held) if step in s)
        self.rd.log(f"resuming every rank from step_{step} (held by rank {self.writer}; held: "
                    + ", ".join(f"rank {r}: {s}" for r, s in enumerate(held)) + ")")
        return checkpoints.path(step)

    def load(self, path: Path, map_location: str) -> dict:
        """The writer reads the checkpoint (to the CPU) and broadcasts it to every rank."""
        state = ckpt.load(path, map_location="cpu") if self.is_writer else None
        state = self.group.broadcast_object(state, src=self.writer)
        if not self.is_writer:
            self.rd.log(f"restored step {state['state']['step']} from rank {self.writer}'s checkpoint {path.name}")
        return state

    # ------------------------------------------------------------------ step boundaries, together
    def at_boundary(self, step: int, checkpoints: list[Request], stop_request: Request | None, periodic: bool,
                    snapshot: Snapshot, stop: Callable[[str], None]) -> None:
        wants_checkpoint, stop_code = self.group.agree(
            [int(bool(checkpoints)), STOP_CODES[stop_request.reason if stop_request else None]])
        if self.is_writer:
            for r in checkpoints:
                snapshot(r, False)
            if wants_checkpoint and not checkpoints:
                snapshot(None, False)  # asked on another host
        else:
            for r in checkpoints:
                self.rd.log(f"checkpoint request {r.id}: rank {self.writer} writes the run's checkpoints")
                self.control.done(r)
        if stop_code:
            if self.is_writer:
                snapshot(stop_request, False)
            elif stop_request is not None:
                self.control.done(stop_request)
            stop(STOP_REASONS[stop_code])
            return
        if periodic and self.is_writer:
            snapshot(None, False)

    def final_requests(self, requests: list[Request]) -> list[Request]:
        """After the last step there is nothing left to agree on: the writer's final save serves it."""
        return []

    # ------------------------------------------------------------------ failure
    def _peer_lost(self, message: str) -> None:
        """From the watchdog: stop the pipeline; if this rank is stuck (a collective that will not
        return), record the failure and end the process after a short grace."""
        with self._lost_lock:
            if self.lost is not None:
                return
            self.lost = message
        self.rd.log(f"stopping: {message}")
        self.stop.fail(PeerLost(message), thread="host-watchdog")
        deadline = time.monotonic() + EXIT_GRACE_S
        while time.monotonic() < deadline:
            time.sleep(0.1)
        error = {"message": f"PeerLost: {message}", "traceback": "", "thread": "host-watchdog"}
        self.rd.event("error", self.current_step(), **error)
        self.rd.update(state="failed", error=error)
        self.rd.log(f"FAILED: {message} (ended by the watchdog: this rank was stuck)")
        self.rd.close()
        sys.stdout.flush()
        os._exit(1)

    def error_record(self, record: dict) -> dict:
        if self.lost is not None and "PeerLost" not in record["message"]:
            record = {**record, "message": f"PeerLost: {self.lost} (then {record['message']})"}
        return record

    def stopped_with_peers(self, exc: BaseException) -> str | None:
        """A lost peer that is this host's share of an operator's stop: the stop reached this host too and
        no peer reported a failure. A peer still in its setup serves a stop at once, without agreeing on a
        step with the others (they may already be training), so the collective this rank waits in fails
        when that peer's process ends: `run stop` of a group read `failed` on the hosts that had begun
        training first. The rank keeps its last checkpoint: the others are gone, the step is not agreed."""
        cause = exc.cause if isinstance(exc, PipelineFailed) else exc
        if not (isinstance(cause, PeerLost) or self.lost is not None) or not self.control.stop_pending():
            return None
        try:
            reported = self.group.failures()
        except Exception:  # noqa: BLE001 - the store may be gone with its host; none reported then
            reported = []
        return None if reported else f"stopped by the operator; the other hosts stopped first ({cause})"

    def finish(self, status: dict[str, Any]) -> None:
        if status.get("state") == "failed":
            if self.lost is None:  # this rank's own failure: tell the others why
                self.group.report_failure(status["error"]["message"] if status.get("error") else "failed")
        else:
            self.group.report_finished()
        self.group.close()
