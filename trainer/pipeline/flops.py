"""Model FLOPs of the target forward and of one drafter training step, for MFU.

Counts matmul FLOPs of the shapes actually computed (padding included), 2 per multiply-add:
forward = 2*N*tokens; backward = 2x forward for trainable weights plus input grads, and 1x
(input grads only) for frozen ones such as the shared LM head. Attention is counted at its
average visible span: half the sequence for the causal target, half the context plus the own
block for a draft slot (anchors are uniform over the sequence). Recomputation is not counted
(model FLOPs, not hardware FLOPs). This is the one count behind every MFU figure: the pipeline's
`step` events and every measurement in bench/RESULTS.md.

At Qwen3-8B shape (36 layers, 5-layer drafter, 512 anchors x 16, sequence 3072) per sequence
token: target forward 1.48e10, drafter step 2.34e10.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from trainer.models.drafter import DrafterConfig
    from trainer.models.masks import Blocks

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A6000": 155.0}


def peak_tflops(device_name: str | None) -> float | None:
    if not device_name:
        return None
    for key, value in PEAK_BF16_TFLOPS.items():
        if key in device_name:
            return value
    return None


def _dims(cfg: Any) -> tuple[int, int, int]:
    h = cfg.hidden_size
    hd = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    return h, cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd


def mlp_flops_per_token(cfg: Any) -> float:
    """Feed-forward FLOPs per token and layer: dense 3*h*I; MoE (Qwen3-MoE, Qwen3-Next, gpt-oss) the
    active experts only, top_k*3*h*I_expert, plus the router and a shared expert (model FLOPs of the
    tokens' own experts: MoE MFU counts active parameters)."""
    h = cfg.hidden_size
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) or 0
    if not experts:
        return 2.0 * 3 * h * (cfg.intermediate_size or 0)
    active = int(getattr(cfg, "num_experts_per_tok", None) or getattr(cfg, "experts_per_token", None) or 1)
    expert = int(getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size)
    shared = getattr(cfg, "shared_expert_intermediate_size", 0) or 0
    return 2.0 * (active * 3 * h * expert + h * experts + 3 * h * shared)


def target_flops(cfg: Any, tokens: float, pairs: float, layers_used: int | None = None) -> float:
    """Decoder stack over `tokens` positions whose attention covers `pairs` (query, key) pairs
    (every layer counted as attention: linear-attention layers of a hybrid are approximated so)."""
    h, q, kv = _dims(cfg)
    per_token = 2 * (h * q + 2 * h * kv + q * h) + mlp_flops_per_token(cfg)
    layers = layers_used or cfg.num_hidden_layers
    return float(layers * (tokens * per_token + 4 * q * pairs))


def target_forward_flops(cfg: Any, batch: int, length: int, layers_used: int | None = None) -> float:
    """Decoder stack only (features need no LM head; layers_used: the layers that run, up to the
    last tapped one; default all of them); causal attention counted at half."""
    return target_flops(cfg, batch * length, batch * length * length / 2, layers_used)


def drafter_flops(c: DrafterConfig, ctx_tokens: float, slots: float, pairs: float, head_rows: float) -> float:
    """Forward + backward of the drafter over `ctx_tokens` context positions and `slots` block
    slots whose attention covers `pairs` (slot, key) pairs, with `head_rows` slots through the LM head."""
    h, q, kv = _dims(c)
    per_layer_slot = 2 * (h * q + 2 * h * kv + q * h + 3 * h * c.intermediate_size)
    per_layer_ctx = 2 * (2 * h * kv)  # K/V projections of the context
    fc = 2 * len(c.target_layer_ids) * h * h * ctx_tokens
    head = 2 * h * c.vocab_size * head_rows
    forward_trainable = c.num_hidden_layers * (slots * per_layer_slot + 4 * q * pairs + ctx_tokens * per_layer_ctx) + fc
    return float(3 * forward_trainable + 2 * head)


def drafter_step_flops(c: DrafterConfig, batch: int, ctx_len: int, anchors: int) -> float:
    """Forward + backward of `trainer.models.objective.drafter_loss_sums` on one micro-batch.

    c: trainer.models.drafter.DrafterConfig."""
    bs = c.block_size
    slots = batch * anchors * bs
    return drafter_flops(c, batch * ctx_len, slots, slots * (ctx_len / 2 + bs), batch * anchors * (bs - 1))


FLOP_KEYS = ("target_real", "target_padded", "drafter_real", "drafter_padded", "tokens_real", "tokens_padded",
             "blocks_real")


def micro_batch_flops(target_cfg: Any, drafter_cfg: DrafterConfig, attention_mask: torch.Tensor,
                      doc_start: torch.Tensor | None, blocks: Blocks, kl: bool = False) -> dict:
    """Model FLOPs of one micro-batch, on real tokens and on everything computed (padding included).

    Real: the target over real tokens with attention inside each document (or each unpadded
    sequence), the drafter over real context tokens and valid blocks, each block's slots seeing
    its document's context before the anchor plus the block. Padded: the whole [B, L] shape
    (the pad tail of a packed row is one more document; an unpacked row is causal over its padded
    length) and every block slot, valid or not, through the projections, MLP and LM head (a
    padding block sees nothing, so attention is the same). kl (model.loss reads the target's logits):
    the target runs every layer, and its LM head runs once more on the drafter for each loss slot.
    CPU tensors in, floats out."""
    b, length = attention_mask.shape
    real_len = attention_mask.sum(1).double()
    tokens_real = float(real_len.sum())
    if doc_start is None:
        pairs_real = float((real_len ** 2 / 2).sum())
        pairs_padded = b * length * length / 2
    else:
        ar = torch.arange(length)
        firsts = doc_start == ar
        sizes = torch.bincount((doc_start + ar.new_tensor(length) * torch.arange(b)[:, None]).flatten(),
                               minlength=b * length).double().view(b, length)
        is_real = firsts & (attention_mask > 0)
        pairs_real = float((sizes ** 2 / 2 * is_real).sum())
        pairs_padded = float((sizes ** 2 / 2 * firsts).sum())
    bs = drafter_cfg.block_size
    valid = blocks.valid.cpu()
    n_valid = float(valid.sum())
    before = (blocks.anchors.cpu() - blocks.starts.cpu()).double()  # context before each anchor
    # per layer: a sliding layer's slots see at most its window of that context; averaged over the layers
    kinds = drafter_cfg.layout.kinds(drafter_cfg.num_hidden_layers)
    pairs_slots = sum(float(((before if w is None else before.clamp(max=w)) + bs).mul(valid).sum()) * bs
                      for w, _ in kinds) / len(kinds)
    n_blocks = valid.numel()
    # features run the layers up to the last tapped one; kl: all of them
    layers = target_cfg.num_hidden_layers if kl else max(drafter_cfg.target_layer_ids) + 1
    target_head = 2 * drafter_cfg.hidden_size * drafter_cfg.vocab_size * (bs - 1) if kl else 0.0  # per block
    return {
        "target_real": target_flops(target_cfg, tokens_real, pairs_real, layers),
        "target_padded": target_flops(target_cfg, b * length, pairs_padded, layers),
        "drafter_real": drafter_flops(drafter_cfg, tokens_real, n_valid * bs, pairs_slots, n_valid * (bs - 1))
        + target_head * n_valid,
        "drafter_padded": drafter_flops(drafter_cfg, b * length, n_blocks * bs, pairs_slots, n_blocks * (bs - 1))
        + target_head * n_blocks,
        "tokens_real": tokens_real, "tokens_padded": float(b * length), "blocks_real": n_valid,
    }
