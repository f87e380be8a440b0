"""The DFlash training objective as sums, so a step can be normalised over all micro-batches.

loss = Σ w·CE / Σ w over every block slot of every micro-batch and replica of a step;
accuracy = Σ w·[argmax == label] / Σ w. Callers add up the three sums and divide once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from trainer.models.drafter import DFlashDrafter, pointwise
from trainer.models.masks import Blocks, block_attention
from trainer.models.target import FrozenHead


def _chunk_sums(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor,
                weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = (hidden @ lm_head_weight.to(hidden.dtype).t()).float()
    ce = F.cross_entropy(logits, labels, reduction="none")
    correct = (logits.argmax(dim=-1) == labels).float()
    return (ce * weights).sum(), (correct * weights).sum()


def chunked_weighted_ce(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor,
                        weights: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ w·CE and Σ w·correct, computing vocab logits `chunk` positions at a time.

    Each chunk runs under activation checkpointing, so only the hidden states are kept for
    backward and the [positions, vocab] logits never exist for more than one chunk.
    """
    loss_sum = hidden.new_zeros((), dtype=torch.float32)
    correct_sum = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk):
        sl = slice(start, start + chunk)
        if torch.is_grad_enabled() and hidden.requires_grad:
            l, c = checkpoint(_chunk_sums, hidden[sl], lm_head_weight, labels[sl], weights[sl], use_reentrant=False)
        else:
            l, c = _chunk_sums(hidden[sl], lm_head_weight, labels[sl], weights[sl])
        loss_sum = loss_sum + l
        correct_sum = correct_sum + c.detach()
    return loss_sum, correct_sum


@pointwise
def _ce_and_grad(logits: torch.Tensor, labels: torch.Tensor,
                 weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Σ w·CE, Σ w·correct and d(Σ w·CE)/d logits for one chunk (one fused pass on CUDA)."""
    logits32 = logits.float()
    lse = torch.logsumexp(logits32, dim=-1)
    picked = logits32.gather(1, labels[:, None]).squeeze(1)
    correct = (logits32.argmax(dim=-1) == labels).float()
    grad = torch.exp(logits32 - lse[:, None]) * weights[:, None]
    grad = grad.scatter_add(1, labels[:, None], -weights[:, None])
    return ((lse - picked) * weights).sum(), (correct * weights).sum(), grad.to(logits.dtype)


class _HeadCE(torch.autograd.Function):
    """Σ w·CE through a frozen LM head, with d/d hidden computed chunk by chunk in the forward.

    The loss is a scalar, so its gradient is grad_output x (the gradient computed here): the
    backward is one multiply, the [positions, vocab] logits never outlive their chunk, and the
    LM-head matmul runs twice (logits, grad of hidden), not three times as under checkpointing.
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor,
                weights: torch.Tensor, chunk: int, need_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = torch.get_autocast_dtype(hidden.device.type) if torch.is_autocast_enabled(hidden.device.type) \
            else hidden.dtype
        with torch.autocast(hidden.device.type, enabled=False):
            w = lm_head_weight.to(dtype)
            loss_sum = hidden.new_zeros((), dtype=torch.float32)
            correct_sum = hidden.new_zeros((), dtype=torch.float32)
            grad_hidden = hidden.new_empty(hidden.shape, dtype=dtype) if need_grad else None
            for start in range(0, hidden.shape[0], chunk):
                sl = slice(start, start + chunk)
                logits = hidden[sl].to(dtype) @ w.t()
                l, c, grad_logits = _ce_and_grad(logits, labels[sl], weights[sl], compiled=need_grad)
                loss_sum += l
                correct_sum += c
                if need_grad:
                    torch.matmul(grad_logits, w, out=grad_hidden[sl])  # type: ignore[index]  # allocated when need_grad
        ctx.save_for_backward(grad_hidden)
        ctx.hidden_dtype = hidden.dtype
        ctx.mark_non_differentiable(correct_sum)
        return loss_sum, correct_sum

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor,
                 _grad_correct: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (grad_hidden,) = ctx.saved_tensors
        return (grad_hidden * grad_loss.to(grad_hidden.dtype)).to(ctx.hidden_dtype), None, None, None, None, None


def fused_weighted_ce(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor,
                      weights: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Same sums as `chunked_weighted_ce`, without recomputing the LM head in backward."""
    need_grad = torch.is_grad_enabled() and hidden.requires_grad
    loss_sum, correct_sum = _HeadCE.apply(hidden, lm_head_weight, labels, weights, chunk, need_grad)
    return loss_sum, correct_sum.detach()


WEIGHTED_CE = {"fused": fused_weighted_ce, "checkpoint": chunked_weighted_ce}


def drafter_loss_sums(
    drafter: DFlashDrafter,
    head: FrozenHead,
    ctx_features: torch.Tensor,
    blocks: Blocks,
    backend: str,
    chunk: int = 2048,
    ce: str = "fused",
    doc_start: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Training forward of the drafter on one micro-batch.

    ctx_features: [B, L, n*H] from `target_context_features`; blocks: from
    `trainer.models.masks.prepare_blocks` (on the drafter's device). Returns (loss_sum, weight_sum,
    correct_sum) as 0-d fp32 tensors (loss_sum differentiable); no host sync happens here.
    ce: "fused" (default) or "checkpoint" (the reference implementation, kept for parity and the bench).
    doc_start [B, L]: packed rows (trainer.data.packing): context positions restart per document, a
    block sees only its own document, and flex builds its mask from tiles (long rows).
    """
    b, a, bs = blocks.input_ids.shape
    ctx_len = ctx_features.shape[1]
    packed = doc_start is not None
    attend = block_attention(backend, blocks.anchors, blocks.valid, ctx_len, bs, blocks.starts if packed else None,
                             tiled=packed, kinds=drafter.config.kinds())
    embeds = drafter.embed_block(head.embed, blocks.input_ids.view(b, a * bs))
    ctx_positions = None
    if doc_start is not None:  # packed
        doc_start = doc_start.to(ctx_features.device)
        ctx_positions = torch.arange(ctx_len, device=doc_start.device) - doc_start
    hidden = drafter.forward_train(ctx_features, embeds, blocks.positions.view(b, a * bs), attend, ctx_positions)
    hidden = hidden.view(b, a, bs, -1)[:, :, 1:].reshape(-1, hidden.shape[-1])  # slot 0 carries no loss
    labels = blocks.labels[:, :, 1:].reshape(-1)
    weights = blocks.weights[:, :, 1:].reshape(-1)
    loss_sum, correct_sum = WEIGHTED_CE[ce](hidden, head.lm_head_weight, labels, weights, chunk)
    return loss_sum, weights.sum(), correct_sum
