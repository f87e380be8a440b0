"""The two worker kinds: target (features) and drafter (training), one thread each per device."""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trainer.distributed.grad_sync import STATS, FlatGrads, ReplicaAllReduce
from trainer.models.drafter import DFlashDrafter
from trainer.models.objective import CE_DECAY, Objective, drafter_loss_sums, selector_sums_of
from trainer.models.stages import write_pending
from trainer.models.target import FrozenHead, stage_context_features
from trainer.pipeline.compile_safety import CompileGuard, configure_compile_for_thread
from trainer.pipeline.device_stats import BusyMeter, MetricAccumulator, is_cuda
from trainer.pipeline.features import FeatureSlot
from trainer.pipeline.prefetch import MicroBatch
from trainer.pipeline.stages import StageQueue
from trainer.run.stopping import StopSignal
from trainer.train.streams import on_stream, record_event

METRIC_NAMES = [*STATS, "grad_norm_sum", "steps"]  # the flat buffer's stats, then the step's norm and count


def worker_stream(device: torch.device) -> torch.cuda.Stream | None:
    return torch.cuda.Stream(device) if is_cuda(device) else None


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


def split_features(tensor: torch.Tensor, objective: Objective, hidden: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A feature slot's view [B, L, n*H (+ H)] as (context features, the target's last hidden states
    or None): the second only when the objective reads the target's logits."""
    if not objective.needs_target:
        return tensor, None
    return tensor[..., :-hidden], tensor[..., -hidden:]


@dataclass(frozen=True, kw_only=True)
class WorkerLinks:
    """What every worker thread shares with the pipeline: the stop signal, its device's busy meter
    and the compile guard its warmed shapes run under."""

    stop: StopSignal
    busy: BusyMeter
    guard: CompileGuard


@dataclass(frozen=True, kw_only=True)
class TargetSettings:
    rank: int  # the target replica
    device: torch.device
    layer_ids: list[int]
    width: int  # features per position: len(layer_ids) * hidden size
    top_width: int = 0  # hidden size when the loss reads the target's logits (model.loss kl): its last
    # hidden states ride in the slot after the features (`split_features`), written by the last stage
    count: int  # micro-batches this worker handles
    route: Callable[[int], int]  # micro-batch index -> drafter rank


@dataclass(frozen=True, kw_only=True)
class TargetStage:
    """Which part of a target replica a worker runs: layers [lo, hi) of stage `index` of `count`."""

    index: int
    count: int
    lo: int
    hi: int
    taps: dict[int, list[int]]  # layer id -> feature columns (trainer.models.stages.tap_columns)
    next_device: torch.device | None = None  # where the hidden states go next (None: the last stage)

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1


@dataclass
class Handoff:
    """Hidden states passed from one target stage to the next, on the next stage's device."""

    mb: MicroBatch
    hidden: torch.Tensor
    slot: FeatureSlot
    ready: torch.cuda.Event | None
    pending: list[tuple[int, torch.Tensor]]  # tapped outputs already on the slot's device, not yet written


class TargetWorker:
    """One stage of a target replica (the whole replica when it is not split).

    The first stage takes micro-batches from the prefetcher and a feature slot from the replica's
    pool (on the last stage's device); a stage on the slot's device writes its tapped layers' outputs
    into the slot, one elsewhere sends them whole to that device with the hand-off (the last stage
    writes them), and hands its hidden states, already copied to the next stage's device, through a
    bounded queue; the last stage hands the filled slot to a drafter. Ordering is GPU-side:
    each hand-off carries an event the receiver's stream waits on; the host never waits."""

    def __init__(self, settings: TargetSettings, target: torch.nn.Module, inputs: StageQueue,
                 outputs: list[StageQueue], slots: list[FeatureSlot] | StageQueue, links: WorkerLinks,
                 stage: TargetStage | None = None) -> None:
        from trainer.models.stages import feature_layers, tap_columns

        self.s, self.rank, self.target, self.device = settings, settings.rank, target, settings.device
        self.inputs, self.outputs, self.links = inputs, outputs, links
        self.stage = stage or TargetStage(index=0, count=1, lo=0, hi=feature_layers(settings.layer_ids),
                                            taps=tap_columns(settings.layer_ids))
        rank = settings.rank
        self.key = f"target:{self.device}" if self.stage.count == 1 else f"target{rank}.{self.stage.index}:{self.device}"
        if isinstance(slots, StageQueue):  # a later stage: the replica's pool, owned by its first stage
            self.free = slots
        else:
            self.free = StageQueue(f"target{rank}.free", len(slots), links.stop)
            for slot in slots:
                self.free.put(slot)

    def run(self) -> None:
        configure_compile_for_thread()
        stream = worker_stream(self.device)
        st = self.stage
        with on_stream(stream), torch.inference_mode():
            for _ in range(self.s.count):
                if st.first:
                    mb: MicroBatch = self.inputs.get()
                    slot = self.free.get()
                else:
                    hop: Handoff = self.inputs.get()
                    mb, slot = hop.mb, hop.slot
                with self.links.busy.busy():
                    if st.first:
                        if stream is not None and slot.released is not None:  # CUDA: released is an event
                            stream.wait_event(slot.released)
                        x = mb.input_ids.to(self.device, non_blocking=True)
                    else:
                        if stream is not None and hop.ready is not None:
                            stream.wait_event(hop.ready)
                            hop.hidden.record_stream(stream)  # allocated by the previous stage's thread
                        x = hop.hidden
                    pending = [] if st.first else hop.pending
                    doc_start = None if mb.doc_start is None else mb.doc_start.to(self.device, non_blocking=True)
                    out = slot.view(x.shape[0], x.shape[1], self.s.width + self.s.top_width)
                    top = out[..., self.s.width:] if st.last and self.s.top_width else None

                    def forward(x: torch.Tensor = x, out: torch.Tensor = out, doc_start: torch.Tensor | None = doc_start,
                                pending: list = pending, top: torch.Tensor | None = top) -> torch.Tensor:
                        return stage_context_features(self.target, x, st.lo, st.hi, st.taps, out, doc_start,
                                                      pending=pending, top=top)

                    # packed rows / compile_target: the target runs compiled code too
                    hidden = self.links.guard.run_warmed(self.key, tuple(x.shape[:2]), forward)
                    if st.last:
                        write_pending(out, pending, stream)
                    else:
                        hidden = hidden.to(st.next_device, non_blocking=True)
                    ready = record_event(stream)
                if st.last:
                    self.outputs[self.s.route(mb.index)].put(Features(mb, out, ready, slot, self))
                else:
                    self.outputs[0].put(Handoff(mb, hidden, slot, ready, pending))


