"""The threaded pipeline: prefetcher -> target workers -> drafter replicas, one thread per device role.

A pipeline kind of the Trainer (trainer.train.loop), which keeps setup, resume, evaluation and
the final checkpoint; this runs the steps. `ThreadedPipeline` holds the replicas and the warm-up
state; each `train_steps` builds the stages and their threads (`_Stages`) and runs them. See
trainer/pipeline/__init__.py for the stages and compile_safety.py for why the warm-up happens on
one thread before any worker starts.
"""
from __future__ import annotations

import copy
import time

import torch

from trainer.data.batches import Batch, PreloadedDataset
from trainer.data.packing import row_anchors, warmup_packed_batch
from trainer.distributed.grad_sync import FlatGrads, ReplicaAllReduce
from trainer.models.hf import hf_config
from trainer.models.masks import Blocks, prepare_blocks
from trainer.models.objective import drafter_loss_sums, selector_metrics
from trainer.models.stages import StagePlan, feature_layers, tap_columns
from trainer.models.target import FrozenHead, compile_decoder_layers, uncompile_decoder_layers
from trainer.models.target_loading import replica_target
from trainer.pipeline.compile_safety import CompileGuard
from trainer.pipeline.device_stats import BusyMeter, MetricAccumulator, is_cuda, peak_memory_gb
from trainer.pipeline.features import allocate_slots, pack_context_features
from trainer.pipeline.flops import FLOP_KEYS, micro_batch_flops, peak_tflops
from trainer.pipeline.prefetch import BatchPrefetcher, MicroBatch
from trainer.pipeline.shapes import PackedShape, WarmShapes
from trainer.pipeline.stages import StageQueue, StageThread, join_all
from trainer.pipeline.workers import (
    METRIC_NAMES,
    DrafterSettings,
    DrafterWorker,
    Replica,
    TargetSettings,
    TargetStage,
    TargetWorker,
    WorkerLinks,
    split_features,
)
from trainer.run.config import TrainerConfig, target_replicas
from trainer.run.control import Request
from trainer.train.components import Components, require_logits
from trainer.train.loop import Trainer, autocast_for
from trainer.train.metrics import LossNotFinite
from trainer.train.optim import build_optimizer, build_scheduler, lr_factor


def compiles_target(cfg: TrainerConfig, target_devices: list[torch.device]) -> bool:
    """model.compile_target as written, or for `auto`: every target device is CUDA and the rows are
    packed (one warmed shape). Never on the CPU (no compiler needed there; tests stay eager)."""
    if not all(is_cuda(d) for d in target_devices):
        return False
    if cfg.model.compile_target == "auto":
        return bool(cfg.data.pack_length)
    return bool(cfg.model.compile_target)


def forget_states_before(states: dict, first_kept: int) -> None:
    """Drop the entries with an index below first_kept.

    The prefetch thread inserts into `states` meanwhile; iterating a dict in Python while another
    thread adds to it raises "dictionary changed size during iteration", so the keys are copied
    first with list(), which does not give up the GIL part-way."""
    for old in [i for i in list(states) if i < first_kept]:
        states.pop(old, None)


def build_replicas(cfg: TrainerConfig, c: Components, devices: list[torch.device]) -> list[Replica]:
    """The drafter (replica 0, on its first device) and a copy per further drafter device, each with
    its own optimizer and scheduler in the same state."""
    replicas = [Replica(drafter=c.drafter, head=c.head, optimizer=c.optimizer, scheduler=c.scheduler,
                        flat=FlatGrads(list(c.drafter.parameters())))]
    for d in devices[1:]:
        drafter = copy.deepcopy(c.drafter).to(d)
        opt = build_optimizer(drafter.parameters(), cfg.optim)
        opt.load_state_dict(c.optimizer.state_dict())
        sched = build_scheduler(opt, cfg.optim)
        sched.load_state_dict(c.scheduler.state_dict())
        head = c.head if d == torch.device(c.drafter_device) else FrozenHead.from_target(c.target, d)
        replicas.append(Replica(drafter=drafter, head=head, optimizer=opt, scheduler=sched,
                                flat=FlatGrads(list(drafter.parameters()))))
    return replicas


