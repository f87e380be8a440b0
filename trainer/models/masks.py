"""Anchor sampling, draft-block tensors and the training attention mask.

Layout of one training sequence: keys are [context positions 0..L-1 | A blocks of bs slots];
queries are the A*bs block slots. A block with anchor p:
  * sees context key j iff j < p (strictly before its anchor: the anchor token itself enters
    the block as its first slot, exactly as at inference);
  * sees every slot of its own block (bidirectional), never another block;
  * a padding block (no anchor) sees nothing, and its output is zero.
Slot k of the block sits at position p+k and predicts the token at p+k (not shifted).

A layer of the draft's own layout (DrafterConfig.kinds) narrows this as vLLM's draft layer does at
serving time (trainer.models.drafter.serving_mask): a sliding layer of window W lets slot k see
context key j only if (p + k) - j < W and its own slot m only if |k - m| < W; a causal layer lets
slot k see its own slots m <= k only. Every mask takes the layer's (window, causal): (None, False)
is the rule above.

Packed rows (trainer.data.packing) hold several documents back to back. Then every block also carries
the row index where its anchor's document starts (`starts`): it sees context key j iff
start <= j < p, so never another document; its positions and the target's restart at each
document; a slot past its document's end is out of bounds (no label, no weight), exactly as past
the end of an unpacked sequence. Unpacked, starts are 0 and everything reads as above.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

    from trainer.models.drafter import Attention

# flex_attention's mask_mod: (batch, head, query index, key index) -> may the query see the key
MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Blocks:
    """Draft blocks for a batch. Shapes: anchors/valid [B, A]; the rest [B, A, bs]."""

    anchors: torch.Tensor  # anchor position per block (0 for padding blocks)
    valid: torch.Tensor  # bool: a real block, not padding
    input_ids: torch.Tensor  # [anchor token, MASK, ..., MASK]
    positions: torch.Tensor  # anchor + k
    labels: torch.Tensor  # token at anchor + k (0 where out of bounds)
    weights: torch.Tensor  # float loss weight, 0 for slot 0, padding, out-of-bounds, non-loss tokens
    starts: torch.Tensor  # [B, A] row index where the anchor's document begins (0 unpacked)

    def to(self, device: torch.device | str) -> "Blocks":
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
    """Per-slot weight: 0 for slot 0, exp(-(k-1)/gamma) for slot k >= 1 (gamma = inf: 1, D-PACE's base)."""
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
    doc_start: torch.Tensor | None = None,
) -> Blocks:
    """Build block inputs, positions, labels and loss weights for the given anchors. A float
    loss_mask (the data's per-token weights, trainer.data.batches.mask_dtype) multiplies each
    label's weight by its token's; a bool one leaves the weights what they always were.

    doc_start [B, L] (packed rows): the row index where each token's document begins; positions
    are then counted from the anchor's document start, and slots outside that document are out
    of bounds."""
    b, length = input_ids.shape
    dev = anchors.device
    offsets = torch.arange(block_size, device=dev)
    absolute = anchors[..., None] + offsets  # [B, A, bs] row index of each slot's label
    in_bounds = absolute < length
    safe = absolute.clamp(max=length - 1).view(b, -1)
    if doc_start is None:
        starts = torch.zeros_like(anchors)
    else:
        doc_start = doc_start.to(dev)
        starts = torch.gather(doc_start, 1, anchors)
        in_bounds &= torch.gather(doc_start, 1, safe).view_as(absolute) == starts[..., None]
    labels = torch.gather(input_ids.to(dev), 1, safe).view_as(absolute)
    on_loss = torch.gather(loss_mask.to(dev), 1, safe).view_as(absolute)
    weights = loss_decay(block_size, gamma).to(dev) * (valid[..., None] & in_bounds & on_loss.bool())
    if loss_mask.is_floating_point():  # per-token weights (trainer.data.chat.answer_weights) scale each label's
        weights = weights * on_loss
    labels = torch.where(in_bounds, labels, torch.zeros_like(labels))
    block_ids = torch.full_like(absolute, mask_token_id)
    block_ids[..., 0] = torch.where(valid, labels[..., 0], torch.full_like(anchors, mask_token_id))
    positions = absolute - starts[..., None]
    return Blocks(anchors, valid, block_ids, positions, labels, weights, starts)


