"""The threaded trainer: prefetcher -> target workers -> drafter replicas, one thread per device role.

Reuses the reference `Trainer` for setup, resume, evaluation and the final checkpoint; replaces
the step loop. See trainer/pipeline/__init__.py for the stages and compile_safety.py for why the
warm-up happens on one thread before any worker starts.
"""
from __future__ import annotations

import copy
import time
from collections.abc import Callable

import torch

from trainer.train.config import TrainerConfig
from trainer.train.control import Request
from trainer.data.batches import Batch
from trainer.train.loop import Trainer, autocast_for
from trainer.models.masks import Blocks, prepare_blocks
from trainer.train.optim import build_optimizer, build_scheduler, lr_factor
from trainer.data.packing import row_anchors, warmup_packed_batch
from trainer.models.stages import StagePlan, feature_layers, plan_of, tap_columns
from trainer.models.target import FrozenHead, compile_decoder_layers, uncompile_decoder_layers
from trainer.models.target_loading import replica_target
from trainer.train.config import target_replicas

from trainer.pipeline.compile_safety import CompileGuard
from trainer.pipeline.device_stats import BusyMeter, MetricAccumulator, is_cuda, peak_memory_gb
from trainer.pipeline.features import allocate_slots, pack_context_features
from trainer.pipeline.flops import FLOP_KEYS, micro_batch_flops, peak_tflops
from trainer.distributed.grad_sync import FlatGrads, ReplicaAllReduce
from trainer.pipeline.prefetch import BatchPrefetcher, MicroBatch
from trainer.pipeline.shapes import PackedShape, WarmShapes
from trainer.pipeline.stages import StageQueue, StageThread, join_all
from trainer.pipeline.stopping import PipelineFailed, StopSignal
from trainer.pipeline.workers import METRIC_NAMES, DrafterSettings, DrafterWorker, TargetStage, TargetWorker


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