class ThreadedPipeline:
    """The Trainer's threaded pipeline kind: replicas on every configured device, warmed on one thread."""

    def __init__(self, trainer: Trainer, c: Components) -> None:
        cfg = self.cfg = trainer.cfg
        self.trainer, self.c = trainer, c
        first = c.target.plan
        self.target_plans = [StagePlan(first.bounds, tuple(torch.device(d) for d in devices))
                             for devices in target_replicas(cfg.devices)]
        self.replica_devices = [plan.devices[0] for plan in self.target_plans]  # where each replica's input goes
        self.target_devices = list(dict.fromkeys(d for plan in self.target_plans for d in plan.devices))
        self.drafter_devices = [torch.device(d) for d in cfg.devices.drafter]
        self.targets = [c.target if plan.devices == first.devices else replica_target(c.target, plan)
                        for plan in self.target_plans]
        if c.objective.needs_target:  # model.loss kl: every replica runs its layers above the tapped ones
            for target in self.targets[1:]:
                require_logits(target, trainer.rd.log)
        self.replicas = build_replicas(cfg, c, self.drafter_devices)
        self.replica_keys = [str(d) if len(self.drafter_devices) == 1 else f"{d}#drafter{r}"
                             for r, d in enumerate(self.drafter_devices)]
        self.autocast_dtype = {d: (torch.bfloat16 if d.type == "cuda" and cfg.model.dtype == "bf16" else None)
                               for d in self.drafter_devices}
        self.micro_batches = trainer.hosts.local_micro_batches(cfg.optim.micro_batches)  # this host's, per step
        remaining = (cfg.optim.total_steps - trainer.state.step) * cfg.optim.micro_batches
        self.warm: PackedShape | WarmShapes
        if cfg.data.pack_length:  # one shape for the whole run: nothing to pad, one warm-up
            self.warm, self.pad = PackedShape(cfg.data.pack_rows, cfg.data.pack_length), False
        else:
            assert isinstance(c.train_data, PreloadedDataset), "unpacked rows: trainer.train.components"
            self.warm = WarmShapes(c.train_data, remaining, cfg.run.warmup_shapes)
            mode = cfg.pipeline.pad_to_warm_shapes
            self.pad = mode == "always" or (mode == "auto" and c.backend == "flex")
        self.anchors = row_anchors(cfg.data, cfg.model.block_size)
        self.guard = CompileGuard()
        self.compiled_target = compiles_target(cfg, self.target_devices)
        self.step_flops: dict[int, dict] = {}  # FLOP and token counts by step, of the micro-batches built
        trainer.rd.update(gpus=sorted({d.index or 0 for d in self.devices() if is_cuda(d)}))

    def top_width(self) -> int:
        """Columns a feature slot holds after the features: the target's hidden size when the loss
        reads its logits (its last hidden states, trainer.pipeline.workers.split_features), else 0."""
        return int(hf_config(self.c.target.module).hidden_size) if self.c.objective.needs_target else 0

    def devices(self) -> list[torch.device]:
        return list(dict.fromkeys(self.target_devices + self.drafter_devices))

    # ------------------------------------------------------------------ warm-up
    def warmup(self) -> None:
        """Every drafter device, every warm shape, forward + backward, on this one thread; then freeze."""
        cfg, c, rd = self.cfg, self.c, self.trainer.rd
        packed = bool(cfg.data.pack_length)
        if self.compiled_target:
            for target in dict.fromkeys(self.targets):
                compile_decoder_layers(target.module)
        shapes = self.warm.shapes()
        rd.update(state="warmup")
        began = time.time()
        gen = torch.Generator().manual_seed(12345)
        layer_ids = c.drafter.config.target_layer_ids

        def inputs(shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
            b, seq = shape
            if packed:  # documents and boundaries like the real rows, through the packed paths
                batch = warmup_packed_batch(b, seq, c.drafter.config.vocab_size, gen)
                return batch.input_ids, batch.doc_start, batch.loss_mask
            ids = torch.randint(0, c.drafter.config.vocab_size, (b, seq), generator=gen)
            return ids, None, torch.ones_like(ids, dtype=torch.bool)

        width = len(layer_ids) * int(hf_config(c.target.module).hidden_size)
        top_width = self.top_width()

        def features(t: int, ids: torch.Tensor, doc_start: torch.Tensor | None) -> torch.Tensor:
            """The target workers' own calls (same mask path, stage by stage, the same slot layout), so a
            compiled target meets nothing new."""
            tdev = self.replica_devices[t]
            target = self.targets[t]
            out = torch.empty(*ids.shape, width + top_width, dtype=target.dtype,
                              device=self.target_plans[t].devices[-1])
            with torch.inference_mode():
                return pack_context_features(target, ids.to(tdev), None, layer_ids, out,
                                             None if doc_start is None else doc_start.to(tdev),
                                             top=out[..., width:] if top_width else None)

        for t in range(1, len(self.targets)):  # targets[0] is warmed with every drafter below
            if self.target_plans[t].devices not in [p.devices for p in self.target_plans[:t]]:
                def target_step(shape: tuple[int, int], t: int = t) -> None:
                    features(t, *inputs(shape)[:2])

                self.guard.warm_up(f"target{t}:{self.replica_devices[t]}", shapes, target_step)
        for rank, device in enumerate(self.drafter_devices):
            def step(shape: tuple[int, int], rank: int = rank, device: torch.device = device) -> None:
                ids, doc_start, loss_mask = inputs(shape)
                blocks = prepare_blocks(ids, loss_mask, self.anchors, cfg.model.block_size, c.gamma,
                                        c.drafter.config.mask_token_id, gen, doc_start).to(device)
                feats = features(0, ids, doc_start).clone().to(device)
                ctx, top = split_features(feats, c.objective, c.drafter.config.hidden_size)
                replica = self.replicas[rank]
                with autocast_for(str(device), cfg.model.dtype):
                    loss, _, _ = drafter_loss_sums(replica.drafter, replica.head, ctx, blocks, c.backend,
                                                   cfg.model.loss_chunk,
                                                   doc_start=None if doc_start is None else doc_start.to(device),
                                                   objective=c.objective, target_hidden=top)
                    loss.backward()

            self.guard.warm_up(self.replica_keys[rank], shapes, step)
        for replica in self.replicas:
            replica.flat.zero()
        for device in set(self.target_devices + self.drafter_devices):
            if is_cuda(device):
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
        r0 = self.replicas[0]
        self.trainer.prepare_checkpoints(r0.drafter, r0.optimizer, r0.scheduler)
        self.guard.freeze()
        seconds = time.time() - began
        rd.event("warmup", self.trainer.state.step, shapes=[list(s) for s in shapes], seconds=round(seconds, 3),
                 compile_target=self.compiled_target)
        rd.log(f"warm-up of {len(self.drafter_devices)} drafter device(s) on {len(shapes)} shapes {shapes} "
               f"took {seconds:.1f}s (target {'compiled' if self.compiled_target else 'eager'}); compiles frozen")

    # ------------------------------------------------------------------ the run
    def train_steps(self) -> str | None:
        """Run the threads until done or stopped; returns the stop reason (None when done)."""
        stages = _Stages(self)
        stop, checkpointer = self.trainer.stop, self.trainer.checkpointer
        since = (self.trainer.state.step, time.time(), None)
        for t in stages.threads:
            t.start()
        try:
            while any(t.is_alive() for t in stages.threads) and not stop.is_set():
                stop.wait(0.2)
                for w in stages.accumulator.completed():
                    since = stages.write_window(w, since)
            lingering = join_all(stages.threads, stop)
            if lingering:
                self.trainer.rd.log(f"threads still running after stop: {lingering}")
            if stop.error is None:
                for w in stages.accumulator.drain():
                    since = stages.write_window(w, since)
        except LossNotFinite:  # seen in a window's record: the threads stop before training on it further
            stop.stop("loss not finite")
            join_all(stages.threads, stop)
            raise
        finally:
            checkpointer.wait(raise_failure=False)  # a stop's checkpoint is on disk before the run ends
            self.guard.unfreeze()
            for target in dict.fromkeys(self.targets):  # evaluation meets new lengths: run it eagerly
                uncompile_decoder_layers(target.module)
        if stop.error is not None:
            raise stop.error
        checkpointer.wait()  # a failed requested checkpoint fails the run
        return stop.reason


class _Stages:
    """One run of the pipeline's stages: queues, prefetcher, workers and their threads, the
    step-boundary hook (drafter 0's thread) and the step windows' records."""

    def __init__(self, p: ThreadedPipeline) -> None:
        cfg, c, trainer = p.cfg, p.c, p.trainer
        self.p, self.cfg, self.trainer = p, cfg, trainer
        M, T, R = p.micro_batches, len(p.targets), len(p.drafter_devices)
        first = self.first_step = trainer.state.step
        count = (cfg.optim.total_steps - first) * M
        stop = self.stop = trainer.stop
        q = cfg.pipeline
        self.target_inputs = [StageQueue(f"prefetch->target{t}", q.prefetch, stop) for t in range(T)]
        self.feature_queues = [[StageQueue(f"target{t}->drafter{r}", q.queue_depth, stop) for t in range(T)]
                               for r in range(R)]
        self.data_states: dict[int, dict] = {}
        self.step_tokens: dict[int, int] = {}
        self.step_flops = p.step_flops

        def data_state() -> dict:
            return {"data": c.train_data.state_dict(), "anchor_rng": trainer.state.anchor_rng.get_state()}

        def prepare(batch: Batch) -> Blocks:
            return prepare_blocks(batch.input_ids, batch.loss_mask, p.anchors, cfg.model.block_size,
                                  c.gamma, c.drafter.config.mask_token_id, trainer.state.anchor_rng,
                                  getattr(batch, "doc_start", None))

        next_batch, prepare_fn = trainer.hosts.batch_source(c.train_data.next_batch, prepare)
        def record(mb: MicroBatch) -> None:  # what each micro-batch holds, for checkpoints and the step metrics
            self.data_states[mb.index] = mb.data_state
            self.step_tokens[mb.step] = self.step_tokens.get(mb.step, 0) + mb.tokens
            counts = micro_batch_flops(c.target.config, c.drafter.config, mb.attention_mask, mb.doc_start, mb.blocks,
                                       kl=c.objective.needs_target)
            into = self.step_flops.setdefault(mb.step, dict.fromkeys(FLOP_KEYS, 0.0))
            for key, value in counts.items():
                into[key] += value

        prefetcher = BatchPrefetcher(next_batch, prepare_fn, data_state, self.target_inputs, stop, count, M,
                                     first, p.warm.shape_for if p.pad else None,
                                     pin=any(is_cuda(d) for d in p.target_devices + p.drafter_devices),
                                     on_built=record)
        self.busy = {d: BusyMeter(d) for d in p.devices()}
        layer_ids = c.drafter.config.target_layer_ids
        width = len(layer_ids) * int(hf_config(c.target.module).hidden_size)
        top_width = p.top_width()
        max_numel = max(b * s for b, s in p.warm.shapes()) * (width + top_width)
        if not p.pad:
            max_numel = max(max_numel, cfg.data.token_budget * (width + top_width))
        target_dtype = c.target.dtype
        route = lambda index: (index % M) % R  # noqa: E731 - micro-batch j of a step goes to replica j % R
        self.target_workers: list[TargetWorker] = []
        self.stage_queues: list[StageQueue] = []
        taps, last_layer = tap_columns(layer_ids), feature_layers(layer_ids)
        for t, plan in enumerate(p.target_plans):
            S, n = len(plan), len(range(t, count, T))
            hops = [StageQueue(f"target{t}.{s}->target{t}.{s + 1}", q.queue_depth, stop) for s in range(S - 1)]
            self.stage_queues += hops
            pool: list | StageQueue = allocate_slots(q.queue_depth * (R + S - 1) + 2, max_numel, target_dtype,
                                                     plan.devices[-1])
            for s, ((lo, hi), d) in enumerate(zip(plan.bounds, plan.devices)):
                stage = TargetStage(index=s, count=S, lo=lo, hi=last_layer if s == S - 1 else hi, taps=taps,
                                    next_device=None if s == S - 1 else plan.devices[s + 1])
                outputs = [self.feature_queues[r][t] for r in range(R)] if s == S - 1 else [hops[s]]
                worker = TargetWorker(TargetSettings(rank=t, device=d, layer_ids=layer_ids, width=width,
                                                     top_width=top_width, count=n, route=route), p.targets[t].module,
                                      self.target_inputs[t] if s == 0 else hops[s - 1], outputs, pool,
                                      WorkerLinks(stop=stop, busy=self.busy[d], guard=p.guard), stage)
                pool = worker.free
                self.target_workers.append(worker)
        streams = [torch.cuda.Stream(d) if is_cuda(d) else None for d in p.drafter_devices]
        reducer = ReplicaAllReduce([r.flat for r in p.replicas], streams, stop,
                                   across_hosts=trainer.hosts.across_hosts())
        self.accumulator = MetricAccumulator(METRIC_NAMES, p.drafter_devices[0])
        self.drafter_workers = [
            DrafterWorker(DrafterSettings(rank=r, replicas=R, device=d, backend=c.backend,
                                          loss_chunk=cfg.model.loss_chunk, autocast_dtype=p.autocast_dtype[d],
                                          max_norm=cfg.optim.grad_clip,
                                          first_step=first, total_steps=cfg.optim.total_steps, micro_batches=M,
                                          log_every=cfg.run.log_every, objective=c.objective),
                          p.replicas[r], reducer, self.feature_queues[r],
                          WorkerLinks(stop=stop, busy=self.busy[d], guard=p.guard),
                          self.accumulator if r == 0 else None, self.on_step_end if r == 0 else None, streams[r])
            for r, d in enumerate(p.drafter_devices)]
        self.threads = [StageThread("prefetch", prefetcher.run, stop)]
        self.threads += [StageThread(f"target{w.rank}" if w.stage.count == 1 else f"target{w.rank}.{w.stage.index}",
                                     w.run, stop) for w in self.target_workers]
        self.threads += [StageThread(f"drafter{r}", w.run, stop) for r, w in enumerate(self.drafter_workers)]

    # ------------------------------------------------------------------ step boundaries (drafter 0's thread)
    def snapshot(self, step: int, request: Request | None, periodic: bool = False) -> None:
        """Stage the state (trainer.train.checkpointer: side-stream copies to pinned memory), written
        in the background while training goes on."""
        last_index = (step - self.first_step) * self.p.micro_batches - 1
        r0 = self.p.replicas[0]
        self.trainer.snapshot(step, r0.drafter, r0.optimizer, r0.scheduler, self.data_states[last_index], request,
                              periodic)

    def on_step_end(self, step: int, _last: MicroBatch | None) -> None:
        trainer = self.trainer
        trainer.state.step = step
        forget_states_before(self.data_states, (step - self.first_step - 1) * self.p.micro_batches)
        requests = trainer.new_requests()
        every = self.cfg.run.checkpoint_every
        periodic = bool(every and step % every == 0 and step < self.cfg.optim.total_steps)
        stops = [r for r in requests if r.kind == "stop"]
        trainer.hosts.at_boundary(step, [r for r in requests if r.kind == "checkpoint"], stops[0] if stops else None,
                                  periodic, lambda request, periodic: self.snapshot(step, request, periodic),
                                  self.stop.stop)

    # ------------------------------------------------------------------ step windows
    def _gpu_entries(self, busy: dict) -> list[dict]:
        out = []
        p = self.p
        for i, d in enumerate(self.busy):
            roles = [name for name, devs in (("target", p.target_devices), ("drafter", p.drafter_devices))
                     if d in devs]
            out.append({"index": d.index or 0 if is_cuda(d) else i, "role": "+".join(roles) if is_cuda(d) else "cpu",
                        "busy": None if busy[d] is None else round(busy[d], 4), "mem_gb": peak_memory_gb(d)})
        return out

    def _window_counts(self, first: int, end: int) -> dict:
        """FLOPs and token counts of steps first..end-1, from the micro-batches actually built."""
        total = dict.fromkeys(FLOP_KEYS, 0.0)
        for s in range(first, end):
            for key, value in self.step_flops.get(s, {}).items():
                total[key] += value
        return total

    def write_window(self, w: dict, since: tuple) -> tuple:
        """since: (step, host time, GPU time or None) where the window starts. A window is timed
        on the GPU's clock when both its ends have one (every window after the first on CUDA)."""
        cfg, p, metrics = self.cfg, self.p, self.trainer.metrics
        step, now, gpu_now = int(w["step"]), w["time"], w.get("gpu_time")
        prev_step, prev_time, prev_gpu = since
        seconds = max((gpu_now - prev_gpu) if gpu_now is not None and prev_gpu is not None else now - prev_time, 1e-9)
        tokens = sum(self.step_tokens.get(s, 0) for s in range(prev_step, step))
        counts = self._window_counts(prev_step, step)
        weight = max(w["weight_sum"], 1e-6)
        busy = {d: m.busy_fraction() for d, m in self.busy.items()}
        m = {"loss": w["loss_sum"] / weight, "acc": w["correct_sum"] / weight,
             "lr": cfg.optim.lr * lr_factor(step - 1, cfg.optim),
             "grad_norm": w["grad_norm_sum"] / max(w["steps"], 1), "tokens": tokens, "tokens_per_s": tokens / seconds,
             "pad_share": round(1 - counts["tokens_real"] / max(counts["tokens_padded"], 1.0), 4),
             **(selector_metrics(w["selector_loss_sum"], w["selector_correct_sum"], w["selector_recall_sum"],
                                 weight) if cfg.model.drafter.kind == "dflash2" else {}),
             "recompiles": p.guard.recompiles(), "gpus": self._gpu_entries(busy),
             "queues": {q.name: q.depth() for q in self.target_inputs + self.stage_queues
                        + [q for row in self.feature_queues for q in row]}}
        # steady: every window after the first (the pipeline filling up) and before the last, whose
        # drafter steps drain features the target computed ahead in earlier windows (on a shared GPU
        # that window runs the drafter alone: faster than the pipeline); a run of two windows counts
        # its last
        draining = step >= cfg.optim.total_steps and metrics.steady_rate() is not None
        if prev_step > self.first_step and not draining:
            metrics.add_steady(tokens, seconds)
        if metrics.steady_rate() is not None:
            m["tokens_per_s_steady"] = metrics.steady_rate()
        peak = peak_tflops(torch.cuda.get_device_name(p.drafter_devices[0]) if is_cuda(p.drafter_devices[0]) else None)
        if peak:
            nt, nd = len(p.target_devices), len(p.drafter_devices)
            rate = {k: counts[k] / seconds / (peak * 1e12 * (nt if k.startswith("target") else nd))
                    for k in ("target_real", "target_padded", "drafter_real", "drafter_padded")}
            m["mfu"] = {"target": round(rate["target_real"], 4), "drafter": round(rate["drafter_real"], 4),
                        "target_padded": round(rate["target_padded"], 4),
                        "drafter_padded": round(rate["drafter_padded"], 4)}
            if max(rate.values()) > 1.0:
                self.trainer.rd.log(f"warning: MFU above the {peak:.0f} TFLOP/s peak in steps {prev_step}..{step} "
                                    f"{m['mfu']}: the FLOP count or the window's timing is wrong")
        metrics.step(step, m)
        return step, now, gpu_now
