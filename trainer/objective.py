"""The DFlash training objective as sums, so a step can be normalised over all micro-batches.

loss = Σ w·CE / Σ w over every block slot of every micro-batch and replica of a step;
accuracy = Σ w·[argmax == label] / Σ w. Callers add up the three sums and divide once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from trainer.drafter import DFlashDrafter
from trainer.masks import Blocks, block_attention
from trainer.target import FrozenHead


def _chunk_sums(hidden, lm_head_weight, labels, weights):
    logits = (hidden @ lm_head_weight.to(hidden.dtype).t()).float()
    ce = F.cross_entropy(logits, labels, reduction="none")
    correct = (logits.argmax(dim=-1) == labels).float()
    return (ce * weights).sum(), (correct * weights).sum()


def chunked_weighted_ce(hidden, lm_head_weight, labels, weights, chunk: int):
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


def drafter_loss_sums(
    drafter: DFlashDrafter,
    head: FrozenHead,
    ctx_features: torch.Tensor,
    blocks: Blocks,
    backend: str,
    chunk: int = 2048,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Training forward of the drafter on one micro-batch.

    ctx_features: [B, L, n*H] from `target_context_features`; blocks: from
    `trainer.masks.prepare_blocks` (on the drafter's device). Returns (loss_sum, weight_sum,
    correct_sum) as 0-d fp32 tensors (loss_sum differentiable); no host sync happens here.
    """
    b, a, bs = blocks.input_ids.shape
    ctx_len = ctx_features.shape[1]
    attend = block_attention(backend, blocks.anchors, blocks.valid, ctx_len, bs)
    embeds = head.embed(blocks.input_ids.view(b, a * bs))
    hidden = drafter.forward_train(ctx_features, embeds, blocks.positions.view(b, a * bs), attend)
    hidden = hidden.view(b, a, bs, -1)[:, :, 1:].reshape(-1, hidden.shape[-1])  # slot 0 carries no loss
    labels = blocks.labels[:, :, 1:].reshape(-1)
    weights = blocks.weights[:, :, 1:].reshape(-1)
    loss_sum, correct_sum = chunked_weighted_ce(hidden, head.lm_head_weight, labels, weights, chunk)
    return loss_sum, weights.sum(), correct_sum