def sample_packed_anchors(loss_mask: torch.Tensor, doc_start: torch.Tensor, num_anchors: int,
                          generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """`num_anchors` slots per row, shared among its documents by length; sorted, padded invalid.

    Document d covering [s, e) of a row of length L gets floor(A*e/L) - floor(A*s/L) anchors
    (fewer if it has fewer eligible positions), drawn uniformly without replacement from its
    positions p with loss on p and p+1 inside d. Random numbers come from the CPU generator."""
    loss_mask, doc_start = loss_mask.cpu().bool(), doc_start.cpu()
    b, length = loss_mask.shape
    ar = torch.arange(length)
    eligible = torch.zeros_like(loss_mask)
    eligible[:, :-1] = loss_mask[:, :-1] & loss_mask[:, 1:] & (doc_start[:, :-1] == doc_start[:, 1:])
    scores = torch.rand(b, length, generator=generator)
    anchors = torch.zeros(b, num_anchors, dtype=torch.long)
    valid = torch.zeros(b, num_anchors, dtype=torch.bool)
    for r in range(b):
        starts = doc_start[r]
        is_first = starts == ar
        doc_index = torch.cumsum(is_first.long(), 0) - 1
        firsts = ar[is_first]
        ends = torch.cat([firsts[1:], torch.tensor([length])])
        quota = (num_anchors * ends) // length - (num_anchors * firsts) // length
        # sort by (document, eligible first, score descending): each document's segment keeps its place
        key = doc_index.double() * 4 + torch.where(eligible[r], 1 - scores[r].double(), torch.full((length,), 2.0))
        order = torch.argsort(key, stable=True)
        rank = ar - starts[order]  # rank inside its document, in sorted order
        chosen_sorted = eligible[r][order] & (rank < quota[doc_index[order]])
        picked = order[chosen_sorted].sort().values[:num_anchors]
        anchors[r, : len(picked)] = picked
        valid[r, : len(picked)] = True
    return anchors, valid


def prepare_blocks(input_ids: torch.Tensor, loss_mask: torch.Tensor, num_anchors: int, block_size: int, gamma: float,
                   mask_token_id: int, generator: torch.Generator,
                   doc_start: torch.Tensor | None = None) -> Blocks:
    """Sample anchors and build their blocks; with doc_start (packed rows) anchors are sampled
    per document (sample_packed_anchors) and `num_anchors` is per row."""
    if doc_start is None:
        anchors, valid = sample_anchors(loss_mask, num_anchors, generator)
    else:
        doc_start = doc_start.cpu()
        anchors, valid = sample_packed_anchors(loss_mask, doc_start, num_anchors, generator)
    return make_blocks(input_ids.cpu(), loss_mask.cpu(), anchors, valid, block_size, gamma, mask_token_id,
                       doc_start)


Kind = tuple[int | None, bool]  # a layer's (sliding window or None, causal inside the block)
FULL_KIND: Kind = (None, False)


def visible(anchors: torch.Tensor, valid: torch.Tensor, ctx_len: int, block_size: int, q_idx: torch.Tensor,
            kv_idx: torch.Tensor, b: torch.Tensor, starts: torch.Tensor | None = None,
            window: int | None = None, causal: bool = False) -> torch.Tensor:
    """The mask rule for query slot q_idx and key kv_idx of sequence b (shared by both backends),
    for a layer of that window and causality."""
    block = q_idx // block_size
    anchor = anchors[b, block]
    is_ctx = kv_idx < ctx_len
    sees_ctx = is_ctx & (kv_idx < anchor)
    if starts is not None:
        sees_ctx = sees_ctx & (kv_idx >= starts[b, block])
    own = kv_idx - ctx_len
    sees_own_block = (~is_ctx) & (own // block_size == block)
    if window is not None or causal:
        k = q_idx - block * block_size  # the query's slot: position anchor + k (context key j: position j)
        m = own - block * block_size  # the key's slot in the block
        if window is not None:
            sees_ctx = sees_ctx & (anchor + k - kv_idx < window)
            sees_own_block = sees_own_block & (k - m < window) & (m - k < window)
        if causal:
            sees_own_block = sees_own_block & (m <= k)
    return valid[b, block] & (sees_ctx | sees_own_block)


def dense_mask(anchors: torch.Tensor, valid: torch.Tensor, ctx_len: int, block_size: int,
               starts: torch.Tensor | None = None, window: int | None = None, causal: bool = False) -> torch.Tensor:
    """Boolean mask [B, 1, A*bs, ctx_len + A*bs] of a layer of that window and causality."""
    b, a = anchors.shape
    dev = anchors.device
    q = torch.arange(a * block_size, device=dev)[None, :, None]
    kv = torch.arange(ctx_len + a * block_size, device=dev)[None, None, :]
    bidx = torch.arange(b, device=dev)[:, None, None]
    return visible(anchors, valid, ctx_len, block_size, q, kv, bidx, starts, window, causal)[:, None]


def document_causal_dense(doc_start: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """The target's mask in a packed row, dense [B, 1, L, L]: query i sees key j iff
    doc_start[i] <= j <= i (causal inside its own document only), and with a sliding `window`
    also i - j < window (transformers' sliding_window_overlay)."""
    length = doc_start.shape[1]
    idx = torch.arange(length, device=doc_start.device)
    mask = (doc_start[:, :, None] <= idx[None, None, :]) & (idx[None, None, :] <= idx[None, :, None])
    if window is not None:
        mask &= idx[None, None, :] > idx[None, :, None] - window
    return mask[:, None]


TILE = 128  # flex_attention's BlockMask tile (queries and keys)


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, NQ, NKV] bool -> (count [B, 1, NQ], indices [B, 1, NQ, NKV]) with the True tiles first."""
    count = tiles.sum(-1, dtype=torch.int32)
    order = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return count[:, None], order[:, None]


def _tile_block_mask(partial: torch.Tensor, full: torch.Tensor, mask_mod: MaskMod, q_len: int, kv_len: int) -> BlockMask:
    from torch.nn.attention.flex_attention import BlockMask

    kv_num, kv_idx = _ordered(partial & ~full)
    full_num, full_idx = _ordered(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=TILE, mask_mod=mask_mod,
                                    seq_lengths=(q_len, kv_len))


def _tile_ranges(count: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    lo = torch.arange(count, device=device) * TILE
    return lo, lo + TILE


def document_causal_block_mask(doc_start: torch.Tensor) -> BlockMask:
    """The target's packed-row mask as a flex BlockMask, built from tile arithmetic (no dense
    [L, L] evaluation and no host sync). Needs L % 128 == 0.

    A query tile's queries have nondecreasing document starts, so the keys any of them sees are
    [doc_start(first), last] and the keys all of them see are [doc_start(last), first]: tiles
    inside the second range are full (no mask_mod), tiles touching the first are partial."""
    b, length = doc_start.shape
    if length % TILE:
        raise ValueError(f"packed length {length} is not a multiple of {TILE}")
    n = length // TILE
    tiles = doc_start.view(b, n, TILE)
    first_q = torch.arange(n, device=doc_start.device) * TILE
    kv_lo, kv_hi = _tile_ranges(n, doc_start.device)  # key tile j covers [lo, hi)
    union_lo, union_hi = tiles[:, :, 0], first_q + TILE - 1  # keys seen by some query: [lo, hi]
    inter_lo, inter_hi = tiles[:, :, -1], first_q  # keys seen by every query: [lo, hi]
    partial = (kv_hi[None, None] > union_lo[..., None]) & (kv_lo[None, None] <= union_hi[None, :, None])
    full = (kv_lo[None, None] >= inter_lo[..., None]) & (kv_hi[None, None] - 1 <= inter_hi[None, :, None])

    def mask_mod(bi: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return (doc_start[bi, q_idx] <= kv_idx) & (kv_idx <= q_idx)

    return _tile_block_mask(partial, full & partial, mask_mod, length, length)


def draft_block_mask(anchors: torch.Tensor, valid: torch.Tensor, starts: torch.Tensor, ctx_len: int,
                     block_size: int, window: int | None = None, causal: bool = False) -> BlockMask:
    """The drafter's mask (`visible`) as a flex BlockMask from tile arithmetic, for long packed
    rows where evaluating the rule densely over [A*bs, ctx_len + A*bs] would cost gigabytes.

    Per query tile: context tiles meeting [min start, max anchor) of its valid blocks are
    partial, those inside [max start, min anchor) of all its blocks (all valid) are full; the
    tiles holding its blocks' own slots are partial. A sliding layer's slot k sees context from
    max(start, anchor + k - window + 1) on: its tiles start there, so the mask stays as sparse as
    the window (a few tiles per query tile, not the whole row). Needs ctx_len % 128 == 0."""
    if ctx_len % TILE:
        raise ValueError(f"context length {ctx_len} is not a multiple of {TILE}")
    b, a = anchors.shape
    dev = anchors.device
    q_len = a * block_size
    nq = -(-q_len // TILE)
    nc = ctx_len // TILE
    pad = nq * TILE - q_len

    def per_slot(t: torch.Tensor, fill: bool | int) -> torch.Tensor:
        t = t.repeat_interleave(block_size, dim=1)
        return torch.nn.functional.pad(t, (0, pad), value=fill).view(b, nq, TILE)

    big = ctx_len + q_len + TILE
    slot_valid = per_slot(valid, False)
    slot_anchor = per_slot(anchors, 0)
    slot_start = per_slot(starts, 0)
    if window is not None:  # the lowest context key of slot k: max(start, anchor + k - window + 1)
        k_of_slot = torch.nn.functional.pad(torch.arange(block_size, device=dev).repeat(a), (0, pad)).view(1, nq, TILE)
        slot_start = torch.maximum(slot_start, slot_anchor + k_of_slot - window + 1)
    own_lo = per_slot(ctx_len + torch.arange(a, device=dev)[None].expand(b, a) * block_size, 0)
    any_valid, all_valid = slot_valid.any(-1), slot_valid.all(-1)
    union_lo = torch.where(slot_valid, slot_start, big).amin(-1)
    union_hi = torch.where(slot_valid, slot_anchor, -1).amax(-1)
    inter_lo, inter_hi = slot_start.amax(-1), slot_anchor.amin(-1)
    own_union_lo = torch.where(slot_valid, own_lo, big).amin(-1)
    own_union_hi = torch.where(slot_valid, own_lo + block_size, -1).amax(-1)
    kv_lo, kv_hi = _tile_ranges(nc + nq, dev)
    kv_lo, kv_hi = kv_lo[None, None], kv_hi[None, None]
    is_ctx = kv_lo < ctx_len
    ctx_any = is_ctx & (kv_hi > union_lo[..., None]) & (kv_lo < union_hi[..., None])
    own_any = ~is_ctx & (kv_hi > own_union_lo[..., None]) & (kv_lo < own_union_hi[..., None])
    partial = any_valid[..., None] & (ctx_any | own_any)
    full = (all_valid & (inter_hi > inter_lo))[..., None] & is_ctx & (kv_lo >= inter_lo[..., None]) \
        & (kv_hi <= inter_hi[..., None])

    def mask_mod(bi: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return visible(anchors, valid, ctx_len, block_size, q_idx, kv_idx, bi, starts, window, causal)

    return _tile_block_mask(partial, full, mask_mod, q_len, ctx_len + q_len)


def dense_attention(mask: torch.Tensor) -> Attention:
    """SDPA with a dense boolean mask; rows that see nothing give zeros (as flex_attention does).
    A layer with sinks passes sink= (per-head logits [heads]: trainer.models.drafter.attend_masked)."""
    from trainer.models.drafter import attend_masked

    any_visible = mask.any(dim=-1, keepdim=True)
    safe_mask = mask | ~any_visible  # keep softmax finite on empty rows; their output is zeroed below

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: torch.Tensor | None = None) -> torch.Tensor:
        out = attend_masked(q, k, v, safe_mask, sink)
        return out * any_visible.to(out.dtype)

    return attend


_compiled_flex: Callable[..., Any] | None = None


def _flex_fn(device_type: str) -> Callable[..., Any]:
    from torch.nn.attention.flex_attention import flex_attention

    global _compiled_flex
    if device_type == "cpu":
        return flex_attention  # eager: compiled flex on CPU is inference-only
    if torch.compiler.is_compiling():
        # Traced inside a compiled region (model.compile_target): Dynamo fuses flex_attention into
        # that graph itself. Never create or cache here: under tracing torch.compile(fn) returns
        # fn, and the cache would keep the raw, unfused flex_attention for every later caller.
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def flex_attention_fn(anchors: torch.Tensor, valid: torch.Tensor, ctx_len: int, block_size: int,
                      starts: torch.Tensor | None = None, tiled: bool = False, window: int | None = None,
                      causal: bool = False) -> Attention:
    """flex_attention with a BlockMask built from the same rule as `dense_mask`.

    tiled: build it by tile arithmetic (`draft_block_mask`, for packed rows) instead of
    evaluating the rule on every (query, key) pair (`create_block_mask`)."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, a = anchors.shape
    if tiled:
        block_mask = draft_block_mask(anchors, valid, torch.zeros_like(anchors) if starts is None else starts,
                                      ctx_len, block_size, window, causal)
    else:
        def mask_mod(bi: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            return visible(anchors, valid, ctx_len, block_size, q_idx, kv_idx, bi, starts, window, causal)

        block_mask = create_block_mask(
            mask_mod, b, None, a * block_size, ctx_len + a * block_size, device=anchors.device
        )
    return flex_with(block_mask)


# The drafter's attention on Hopper at head_dim 128: the tiles inductor's max-autotune picks for a
# packed row of 8192 (forward + backward 1.135 x the default tiles, bench/RESULTS.md), set
# here so a run gets them without autotuning in its warm-up.
FLEX_TILES_SM90_D128 = {"BLOCK_M": 64, "BLOCK_N": 64, "fwd_num_stages": 3, "fwd_num_warps": 4,
                        "BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32,
                        "bwd_num_stages": 3, "bwd_num_warps": 4}


@functools.lru_cache(maxsize=None)
def flex_kernel_options(device: torch.device, head_dim: int) -> dict[str, Any] | None:
    """The drafter's flex tiles for this device and head size; None: inductor's defaults. Asked at
    every attention call: cached, so the device's capability is read once."""
    if device.type != "cuda" or head_dim != 128 or torch.cuda.get_device_capability(device)[0] != 9:
        return None
    return FLEX_TILES_SM90_D128


def flex_with(block_mask: BlockMask) -> Attention:
    """attend(q, k, v) through (compiled on CUDA) flex_attention under `block_mask`."""
    flex = _flex_fn(block_mask.kv_num_blocks.device.type)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: torch.Tensor | None = None) -> torch.Tensor:
        options = flex_kernel_options(q.device, q.shape[-1])
        extra = {"kernel_options": options} if options else {}
        if sink is None:
            return flex(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1], **extra)
        # a sink is one more key of value 0 and logit `sink`: out * Z / (Z + e^sink) = out * sigmoid(lse - sink)
        from torch.nn.attention.flex_attention import AuxRequest

        out, aux = flex(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1],
                        return_aux=AuxRequest(lse=True), **extra)
        lse = aux.lse
        return out * torch.sigmoid(lse.float() - sink.float()[None, :, None])[..., None].to(out.dtype)

    return attend


