"""The target's decoder on preallocated buffers: the one hand-written decoding path of a target.

Regeneration (`trainer_tools.regen`: greedy and sampled answers, `generate`), speculative decoding
(`trainer.generate.speculative`: verification rounds) and evaluation (which decodes through
speculative decoding) all run the target through `TargetDecoder.forward` on a `KVCache`. It runs
the target from its own modules (embeddings, norms, projections, rotary embedding, MLP) with the
arithmetic of transformers' SDPA path, so its tokens are transformers' greedy tokens (tests:
tests/trainer/test_regen_static.py, test_speculative_cached.py). Anything `supports` refuses is
decoded by transformers itself (`generate`, or a `DynamicCache`), slower, same tokens.

The cache is addressed by slot: every row has `capacity` slots per layer; a forward writes its T
new entries at the given slots (the same slots for every row) and each query attends to the slots
its `visible` mask allows. Holes (padding, rejected drafts) are masked, never moved, until
`KVCache.compact` packs the valid slots of each row to the front.

Hybrid and recurrent targets (issue 23: Qwen3.5/Qwen3-Next linear attention): a recurrent layer's
state is not addressed by slot, so a rejected draft cannot be masked away. `KVCache.snapshot`
(before a verification) and `KVCache.restore` (after it, with each row's accepted count) are the
hooks of the static rounds; for the attention-only targets `supports` admits they do nothing.
Hybrids are decoded by transformers' own layers (their Gated DeltaNet and gated attention are not
written out here) on a transformers cache, with the same two steps in `RecurrentStates`: the block
is verified one position at a time, the linear layers' conv and recurrent states are snapshotted
after each position, and each row is restored to the state after its last accepted token
(trainer.generate.speculative, `_HFTarget`). Per-position snapshots rather than snapshot and
recompute: rows accept different counts, and a recompute would need a sub-batch per count.
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from trainer.models.hf import base_model, hf_config, output_embeddings

FAMILIES = ("qwen3", "qwen2", "llama")  # model types whose decoder layers `forward` runs from their modules


class Cancelled(Exception):
    """The decode was cancelled (`cancel` set: an interrupted regen); its tokens are no answer.
    `step` of `steps`: the decode steps the batch had run (0: still in its prefill) of the most it
    would have run, so a caller can say how much of the batch the cancel saved."""

    def __init__(self, step: int = 0, steps: int = 0) -> None:
        super().__init__(f"the decode was cancelled at step {step} of {steps}")
        self.step, self.steps = step, steps


def check_cancel(cancel: threading.Event | None, step: int = 0, steps: int = 0) -> None:
    """Raise Cancelled once `cancel` is set (a flag read, no device sync: cheap at every step)."""
    if cancel is not None and cancel.is_set():
        raise Cancelled(step, steps)


def left_padded(prompts: Sequence[Sequence[int]], width: int, pad: int) -> torch.Tensor:
    """[B, width] int64 on the CPU: each prompt at the right end of its row, `pad` before it.

    Row by row through the buffer protocol: one `torch.tensor` of the nested list parses every token
    as a Python object with the GIL held (7.5 s for 4,096 rows of ~7K tokens on this project's CPU
    box, so a 16,384-row batch held the GIL - and a Ctrl-C - for half a minute); this took 0.9 s and
    lets other threads (the main thread's signal handler) run between rows."""
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    for row, p in zip(ids, prompts):
        if len(p):
            row[width - len(p):] = torch.frombuffer(array("q", p), dtype=torch.long)
    return ids


def supports(model: torch.nn.Module) -> bool:
    """The one rule for which targets the decoder runs: a Qwen3/Qwen2/Llama causal LM whose layers
    are all full attention (no sliding window), with its rotary embedding and an LM head."""
    cfg = hf_config(model)
    kinds = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    return (getattr(cfg, "model_type", None) in FAMILIES and kinds == {"full_attention"}
            and hasattr(base_model(model), "rotary_emb") and output_embeddings(model) is not None)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb for one tensor [B, heads, T, D], cos/sin [B, 1, T, D]."""
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)


class KVCache:
    """Per-layer K/V [batch, kv_heads, capacity, head_dim] of a target (or of any stack of
    attention layers: speculative decoding keeps its drafter's context in one too)."""

    def __init__(self, layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int,
                 device: torch.device | str, dtype: torch.dtype) -> None:
        self.capacity = capacity
        self.keys = [torch.zeros(batch, kv_heads, capacity, head_dim, device=device, dtype=dtype) for _ in range(layers)]
        self.values = [torch.zeros_like(k) for k in self.keys]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              rows: slice = slice(None)) -> None:
        """Entries k, v [rows, kv_heads, T, head_dim] into slots [T] of one layer."""
        self.keys[layer][rows].index_copy_(2, slots, k)
        self.values[layer][rows].index_copy_(2, slots, v)

    def compact(self, order: torch.Tensor, packed: int, used: int) -> None:
        """Slots order[r, j] (of the first `used`) of row r move to slot j, for j < packed."""
        for buf in self.keys + self.values:
            index = order[:, None, :packed, None].expand(-1, buf.shape[1], -1, buf.shape[3])
            buf[:, :, :packed].copy_(buf[:, :, :used].gather(2, index))

    def snapshot(self) -> Any:
        """State to restore after a verification that may be rejected. Attention needs none: a
        rejected slot is masked out, and overwritten by the next block."""
        return None

    def restore(self, snapshot: Any, accepted: torch.Tensor) -> None:
        """After a verification: keep what each row accepted (accepted [B] drafts + the anchor)."""


class TargetDecoder:
    """A supported target (see `supports`) run layer by layer on a `KVCache`."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.base = base_model(model)
        self.lm_head = output_embeddings(model)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype

    def cache(self, batch: int, capacity: int) -> KVCache:
        cfg = hf_config(self.model)
        return KVCache(len(self.base.layers), batch, cfg.num_key_value_heads, capacity, self.head_dim(), self.device,
                       self.dtype)

    def head_dim(self) -> int:
        cfg = hf_config(self.model)
        return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, slots: torch.Tensor,
                visible: torch.Tensor, *, rows: slice = slice(None), upto: int | None = None,
                keep: Sequence[int] = (), last_only: bool = False,
                expand_kv: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """ids [B, T] at positions [B, T] (B = the cache's `rows`); their K/V written at slots [T];
        visible [B, T or 1, S]: the slots 0..S-1 each query attends to (S = `upto`, default the
        capacity). Returns (logits [B, 1 if last_only else T, V], the hidden states after each
        layer in `keep`, as transformers' hidden_states[i + 1]: the last one normed).
        expand_kv: repeat K/V heads for the query heads, as transformers does with a mask on CUDA,
        so SDPA takes a fused kernel instead of materialising [B, heads, T, S] scores."""
        m, wanted = self.base, set(keep)
        b, t = ids.shape
        x = m.embed_tokens(ids)
        cos, sin = m.rotary_emb(x, positions)
        cos, sin = cos[:, None], sin[:, None]
        mask = visible[:, None]
        upto = cache.capacity if upto is None else upto
        last = len(m.layers) - 1
        kept = {}
        for i, layer in enumerate(m.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            shape = (b, t, -1, a.head_dim)
            q, k = a.q_proj(h).view(shape), a.k_proj(h).view(shape)
            if getattr(a, "q_norm", None) is not None:
                q, k = a.q_norm(q), a.k_norm(k)
            q, k = _rope(q.transpose(1, 2), cos, sin), _rope(k.transpose(1, 2), cos, sin)
            cache.write(i, slots, k, a.v_proj(h).view(shape).transpose(1, 2), rows)
            out = _attend(q, cache.keys[i][rows, :, :upto], cache.values[i][rows, :, :upto], mask, a.scaling,
                          expand_kv)
            x = x + a.o_proj(out.transpose(1, 2).reshape(b, t, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if i in wanted and i != last:
                kept[i] = x
        if last in wanted:  # transformers' last hidden state is the normed one
            x = kept[last] = m.norm(x)
            x = x[:, -1:] if last_only else x
        else:
            x = m.norm(x[:, -1:] if last_only else x)
        return self.lm_head(x), [kept[i] for i in keep]


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float,
            expand_kv: bool) -> torch.Tensor:
    """SDPA of q [B, heads, T, D] over keys/values [B, kv_heads, S, D] (grouped-query heads)."""
    b, heads, t, dim = q.shape
    groups = heads // keys.shape[1]
    if t == 1 and groups > 1 and mask.shape[-2] == 1:
        # one query per row: the query heads of a K/V head become its queries (no K/V copies)
        out = F.scaled_dot_product_attention(q.reshape(b, keys.shape[1], groups, dim), keys, values, attn_mask=mask,
                                             scale=scale)
        return out.reshape(b, heads, 1, dim)
    if expand_kv and groups > 1:
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                          enable_gqa=keys.shape[1] != heads)


PREFILL_MASK_ELEMENTS = 1 << 31  # booleans of one prefill chunk's visibility mask


def prefill_rows_for(width: int, rows: int) -> int:
    """Rows prefilled at once (at most `rows`) for prompts `width` tokens wide: their [rows, width,
    width] visibility mask stays within PREFILL_MASK_ELEMENTS (2 GiB of booleans): 256 rows of 16K
    tokens would ask for 69 GB; at least one row."""
    return max(1, min(rows, PREFILL_MASK_ELEMENTS // (width * width)))


def rows_that_fit(d: TargetDecoder, capacity: int, free_bytes: int, total_bytes: int) -> int:
    """Rows whose KV caches of `capacity` slots fit in `free_bytes`, keeping 10 % of the device
    (at least 2 GiB) for the prefill's and the decode step's activations, and a quarter more per
    row for its masks and logits."""
    itemsize = torch.empty((), dtype=d.dtype).element_size()
    per_row = len(d.base.layers) * 2 * hf_config(d.model).num_key_value_heads * d.head_dim() * capacity * itemsize
    usable = free_bytes - max(2 << 30, total_bytes // 10)
    return max(1, int(usable / (1.25 * per_row)))


Pick = Callable[[torch.Tensor, int, int], torch.Tensor]  # (logits [n, V], first row, answer index) -> tokens [n]


def argmax(logits: torch.Tensor, row0: int, t: int) -> torch.Tensor:
    return logits.float().argmax(dim=-1)


def length_chunks(lengths: Sequence[int], max_new_tokens: int, fits: Callable[[int], int]) -> list[list[int]]:
    """A batch's rows (indices) in the chunks decoded one after another: shortest prompt first, each chunk as
    many rows as `fits(capacity)` holds at the capacity (prompt + max_new_tokens slots) of its longest prompt.
    A chunk is padded to its own longest prompt, not the batch's, and a chunk of short prompts holds more
    rows: in input order, one long prompt made every chunk as narrow in rows and as wide in slots as its own."""
    chunks: list[list[int]] = []
    for r in sorted(range(len(lengths)), key=lengths.__getitem__):
        if not chunks or len(chunks[-1]) >= fits(lengths[r] + max_new_tokens):
            chunks.append([])
        chunks[-1].append(r)
    return chunks


def greedy(model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int, stop_ids: set[int],
           prefill_rows: int = 256, max_rows: int | None = None,
           cancel: threading.Event | None = None) -> torch.Tensor:
    """Greedy decoding of a batch (`generate` with the argmax): [B, new]."""
    return generate(model, prompts, max_new_tokens, stop_ids, prefill_rows, max_rows, cancel)


def generate(model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int, stop_ids: set[int],
             prefill_rows: int = 256, max_rows: int | None = None, cancel: threading.Event | None = None,
             picks: Callable[[Sequence[int]], Pick] | None = None) -> torch.Tensor:
    """Decoding of a batch, in chunks of rows by prompt length (`length_chunks`), each at most `max_rows`
    rows (default on CUDA: as many as the free memory holds at the chunk's width, `rows_that_fit`; a batch
    of 16,384 long prompts would not fit at once): [B, new] in the prompts' order. Each token is the
    argmax, or chosen by picks(rows), the chooser of the batch's rows `rows` (a chunk's, in its order:
    trainer.generate.sampling.sampled_picks, the engine's draws, each row from its own noise stream, so
    a row's answer does not depend on its chunk). Once `cancel` is set it raises Cancelled at the next
    prefill chunk or decode step, so an interrupted regen does not decode the rest of a batch whose
    answers it will not write."""
    d = TargetDecoder(model)
    memory = torch.cuda.mem_get_info(d.device) if max_rows is None and d.device.type == "cuda" else None

    def fits(capacity: int) -> int:
        if max_rows is not None:
            return max_rows
        return rows_that_fit(d, capacity, *memory) if memory is not None else len(prompts)

    out = torch.empty(len(prompts), max_new_tokens, dtype=torch.long, device=d.device)
    for rows in length_chunks([len(p) for p in prompts], max_new_tokens, fits):
        out[torch.tensor(rows, device=d.device)] = _generate(d, [prompts[r] for r in rows], max_new_tokens, stop_ids,
                                                              prefill_rows, cancel, picks(rows) if picks else argmax)
    return out


def _generate(d: TargetDecoder, prompts: list[list[int]], max_new_tokens: int, stop_ids: set[int],
              prefill_rows: int, cancel: threading.Event | None, pick: Pick) -> torch.Tensor:
    """Decoding of a whole batch with a preallocated KV cache: [B, new] token ids, each chosen by
    pick(logits, first row, answer index).

    Greedy, the same tokens as `model.generate(do_sample=False)` on left-padded prompts (test:
    tests/trainer/test_regen_static.py), without its per-step cache concatenation and mask
    building, which made a batch of 4,096 decode at ~17k tokens/s on an H200. The prompts are
    left-padded into one cache of width + max_new_tokens slots; a key mask hides the padding;
    prefill runs `prefill_rows` rows at a time; each step appends one slot for every row. Rows
    that reached a stop token keep decoding (their tokens are cut by the caller); the loop ends
    when every row has stopped."""
    dev = d.device
    n, width = len(prompts), max(len(p) for p in prompts)
    cache = d.cache(n, width + max_new_tokens)
    pads = torch.tensor([width - len(p) for p in prompts], device=dev)
    ids = left_padded(prompts, width, 0).to(dev)
    slot = torch.arange(width + max_new_tokens, device=dev)
    valid = slot[None, :] >= pads[:, None]  # [B, slots]: padding never attended to
    positions = (slot[None, :width] - pads[:, None]).clamp(min=0)
    out = torch.zeros(n, max_new_tokens, dtype=torch.long, device=dev)
    causal = slot[:width, None] >= slot[None, :width]
    eye = torch.eye(width, dtype=torch.bool, device=dev)
    prefill_rows = prefill_rows_for(width, prefill_rows)
    with torch.no_grad():
        for r0 in range(0, n, prefill_rows):
            check_cancel(cancel, 0, max_new_tokens)
            rows = slice(r0, min(n, r0 + prefill_rows))
            visible = (valid[rows, None, :width] & causal[None]) | eye[None]
            logits, _ = d.forward(ids[rows], positions[rows], cache, slot[:width], visible, rows=rows, upto=width,
                                  last_only=True)
            out[rows, 0] = pick(logits[:, -1], r0, 0)
        stop = torch.tensor(sorted(stop_ids) or [-1], device=dev)
        done = torch.isin(out[:, 0], stop)
        for t in range(1, max_new_tokens):
            check_cancel(cancel, t, max_new_tokens)
            if t % 8 == 0 and bool(done.all()):
                break
            at = width + t - 1
            logits, _ = d.forward(out[:, t - 1:t], (at - pads)[:, None], cache, slot[at:at + 1],
                                  valid[:, None, :at + 1], upto=at + 1, last_only=True)
            out[:, t] = pick(logits[:, -1], 0, t)
            done |= torch.isin(out[:, t], stop)
    return out


class RecurrentStates:
    """Per-position snapshots of the linear-attention layers' states of a transformers cache: after a
    verification block has run token by token, `restore` puts each row back to the state after its
    last accepted token (an attention entry can be masked away; a recurrent state cannot)."""

    def __init__(self, cache: Any) -> None:  # a transformers Cache
        from transformers.cache_utils import LinearAttentionCacheLayerMixin

        self._kind = LinearAttentionCacheLayerMixin
        self.cache = cache
        self.taken: list[list[tuple[torch.Tensor | None, torch.Tensor | None]]] = []

    def is_recurrent(self, layer: object) -> bool:
        return isinstance(layer, self._kind)

    def _layers(self) -> list[Any]:
        return [layer for layer in self.cache.layers if self.is_recurrent(layer)]

    def clear(self) -> None:
        self.taken = []

    def snapshot(self) -> None:
        """The states now (after one more position of the block)."""
        self.taken.append([(layer.conv_states[0].clone() if layer.conv_states[0] is not None else None,
                            layer.recurrent_states[0].clone() if layer.recurrent_states[0] is not None else None)
                           for layer in self._layers()])

    def restore(self, position: torch.Tensor) -> None:
        """Row r back to its snapshot number position[r] (accepted drafts: the anchor is number 0)."""
        rows = torch.arange(position.shape[0], device=position.device)
        for i, layer in enumerate(self._layers()):
            for which, states in ((0, layer.conv_states), (1, layer.recurrent_states)):
                if states[0] is not None:
                    taken = [snap[i][which] for snap in self.taken]
                    stacked = torch.stack([t for t in taken if t is not None])  # [bs, b, ...]
                    states[0].copy_(stacked[position.to(stacked.device), rows.to(stacked.device)])
        self.clear()