@dataclass(frozen=True, kw_only=True)
class DrafterSettings:
    rank: int
    replicas: int
    device: torch.device
    backend: str  # "flex" | "sdpa"
    loss_chunk: int
    autocast_dtype: torch.dtype | None
    max_norm: float
    first_step: int
    total_steps: int
    micro_batches: int  # per optimizer step, over all replicas
    log_every: int
    objective: Objective = CE_DECAY  # trainer.models.objective; kl: the features carry the target's last hidden states


@dataclass(kw_only=True)
class Replica:
    """One drafter replica and what trains it."""

    drafter: DFlashDrafter
    head: FrozenHead
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    flat: FlatGrads


class DrafterWorker:
    """One drafter replica. Replica 0 also owns the metric accumulator and the step-end hook."""

    def __init__(self, settings: DrafterSettings, replica: Replica, reducer: ReplicaAllReduce,
                 inputs: list[StageQueue], links: WorkerLinks, metrics: MetricAccumulator | None = None,
                 on_step_end: Callable[[int, MicroBatch | None], None] | None = None,
                 stream: torch.cuda.Stream | None = None) -> None:
        self.s, self.rank, self.device = settings, settings.rank, settings.device
        self.drafter, self.head, self.optimizer, self.scheduler = (replica.drafter, replica.head, replica.optimizer,
                                                                   replica.scheduler)
        self.flat, self.reducer, self.inputs, self.links = replica.flat, reducer, inputs, links
        self.metrics = metrics
        self.on_step_end = on_step_end  # (step_done, last MicroBatch) -> None, replica 0 only
        self.stream = stream
        self.key = str(self.device) if settings.replicas == 1 else f"{self.device}#drafter{settings.rank}"

    def my_indices(self, step: int) -> list[int]:
        base = (step - self.s.first_step) * self.s.micro_batches
        return [base + j for j in range(self.s.micro_batches) if j % self.s.replicas == self.rank]

    def micro_step(self, feats: Features) -> None:
        """Forward + backward of one micro-batch on this replica's stream (no host sync)."""
        stream = self.stream
        if stream is not None and feats.ready is not None:
            stream.wait_event(feats.ready)
        same_device = feats.tensor.device == self.device
        ctx = feats.tensor if same_device else feats.tensor.to(self.device, non_blocking=True)
        if not same_device:
            feats.release(stream)
        ctx, top = split_features(ctx, self.s.objective, self.drafter.config.hidden_size)
        blocks = feats.mb.blocks.to(self.device)
        doc_start = None if feats.mb.doc_start is None else feats.mb.doc_start.to(self.device, non_blocking=True)
        autocast = (torch.autocast(self.device.type, dtype=self.s.autocast_dtype)
                    if self.s.autocast_dtype is not None else contextlib.nullcontext())

        parts: dict = {}

        def forward_backward() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            with autocast:
                sums = drafter_loss_sums(self.drafter, self.head, ctx, blocks, self.s.backend, self.s.loss_chunk,
                                         doc_start=doc_start, objective=self.s.objective, target_hidden=top,
                                         parts=parts)
                sums[0].backward()
            return sums

        loss_sum, weight_sum, correct_sum = self.links.guard.run_warmed(self.key, feats.mb.shape, forward_backward)
        self.flat.add_stats(loss_sum, weight_sum, correct_sum, selector_sums_of(parts))
        if same_device:
            feats.release(stream)

    def optimizer_step(self) -> None:
        norm = self.flat.finish_step(self.s.max_norm, self.optimizer)
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
                    with self.links.busy.busy():
                        self.micro_step(feats)
                    last = feats.mb
                self.reducer.all_reduce(self.rank)
                with self.links.busy.busy():
                    self.optimizer_step()
                if self.metrics is not None and (step + 1) % self.s.log_every == 0:
                    self.metrics.snapshot(step + 1)
                if self.on_step_end is not None:
                    self.on_step_end(step + 1, last)