def resolve_backend(name: str, device: torch.device | str, needs_grad: bool) -> str:
    """auto: flex on cuda; on CPU the dense-mask SDPA path (flex has no CPU backward)."""
    device_type = torch.device(device).type
    if name == "auto":
        return "flex" if device_type == "cuda" else "sdpa"
    if name == "flex" and device_type == "cpu" and needs_grad:
        raise ValueError("model.attention: flex has no backward on CPU; use sdpa or auto")
    return name


def block_attention(backend: str, anchors: torch.Tensor, valid: torch.Tensor, ctx_len: int, block_size: int,
                    starts: torch.Tensor | None = None, tiled: bool = False,
                    kinds: list[Kind] | None = None) -> Attention | list[Attention]:
    """One attention per drafter layer of `kinds` (the drafter's DrafterConfig.layout.kinds(layers)), a
    mask built once per distinct (window, causal); kinds None: one attention (full, non-causal) for every layer."""
    built: dict[Kind, Attention] = {}
    out = []
    for kind in kinds or [FULL_KIND]:
        if kind not in built:
            window, causal = kind
            built[kind] = (flex_attention_fn(anchors, valid, ctx_len, block_size, starts, tiled, window, causal)
                           if backend == "flex" else
                           dense_attention(dense_mask(anchors, valid, ctx_len, block_size, starts, window, causal)))
        out.append(built[kind])
    return out if kinds is not None else out[0]
