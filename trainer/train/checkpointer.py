"""Checkpoints that do not stall training: the step's state is staged in host memory at a step
boundary, then written by one background thread (trainer.run.checkpoint: tmp dir, fsync, rename,
so a crash mid-write leaves the previous checkpoint intact).

What the training thread waits for, and nothing else (reported as `stall_s` in the `checkpoint`
event): the previous write, when one is still in flight (one write at a time: the staging buffers
are reused), and queueing the copies. On CUDA the copies run on a side stream, ordered after the
work that produced the state, into pinned buffers; the optimizer's next step waits for them on the
GPU (a step pre-hook: `stream.wait_event`, no host sync), so the state written is exactly that of
one step while the next step's forward and backward already run. The writer thread waits for the
copies itself. The buffers are allocated once, before training starts (`reserve`, from the warm-up), so
even the first checkpoint finds them ready.

With stage_host off (optim.offload host: the fp32 weights and AdamW states already live in host
memory, and a second copy of them may not fit there), host tensors are not copied: the job writes
them from where they are, and the optimizer's next step waits until the write is done (the next
forward and backward still run meanwhile).
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainer.run.checkpoint import CheckpointManager
from trainer.train.metrics import LossNotFinite
from trainer.train.streams import after_current


@dataclass
class Job:
    """One checkpoint: its staged state and what asked for it."""

    step: int
    model: dict[str, torch.Tensor]
    drafter_config: dict
    optim: dict  # {"optimizer": ..., "scheduler": ...}
    trainer_state: dict
    request: Any = None  # the control Request that asked for it, or None (periodic, final)
    periodic: bool = False
    stall_s: float = 0.0
    copies: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)  # (start, done) per device
    copy_s: float | None = None  # GPU time of the device-to-host copies (CUDA only)
    written: threading.Event = field(default_factory=threading.Event)  # set once written (or failed)


Written = Callable[[Job, Path, float], None]
Failed = Callable[[Job, BaseException], None]


class Checkpointer:
    """Stages state at a step boundary and writes it in the background, one write at a time.

    `on_written(job, path, seconds)` and `on_failed(job, error)` run on the writer thread. A failed
    periodic checkpoint is only reported (the run goes on; the next one tries again); any other
    failure is also raised on the training thread at its next `snapshot` or `wait`."""

    def __init__(self, manager: CheckpointManager, on_written: Written, on_failed: Failed,
                 stage_host: bool = True) -> None:
        self.manager, self.on_written, self.on_failed = manager, on_written, on_failed
        self.stage_host = stage_host  # False: host tensors are written in place (module doc)
        self._live: list[Job] = []  # jobs writing host tensors in place: the next update waits for them
        self._staging: dict[str, torch.Tensor] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._pending: list[tuple[torch.device, torch.cuda.Event]] = []  # copies the next update waits for
        self._hooked: set[int] = set()
        self._cond = threading.Condition()
        self._queue: list[Job | Callable[[], None]] = []
        self._busy = False  # a job (or a reservation) is queued or being written
        self._fatal: BaseException | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self.waiting = 0  # training threads waiting for the previous write (tests observe it)

    # ------------------------------------------------------------------ the training thread's side
    def reserve(self, template: dict) -> None:
        """Allocate the staging buffers for state shaped like `template` on the writer thread.

        template: {"model": state_dict, "optim": ...} as `snapshot` gets them; only shapes and
        dtypes are read here (on the calling thread), nothing is copied."""
        specs: list[tuple[str, tuple, torch.dtype, bool]] = []
        _walk(template, "", lambda key, t: specs.append((key, tuple(t.shape), t.dtype, t.is_cuda))
              if t.is_cuda or self.stage_host else None)

        def allocate() -> None:
            for key, shape, dtype, pinned in specs:
                self._buffer(key, shape, dtype, pinned)

        self._submit(allocate)

    def staged_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._staging.values())

    def snapshot(self, step: int, model: dict[str, torch.Tensor], drafter_config: dict, optim: dict,
                 trainer_state: dict, request: Any = None, periodic: bool = False,
                 optimizers: tuple[torch.optim.Optimizer, ...] = ()) -> Job:
        """Stage the state and queue its write; returns at once unless a write is still in flight.

        Call at a step boundary on the thread (and CUDA stream) that produced the state.
        `optimizers`: whose next step must wait for the copies (they update the staged tensors)."""
        began = time.perf_counter()
        self._wait_idle()
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        staged_model = {k: self._stage(v, f"model/{k}", copies) for k, v in model.items()}
        staged_optim = self._stage(optim, "optim", copies)
        job = Job(step, staged_model, drafter_config, staged_optim, copy.deepcopy(trainer_state), request, periodic)
        job.copies = self._copy(copies)
        if not self.stage_host:
            self._live.append(job)
        for opt in optimizers:
            self._hook(opt)
        job.stall_s = time.perf_counter() - began
        self._submit(job)
        return job

    def wait(self, raise_failure: bool = True) -> None:
        """Until no write is in flight. raise_failure: raise a failed non-periodic write (once)."""
        with self._cond:
            while self._busy:
                self._cond.wait()
            fatal = self._fatal
            if raise_failure:
                self._fatal = None
        if fatal is not None and raise_failure:
            raise fatal

    def close(self) -> None:
        """Finish the writes in flight (never raises), end the writer thread, free the staging."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._staging.clear()

    def _wait_idle(self) -> None:
        with self._cond:
            if self._busy:
                self.waiting += 1
                self._cond.notify_all()
                while self._busy:
                    self._cond.wait()
                self.waiting -= 1
            fatal, self._fatal = self._fatal, None
        if fatal is not None:
            raise fatal

    def _submit(self, item: Job | Callable[[], None]) -> None:
        with self._cond:
            if self._thread is None or self._closed:
                self._closed = False
                self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
                self._thread.start()
            self._queue.append(item)
            self._busy = True
            self._cond.notify_all()

    def _buffer(self, key: str, shape: tuple, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        buf = self._staging.get(key)
        if buf is None or tuple(buf.shape) != shape or buf.dtype != dtype:
            try:
                buf = torch.empty(shape, dtype=dtype, pin_memory=pinned)
            except RuntimeError:  # no page-locked memory left: pageable (its copy waits for the GPU)
                buf = torch.empty(shape, dtype=dtype)
            self._staging[key] = buf
        return buf

    def _stage(self, obj: Any, key: str, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        """obj with every tensor replaced by its host buffer (the copy is queued in `copies`)."""
        if isinstance(obj, torch.Tensor):
            src = obj.detach()
            if not (src.is_cuda or self.stage_host):
                return src  # written from where it lives (the module doc)
            buf = self._buffer(key, tuple(src.shape), src.dtype, src.is_cuda)
            copies.append((buf, src))
            return buf
        if isinstance(obj, dict):
            return {k: self._stage(v, f"{key}/{k}", copies) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._stage(v, f"{key}/{i}", copies) for i, v in enumerate(obj))
        return copy.deepcopy(obj)

    def _copy(self, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.cuda.Event, torch.cuda.Event]]:
        """CPU tensors now; CUDA tensors on a side stream per device, after the current stream's work."""
        by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for buf, src in copies:
            if src.is_cuda:
                by_device.setdefault(src.device, []).append((buf, src))
            else:
                buf.copy_(src)
        events = []
        for device, pairs in by_device.items():
            side = self._streams.get(device)
            if side is None:
                side = self._streams[device] = torch.cuda.Stream(device)
            start = torch.cuda.Event(enable_timing=True, blocking=True)
            done = torch.cuda.Event(enable_timing=True, blocking=True)
            with after_current(side, device):
                start.record(side)
                for buf, src in pairs:
                    buf.copy_(src, non_blocking=True)
                done.record(side)
            self._pending.append((device, done))
            events.append((start, done))
        return events

    def _hook(self, optimizer: torch.optim.Optimizer) -> None:
        if id(optimizer) in self._hooked:
            return
        self._hooked.add(id(optimizer))

        def before_step(*_: Any) -> None:  # the update must not overwrite what is still being copied
            pending, self._pending = self._pending, []
            for device, done in pending:
                torch.cuda.current_stream(device).wait_event(done)
            live, self._live = self._live, []
            for job in live:  # or written in place
                job.written.wait()

        optimizer.register_step_pre_hook(before_step)

    # ------------------------------------------------------------------ the writer thread
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                item = self._queue.pop(0)
            failed: BaseException | None = None
            try:
                if isinstance(item, Job):
                    self._write(item)
                else:
                    item()
            except BaseException as exc:  # noqa: BLE001 - reported, never lost with the thread
                failed = exc
            finally:
                if isinstance(item, Job):
                    item.written.set()
            with self._cond:
                if failed is not None and not (isinstance(item, Job) and item.periodic and isinstance(failed, OSError)):
                    self._fatal = failed
                self._busy = bool(self._queue)
                self._cond.notify_all()

    def _write(self, job: Job) -> None:
        for _start, done in job.copies:
            done.synchronize()
        if job.copies:
            job.copy_s = sum(start.elapsed_time(done) for start, done in job.copies) / 1000
        try:
            _refuse_non_finite(job)
            path, seconds = self.manager.save(job.step, job.model, job.drafter_config, job.optim, job.trainer_state)
        except BaseException as exc:
            self.on_failed(job, exc)
            raise
        self.on_written(job, path, seconds)


def _refuse_non_finite(job: Job) -> None:
    """A checkpoint of NaN/inf weights is never written: a resume from it would train on NaN. The
    staged host copies are read on this thread, so training waits for nothing."""
    for name, tensor in job.model.items():
        if tensor.is_floating_point() and tensor.numel():
            lo, hi = torch.aminmax(tensor)
            if not bool(torch.isfinite(lo) & torch.isfinite(hi)):
                raise LossNotFinite(f"the drafter's weight {name} holds NaN/inf at step {job.step}: checkpoint "
                                    "not written (the loss went NaN; lower optim.lr, then resume from an earlier "
                                    "checkpoint)")


def optimizer_state_like(optimizer: torch.optim.Optimizer) -> dict:
    """optimizer.state_dict(), or before its first step what AdamW's will hold after it (for sizing
    the staging buffers: a guess that misses only makes the first snapshot allocate)."""
    state = optimizer.state_dict()
    if state["state"] or not isinstance(optimizer, torch.optim.AdamW):
        return state
    index = 0
    for group in optimizer.param_groups:
        on_device = bool(group.get("fused") or group.get("capturable"))
        for p in group["params"]:
            step = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
            state["state"][index] = {"step": step, "exp_avg": p, "exp_avg_sq": p}
            if group.get("amsgrad"):
                state["state"][index]["max_exp_avg_sq"] = p
            index += 1
    return state


def _walk(obj: Any, key: str, visit: Callable[[str, torch.Tensor], None]) -> None:
    """visit(key, tensor) for every tensor of a nested state, keyed as Checkpointer._stage keys it."""
    if isinstance(obj, torch.Tensor):
        visit(key, obj)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _walk(v, f"{key}/{k}" if key else str(k), visit)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _walk(v, f"{key}/{i}", visit)
