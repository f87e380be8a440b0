"""Gradients of drafter replicas in one flat buffer each, summed across replicas in-process.

Each replica's trainable parameters get `.grad` views into one flat buffer, followed by STAT
slots (loss_sum, weight_sum, correct_sum, and DFlash2's selector sums). Backward runs on the *unnormalised* loss sum, so one
all-reduce of the flat buffers gives the gradient of (sum of losses) and the total weight of the
whole step (all micro-batches, all replicas); `finish_step` then divides by that weight and clips,
all on the device (the grad norm stays a tensor: no `.item()`).

Across CUDA replicas the sum is `torch.cuda.nccl.all_reduce` on each replica's own stream (so it
is ordered after that replica's backward without a host wait); on CPU it is a plain sum.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from trainer.run.stopping import StopAwareBarrier, StopSignal

# DFlash2 adds its selector's sums (zero for a DFlash drafter): trainer.models.objective.selector_metrics
STATS = ("loss_sum", "weight_sum", "correct_sum", "selector_loss_sum", "selector_correct_sum", "selector_recall_sum")


class FlatGrads:
    """One replica's gradient buffer: `.grad` of every trainable parameter is a view into it."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        params = [p for p in params if p.requires_grad]
        if not params:
            raise ValueError("no trainable parameters")
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(f"trainable parameters must share one dtype and device, got {dtypes} {devices}")
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.device = params[0].device
        # the step's sums stay fp32 whatever the gradients' dtype (bf16 weights under optim.offload
        # host): a weight sum rounded to bf16's 8 bits would misnormalise the step. Then they are a
        # buffer of their own, which only a lone replica on one host may have (ReplicaAllReduce).
        self.own_stats = params[0].dtype != torch.float32
        self.flat = torch.zeros(self.numel + (0 if self.own_stats else len(STATS)), dtype=params[0].dtype,
                                device=self.device)
        offset = 0
        for p in params:
            p.grad = self.flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        self.grads = self.flat[: self.numel]
        self.stats = (torch.zeros(len(STATS), dtype=torch.float32, device=self.device) if self.own_stats
                      else self.flat[self.numel :])

    def add_stats(self, loss_sum: torch.Tensor, weight_sum: torch.Tensor, correct_sum: torch.Tensor,
                  selector: tuple[torch.Tensor, ...] = ()) -> None:
        """selector: DFlash2's (selector_loss, selector_correct, selector_recall) sums, else ()."""
        zero = torch.zeros((), device=self.device)
        extra = [t.detach().float() for t in selector] or [zero] * 3
        values = torch.stack([loss_sum.detach().float(), weight_sum.float(), correct_sum.float(), *extra])
        self.stats.add_(values.to(self.stats.dtype))

    def zero(self) -> None:
        self.flat.zero_()
        if self.own_stats:
            self.stats.zero_()

    def check_views(self) -> None:
        """Raise if something replaced a `.grad` (e.g. `optimizer.zero_grad(set_to_none=True)`)."""
        for p in self.params:
            if p.grad is None or p.grad.untyped_storage().data_ptr() != self.flat.untyped_storage().data_ptr():
                raise RuntimeError("a parameter's .grad is no longer a view of the flat buffer")

    def finish_step(self, max_norm: float | None, optimizer: torch.optim.Optimizer | None = None) -> torch.Tensor:
        """Normalise by the step's total weight and clip; returns the (pre-clip) grad norm tensor.

        Both are one factor: the gradients are divided once. An optimizer that unscales gradients
        inside its own update kernel (fused AdamW, the `grad_scale` torch.amp.GradScaler hands it)
        gets the factor instead, so the gradients are only read (for the norm), not rewritten."""
        weight = self.stats[1].clamp(min=1.0)
        norm = torch.linalg.vector_norm(self.grads, dtype=torch.float32) / weight
        scale = weight
        if max_norm is not None and max_norm > 0:
            scale = weight / (max_norm / (norm + 1e-6)).clamp(max=1.0)
        if optimizer is not None and getattr(optimizer, "_step_supports_amp_scaling", False):
            optimizer.grad_scale = scale.float()  # type: ignore[attr-defined]  # read by the fused step
        else:
            self.grads.div_(scale.to(self.grads.dtype))
        return norm


class ReplicaAllReduce:
    """Sum the flat buffers of all replicas; every replica thread calls `all_reduce(rank)`."""

    def __init__(self, replicas: list[FlatGrads], streams: list, stop: StopSignal,
                 across_hosts: Callable[[torch.Tensor], None] | None = None) -> None:
        self.replicas = replicas
        self.across_hosts = across_hosts  # (flat tensor) -> None: the in-place sum over hosts, or None
        self.streams = streams
        self._barrier = StopAwareBarrier(len(replicas), stop)
        devices = [r.device for r in replicas]
        self.mode = "none" if len(replicas) == 1 else "local"
        if any(r.own_stats for r in replicas) and (len(replicas) > 1 or across_hosts is not None):
            raise ValueError("gradients below fp32 (optim.offload host) are summed only for one replica on one host")
        if len(replicas) > 1 and all(d.type == "cuda" for d in devices):
            if len(set(devices)) != len(devices):
                raise ValueError(f"drafter replicas must be on distinct GPUs, got {devices}")
            self.mode = "nccl"
        elif len({d.type for d in devices}) > 1:
            raise ValueError(f"drafter replicas mix device types: {devices}")

    def all_reduce(self, rank: int) -> None:
        """Across hosts (across_hosts set): reduced inside the host onto replica 0's buffer, summed
        over the hosts on that one buffer, then shared back to the host's other replicas."""
        if self.mode == "none":
            if self.across_hosts is not None:
                self.across_hosts(self.replicas[0].flat)
            return
        self._barrier.wait()  # every replica has enqueued its backward
        if rank == 0:
            flats = [r.flat for r in self.replicas]
            if self.mode == "nccl":
                if self.across_hosts is None:
                    torch.cuda.nccl.all_reduce(flats, streams=self.streams)
                else:
                    torch.cuda.nccl.reduce(flats, root=0, streams=self.streams)
                    self.across_hosts(flats[0])  # on replica 0's stream (this thread's current one)
                    torch.cuda.nccl.broadcast(flats, root=0, streams=self.streams)
            else:
                total = torch.stack(flats).sum(0)
                if self.across_hosts is not None:
                    self.across_hosts(total)
                for f in flats:
                    f.copy_(total)
        self._barrier.wait()  # the sum is enqueued (CUDA) or done (CPU) for everyone
