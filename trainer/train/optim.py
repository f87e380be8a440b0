"""AdamW over fp32 master weights, cosine schedule with linear warm-up, gradient clipping."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from trainer.run.config import OptimConfig


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimConfig, fused: bool | None = None,
                    compute_dtype: torch.dtype | None = None) -> torch.optim.AdamW:
    """fused (default: when every parameter is on CUDA) runs the update as one kernel per group.

    cfg.offload host: the fp32 masters and AdamW states on the host, the parameters narrowed to
    compute_dtype (model.dtype) in place (trainer.train.offload.HostAdamW)."""
    params = [p for p in params if p.requires_grad]
    if cfg.offload == "host":
        from trainer.train.offload import HostAdamW

        if compute_dtype is None:
            raise ValueError("optim.offload host: build_optimizer needs the compute dtype (model.dtype)")
        return HostAdamW(params, cfg, compute_dtype)
    if fused is None:
        fused = bool(params) and all(p.is_cuda for p in params)
    beta1, beta2 = cfg.betas
    return torch.optim.AdamW(params, lr=cfg.lr, betas=(beta1, beta2), eps=cfg.eps,
                             weight_decay=cfg.weight_decay, fused=fused or None)


def lr_factor(step: int, cfg: OptimConfig) -> float:
    """Multiplier of cfg.lr at optimizer step `step` (0-based)."""
    warmup = max(1, int(round(cfg.warmup_ratio * cfg.total_steps)))
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, cfg.total_steps - warmup))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))


def clip_gradients(params: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Global grad norm (a tensor: no host sync); clips when max_norm > 0."""
    params = [p for p in params if p.grad is not None]
    if max_norm > 0:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
