"""The two worker kinds: target (features) and drafter (training), one thread each per device."""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trainer.models.drafter import DFlashDrafter
from trainer.models.objective import drafter_loss_sums
from trainer.models.target import FrozenHead

from trainer.pipeline.compile_safety import CompileGuard, configure_compile_for_thread
from trainer.pipeline.device_stats import BusyMeter, MetricAccumulator, is_cuda
from trainer.pipeline.features import FeatureSlot, pack_context_features
from trainer.distributed.grad_sync import FlatGrads, ReplicaAllReduce
from trainer.pipeline.prefetch import MicroBatch
from trainer.pipeline.stages import StageQueue
from trainer.pipeline.stopping import StopSignal

METRIC_NAMES = ["loss_sum", "weight_sum", "correct_sum", "grad_norm_sum", "steps"]


def worker_stream(device: torch.device) -> torch.cuda.Stream | None:
    return torch.cuda.Stream(device) if is_cuda(device) else None


def on_stream(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def record_event(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


@dataclass
class Features:
    """A packed feature tensor on the target device, ready once `ready` completes."""

    mb: MicroBatch
    tensor: torch.Tensor
    ready: torch.cuda.Event | None
    slot: FeatureSlot
    owner: "TargetWorker"

    def release(self, consumer_stream: torch.cuda.Stream | None) -> None:
        """Give the slot back; the target waits on this event (GPU side) before reusing it."""
        self.slot.released = record_event(consumer_stream)
        self.owner.free.put(self.slot)


class TargetWorker:
    def __init__(self, rank: int, target: torch.nn.Module, device: torch.device | str, layer_ids: list[int],
                 width: int, inputs: StageQueue, outputs: list[StageQueue], slots: list[FeatureSlot],
                 stop: StopSignal, busy: BusyMeter, count: int, route: Callable[[int], int],
                 guard: CompileGuard | None = None) -> None:
        self.rank, self.target, self.device = rank, target, torch.device(device)
        self.guard = guard  # packed rows / compile_target: the target runs compiled code too
        self.layer_ids, self.width = layer_ids, width
        self.inputs, self.outputs, self.stop, self.busy = inputs, outputs, stop, busy
        self.count, self.route = count, route  # items this worker handles; micro-batch index -> drafter rank
        self.free = StageQueue(f"target{rank}.free", len(slots), stop)
        for slot in slots:
            self.free.put(slot)

    def run(self) -> None:
        configure_compile_for_thread()
        stream = worker_stream(self.device)
        with on_stream(stream), torch.inference_mode():
            for _ in range(self.count):
                mb: MicroBatch = self.inputs.get()
                slot = self.free.get()
                with self.busy.busy():
                    if slot.released is not None:
                        stream.wait_event(slot.released)
                    ids = mb.input_ids.to(self.device, non_blocking=True)
                    doc_start = None if mb.doc_start is None else mb.doc_start.to(self.device, non_blocking=True)
                    out = slot.view(ids.shape[0], ids.shape[1], self.width)

                    def forward(ids: torch.Tensor = ids, out: torch.Tensor = out,
                                doc_start: torch.Tensor | None = doc_start) -> torch.Tensor:
                        return pack_context_features(self.target, ids, None, self.layer_ids, out, doc_start)

                    if self.guard is None:
                        forward()
                    else:
                        self.guard.run_warmed(f"target:{self.device}", tuple(ids.shape), forward)
                    ready = record_event(stream)
                self.outputs[self.route(mb.index)].put(Features(mb, out, ready, slot, self))


@dataclass
class DrafterSettings:
    backend: str  # "flex" | "sdpa"
    loss_chunk: int
    autocast_dtype: torch.dtype | None
    max_norm: float
    first_step: int
    total_steps: int
    micro_batches: int  # per optimizer step, over all replicas
    log_every: int


class DrafterWorker:
    """One drafter replica. Replica 0 also owns the metric accumulator and the step-end hook."""

    def __init__(self, rank: int, replicas: int, device: torch.device | str, drafter: DFlashDrafter, head: FrozenHead,
                 optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler, flat: FlatGrads,
                 reducer: ReplicaAllReduce, inputs: list[StageQueue], settings: DrafterSettings,
                 stop: StopSignal, busy: BusyMeter, guard: CompileGuard, metrics: MetricAccumulator | None,
                 on_step_end: Callable[[int, MicroBatch | None], None] | None = None,
                 stream: torch.cuda.Stream | None = None) -> None:
        self.rank, self.replicas, self.device = rank, replicas, torch.device(device)
        self.drafter, self.head, self.optimizer, self.scheduler = drafter, head, optimizer, scheduler
        self.flat, self.reducer, self.inputs, self.s = flat, reducer, inputs, settings
        self.stop, self.busy, self.guard, self.metrics = stop, busy, guard, metrics
        self.on_step_end = on_step_end  # (step_done, last MicroBatch) -> None, replica 0 only
        self.stream = stream
        self.key = str(self.device) if replicas == 1 else f"{self.device}#drafter{rank}"

    def my_indices(self, step: int) -> list[int]:
        base = (step - self.s.first_step) * self.s.micro_batches
        return [base + j for j in range(self.s.micro_batches) if j % self.replicas == self.rank]

    def micro_step(self, feats: Features) -> None:
        """Forward + backward of one micro-batch on this replica's stream (no host sync)."""
        stream = self.stream
        if feats.ready is not None:
            stream.wait_event(feats.ready)
        same_device = feats.tensor.device == self.device
        ctx = feats.tensor if same_device else feats.tensor.to(self.device, non_blocking=True)
        if not same_device:
            feats.release(stream)
        blocks = feats.mb.blocks.to(self.device)
        doc_start = None if feats.mb.doc_start is None else feats.mb.doc_start.to(self.device, non_blocking=True)
        autocast = (torch.autocast(self.device.type, dtype=self.s.autocast_dtype)
                    if self.s.autocast_dtype is not None else contextlib.nullcontext())

        def forward_backward() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            with autocast:
                sums = drafter_loss_sums(self.drafter, self.head, ctx, blocks, self.s.backend, self.s.loss_chunk,
                                         doc_start=doc_start)
                sums[0].backward()
            return sums

        loss_sum, weight_sum, correct_sum = self.guard.run_warmed(self.key, feats.mb.shape, forward_backward)
        self.flat.add_stats(loss_sum, weight_sum, correct_sum)
        if same_device:
            feats.release(stream)

    def optimizer_step(self) -> None:
        norm = self.flat.finish_step(self.s.max_norm)
        if self.metrics is not None:
            one = torch.ones(1, dtype=self.flat.stats.dtype, device=self.device)
            self.metrics.add(torch.cat([self.flat.stats, norm.reshape(1).to(self.flat.stats.dtype), one]))
        self.optimizer.step()
        self.scheduler.step()
        self.flat.zero()

    def run(self) -> None:
        configure_compile_for_thread()
        if self.stream is None and is_cuda(self.device):
            self.stream = worker_stream(self.device)
        with on_stream(self.stream):
            for step in range(self.s.first_step, self.s.total_steps):
                last = None
                for index in self.my_indices(step):
                    feats: Features = self.inputs[index % len(self.inputs)].get()
                    if feats.mb.index != index:
                        raise RuntimeError(f"drafter {self.rank} expected micro-batch {index}, got {feats.mb.index}")
                    with self.busy.busy():
                        self.micro_step(feats)
                    last = feats.mb
                self.reducer.all_reduce(self.rank)
                with self.busy.busy():
                    self.optimizer_step()
                if self.metrics is not None and (step + 1) % self.s.log_every == 0:
                    self.metrics.snapshot(step + 1)
                if self.on_step_end is not None:
                    self.on_step_end(step + 1, last)
