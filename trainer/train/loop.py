"""The Trainer (a run's parts, composed) and the single-threaded reference pipeline.

The Trainer holds its parts, each built by a small function or class and every one set in
`__init__`, as torchtitan's Trainer does: the run directory's writers (RunDir, ControlPoller),
metrics (trainer.train.metrics: the one writer of step and eval records), checkpointing
(trainer.run.checkpoint.Checkpointer), the hosts it spans (trainer.distributed.hosts: one
host, or a rank of a host group) and the pipeline kind (`ReferencePipeline` here, or
trainer.pipeline.threaded.ThreadedPipeline; trainer.entry chooses). What the config builds
(tokenizer, data, target, drafter, optimizer: trainer.train.components) is built inside `run`,
so that a failure there lands in status.json, and is handed to the pipeline and to evaluation.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

from trainer.data.batches import PreloadedDataset, select_target_warmup_shapes
from trainer.data.chat import DataError
from trainer.data.packing import row_anchors
from trainer.distributed.group import GroupEnv
from trainer.distributed.hosts import Hosts, OneHost
from trainer.distributed.multihost import HostGroupMember
from trainer.generate.evaluate import eval_sampling, temperature_reports
from trainer.models.drafter import DFlashDrafter
from trainer.models.masks import Blocks, prepare_blocks
from trainer.models.objective import drafter_loss_sums, selector_metrics, selector_sums_of
from trainer.models.target import last_hidden_buffer, target_context_features
from trainer.models.target_loading import SplitError, complete_for_decoding
from trainer.run import checkpoint as ckpt
from trainer.run.config import (
    ConfigError,
    TrainerConfig,
    dump_config,
    missing_devices,
    target_replicas,
    template_kwargs,
)
from trainer.run.contract import phase_text, write_atomic
from trainer.run.control import ControlPoller, Request, SetupStop
from trainer.run.family import ModelDirError
from trainer.run.rundir import RunDir
from trainer.run.stopping import PipelineFailed, StopSignal
from trainer.train.checkpointer import Checkpointer, Job, optimizer_state_like
from trainer.train.components import Components, build_components
from trainer.train.metrics import LossNotFinite, Metrics
from trainer.train.offload import load_model_state, model_state
from trainer.train.optim import clip_gradients


def compiled_graphs() -> int:
    """Graphs torch.compile has produced so far in this process (a recompile adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def autocast_for(device: str, dtype: str) -> contextlib.AbstractContextManager:
    kind = torch.device(device).type
    if kind == "cuda" and dtype == "bf16":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


class TrainState:
    """What a checkpoint restores besides model, optimizer and data: the step and the anchor RNG."""

    def __init__(self, seed: int) -> None:
        self.step = 0
        self.anchor_rng = torch.Generator().manual_seed(seed)


class Pipeline(Protocol):
    """A pipeline kind: how the steps are run (trainer.pipeline.threaded.ThreadedPipeline, ReferencePipeline)."""

    def warmup(self) -> None:
        """Compile and run each shape once before the timed steps."""

    def train_steps(self) -> str | None:
        """Steps until total_steps or a stop; returns the stop reason (None when done)."""


PipelineKind = Callable[["Trainer", Components], Pipeline]  # builds the pipeline over the built parts


def make_blocks(cfg: TrainerConfig, c: Components, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                generator: torch.Generator, doc_start: torch.Tensor | None = None) -> Blocks:
    m = cfg.model
    anchors = row_anchors(cfg.data, m.block_size) if doc_start is not None else cfg.data.num_anchors
    return prepare_blocks(input_ids, loss_mask, anchors, m.block_size, c.gamma, c.drafter.config.mask_token_id,
                          generator, doc_start).to(c.drafter_device)


def forward(cfg: TrainerConfig, c: Components, input_ids: torch.Tensor, attention_mask: torch.Tensor, blocks: Blocks,
            doc_start: torch.Tensor | None = None,
            parts: dict | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Target features (and, when the loss reads the target's logits, its last hidden states), then
    the drafter's loss sums (loss, weight, correct). doc_start: packed rows (trainer.data.packing), else None;
    parts: receives the terms apart (drafter_loss_sums)."""
    top = last_hidden_buffer(c.target, *input_ids.shape) if c.objective.needs_target else None
    feats = target_context_features(c.target, input_ids.to(c.target_device), attention_mask.to(c.target_device),
                                    c.drafter.config.target_layer_ids,
                                    None if doc_start is None else doc_start.to(c.target_device), top=top)
    feats = feats.to(c.drafter_device, non_blocking=True)
    with autocast_for(c.drafter_device, cfg.model.dtype):
        return drafter_loss_sums(c.drafter, c.head, feats, blocks, c.backend, cfg.model.loss_chunk,
                                 doc_start=doc_start, objective=c.objective,
                                 target_hidden=None if top is None else top.to(c.drafter_device, non_blocking=True),
                                 parts=parts)


def error_record(exc: BaseException) -> dict:
    """status.json's `error` for a failure that reached Trainer.run."""
    if isinstance(exc, PipelineFailed):
        return exc.record()
    if isinstance(exc, DataError):  # the user's data, not the code: one line, no traceback
        return {"message": f"data error: {exc}", "traceback": None, "thread": "main"}
    if isinstance(exc, (ConfigError, SplitError)):  # a config that does not fit what it names (drafter_init, a split)
        return {"message": f"config error: {exc}", "traceback": None, "thread": "main"}
    if isinstance(exc, LossNotFinite):  # the numbers, not the code: one line saying what to change
        return {"message": str(exc), "traceback": None, "thread": "main"}
    if isinstance(exc, ModelDirError):  # the model directory, not the code: one line naming what is wrong
        return {"message": f"model error: {exc}", "traceback": None, "thread": "main"}
    from trainer.models.memory_plan import DoesNotFit

    if isinstance(exc, DoesNotFit):  # the config, not the code: one line
        return {"message": str(exc), "traceback": None, "thread": "main"}
    return {"message": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(), "thread": "main"}


class Trainer:
    """One run: its parts, and the run from setup to the final checkpoint (see the module doc)."""

    def __init__(self, cfg: TrainerConfig, run_dir: str | Path, pipeline: PipelineKind,
                 env: GroupEnv | None = None) -> None:
        """env: this process is a rank of a run across hosts (started by torchrun)."""
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.rd = RunDir(self.run_dir, cfg.optim.total_steps)
        self.control = ControlPoller(self.run_dir)
        self.checkpoints = ckpt.CheckpointManager(self.run_dir, cfg.run.keep_checkpoints)
        self.served: set[tuple[str, str | None, str]] = set()  # requests taken (a checkpoint's is done once written)
        # optim.offload host: the host state is written from where it lives, not staged (trainer.train.checkpointer)
        self.checkpointer = Checkpointer(self.checkpoints, self._checkpoint_written, self._checkpoint_failed,
                                         stage_host=cfg.optim.offload == "none")
        self.metrics = Metrics(cfg, self.rd, self.run_dir.name)
        self.state = TrainState(cfg.data.seed)
        self.stop = StopSignal()  # the pipeline's; a lost peer host stops it too
        self.hosts: Hosts = (OneHost() if env is None else
                             HostGroupMember(cfg, env, self.rd, self.control, self.stop, lambda: self.state.step))
        self.pipeline_kind = pipeline
        self._best_pending: tuple[int, float] | None = None  # run.keep_best: a best τ whose checkpoint is coming

    # ------------------------------------------------------------------ setup
    def setup(self, resume: str | None) -> tuple[Components, Pipeline]:
        cfg = self.cfg
        self.hosts.join()
        if self.hosts.is_writer:
            for name in self.checkpoints.remove_stale():
                self.rd.log(f"removed checkpoints/{name}: a checkpoint write its process did not finish")
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        write_atomic(self.run_dir / "config.yaml", dump_config(cfg).encode())
        if cfg.optim.offload != "none" and not isinstance(self.hosts, OneHost):
            raise ConfigError(f"optim.offload: {cfg.optim.offload} trains on one host; this run spans a host group "
                              "(its gradients are summed across hosts in one fp32 buffer)")
        resumed_from = self.hosts.resolve_resume(self.checkpoints, resume) if resume else None
        from trainer.models.memory_plan import DoesNotFit, build_plan

        missing = missing_devices(cfg.devices, torch.cuda.device_count() if torch.cuda.is_available() else 0)
        if missing is not None:  # what the plan says too (python -m trainer plan), before anything is loaded
            raise DoesNotFit(f"{missing} (python -m trainer plan --config C)")
        refusal = build_plan(cfg).refusal()
        if refusal is not None:
            raise DoesNotFit(f"the memory plan does not fit: {refusal} (python -m trainer plan --config C)")
        c = build_components(cfg, self.run_dir, self.rd.log, self.rd.phase)
        if resumed_from is not None:
            # offloaded: the optimizer state goes to the host; loading it onto the device first may not fit
            device = "cpu" if cfg.optim.offload == "host" else c.drafter_device
            self.restore(c, self.hosts.load(resumed_from, device), where=str(resumed_from))
        step = self.state.step
        gpus = sorted({torch.device(d).index or 0 for d in target_replicas(cfg.devices)[0] + cfg.devices.drafter[:1]
                       if d.startswith("cuda")})
        self.rd.update(step=step, gpus=gpus)
        self.metrics.start_at(step)
        n_params = sum(p.numel() for p in c.drafter.parameters())
        rel = str(resumed_from.relative_to(self.run_dir)) if resumed_from else None
        self.rd.event("start", step, resumed_from=rel, total_steps=cfg.optim.total_steps, config={
            "drafter_params": n_params, "drafter_layers": cfg.model.drafter_layers,
            "block_size": cfg.model.block_size, "target_layer_ids": c.drafter.config.target_layer_ids,
            "attention": c.backend,
            "devices": {"target": target_replicas(cfg.devices)[0], "drafter": cfg.devices.drafter[0]},
        })
        self.rd.log(f"drafter {n_params / 1e6:.2f}M params, {len(c.train_data)} training conversations, "
                    f"attention {c.backend}" + (f", resumed from {rel}" if rel else ""))
        pipeline = self.pipeline_kind(self, c)
        self.hosts.joined()
        return c, pipeline

    def restore(self, c: Components, state: dict, where: str = "the checkpoint") -> None:
        """Put a checkpoint's contents (trainer.run.checkpoint.load) into the model, optimizer and data.
        A checkpoint this config's drafter does not fit (a resume after the drafter's shape changed)
        is one line naming it and the tensor, not torch's multi-line error."""
        from trainer.models.weights_check import check_fits

        try:
            check_fits(f"resume from {where}", state["model"], c.drafter.state_dict())
        except ValueError as e:
            raise ConfigError(str(e)) from None
        load_model_state(c.drafter, c.optimizer, state["model"])  # offloaded: the masters too
        c.optimizer.load_state_dict(state["optim"]["optimizer"])  # AdamW's, moved to where its weights are
        c.scheduler.load_state_dict(state["optim"]["scheduler"])
        s = state["state"]
        self.state.step = s["step"]
        c.train_data.load_state_dict(s["data"])
        self.state.anchor_rng.set_state(s["anchor_rng"])
        ckpt.set_rng_state(s["rng"])

    # ------------------------------------------------------------------ evaluation, checkpoints
    @torch.no_grad()
    def evaluate(self, c: Components) -> dict:
        """τ on held-out conversations and the drafter's accuracy on 8 held-out batches (the
        writer host only; the others return {})."""
        if not self.hosts.is_writer:
            return {}
        e = self.cfg.eval
        report: dict
        if complete_for_decoding(c.target, self.rd.log):
            report = temperature_reports(c.target.module, c.drafter, c.head, c.tokenizer,
                                         c.eval_conversations[: e.samples], e.max_new_tokens, e.temperatures,
                                         eval_sampling(e), batch=e.batch, template_kwargs=template_kwargs(self.cfg.data),
                                         turns=e.turns)
        else:  # the model directory holds only the layers training runs
            report = {"tau": None, "tau_per_prompt": None, "acceptance": None, "samples": 0}
        data = c.eval_data
        batches, _ = data.plan_epoch(0)
        gen = torch.Generator().manual_seed(0)
        weight, correct = 0.0, 0.0
        c.drafter.eval()
        for indices in batches[:8]:
            batch = data.collate(indices)
            blocks = make_blocks(self.cfg, c, batch.input_ids, batch.loss_mask, gen)
            _, w, k = forward(self.cfg, c, batch.input_ids, batch.attention_mask, blocks)
            weight, correct = weight + float(w), correct + float(k)
        c.drafter.train()
        result = {**report, "acc": correct / max(weight, 1e-6)}
        self.metrics.eval(self.state.step, result)
        self.keep_if_best(result.get("tau"))
        return result

    def snapshot(self, step: int, drafter: DFlashDrafter, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, trainer_state: dict,
                 request: Request | None = None, periodic: bool = False) -> Job:
        """Stage the step's state for the background writer (trainer.train.checkpointer); training
        goes on while it is written. Blocks only while the previous write is still in flight."""
        return self.checkpointer.snapshot(
            step, model_state(drafter, optimizer), drafter.config.to_dict(),
            {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
            {**trainer_state, "rng": ckpt.rng_state()}, request, periodic, optimizers=(optimizer,))

    def prepare_checkpoints(self, drafter: torch.nn.Module, optimizer: torch.optim.Optimizer,
                            scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
        """Allocate the checkpoints' host buffers now (pinned on CUDA), in the warm-up: page-locking
        gigabytes while the workers launch kernels would slow the steps it overlaps. The writer
        host only (the others never write)."""
        if not self.hosts.is_writer:
            return
        began = time.time()
        template = {"model": model_state(drafter, optimizer), "optim": {"optimizer": optimizer_state_like(optimizer),
                                                             "scheduler": scheduler.state_dict()}}
        self.checkpointer.reserve(template)
        self.checkpointer.wait()
        size = self.checkpointer.staged_bytes() / 2**30
        self.rd.log(f"checkpoint staging: {size:.2f} GiB of host memory in {time.time() - began:.1f}s")

    def checkpoint(self, c: Components, request: Request | None = None, periodic: bool = False) -> Job:
        state = {"data": c.train_data.state_dict(), "anchor_rng": self.state.anchor_rng.get_state()}
        return self.snapshot(self.state.step, c.drafter, c.optimizer, c.scheduler, state, request, periodic)

    def keep_if_best(self, tau: float | None) -> None:
        """run.keep_best: a τ better than the best so far marks this step's checkpoint as the best
        (checkpoints/best.json; pruning keeps it) once it is on disk: now, or when the writer
        finishes it. Evaluations fall on checkpoint steps (the config check: eval.every a multiple
        of checkpoint_every; the final evaluation is followed by the final checkpoint)."""
        best = self.checkpoints.best
        if not self.cfg.run.keep_best or tau is None or (best is not None and tau <= best["tau"]):
            return
        self._best_pending = (self.state.step, tau)
        if self.state.step in self.checkpoints.steps():
            self._mark_best(self.state.step)

    def _mark_best(self, step: int) -> None:
        pending = self._best_pending
        if pending is not None and pending[0] == step:
            self._best_pending = None
            self.checkpoints.mark_best(step, pending[1])
            self.rd.log(f"checkpoint step_{step} is the best so far (tau {pending[1]:.3f}): kept (checkpoints/best.json)")

    def save(self, c: Components, request: Request | None) -> None:
        """A checkpoint of this step, complete on disk when this returns (stop, the end of the run);
        the writer host only."""
        if not self.hosts.is_writer:
            return
        self.checkpoint(c, request)
        self.rd.phase("checkpointing")
        self.rd.update(state="checkpointing")
        self.checkpointer.wait()
        self.rd.update(state="running")

    def _checkpoint_written(self, job: Job, path: Path, seconds: float) -> None:
        """On the writer thread: the event `run checkpoint --wait` waits for, then the request is done."""
        rel = str(path.relative_to(self.run_dir))
        request = job.request.id if job.request is not None else None
        self._mark_best(job.step)
        copy = {} if job.copy_s is None else {"copy_s": round(job.copy_s, 3)}
        self.rd.event("checkpoint", job.step, path=rel, seconds=round(seconds, 3), stall_s=round(job.stall_s, 4),
                      **copy, request=request)
        self.rd.update(last_checkpoint=rel)
        self.rd.log(f"checkpoint {rel} written in {seconds:.2f}s in the background; training waited "
                    f"{job.stall_s:.3f}s" + (f" (GPU copy {job.copy_s:.2f}s)" if job.copy_s is not None else ""))
        if job.request is not None:
            self.control.done(job.request)

    def _checkpoint_failed(self, job: Job, exc: BaseException) -> None:
        """A periodic checkpoint that fails for lack of space (or any OSError) is reported and
        retried at the next one; the run goes on instead of losing its steps. Any other failure
        also fails the run (the checkpointer raises it on the training thread)."""
        message = f"{type(exc).__name__}: {exc}"
        self.rd.event("checkpoint_failed", job.step, message=message,
                      request=job.request.id if job.request is not None else None)
        self.rd.update(last_checkpoint_error={"step": job.step, "message": message})
        if job.periodic and isinstance(exc, OSError):
            self.rd.log(f"checkpoint at step {job.step} failed ({message}); training goes on, the next "
                        "checkpoint tries again")

    def new_requests(self) -> list[Request]:
        """Control requests not taken yet: a checkpoint request stays in control/ until its
        checkpoint is written in the background, and must not be served again meanwhile."""
        found = [r for r in self.control.poll() if (r.kind, r.id, r.reason) not in self.served]
        self.served.update((r.kind, r.id, r.reason) for r in found)
        return found

    def serve(self, c: Components, requests: list[Request]) -> str | None:
        """Serve control requests; returns the stop reason when the run must stop."""
        for r in requests:
            if r.kind == "checkpoint":
                self.checkpoint(c, r)
        for r in requests:
            if r.kind == "stop":
                self.save(c, r)
                return r.reason
        return None

    def final_evaluation(self, c: Components) -> str | None:
        """The last evaluation, which a stop cuts short (decoding τ on a large target takes minutes):
        returns the stop's reason, or None when it ran to its end."""
        try:
            self.control.arm_setup()
            self.evaluate(c)
        except SetupStop as stop:
            self.rd.log(f"final evaluation stopped ({stop.reason}); writing the final checkpoint")
            if stop.reason == "control":
                self.control.done(Request("stop", None, "control"))
            return stop.reason
        finally:
            self.control.disarm_setup()
        return None

    def stopped_in_setup(self, stop: SetupStop) -> int:
        """A stop before the first step (SetupStop): nothing trained, so no checkpoint; the run ends
        `stopped` and says in which phase (a stop request served is removed, so a resume runs)."""
        phase = phase_text(self.rd.status.get("phase")) or "setup"
        if stop.reason == "control":
            self.control.done(Request("stop", None, "control"))
        self.rd.event("stop", self.state.step, reason=stop.reason, phase=phase)
        self.rd.update(state="stopped")  # its phase stays the one it stopped in
        self.rd.log(f"stopped while {phase} ({stop.reason}): nothing trained yet in this process, no checkpoint written")
        return 0

    # ------------------------------------------------------------------ the run
    def run(self, resume: str | None) -> int:
        self.control.install_sigterm()
        self.rd.start_heartbeat(self.cfg.run.heartbeat_s)
        try:
            self.control.arm_setup()  # until the first step, a stop acts at once (trainer.run.control)
            c, pipeline = self.setup(resume)
            self.rd.phase("compiling and warming up")
            pipeline.warmup()
            self.control.disarm_setup()
            self.rd.update(state="running")
            self.rd.phase("training")
            stop_reason = pipeline.train_steps()
            if stop_reason is None:
                stop_reason = self.serve(c, self.hosts.final_requests(self.new_requests()))
            step = self.state.step
            if stop_reason:
                self.rd.event("stop", step, reason=stop_reason)
                self.rd.phase("finished")
                self.rd.update(state="stopped")
                self.rd.log(f"stopped at step {step} ({stop_reason})")
                return 0
            self.rd.phase("evaluating")
            stop_reason = self.final_evaluation(c)
            self.save(c, None)
            if stop_reason:  # asked during the final evaluation: its checkpoint is written, τ is not
                self.rd.event("stop", step, reason=stop_reason, phase="evaluating")
                self.rd.phase("finished")
                self.rd.update(state="stopped")
                self.rd.log(f"stopped at step {step} ({stop_reason}) during the final evaluation; checkpoint written")
                return 0
            self.rd.event("stop", step, reason="done")
            self.rd.phase("finished")
            self.rd.update(state="done")
            self.rd.log(f"done: {step} steps")
            return 0
        except SetupStop as stop:
            return self.stopped_in_setup(stop)
        except BaseException as exc:  # noqa: BLE001 - every failure must land in status.json
            with_peers = self.hosts.stopped_with_peers(exc)
            if with_peers is not None:
                self.rd.event("stop", self.state.step, reason="control", detail=with_peers)
                self.rd.update(state="stopped")
                self.rd.log(f"stopped at step {self.state.step}: {with_peers}")
                return 0
            error = self.hosts.error_record(error_record(exc))
            self.rd.event("error", self.state.step, **error)
            self.rd.update(state="failed", error=error)
            trace = f"\n{error['traceback']}" if error.get("traceback") else ""
            self.rd.log(f"FAILED in thread {error['thread']}: {error['message']}{trace}")
            return 1
        finally:
            self.control.disarm_setup()
            self.checkpointer.close()
            self.rd.close()
            self.metrics.close()
            self.hosts.finish(self.rd.status)


class ReferencePipeline:
    """The single-threaded reference: one step at a time, on the target's and drafter's first devices."""

    def __init__(self, trainer: Trainer, c: Components) -> None:
        self.trainer, self.c, self.cfg = trainer, c, trainer.cfg
        self.graphs_after_warmup = compiled_graphs()

    def warmup(self) -> None:
        """Run each bucket's largest shape once, so kernels are compiled before the timed loop."""
        cfg, c, rd = self.cfg, self.c, self.trainer.rd
        rd.update(state="warmup")
        began = time.time()
        gen = torch.Generator().manual_seed(12345)
        if cfg.data.pack_length:
            from trainer.data.packing import warmup_packed_batch

            batch = warmup_packed_batch(cfg.data.pack_rows, cfg.data.pack_length, c.drafter.config.vocab_size, gen)
            shapes = [(batch.input_ids.shape[0], batch.input_ids.shape[1])]
            blocks = make_blocks(cfg, c, batch.input_ids, batch.loss_mask, gen, batch.doc_start)
            loss, _, _ = forward(cfg, c, batch.input_ids, batch.attention_mask, blocks, batch.doc_start)
            loss.backward()
        else:
            data = c.train_data
            assert isinstance(data, PreloadedDataset), "unpacked rows: trainer.train.components"
            batches, bucket_ids = data.plan_epoch(data.epoch)
            shapes = select_target_warmup_shapes(data, batches, bucket_ids, cfg.run.warmup_shapes)
            for b, seq in shapes:
                ids = torch.randint(0, c.drafter.config.vocab_size, (b, seq), generator=gen)
                mask = torch.ones_like(ids, dtype=torch.bool)
                loss, _, _ = forward(cfg, c, ids, torch.ones_like(ids), make_blocks(cfg, c, ids, mask, gen))
                loss.backward()
        c.drafter.zero_grad(set_to_none=True)
        self.trainer.prepare_checkpoints(c.drafter, c.optimizer, c.scheduler)
        seconds = time.time() - began
        self.graphs_after_warmup = compiled_graphs()
        rd.event("warmup", self.trainer.state.step, shapes=[list(s) for s in shapes], seconds=round(seconds, 3))
        rd.log(f"warm-up on {len(shapes)} shapes {shapes} took {seconds:.1f}s")

    def train_step(self) -> dict:
        """One optimizer step over `micro_batches` micro-batches, normalised by the step's total weight.

        Loss weights do not depend on the model, so Σw of the whole step is known before any
        forward; each micro-batch backpropagates loss_sum / Σw_step (no per-micro-batch mean).
        """
        cfg, c, state = self.cfg, self.c, self.trainer.state
        began = time.time()
        micro = []
        for _ in range(cfg.optim.micro_batches):
            batch = c.train_data.next_batch()
            doc_start = getattr(batch, "doc_start", None)
            micro.append((batch, make_blocks(cfg, c, batch.input_ids, batch.loss_mask, state.anchor_rng, doc_start)))
        weight_total = functools.reduce(operator.add, [blocks.weights[:, :, 1:].sum() for _, blocks in micro])
        weight_total = weight_total.clamp(min=1e-6)
        loss_total = torch.zeros((), device=c.drafter_device)
        correct_total = torch.zeros((), device=c.drafter_device)
        selector_total = torch.zeros(3, device=c.drafter_device)  # DFlash2: selector loss, correct, recall sums
        tokens, positions = 0, 0
        for batch, blocks in micro:
            parts: dict = {}
            loss_sum, _, correct_sum = forward(cfg, c, batch.input_ids, batch.attention_mask, blocks,
                                               getattr(batch, "doc_start", None), parts)
            (loss_sum / weight_total).backward()
            loss_total += loss_sum.detach()
            correct_total += correct_sum
            if selector_sums_of(parts):
                selector_total += torch.stack([t.float() for t in selector_sums_of(parts)])
            tokens += batch.tokens
            positions += batch.input_ids.numel()
        grad_norm = clip_gradients(c.drafter.parameters(), cfg.optim.grad_clip)
        lr = c.scheduler.get_last_lr()[0]
        c.optimizer.step()
        c.scheduler.step()
        c.optimizer.zero_grad(set_to_none=True)
        state.step += 1
        seconds = max(time.time() - began, 1e-9)
        if state.step > 1:  # steady: every step after the first
            self.trainer.metrics.add_steady(tokens, seconds)
        sel_loss, sel_correct, sel_recall = selector_total.tolist()
        selector = selector_metrics(sel_loss, sel_correct, sel_recall, float(weight_total)) \
            if cfg.model.drafter.kind == "dflash2" else {}
        return {"loss": float(loss_total / weight_total), "acc": float(correct_total / weight_total), "lr": lr, **selector,
                "grad_norm": float(grad_norm), "tokens_per_s": tokens / seconds, "step_tokens": tokens,
                "pad_share": round(1 - tokens / max(positions, 1), 4)}

    def train_steps(self) -> str | None:
        """Steps until total_steps or a stop request; returns the stop reason (None when done)."""
        t, c, cfg = self.trainer, self.c, self.cfg
        total, stop_reason = cfg.optim.total_steps, None
        window_tokens = 0  # real tokens since the last step record
        while t.state.step < total:
            stop_reason = t.serve(c, t.new_requests())
            if stop_reason:
                break
            m = self.train_step()
            step = t.state.step
            window_tokens += m.pop("step_tokens")
            if step % cfg.run.log_every == 0 or step == total:
                t.metrics.step(step, {"recompiles": compiled_graphs() - self.graphs_after_warmup, **m,
                                      "tokens": window_tokens})
                window_tokens = 0
            else:
                t.rd.update(step=step)
            if cfg.run.checkpoint_every and step % cfg.run.checkpoint_every == 0 and step < total:
                t.checkpoint(c, periodic=True)
            if cfg.eval.every and step % cfg.eval.every == 0 and step < total:
                t.evaluate(self.c)
        return stop_reason
