"""The single-threaded reference training loop, writing the run-directory contract."""

from __future__ import annotations

import contextlib
import importlib.util
import time
import traceback
from pathlib import Path

import torch

from trainer.train import checkpoint as ckpt
from trainer.train.checkpointer import Checkpointer, Job, optimizer_state_like
from trainer.data.chat import DataError
from trainer.train.components import Components, build_components
from trainer.train.config import TrainerConfig, dump_config, target_replicas
from trainer.train.control import ControlPoller, Request
from trainer.data.batches import select_target_warmup_shapes
from trainer.generate.evaluate import acceptance_report
from trainer.models.masks import Blocks, prepare_blocks, resolve_backend
from trainer.models.objective import drafter_loss_sums
from trainer.train.optim import clip_gradients
from trainer.data.packing import row_anchors
from trainer.train.rundir import RunDir, atomic_write
from trainer.models.stages import plan_of
from trainer.models.target import target_context_features
from trainer.models.target_loading import complete_for_decoding


def compiled_graphs() -> int:
    """Graphs torch.compile has produced so far in this process (a recompile adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def autocast_for(device: str, dtype: str) -> contextlib.AbstractContextManager:
    kind = torch.device(device).type
    if kind == "cuda" and dtype == "bf16":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


class Trainer:
    def __init__(self, cfg: TrainerConfig, run_dir: str | Path):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.rd = RunDir(self.run_dir, cfg.optim.total_steps)
        self.control = ControlPoller(self.run_dir)
        self.checkpoints = ckpt.CheckpointManager(self.run_dir, cfg.run.keep_checkpoints)
        self.served: set[tuple[str, str | None, str]] = set()  # requests taken (a checkpoint's is done once written)
        self.checkpointer = Checkpointer(self.checkpoints, self._checkpoint_written, self._checkpoint_failed)
        self.step = 0
        self.anchor_rng = torch.Generator().manual_seed(cfg.data.seed)
        self.c: Components | None = None
        self._steady = (0, 0.0)  # real tokens and seconds of the steps after the first
        self.wandb = None

    # ------------------------------------------------------------------ setup
    def setup(self, resume: str | None) -> str | None:
        cfg = self.cfg
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        atomic_write(self.run_dir / "config.yaml", dump_config(cfg).encode())
        resumed_from = self.resolve_resume(resume) if resume else None
        from trainer.models.memory_plan import DoesNotFit, build_plan

        refusal = build_plan(cfg).refusal()
        if refusal is not None:
            raise DoesNotFit(f"the memory plan does not fit: {refusal} (python -m trainer plan --config C)")
        self.c = build_components(cfg, self.run_dir, self.rd.log)
        self.backend = resolve_backend(cfg.model.attention, self.c.drafter_device, needs_grad=True)
        if resumed_from is not None:
            self.load(resumed_from)
        gpus = sorted({torch.device(d).index or 0 for d in target_replicas(cfg.devices)[0] + cfg.devices.drafter[:1]
                       if d.startswith("cuda")})
        self.rd.update(step=self.step, gpus=gpus)
        n_params = sum(p.numel() for p in self.c.drafter.parameters())
        rel = str(resumed_from.relative_to(self.run_dir)) if resumed_from else None
        self.rd.event("start", self.step, resumed_from=rel, total_steps=cfg.optim.total_steps, config={
            "drafter_params": n_params, "drafter_layers": cfg.model.drafter_layers,
            "block_size": cfg.model.block_size, "target_layer_ids": self.c.drafter.config.target_layer_ids,
            "attention": self.backend, "devices": {"target": target_replicas(cfg.devices)[0], "drafter": cfg.devices.drafter[0]},
        })
        self.rd.log(f"drafter {n_params / 1e6:.2f}M params, {len(self.c.train_data)} training conversations, "
                    f"attention {self.backend}" + (f", resumed from {rel}" if rel else ""))
        if cfg.run.wandb is not None and importlib.util.find_spec("wandb") is not None:
            import wandb

            self.wandb = wandb.init(project=cfg.run.wandb.project, name=cfg.run.wandb.name or self.run_dir.name,
                                    config=dump_config(cfg))
        return rel

    def resolve_resume(self, which: str) -> Path:
        """--resume 'latest' or a step -> the checkpoint directory to restore."""
        return self.checkpoints.resolve(which)

    def load(self, path: Path) -> None:
        self.restore(ckpt.load(path, map_location=self.c.drafter_device))

    def restore(self, state: dict) -> None:
        """Put a checkpoint's contents (trainer.train.checkpoint.load) into the model, optimizer and data."""
        self.c.drafter.load_state_dict(state["model"])
        self.c.optimizer.load_state_dict(state["optim"]["optimizer"])
        self.c.scheduler.load_state_dict(state["optim"]["scheduler"])
        s = state["state"]
        self.step = s["step"]
        self.c.train_data.load_state_dict(s["data"])
        self.anchor_rng.set_state(s["anchor_rng"])
        ckpt.set_rng_state(s["rng"])

    def warmup(self) -> None:
        """Run each bucket's largest shape once, so kernels are compiled before the timed loop."""
        data = self.c.train_data
        self.rd.update(state="warmup")
        began = time.time()
        gen = torch.Generator().manual_seed(12345)
        if self.cfg.data.pack_length:
            from trainer.data.packing import warmup_packed_batch

            batch = warmup_packed_batch(self.cfg.data.pack_rows, self.cfg.data.pack_length,
                                        self.c.drafter.config.vocab_size, gen)
            shapes = [(batch.input_ids.shape[0], batch.input_ids.shape[1])]
            blocks = self._blocks(batch.input_ids, batch.loss_mask, gen, batch.doc_start)
            loss, _, _ = self._forward(batch.input_ids, batch.attention_mask, blocks, batch.doc_start)
            loss.backward()
        else:
            batches, bucket_ids = data.plan_epoch(data.epoch)
            shapes = select_target_warmup_shapes(data, batches, bucket_ids, self.cfg.run.warmup_shapes)
            for b, seq in shapes:
                ids = torch.randint(0, self.c.drafter.config.vocab_size, (b, seq), generator=gen)
                mask = torch.ones_like(ids, dtype=torch.bool)
                blocks = self._blocks(ids, mask, gen)
                loss, _, _ = self._forward(ids, torch.ones_like(ids), blocks)
                loss.backward()
        self.c.drafter.zero_grad(set_to_none=True)
        seconds = time.time() - began
        self.prepare_checkpoints(self.c.drafter, self.c.optimizer, self.c.scheduler)
        self.graphs_after_warmup = compiled_graphs()
        self.rd.event("warmup", self.step, shapes=[list(s) for s in shapes], seconds=round(seconds, 3))
        self.rd.log(f"warm-up on {len(shapes)} shapes {shapes} took {seconds:.1f}s")

    # ------------------------------------------------------------------ one step
    def _blocks(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, generator: torch.Generator,
                doc_start: torch.Tensor | None = None) -> Blocks:
        m = self.cfg.model
        anchors = row_anchors(self.cfg.data, m.block_size) if doc_start is not None else self.cfg.data.num_anchors
        return prepare_blocks(input_ids, loss_mask, anchors, m.block_size, self.c.gamma,
                              self.c.drafter.config.mask_token_id, generator, doc_start).to(self.c.drafter_device)

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, blocks: Blocks,
                 doc_start: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """doc_start: packed rows (trainer.data.packing), else None."""
        c = self.c
        feats = target_context_features(c.target, input_ids.to(c.target_device), attention_mask.to(c.target_device),
                                        c.drafter.config.target_layer_ids,
                                        None if doc_start is None else doc_start.to(c.target_device))
        feats = feats.to(c.drafter_device, non_blocking=True)
        with autocast_for(c.drafter_device, self.cfg.model.dtype):
            return drafter_loss_sums(c.drafter, c.head, feats, blocks, self.backend, self.cfg.model.loss_chunk,
                                     doc_start=doc_start)

    def train_step(self) -> dict:
        """One optimizer step over `micro_batches` micro-batches, normalised by the step's total weight.

        Loss weights do not depend on the model, so Σw of the whole step is known before any
        forward; each micro-batch backpropagates loss_sum / Σw_step (no per-micro-batch mean).
        """
        c = self.c
        began = time.time()
        micro = []
        for _ in range(self.cfg.optim.micro_batches):
            batch = c.train_data.next_batch()
            doc_start = getattr(batch, "doc_start", None)
            micro.append((batch, self._blocks(batch.input_ids, batch.loss_mask, self.anchor_rng, doc_start)))
        weight_total = sum(blocks.weights[:, :, 1:].sum() for _, blocks in micro).clamp(min=1e-6)
        loss_total = torch.zeros((), device=c.drafter_device)
        correct_total = torch.zeros((), device=c.drafter_device)
        tokens, positions = 0, 0
        for batch, blocks in micro:
            loss_sum, _, correct_sum = self._forward(batch.input_ids, batch.attention_mask, blocks,
                                                     getattr(batch, "doc_start", None))
            (loss_sum / weight_total).backward()
            loss_total += loss_sum.detach()
            correct_total += correct_sum
            tokens += batch.tokens
            positions += batch.input_ids.numel()
        grad_norm = clip_gradients(c.drafter.parameters(), self.cfg.optim.grad_clip)
        lr = c.scheduler.get_last_lr()[0]
        c.optimizer.step()
        c.scheduler.step()
        c.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        seconds = max(time.time() - began, 1e-9)
        if self.step > 1:  # steady: every step after the first
            self._steady = (self._steady[0] + tokens, self._steady[1] + seconds)
        return {"loss": float(loss_total / weight_total), "acc": float(correct_total / weight_total), "lr": lr,
                "grad_norm": float(grad_norm), "tokens_per_s": tokens / seconds,
                "pad_share": round(1 - tokens / max(positions, 1), 4)}

    # ------------------------------------------------------------------ evaluation, checkpoints
    @torch.no_grad()
    def evaluate(self) -> dict:
        c, e = self.c, self.cfg.eval
        if complete_for_decoding(c.target, plan_of(c.target), self.rd.log):
            report = acceptance_report(c.target, c.drafter, c.head, c.tokenizer,
                                       c.eval_conversations[: e.samples], e.max_new_tokens)
        else:  # the model directory holds only the layers training runs
            report = {"tau": None, "tau_per_prompt": None, "samples": 0}
        tau = report["tau"]
        data = c.eval_data
        batches, _ = data.plan_epoch(0)
        gen = torch.Generator().manual_seed(0)
        weight, correct = 0.0, 0.0
        c.drafter.eval()
        for indices in batches[:8]:
            batch = data.collate(indices)
            _, w, k = self._forward(batch.input_ids, batch.attention_mask, self._blocks(batch.input_ids, batch.loss_mask, gen))
            weight, correct = weight + float(w), correct + float(k)
        c.drafter.train()
        result = {**report, "acc": correct / max(weight, 1e-6)}
        self.rd.event("eval", self.step, **result)
        self.rd.update(tau=tau, tau_per_prompt=report["tau_per_prompt"])
        if tau is None:
            self.rd.log(f"eval step {self.step}: tau not measured, acc {result['acc']:.3f}")
        else:
            self.rd.log(f"eval step {self.step}: tau {tau:.2f} (mean acceptance length; per-prompt mean "
                        f"{report['tau_per_prompt']:.2f}), acc {result['acc']:.3f}, {report['samples']} conversations")
        return result

    def snapshot(self, step: int, drafter: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, trainer_state: dict,
                 request: Request | None = None, periodic: bool = False) -> Job:
        """Stage the step's state for the background writer (trainer.train.checkpointer); training
        goes on while it is written. Blocks only while the previous write is still in flight."""
        return self.checkpointer.snapshot(
            step, drafter.state_dict(), drafter.config.to_dict(),
            {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
            {**trainer_state, "rng": ckpt.rng_state()}, request, periodic, optimizers=(optimizer,))

    def prepare_checkpoints(self, drafter: torch.nn.Module, optimizer: torch.optim.Optimizer,
                            scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
        """Allocate the checkpoints' host buffers now (pinned on CUDA), before training starts: page-
        locking gigabytes while the workers launch kernels would slow the steps it overlaps."""
        if not self.writes_checkpoints:
            return
        began = time.time()
        template = {"model": drafter.state_dict(), "optim": {"optimizer": optimizer_state_like(optimizer),
                                                             "scheduler": scheduler.state_dict()}}
        self.checkpointer.reserve(template)
        self.checkpointer.wait()
        size = self.checkpointer.staged_bytes() / 2**30
        self.rd.log(f"checkpoint staging: {size:.2f} GiB of host memory in {time.time() - began:.1f}s")

    @property
    def writes_checkpoints(self) -> bool:
        return True

    def checkpoint(self, request: Request | None = None, periodic: bool = False) -> Job:
        c = self.c
        state = {"data": c.train_data.state_dict(), "anchor_rng": self.anchor_rng.get_state()}
        return self.snapshot(self.step, c.drafter, c.optimizer, c.scheduler, state, request, periodic)

    def save(self, request: Request | None) -> None:
        """A checkpoint of this step, complete on disk when this returns (stop, the end of the run)."""
        self.checkpoint(request)
        self.rd.update(state="checkpointing")
        self.checkpointer.wait()
        self.rd.update(state="running")

    def _checkpoint_written(self, job: Job, path: Path, seconds: float) -> None:
        """On the writer thread: the event `run checkpoint --wait` waits for, then the request is done."""
        rel = str(path.relative_to(self.run_dir))
        request = job.request.id if job.request is not None else None
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

    def _serve(self, requests: list[Request]) -> str | None:
        """Serve control requests; returns the stop reason when the run must stop."""
        for r in requests:
            if r.kind == "checkpoint":
                self.checkpoint(r)
        for r in requests:
            if r.kind == "stop":
                self.save(r)
                return r.reason
        return None

    # ------------------------------------------------------------------ the run
    def train_steps(self) -> str | None:
        """Steps until total_steps or a stop request; returns the stop reason (None when done)."""
        total, stop_reason = self.cfg.optim.total_steps, None
        while self.step < total:
            stop_reason = self._serve(self.new_requests())
            if stop_reason:
                break
            m = self.train_step()
            if self.step % self.cfg.run.log_every == 0 or self.step == total:
                recompiles = compiled_graphs() - self.graphs_after_warmup
                self.rd.event("step", self.step, recompiles=recompiles, **m)
                steady = {"tokens_per_s_steady": self._steady[0] / self._steady[1]} if self._steady[1] else {}
                self.rd.update(step=self.step, recompiles=recompiles, loss=m["loss"], acc=m["acc"],
                               tokens_per_s=m["tokens_per_s"], pad_share=m["pad_share"], **steady)
                self.rd.log(f"step {self.step}/{total} loss {m['loss']:.4f} acc {m['acc']:.3f} "
                            f"lr {m['lr']:.2e} grad_norm {m['grad_norm']:.3f} tok/s {m['tokens_per_s']:.0f}")
                if self.wandb is not None:
                    self.wandb.log(m, step=self.step)
            else:
                self.rd.update(step=self.step)
            if self.cfg.run.checkpoint_every and self.step % self.cfg.run.checkpoint_every == 0 and self.step < total:
                self.checkpoint(periodic=True)
            if self.cfg.eval.every and self.step % self.cfg.eval.every == 0 and self.step < total:
                self.evaluate()
        return stop_reason

    def error_record(self, exc: BaseException) -> dict:
        """status.json's `error` for a failure that reached run()."""
        if isinstance(exc, DataError):  # the user's data, not the code: one line, no traceback
            return {"message": f"data error: {exc}", "traceback": None, "thread": "main"}
        from trainer.models.memory_plan import DoesNotFit

        if isinstance(exc, DoesNotFit):  # the config, not the code: one line
            return {"message": str(exc), "traceback": None, "thread": "main"}
        return {"message": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(), "thread": "main"}

    def run(self, resume: str | None) -> int:
        self.control.install_sigterm()
        self.rd.start_heartbeat(self.cfg.run.heartbeat_s)
        try:
            self.setup(resume)
            self.warmup()
            self.rd.update(state="running")
            stop_reason = self.train_steps()
            if stop_reason is None:
                stop_reason = self._serve(self.new_requests())
            if stop_reason:
                self.rd.event("stop", self.step, reason=stop_reason)
                self.rd.update(state="stopped")
                self.rd.log(f"stopped at step {self.step} ({stop_reason})")
                return 0
            self.evaluate()
            self.save(None)
            self.rd.event("stop", self.step, reason="done")
            self.rd.update(state="done")
            self.rd.log(f"done: {self.step} steps")
            return 0
        except BaseException as exc:  # noqa: BLE001 - every failure must land in status.json
            error = self.error_record(exc)
            self.rd.event("error", self.step, **error)
            self.rd.update(state="failed", error=error)
            trace = f"\n{error['traceback']}" if error.get("traceback") else ""
            self.rd.log(f"FAILED in thread {error['thread']}: {error['message']}{trace}")
            return 1
        finally:
            self.checkpointer.close()
            self.rd.close()
            if self.wandb is not None:
                self.wandb.finish()
