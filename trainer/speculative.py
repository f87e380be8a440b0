"""Greedy speculative decoding with KV caches for target and drafter, many prompts at once.

Same algorithm and result as the uncached reference (`trainer.evaluate.speculative_generate`),
which re-runs the target on the whole sequence every round; here each round feeds only the
block (anchor + drafts) to the target and keeps what it accepted:

* Target: one Hugging Face `DynamicCache` for the batch. Every round appends the block's
  `block_size` entries for every row, marks the rejected ones invalid in a per-row key mask,
  and crops the cache to the longest accepted length (the DFlash reference crops to the
  accepted length; with a batch, rows accept different lengths, so shorter rows keep masked
  holes). The target sees an explicit 4D mask (key valid and not in the future) and explicit
  positions, so holes cost nothing but memory. A query always sees itself, so no softmax row
  is empty (left-padded prompts included).
* Drafter: the context K/V of each drafter layer depends only on the target features of that
  position, so it is computed once per accepted position and appended; a block then attends
  to [cached context | its own slots], exactly as `DFlashDrafter.draft_block`.
* Rows that finish (stop token or max_new_tokens) leave the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from trainer.drafter import DFlashDrafter, _rotate, rope_cos_sin
from trainer.target import FrozenHead


@dataclass
class Generation:
    tokens: list[int]  # generated tokens (prompt excluded)
    acceptance_lengths: list[int]  # tokens produced per verification round (accepted drafts + 1)
    accepted: list[int] = field(default_factory=list)  # drafts accepted per round (before any stop cut)


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean visibility mask as the additive float mask every attention implementation takes."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


class DrafterCache:
    """Per-layer context K/V of the drafter for a batch, with a validity mask over entries."""

    def __init__(self, drafter: DFlashDrafter, batch: int, device, dtype):
        c = drafter.config
        self.drafter = drafter
        self.keys = [torch.zeros(batch, c.num_key_value_heads, 0, c.head_dim, device=device, dtype=dtype)
                     for _ in drafter.layers]
        self.values = [k.clone() for k in self.keys]
        self.valid = torch.zeros(batch, 0, dtype=torch.bool, device=device)

    def append(self, features: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> None:
        """Add context entries: target features [B, T, n*H] at positions [B, T]."""
        d, c = self.drafter, self.drafter.config
        dtype = self.keys[0].dtype
        ctx = d.hidden_norm(d.fc(features.to(dtype)))
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta)
        b, t, _ = ctx.shape
        for i, layer in enumerate(d.layers):
            a = layer.self_attn
            k = a.k_norm(a.k_proj(ctx).view(b, t, a.kv_heads, a.head_dim)).transpose(1, 2)
            v = a.v_proj(ctx).view(b, t, a.kv_heads, a.head_dim).transpose(1, 2)
            self.keys[i] = torch.cat([self.keys[i], _rotate(k, cos, sin)], dim=2)
            self.values[i] = torch.cat([self.values[i], v], dim=2)
        self.valid = torch.cat([self.valid, valid], dim=1)

    def select(self, rows: torch.Tensor) -> None:
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]
        self.valid = self.valid[rows]

    def draft(self, block_embeds: torch.Tensor, block_positions: torch.Tensor) -> torch.Tensor:
        """Final hidden states [B, bs, H] of one block per row after the cached context."""
        d, c = self.drafter, self.drafter.config
        x = block_embeds.to(self.keys[0].dtype)
        b, t, _ = x.shape
        cos, sin = rope_cos_sin(block_positions, c.head_dim, c.rope_theta)
        visible = torch.cat([self.valid, torch.ones(b, t, dtype=torch.bool, device=x.device)], dim=1)
        mask = visible[:, None, None, :]
        for i, layer in enumerate(d.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = _rotate(a.q_norm(a.q_proj(h).view(b, t, a.heads, a.head_dim)).transpose(1, 2), cos, sin)
            k = _rotate(a.k_norm(a.k_proj(h).view(b, t, a.kv_heads, a.head_dim)).transpose(1, 2), cos, sin)
            v = a.v_proj(h).view(b, t, a.kv_heads, a.head_dim).transpose(1, 2)
            k = torch.cat([self.keys[i], k], dim=2)
            v = torch.cat([self.values[i], v], dim=2)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=a.kv_heads != a.heads)
            x = x + a.o_proj(out.transpose(1, 2).reshape(b, t, a.heads * a.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return d.norm(x)


def _crop(cache: DynamicCache, length: int) -> None:
    """Keep the first `length` entries. A negative argument (entries to remove) is what every
    transformers release accepts; 5.2x refuses a positive target length."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


def _features(hidden_states, layer_ids: list[int]) -> torch.Tensor:
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