class ThreadedTrainer(Trainer):
    # ------------------------------------------------------------------ replicas
    def build_replicas(self) -> None:
        cfg, c = self.cfg, self.c
        first = plan_of(c.target)
        self.target_plans = [StagePlan(first.bounds, tuple(torch.device(d) for d in devices))
                             for devices in target_replicas(cfg.devices)]
        self.replica_devices = [plan.devices[0] for plan in self.target_plans]  # where each replica's input goes
        self.target_devices = list(dict.fromkeys(d for plan in self.target_plans for d in plan.devices))
        self.drafter_devices = [torch.device(d) for d in cfg.devices.drafter]
        self.targets = [c.target if plan.devices == first.devices else replica_target(c.target, plan, cfg.model.dtype)
                        for plan in self.target_plans]
        self.drafters, self.heads, self.optimizers, self.schedulers = [c.drafter], [c.head], [c.optimizer], [c.scheduler]
        for d in self.drafter_devices[1:]:
            replica = copy.deepcopy(c.drafter).to(d)
            opt = build_optimizer(replica.parameters(), cfg.optim)
            opt.load_state_dict(c.optimizer.state_dict())
            sched = build_scheduler(opt, cfg.optim)
            sched.load_state_dict(c.scheduler.state_dict())
            self.drafters.append(replica)
            self.heads.append(c.head if d == torch.device(c.drafter_device) else FrozenHead.from_target(c.target, d))
            self.optimizers.append(opt)
            self.schedulers.append(sched)
        self.flats = [FlatGrads(list(m.parameters())) for m in self.drafters]
        self.replica_keys = [str(d) if len(self.drafter_devices) == 1 else f"{d}#drafter{r}"
                             for r, d in enumerate(self.drafter_devices)]
        self.autocast_dtype = {d: (torch.bfloat16 if d.type == "cuda" and cfg.model.dtype == "bf16" else None)
                               for d in self.drafter_devices}

    # ------------------------------------------------------------------ warm-up
    def warmup(self) -> None:
        """Every drafter device, every warm shape, forward + backward, on this one thread; then freeze."""
        cfg, c = self.cfg, self.c
        remaining = (cfg.optim.total_steps - self.step) * cfg.optim.micro_batches
        self.packed = bool(cfg.data.pack_length)
        if self.packed:  # one shape for the whole run: nothing to pad, one warm-up
            self.warm: PackedShape | WarmShapes = PackedShape(cfg.data.pack_rows, cfg.data.pack_length)
            self.pad = False
        else:
            self.warm = WarmShapes(c.train_data, remaining, cfg.run.warmup_shapes)
            mode = cfg.pipeline.pad_to_warm_shapes
            self.pad = mode == "always" or (mode == "auto" and self.backend == "flex")
        self.anchors = row_anchors(cfg.data, cfg.model.block_size)
        self.compiled_target = compiles_target(cfg, self.target_devices)
        if self.compiled_target:
            for target in dict.fromkeys(self.targets):
                compile_decoder_layers(target)
        shapes = self.warm.shapes()
        self.guard = CompileGuard()
        self.rd.update(state="warmup")
        began = time.time()
        gen = torch.Generator().manual_seed(12345)
        layer_ids = c.drafter.config.target_layer_ids

        def inputs(shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
            b, seq = shape
            if self.packed:  # documents and boundaries like the real rows, through the packed paths
                batch = warmup_packed_batch(b, seq, c.drafter.config.vocab_size, gen)
                return batch.input_ids, batch.doc_start, batch.loss_mask
            ids = torch.randint(0, c.drafter.config.vocab_size, (b, seq), generator=gen)
            return ids, None, torch.ones_like(ids, dtype=torch.bool)

        def features(t: int, ids: torch.Tensor, doc_start: torch.Tensor | None) -> torch.Tensor:
            """The target workers' own calls (same mask path, stage by stage), so a compiled target meets
            nothing new."""
            tdev = self.replica_devices[t]
            with torch.inference_mode():
                return pack_context_features(self.targets[t], ids.to(tdev), None, layer_ids, None,
                                             None if doc_start is None else doc_start.to(tdev))

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
                with autocast_for(str(device), cfg.model.dtype):
                    from trainer.models.objective import drafter_loss_sums

                    loss, _, _ = drafter_loss_sums(self.drafters[rank], self.heads[rank], feats, blocks,
                                                   self.backend, cfg.model.loss_chunk,
                                                   doc_start=None if doc_start is None else doc_start.to(device))
                    loss.backward()

            self.guard.warm_up(self.replica_keys[rank], shapes, step)
        for flat in self.flats:
            flat.zero()
        for device in set(self.target_devices + self.drafter_devices):
            if is_cuda(device):
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
        self.prepare_checkpoints(self.drafters[0], self.optimizers[0], self.schedulers[0])
        self.guard.freeze()
        seconds = time.time() - began
        self.rd.event("warmup", self.step, shapes=[list(s) for s in shapes], seconds=round(seconds, 3),
                      compile_target=self.compiled_target)
        self.rd.log(f"warm-up of {len(self.drafter_devices)} drafter device(s) on {len(shapes)} shapes {shapes} "
                    f"took {seconds:.1f}s (target {'compiled' if self.compiled_target else 'eager'}); compiles frozen")

    # ------------------------------------------------------------------ the threaded loop
    def _build_pipeline(self) -> list[StageThread]:
        cfg, c = self.cfg, self.c
        M, T, R = self.local_micro_batches(), len(self.targets), len(self.drafter_devices)
        first = self.step
        count = (cfg.optim.total_steps - first) * M
        stop = self.stop = StopSignal()
        p = cfg.pipeline
        self.target_inputs = [StageQueue(f"prefetch->target{t}", p.prefetch, stop) for t in range(T)]
        self.feature_queues = [[StageQueue(f"target{t}->drafter{r}", p.queue_depth, stop) for t in range(T)]
                               for r in range(R)]
        self.data_states: dict[int, dict] = {}
        self.step_tokens: dict[int, int] = {}

        def data_state() -> dict:
            return {"data": c.train_data.state_dict(), "anchor_rng": self.anchor_rng.get_state()}

        def prepare(batch: Batch) -> Blocks:
            return prepare_blocks(batch.input_ids, batch.loss_mask, self.anchors, cfg.model.block_size,
                                  c.gamma, c.drafter.config.mask_token_id, self.anchor_rng,
                                  getattr(batch, "doc_start", None))

        next_batch, prepare = self.batch_source(c.train_data.next_batch, prepare)  # type: ignore[assignment]  # the source may wrap it
        prefetcher = BatchPrefetcher(next_batch, prepare, data_state, self.target_inputs, stop, count, M,
                                     first, self.warm.shape_for if self.pad else None,
                                     pin=any(is_cuda(d) for d in self.target_devices + self.drafter_devices))
        build = prefetcher.build

        self.step_flops: dict[int, dict] = {}

        def build_and_record(index: int) -> MicroBatch:
            mb = build(index)
            self.data_states[index] = mb.data_state
            self.step_tokens[mb.step] = self.step_tokens.get(mb.step, 0) + mb.tokens
            counts = micro_batch_flops(c.target.config, c.drafter.config, mb.attention_mask, mb.doc_start, mb.blocks)
            into = self.step_flops.setdefault(mb.step, dict.fromkeys(FLOP_KEYS, 0.0))
            for key, value in counts.items():
                into[key] += value
            return mb

        prefetcher.build = build_and_record  # type: ignore[method-assign]  # this instance records what it builds
        self.busy = {d: BusyMeter(d) for d in dict.fromkeys(self.target_devices + self.drafter_devices)}
        layer_ids = c.drafter.config.target_layer_ids
        width = len(layer_ids) * c.target.config.hidden_size
        max_numel = max(b * s for b, s in self.warm.shapes()) * width
        if not self.pad:
            max_numel = max(max_numel, cfg.data.token_budget * width)
        target_dtype = c.target.get_input_embeddings().weight.dtype
        route = lambda index: (index % M) % R  # noqa: E731 - micro-batch j of a step goes to replica j % R
        self.target_workers, self.stage_queues = [], []
        taps, last_layer = tap_columns(layer_ids), feature_layers(layer_ids)
        for t, plan in enumerate(self.target_plans):
            S, n = len(plan), len(range(t, count, T))
            hops = [StageQueue(f"target{t}.{s}->target{t}.{s + 1}", p.queue_depth, stop) for s in range(S - 1)]
            self.stage_queues += hops
            pool: list | StageQueue = allocate_slots(p.queue_depth * (R + S - 1) + 2, max_numel, target_dtype,
                                                     plan.devices[-1])
            for s, ((lo, hi), d) in enumerate(zip(plan.bounds, plan.devices)):
                stage = TargetStage(s, S, lo, last_layer if s == S - 1 else hi, taps,
                                    None if s == S - 1 else plan.devices[s + 1])
                outputs = [self.feature_queues[r][t] for r in range(R)] if s == S - 1 else [hops[s]]
                worker = TargetWorker(t, self.targets[t], d, layer_ids, width,
                                      self.target_inputs[t] if s == 0 else hops[s - 1], outputs, pool, stop,
                                      self.busy[d], n, route, self.guard, stage)
                pool = worker.free
                self.target_workers.append(worker)
        streams = [torch.cuda.Stream(d) if is_cuda(d) else None for d in self.drafter_devices]
        reducer = ReplicaAllReduce(self.flats, streams, stop, across_hosts=self.across_hosts())
        self.metrics = MetricAccumulator(METRIC_NAMES, self.drafter_devices[0])
        self.drafter_workers = []
        for r, d in enumerate(self.drafter_devices):
            settings = DrafterSettings(self.backend, cfg.model.loss_chunk, self.autocast_dtype[d], cfg.optim.grad_clip,
                                       first, cfg.optim.total_steps, M, cfg.run.log_every)
            self.drafter_workers.append(DrafterWorker(
                r, R, d, self.drafters[r], self.heads[r], self.optimizers[r], self.schedulers[r], self.flats[r],
                reducer, self.feature_queues[r], settings, stop, self.busy[d], self.guard,
                self.metrics if r == 0 else None, self._on_step_end if r == 0 else None, streams[r]))
        threads = [StageThread("prefetch", prefetcher.run, stop)]
        threads += [StageThread(f"target{w.rank}" if w.stage.count == 1 else f"target{w.rank}.{w.stage.index}", w.run,
                                stop) for w in self.target_workers]
        threads += [StageThread(f"drafter{r}", w.run, stop) for r, w in enumerate(self.drafter_workers)]
        return threads

    def _snapshot(self, step: int, request: Request | None, periodic: bool = False) -> None:
        """On drafter 0's thread at a step boundary: stage the state (trainer.train.checkpointer:
        side-stream copies to pinned memory), written in the background while training goes on."""
        M = self.local_micro_batches()
        last_index = (step - self.first_step) * M - 1
        self.snapshot(step, self.drafters[0], self.optimizers[0], self.schedulers[0], self.data_states[last_index],
                      request, periodic)

    def _on_step_end(self, step: int, _last: MicroBatch | None) -> None:
        self.step = step
        forget_states_before(self.data_states, (step - self.first_step - 1) * self.local_micro_batches())
        requests = self.new_requests()
        every = self.cfg.run.checkpoint_every
        periodic = bool(every and step % every == 0 and step < self.cfg.optim.total_steps)
        stops = [r for r in requests if r.kind == "stop"]
        self._act(step, [r for r in requests if r.kind == "checkpoint"], stops[0] if stops else None, periodic)

    def _act(self, step: int, checkpoints: list[Request], stop_request: Request | None, periodic: bool) -> None:
        """At a step boundary: serve checkpoint requests, a stop, or the periodic checkpoint."""
        for r in checkpoints:
            self._snapshot(step, r)
        if stop_request is not None:
            self._snapshot(step, stop_request)
            self.stop.stop(stop_request.reason)
            return
        if periodic and not checkpoints:  # a requested checkpoint of this step serves as the periodic one
            self._snapshot(step, None, periodic=True)

    # ------------------------------------------------------------------ what a host-group trainer changes
    def local_micro_batches(self) -> int:
        """Micro-batches this process trains per optimizer step (all of them on one host)."""
        return self.cfg.optim.micro_batches

    def batch_source(self, next_batch: Callable[[], Batch], prepare: Callable[[Batch], Blocks],
                     ) -> tuple[Callable[[], Batch], Callable[[Batch], Blocks]]:
        """(next_batch, prepare) the prefetcher calls; on one host the dataset's own."""
        return next_batch, prepare

    def across_hosts(self) -> Callable[[torch.Tensor], None] | None:
        """A function summing a flat gradient buffer over the hosts in place, or None on one host."""
        return None

    # ------------------------------------------------------------------ metrics
    def _gpu_entries(self, busy: dict) -> list[dict]:
        out = []
        for i, d in enumerate(self.busy):
            roles = [name for name, devs in (("target", self.target_devices), ("drafter", self.drafter_devices))
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

    def _write_window(self, w: dict, since: tuple) -> tuple:
        """since: (step, host time, GPU time or None) where the window starts. A window is timed
        on the GPU's clock when both its ends have one (every window after the first on CUDA)."""
        cfg = self.cfg
        step, now, gpu_now = int(w["step"]), w["time"], w.get("gpu_time")
        prev_step, prev_time, prev_gpu = since
        seconds = max((gpu_now - prev_gpu) if gpu_now is not None and prev_gpu is not None else now - prev_time, 1e-9)
        tokens = sum(self.step_tokens.get(s, 0) for s in range(prev_step, step))
        counts = self._window_counts(prev_step, step)
        weight = max(w["weight_sum"], 1e-6)
        busy = {d: m.busy_fraction() for d, m in self.busy.items()}
        m = {"loss": w["loss_sum"] / weight, "acc": w["correct_sum"] / weight,
             "lr": cfg.optim.lr * lr_factor(step - 1, cfg.optim),
             "grad_norm": w["grad_norm_sum"] / max(w["steps"], 1), "tokens_per_s": tokens / seconds,
             "pad_share": round(1 - counts["tokens_real"] / max(counts["tokens_padded"], 1.0), 4),
             "recompiles": self.guard.recompiles(), "gpus": self._gpu_entries(busy),
             "queues": {q.name: q.depth() for q in self.target_inputs + self.stage_queues
                        + [q for row in self.feature_queues for q in row]}}
        # steady: every window after the first (which holds the pipeline filling up)
        self.windows_seen = getattr(self, "windows_seen", 0) + 1
        if self.windows_seen > 1:
            self.steady_tokens = getattr(self, "steady_tokens", 0) + tokens
            self.steady_seconds = getattr(self, "steady_seconds", 0.0) + seconds
            m["tokens_per_s_steady"] = self.steady_tokens / self.steady_seconds
        peak = peak_tflops(torch.cuda.get_device_name(self.drafter_devices[0]) if is_cuda(self.drafter_devices[0]) else None)
        if peak:
            nt, nd = len(self.target_devices), len(self.drafter_devices)
            rate = {k: counts[k] / seconds / (peak * 1e12 * (nt if k.startswith("target") else nd))
                    for k in ("target_real", "target_padded", "drafter_real", "drafter_padded")}
            m["mfu"] = {"target": round(rate["target_real"], 4), "drafter": round(rate["drafter_real"], 4),
                        "target_padded": round(rate["target_padded"], 4),
                        "drafter_padded": round(rate["drafter_padded"], 4)}
            if max(rate.values()) > 1.0:
                self.rd.log(f"warning: MFU above the {peak:.0f} TFLOP/s peak in steps {prev_step}..{step} {m['mfu']}: "
                            "the FLOP count or the window's timing is wrong")
        self.rd.event("step", step, **m)
        self.rd.update(step=step, loss=m["loss"], acc=m["acc"], tokens_per_s=m["tokens_per_s"],
                       recompiles=m["recompiles"], pad_share=m["pad_share"],
                       **({"tokens_per_s_steady": m["tokens_per_s_steady"]} if "tokens_per_s_steady" in m else {}))
        self.rd.log(f"step {step}/{cfg.optim.total_steps} loss {m['loss']:.4f} acc {m['acc']:.3f} "
                    f"lr {m['lr']:.2e} grad_norm {m['grad_norm']:.3f} tok/s {m['tokens_per_s']:.0f} "
                    f"pad {m['pad_share']:.1%} busy {[g['busy'] for g in m['gpus']]}")
        return step, now, gpu_now

    # ------------------------------------------------------------------ the run
    def train_steps(self) -> str | None:
        """Run the threads until done or stopped; returns the stop reason (None when done)."""
        self.first_step = self.step
        threads = self._build_pipeline()
        since = (self.step, time.time(), None)
        for t in threads:
            t.start()
        try:
            while any(t.is_alive() for t in threads) and not self.stop.is_set():
                self.stop.wait(0.2)
                for w in self.metrics.completed():
                    since = self._write_window(w, since)
            lingering = join_all(threads, self.stop)
            if lingering:
                self.rd.log(f"threads still running after stop: {lingering}")
            if self.stop.error is None:
                for w in self.metrics.drain():
                    since = self._write_window(w, since)
        finally:
            self.checkpointer.wait(raise_failure=False)  # a stop's checkpoint is on disk before the run ends
            self.guard.unfreeze()
            for target in dict.fromkeys(self.targets):  # evaluation meets new lengths: run it eagerly
                uncompile_decoder_layers(target)
        if self.stop.error is not None:
            raise self.stop.error
        self.checkpointer.wait()  # a failed requested checkpoint fails the run
        return self.stop.reason

    def setup(self, resume: str | None) -> str | None:
        rel = super().setup(resume)
        self.build_replicas()
        self.rd.update(gpus=sorted({d.index or 0 for d in self.busy_devices() if is_cuda(d)}))
        return rel

    def error_record(self, exc: BaseException) -> dict:
        if isinstance(exc, PipelineFailed):
            return exc.record()
        return super().error_record(exc)

    def busy_devices(self) -> list[torch.device]:
        return list(dict.fromkeys(self.target_devices + self.drafter_devices))
