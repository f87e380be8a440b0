"""Model FLOPs of the target forward and of one drafter training step, for MFU.

Counts matmul FLOPs of the shapes actually computed (padding included), 2 per multiply-add:
forward = 2*N*tokens; backward = 2x forward for trainable weights plus input grads, and 1x
(input grads only) for frozen ones such as the shared LM head.
"""
from __future__ import annotations

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A6000": 155.0}


def peak_tflops(device_name: str | None) -> float | None:
    if not device_name:
        return None
    for key, value in PEAK_BF16_TFLOPS.items():
        if key in device_name:
            return value
    return None


def target_forward_flops(cfg, batch: int, length: int, layers_used: int | None = None) -> float:
    """Decoder stack only (features need no LM head); causal attention counted at half."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    hd = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    per_token = 2 * (h * q + 2 * h * kv + q * h + 3 * h * inter)
    attention = 2 * 2 * q * length / 2
    layers = layers_used or cfg.num_hidden_layers
    return layers * batch * length * (per_token + attention)


def drafter_step_flops(c, batch: int, ctx_len: int, anchors: int) -> float:
    """Forward + backward of `trainer.objective.drafter_loss_sums` on one micro-batch.

    c: trainer.drafter.DrafterConfig."""
    h, inter, bs = c.hidden_size, c.intermediate_size, c.block_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    slots = batch * anchors * bs
    ctx = batch * ctx_len
    per_layer_slot = 2 * (h * q + 2 * h * kv + q * h + 3 * h * inter)
    per_layer_ctx = 2 * (2 * h * kv)  # K/V projections of the context
    attention = 2 * 2 * q * (ctx_len + bs)  # upper bound: every slot against the whole context
    fc = 2 * len(c.target_layer_ids) * h * h * ctx
    head = 2 * h * c.vocab_size * batch * anchors * (bs - 1)
    forward_trainable = c.num_hidden_layers * (slots * (per_layer_slot + attention) + ctx * per_layer_ctx) + fc
    return 3 * forward_trainable + 2 * head