@torch.no_grad()
def speculative_generate_cached(target, drafter: DFlashDrafter, head: FrozenHead, prompts: list[list[int]],
                                max_new_tokens: int, stop_ids: set[int]) -> list[Generation]:
    """Greedy speculative decoding of every prompt (a batch), with KV caches; see the module doc."""
    c = drafter.config
    bs, layer_ids = c.block_size, c.target_layer_ids
    tdev = next(target.parameters()).device
    ddev = head.embed_weight.device
    tdtype = next(target.parameters()).dtype
    ddtype = torch.get_autocast_dtype(ddev.type) if torch.is_autocast_enabled(ddev.type) else drafter.fc.weight.dtype
    n = len(prompts)
    longest = max(len(p) for p in prompts)

    # prefill, left-padded: cache index j of row r holds position j - pad_r
    pads = torch.tensor([longest - len(p) for p in prompts], device=tdev)
    ids = torch.zeros(n, longest, dtype=torch.long, device=tdev)
    for r, p in enumerate(prompts):
        ids[r, longest - len(p):] = torch.tensor(p, device=tdev)
    index = torch.arange(longest, device=tdev)
    key_valid = index[None, :] >= pads[:, None]  # [B, L]
    positions = (index[None, :] - pads[:, None]).clamp(min=0)
    cache = DynamicCache()
    causal = index[None, :, None] >= index[None, None, :]
    mask = (key_valid[:, None, :] & causal) | torch.eye(longest, dtype=torch.bool, device=tdev)[None]
    out = target(input_ids=ids, attention_mask=_additive(mask[:, None], tdtype), position_ids=positions,
                 past_key_values=cache, use_cache=True, output_hidden_states=True, logits_to_keep=1)
    first = out.logits[:, -1].argmax(dim=-1).tolist()
    dcache = DrafterCache(drafter, n, ddev, ddtype)
    dcache.append(_features(out.hidden_states, layer_ids).to(ddev), positions.to(ddev), key_valid.to(ddev))

    results = [Generation([first[r]], [], []) for r in range(n)]
    lengths = [len(p) + 1 for p in prompts]  # tokens in each sequence (prompt + generated)
    rows = [r for r in range(n) if not (first[r] in stop_ids or max_new_tokens <= 1)]
    if len(rows) < n:
        keep = torch.tensor(rows, device=tdev, dtype=torch.long)
        cache.batch_select_indices(keep)
        key_valid = key_valid[keep]
        dcache.select(keep.to(ddev))
    offsets = torch.arange(bs, device=tdev)
    while rows:
        b = len(rows)
        anchor_pos = torch.tensor([lengths[r] - 1 for r in rows], device=tdev)
        block = torch.full((b, bs), c.mask_token_id, dtype=torch.long, device=ddev)
        block[:, 0] = torch.tensor([results[r].tokens[-1] for r in rows], device=ddev)
        hidden = dcache.draft(head.embed(block), (anchor_pos[:, None] + offsets).to(ddev))
        drafts = head.logits(hidden[:, 1:]).argmax(dim=-1).to(tdev)  # [b, bs-1]

        verify = torch.cat([block[:, :1].to(tdev), drafts], dim=1)
        past = key_valid.shape[1]
        q_index = past + offsets
        visible = torch.cat([key_valid, torch.ones(b, bs, dtype=torch.bool, device=tdev)], dim=1)
        mask = visible[:, None, :] & (torch.arange(past + bs, device=tdev)[None, None, :] <= q_index[None, :, None])
        out = target(input_ids=verify, attention_mask=_additive(mask[:, None], tdtype),
                     position_ids=anchor_pos[:, None] + offsets, past_key_values=cache, use_cache=True,
                     output_hidden_states=True, logits_to_keep=bs)
        posterior = out.logits.argmax(dim=-1)  # [b, bs]: target's token for position anchor+k+1
        matches = (drafts == posterior[:, :-1]).long().cumprod(dim=1).sum(dim=1)  # accepted drafts per row
        accepted = matches.tolist()
        post, drf = posterior.tolist(), drafts.tolist()

        still = []
        for i, r in enumerate(rows):
            a = accepted[i]
            new = drf[i][:a] + [post[i][a]]
            for j, tok in enumerate(new):
                if tok in stop_ids:
                    new = new[: j + 1]
                    break
            new = new[: max_new_tokens - len(results[r].tokens)]
            g = results[r]
            g.tokens += new
            g.acceptance_lengths.append(len(new))
            g.accepted.append(a)
            lengths[r] += len(new)
            if not (g.tokens[-1] in stop_ids or len(g.tokens) >= max_new_tokens):
                still.append(i)
        if not still:
            break
        # entries anchor..anchor+a are now context; the rest of the block is rejected
        entry_valid = offsets[None, :] <= matches[:, None]  # [b, bs]
        keep_len = int(matches[still].max()) + 1
        _crop(cache, past + keep_len)
        key_valid = torch.cat([key_valid, entry_valid[:, :keep_len]], dim=1)
        feats = _features(out.hidden_states, layer_ids)[:, :keep_len]
        dcache.append(feats.to(ddev), (anchor_pos[:, None] + offsets[:keep_len]).to(ddev),
                      entry_valid[:, :keep_len].to(ddev))
        if len(still) < b:
            keep = torch.tensor(still, device=tdev, dtype=torch.long)
            cache.batch_select_indices(keep)
            key_valid = key_valid[keep]
            dcache.select(keep.to(ddev))
        rows = [rows[i] for i in still]
    return results
