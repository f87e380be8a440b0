"""Anchor sampling, draft-block tensors and the training attention mask.

Layout of one training sequence: keys are [context positions 0..L-1 | A blocks of bs slots];
queries are the A*bs block slots. A block with anchor p:
  * sees context key j iff j < p (strictly before its anchor: the anchor token itself enters
    the block as its first slot, exactly as at inference);
  * sees every slot of its own block (bidirectional), never another block;
  * a padding block (no anchor) sees nothing, and its output is zero.
Slot k of the block sits at position p+k and predicts the token at p+k (not shifted).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Blocks:
    """Draft blocks for a batch. Shapes: anchors/valid [B, A]; the rest [B, A, bs]."""

    anchors: torch.Tensor  # anchor position per block (0 for padding blocks)
    valid: torch.Tensor  # bool: a real block, not padding
    input_ids: torch.Tensor  # [anchor token, MASK, ..., MASK]
    positions: torch.Tensor  # anchor + k
    labels: torch.Tensor  # token at anchor + k (0 where out of bounds)
    weights: torch.Tensor  # float loss weight, 0 for slot 0, padding, out-of-bounds, non-loss tokens

    def to(self, device) -> "Blocks":
        return Blocks(*(getattr(self, f).to(device, non_blocking=True) for f in self.__dataclass_fields__))


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `num_anchors` positions p per sequence where p and p+1 both carry loss.

    Sampled uniformly without replacement (on the CPU generator, so the choice does not
    depend on the device), sorted ascending, padded with invalid entries to num_anchors.
    """
    loss_mask = loss_mask.cpu().bool()
    b, length = loss_mask.shape
    eligible = torch.zeros_like(loss_mask)
    eligible[:, :-1] = loss_mask[:, :-1] & loss_mask[:, 1:]
    scores = torch.rand(b, length, generator=generator)
    scores = scores.masked_fill(~eligible, -1.0)
    k = min(num_anchors, length)
    top, idx = scores.topk(k, dim=1)
    chosen = top >= 0
    idx = torch.where(chosen, idx, torch.full_like(idx, length))
    idx, _ = idx.sort(dim=1)
    valid = idx < length
    idx = torch.where(valid, idx, torch.zeros_like(idx))
    if k < num_anchors:
        idx = F.pad(idx, (0, num_anchors - k))
        valid = F.pad(valid, (0, num_anchors - k), value=False)
    return idx, valid


def loss_decay(block_size: int, gamma: float) -> torch.Tensor:
    """Per-slot weight: 0 for slot 0, exp(-(k-1)/gamma) for slot k >= 1."""
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def make_blocks(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    valid: torch.Tensor,
    block_size: int,
    gamma: float,
    mask_token_id: int,
) -> Blocks:
    """Build block inputs, positions, labels and loss weights for the given anchors."""
    b, length = input_ids.shape
    dev = anchors.device
    offsets = torch.arange(block_size, device=dev)
    positions = anchors[..., None] + offsets  # [B, A, bs]
    in_bounds = positions < length
    safe = positions.clamp(max=length - 1).view(b, -1)
    labels = torch.gather(input_ids.to(dev), 1, safe).view_as(positions)
    on_loss = torch.gather(loss_mask.to(dev).bool(), 1, safe).view_as(positions)
    weights = loss_decay(block_size, gamma).to(dev) * (valid[..., None] & in_bounds & on_loss)
    labels = torch.where(in_bounds, labels, torch.zeros_like(labels))
    block_ids = torch.full_like(positions, mask_token_id)
    block_ids[..., 0] = torch.where(valid, labels[..., 0], torch.full_like(anchors, mask_token_id))
    return Blocks(anchors, valid, block_ids, positions, labels, weights)


def prepare_blocks(input_ids, loss_mask, num_anchors, block_size, gamma, mask_token_id, generator) -> Blocks:
    anchors, valid = sample_anchors(loss_mask, num_anchors, generator)
    return make_blocks(input_ids.cpu(), loss_mask.cpu(), anchors, valid, block_size, gamma, mask_token_id)


def visible(anchors: torch.Tensor, valid: torch.Tensor, ctx_len: int, block_size: int, q_idx, kv_idx, b):
    """The mask rule for query slot q_idx and key kv_idx of sequence b (shared by both backends)."""
    block = q_idx // block_size
    anchor = anchors[b, block]
    is_ctx = kv_idx < ctx_len
    sees_ctx = is_ctx & (kv_idx < anchor)
    sees_own_block = (~is_ctx) & ((kv_idx - ctx_len) // block_size == block)
    return valid[b, block] & (sees_ctx | sees_own_block)


def dense_mask(anchors: torch.Tensor, valid: torch.Tensor, ctx_len: int, block_size: int) -> torch.Tensor:
    """Boolean mask [B, 1, A*bs, ctx_len + A*bs]."""
    b, a = anchors.shape
    dev = anchors.device
    q = torch.arange(a * block_size, device=dev)[None, :, None]
    kv = torch.arange(ctx_len + a * block_size, device=dev)[None, None, :]
    bidx = torch.arange(b, device=dev)[:, None, None]
    return visible(anchors, valid, ctx_len, block_size, q, kv, bidx)[:, None]


def dense_attention(mask: torch.Tensor):
    """SDPA with a dense boolean mask; rows that see nothing give zeros (as flex_attention does)."""
    any_visible = mask.any(dim=-1, keepdim=True)
    safe_mask = mask | ~any_visible  # keep softmax finite on empty rows; their output is zeroed below

    def attend(q, k, v):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=safe_mask, enable_gqa=k.shape[1] != q.shape[1])
        return out * any_visible.to(out.dtype)

    return attend


_compiled_flex = None


def _flex_fn(device_type: str):
    from torch.nn.attention.flex_attention import flex_attention

    global _compiled_flex
    if device_type == "cpu":
        return flex_attention  # eager: compiled flex on CPU is inference-only
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def flex_attention_fn(anchors: torch.Tensor, valid: torch.Tensor, ctx_len: int, block_size: int):
    """flex_attention with a BlockMask built from the same rule as `dense_mask`."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, a = anchors.shape

    def mask_mod(bi, h, q_idx, kv_idx):
        return visible(anchors, valid, ctx_len, block_size, q_idx, kv_idx, bi)

    block_mask = create_block_mask(
        mask_mod, b, None, a * block_size, ctx_len + a * block_size, device=anchors.device
    )
    flex = _flex_fn(anchors.device.type)

    def attend(q, k, v):
        return flex(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])

    return attend


def resolve_backend(name: str, device: torch.device | str, needs_grad: bool) -> str:
    """auto: flex on cuda; on CPU the dense-mask SDPA path (flex has no CPU backward)."""
    device_type = torch.device(device).type
    if name == "auto":
        return "flex" if device_type == "cuda" else "sdpa"
    if name == "flex" and device_type == "cpu" and needs_grad:
        raise ValueError("model.attention: flex has no backward on CPU; use sdpa or auto")
    return name


def block_attention(backend: str, anchors, valid, ctx_len: int, block_size: int):
    if backend == "flex":
        return flex_attention_fn(anchors, valid, ctx_len, block_size)
    return dense_attention(dense_mask(anchors, valid, ctx_len, block_size))
