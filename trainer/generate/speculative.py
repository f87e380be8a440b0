"""Speculative decoding with KV caches for target and drafter, many prompts at once, greedy or sampled.

Same algorithm and result as the uncached reference (`trainer.generate.evaluate.speculative_generate`),
which re-runs the target on the whole sequence every round; here each round feeds only the
block (anchor + drafts) to the target and keeps what it accepted. Two implementations, one result
(`speculative_generate_cached` picks one):

* Static (targets `trainer.models.decoder.supports`, with target and drafter on one device; what
  evaluation uses). Every buffer is allocated once: per-layer K/V of target and drafter
  [B, kv_heads, capacity, head_dim] and a per-row validity mask over the slots. All rows share
  one write pointer p: a round writes its block into slots p..p+bs-1 of every row, target and
  drafter alike (a drafter context entry is a function of the target's features at the same
  position), marks each row's rejected slots invalid and advances p by the longest accepted
  length (the reference crops the target cache to the accepted length; with a batch, shorter
  rows keep masked holes). Positions are explicit per row, so holes cost nothing but memory;
  when p would run past the capacity, each row's valid slots are packed to the front. A round is
  thus one computation of fixed shape on fixed buffers (drafter block, target verification of
  [B, bs], acceptance, the block's drafter context); on CUDA it is captured once as a CUDA graph
  and replayed every round (eager, a round is launch-bound: thousands of small kernels), and the
  host reads back only drafts, target tokens and accepted counts. Rows that finish stay in the
  batch, ignored. The target runs through the one target decoder (`trainer.models.decoder`: its
  own modules, the arithmetic of transformers' SDPA path), the drafter's context in a KVCache too.
* Dynamic (any other causal LM, or two devices): one Hugging Face `DynamicCache` for the batch.
  Every round appends the block's entries for every row, marks the rejected ones invalid in a
  per-row key mask and crops the cache to the longest accepted length; the target sees an
  explicit 4D mask and explicit positions. Rows that finish leave the batch.

In both, a query always sees itself, so no softmax row is empty (left-padded prompts included),
and the drafter's context K/V of a position is computed once, when it is accepted: a block then
attends to [cached context | its own slots], exactly as `DFlashDrafter.draft_block`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from trainer.generate.sampling import Noise, propose_sampled, reach, sample_next, verify
from trainer.generate.sampling_params import GREEDY, Sampling
from trainer.generate.slot_batch import prefill_layout
from trainer.models import decoder
from trainer.models.decoder import RecurrentStates
from trainer.models.drafter import Attention, DFlashDrafter, _rotate, rope_cos_sin, serving_attention
from trainer.models.hf import hf_config
from trainer.models.target import FrozenHead


@dataclass
class Generation:
    """One prompt's speculative decoding, round by round: what every decoder here returns (the cached
    ones, the uncached reference `trainer.generate.evaluate.speculative_generate`, n-gram lookup),
    greedy or sampled (trainer.generate.sampling)."""

    tokens: list[int]  # generated tokens (prompt excluded)
    acceptance_lengths: list[int]  # tokens produced per verification round (accepted drafts + 1)
    accepted: list[int] = field(default_factory=list)  # drafts accepted per round (before any stop cut)
    # per round, P(the round produces more than k tokens) for k = 1..drafts (trainer.generate.sampling.reach):
    # the expected length 1 + sum; at T = 0 exactly the produced length
    reach: list[list[float]] = field(default_factory=list)

    def add_round(self, new: list[int], accepted: int, stop_ids: set[int], max_new_tokens: int,
                  drafts: list[int], probs: list[float] | None = None) -> bool:
        """One verification round's tokens (the accepted drafts, then the target's own), cut after
        the first stop token and at max_new_tokens; drafts: the round's drafts, probs: each one's
        acceptance probability (None: greedy, 1 for the accepted ones and 0 after); whether the
        decoding goes on."""
        if probs is None:
            probs = [1.0] * accepted + [0.0] * (len(drafts) - accepted)
        limit = max_new_tokens - len(self.tokens)
        limit = min([limit] + [j for j, tok in enumerate(drafts, start=1) if tok in stop_ids])
        self.reach.append(reach(probs, limit))
        for j, tok in enumerate(new):
            if tok in stop_ids:
                new = new[: j + 1]
                break
        new = new[: max_new_tokens - len(self.tokens)]
        self.tokens += new
        self.acceptance_lengths.append(len(new))
        self.accepted.append(accepted)
        return not (self.tokens[-1] in stop_ids or len(self.tokens) >= max_new_tokens)

    @property
    def expected_lengths(self) -> list[float]:
        """Each round's expected length, 1 + sum of its reach."""
        return [1.0 + sum(r) for r in self.reach]


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean visibility mask as the additive float mask every attention implementation takes."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


def _draft_block(d: DFlashDrafter, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 keys: list[torch.Tensor], values: list[torch.Tensor], attends: list[Attention]) -> torch.Tensor:
    """The drafter's layers over one block x [B, bs, H], attending to each layer's cached context
    keys/values followed by the block itself, each layer under its own serving mask
    (trainer.models.drafter.serving_attention: its window and causality, its sinks)."""
    b, t, _ = x.shape
    for i, (layer, attend) in enumerate(zip(d.blocks(), attends, strict=True)):
        a, conv_a, conv_m = layer.self_attn, layer.attention_conv, layer.mlp_conv  # convolutions: DFlash2
        bs = layer.block_size
        h = layer.input_layernorm(x)
        if conv_a is not None:
            h, delta = conv_a.prepare(h, bs)
        q = _rotate(a.q_norm(a.q_proj(h).view(b, t, a.heads, a.head_dim)).transpose(1, 2), cos, sin)
        k = _rotate(a.k_norm(a.k_proj(h).view(b, t, a.kv_heads, a.head_dim)).transpose(1, 2), cos, sin)
        v = a.v_proj(h).view(b, t, a.kv_heads, a.head_dim).transpose(1, 2)
        k = torch.cat([keys[i], k], dim=2)
        v = torch.cat([values[i], v], dim=2)
        sink = a.attention_sink_bias
        out = attend(q, k, v) if sink is None else attend(q, k, v, sink=sink)
        out = a.o_proj(out.transpose(1, 2).reshape(b, t, a.heads * a.head_dim))
        x = x + (out if conv_a is None else conv_a.finish(out, delta, bs))
        h = layer.post_attention_layernorm(x)
        if conv_m is None:
            x = x + layer.mlp(h)
        else:
            h, delta = conv_m.prepare(h, bs)
            x = x + conv_m.finish(layer.mlp(h), delta, bs)
    return d.norm(x)


def _context_kv(drafter: DFlashDrafter, features: torch.Tensor, positions: torch.Tensor,
                dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The drafter's context K/V per layer [B, kv_heads, T, head_dim] of target features [B, T, n*H]
    at positions [B, T] (a context entry is a function of the target's features at its position)."""
    d, c = drafter, drafter.config
    ctx = d.hidden_norm(d.fc(features.to(dtype)))
    cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta)
    b, t, _ = ctx.shape
    out = []
    for layer in d.blocks():
        a = layer.self_attn
        k = a.k_norm(a.k_proj(ctx).view(b, t, a.kv_heads, a.head_dim)).transpose(1, 2)
        out.append((_rotate(k, cos, sin), a.v_proj(ctx).view(b, t, a.kv_heads, a.head_dim).transpose(1, 2)))
    return out


class DrafterCache:
    """Per-layer context K/V of the drafter for a batch, with a validity mask over entries."""

    def __init__(self, drafter: DFlashDrafter, batch: int, device: torch.device | str, dtype: torch.dtype) -> None:
        c = drafter.config
        self.drafter = drafter
        self.keys = [torch.zeros(batch, c.num_key_value_heads, 0, c.head_dim, device=device, dtype=dtype)
                     for _ in drafter.layers]
        self.values = [k.clone() for k in self.keys]
        self.valid = torch.zeros(batch, 0, dtype=torch.bool, device=device)
        self.positions = torch.zeros(batch, 0, dtype=torch.long, device=device)  # of each entry (sliding windows)

    def append(self, features: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> None:
        """Add context entries: target features [B, T, n*H] at positions [B, T]."""
        for i, (k, v) in enumerate(_context_kv(self.drafter, features, positions, self.keys[0].dtype)):
            self.keys[i] = torch.cat([self.keys[i], k], dim=2)
            self.values[i] = torch.cat([self.values[i], v], dim=2)
        self.valid = torch.cat([self.valid, valid], dim=1)
        self.positions = torch.cat([self.positions, positions.to(self.positions.device)], dim=1)

    def select(self, rows: torch.Tensor) -> None:
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]
        self.valid = self.valid[rows]
        self.positions = self.positions[rows]

    def draft(self, block_embeds: torch.Tensor, block_positions: torch.Tensor) -> torch.Tensor:
        """Final hidden states [B, bs, H] of one block per row after the cached context."""
        d, c = self.drafter, self.drafter.config
        x = block_embeds.to(self.keys[0].dtype)
        b, t, _ = x.shape
        cos, sin = rope_cos_sin(block_positions, c.head_dim, c.rope_theta)
        attends = serving_attention(c.layout.kinds(c.num_hidden_layers), self.valid, self.positions, block_positions)
        return _draft_block(d, x, cos, sin, self.keys, self.values, attends)


def _features(hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int]) -> torch.Tensor:
    last = hidden_states[-1].device  # a target split in stages leaves each layer's output on its device
    return torch.cat([hidden_states[i + 1].to(last) for i in layer_ids], dim=-1)


def static_supported(target: torch.nn.Module, drafter_device: torch.device | str) -> bool:
    """Whether the static implementation can run this target: the target decoder supports it
    (`trainer.models.decoder.supports`) and target and drafter share a device (a target split in
    stages over several devices decodes through the Hugging Face forward)."""
    return decoder.supports(target) and {p.device for p in target.parameters()} == {torch.device(drafter_device)}


class _StaticRounds:
    """The fixed buffers and the fixed-shape round of the static implementation."""

    def __init__(self, target: torch.nn.Module, drafter: DFlashDrafter, head: FrozenHead, batch: int, capacity: int,
                 ddtype: torch.dtype, sampling: Sampling, streams: list[int]) -> None:
        self.drafter, self.head, self.sampling = drafter, head, sampling
        self.decoder = decoder.TargetDecoder(target)
        c = drafter.config
        self.bs, self.layer_ids, self.capacity, self.ddtype = c.block_size, list(c.target_layer_ids), capacity, ddtype
        dev = self.dev = self.decoder.device
        self.noise = Noise.of(sampling.seed, streams, dev)
        self.target_cache = self.decoder.cache(batch, capacity)
        self.drafter_cache = decoder.KVCache(len(drafter.layers), batch, c.num_key_value_heads, capacity, c.head_dim,
                                             dev, ddtype)
        self.valid = torch.zeros(batch, capacity, dtype=torch.bool, device=dev)  # slot holds an accepted entry
        self.slot_pos = torch.zeros(batch, capacity, dtype=torch.long, device=dev)  # its position (sliding windows)
        self.slot = torch.arange(capacity, device=dev)
        self.offsets = torch.arange(self.bs, device=dev)
        self.block_visible = torch.ones(batch, self.bs, dtype=torch.bool, device=dev)
        self.masks = torch.full((batch, self.bs - 1), c.mask_token_id, dtype=torch.long, device=dev)
        # the round's inputs: write pointer, each row's anchor token and its position
        self.start = torch.zeros((), dtype=torch.long, device=dev)
        self.anchor_token = torch.zeros(batch, dtype=torch.long, device=dev)
        self.anchor_pos = torch.zeros(batch, dtype=torch.long, device=dev)

    # ---------------------------------------------------------------- the two models on the buffers
    def _target(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, visible: torch.Tensor,
                last_only: bool, expand_kv: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Target decoder on ids [B, T] at positions [B, T] (trainer.models.decoder); returns (logits,
        features [B, T, n*H])."""
        logits, kept = self.decoder.forward(ids, positions, self.target_cache, slots, visible, keep=self.layer_ids,
                                            last_only=last_only, expand_kv=expand_kv)
        return logits, torch.cat(kept, dim=-1)

    def _context(self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """The drafter's context K/V of target features [B, T, n*H] at positions [B, T], written at slots [T]."""
        for i, (k, v) in enumerate(_context_kv(self.drafter, features, positions, self.ddtype)):
            self.drafter_cache.write(i, slots, k, v)
        self.slot_pos.index_copy_(1, slots, positions)

    def _draft(self, block: torch.Tensor, positions: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """Drafter hidden states [B, bs, H] of the block ids [B, bs] after the visible context slots."""
        c = self.drafter.config
        x = self.drafter.embed_block(self.head.embed, block).to(self.ddtype)
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta)
        attends = serving_attention(c.layout.kinds(c.num_hidden_layers), context, self.slot_pos, positions)
        return _draft_block(self.drafter, x, cos, sin, self.drafter_cache.keys, self.drafter_cache.values, attends)

    # ---------------------------------------------------------------- prefill, rounds, bookkeeping
    def prefill(self, prompts: list[list[int]]) -> list[int]:
        """Left-padded prompts into slots 0..L-1 (slot j of row r = position j - pad_r); the first tokens."""
        dev, longest = self.dev, max(len(p) for p in prompts)
        ids, positions, index, visible, key_valid = prefill_layout(prompts, self.capacity, dev)
        logits, features = self._target(ids, positions, index, visible, last_only=True,
                                        expand_kv=dev.type == "cuda")  # long prompts: no score matrix
        self._context(features, positions, index)
        self.valid[:, :longest] = key_valid
        lengths = torch.tensor([len(p) for p in prompts], device=dev)
        first = sample_next(logits[:, -1], self.sampling, self.noise, lengths)
        self.anchor_token.copy_(first)
        self.anchor_pos.copy_(lengths)
        return first.tolist()

    def round(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One round at write pointer `start`: ([B, bs + 1] = drafts (bs-1) | the round's own token |
        accepted drafts, [B, bs-1] each draft's acceptance probability). Fixed shapes, no host sync,
        writes only slots start..start+bs-1: what a CUDA graph captures (the target cache's
        snapshot/restore hooks included; the noise is a function of its inputs)."""
        slots = self.start + self.offsets
        positions = self.anchor_pos[:, None] + self.offsets
        context = self.valid & (self.slot < self.start)  # [B, capacity]: accepted entries before the block
        block = torch.cat([self.anchor_token[:, None], self.masks], dim=1)
        drafts, proposal = propose_sampled(self.drafter, self.head.logits, self._draft(block, positions, context)[:, 1:],
                                           self.anchor_token, self.sampling, self.noise, positions[:, 1:])
        drafts = drafts.to(block.device)
        in_block = (self.slot[None, :] >= self.start) & (self.slot[None, :] <= slots[:, None])  # [bs, capacity]
        snapshot = self.target_cache.snapshot()
        logits, features = self._target(torch.cat([block[:, :1], drafts], dim=1), positions, slots,
                                        context[:, None, :] | in_block[None], last_only=False)
        verdict = verify(logits, drafts, self.sampling, self.noise, self.anchor_pos, proposal)
        accepted = verdict.accepted
        self.target_cache.restore(snapshot, accepted)
        self._context(features, positions, slots)
        return torch.cat([drafts, verdict.token[:, None], accepted[:, None]], dim=1), verdict.probs

    def advance(self, start: int, result: torch.Tensor) -> None:
        """After a round at `start`: the block's accepted slots become context; the next anchors."""
        bs = self.bs
        accepted = result[:, -1]
        self.valid[:, start:start + bs] = self.offsets[None, :] <= accepted[:, None]
        self.anchor_token.copy_(result[:, bs - 1])
        self.anchor_pos += accepted + 1

    def compact(self, live: list[int], used: int) -> int:
        """Pack each live row's valid slots (of the first `used`) to the front, in order; the new pointer."""
        valid = self.valid[:, :used].clone()
        finished = torch.ones(valid.shape[0], dtype=torch.bool, device=self.dev)
        finished[live] = False
        valid[finished] = False
        order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices
        counts = valid.sum(dim=1)
        packed = int(counts.max())
        self.target_cache.compact(order, packed, used)
        self.drafter_cache.compact(order, packed, used)
        self.slot_pos[:, :packed] = self.slot_pos[:, :used].gather(1, order[:, :packed])
        self.valid.zero_()
        self.valid[:, :packed] = self.slot[None, :packed] < counts[:, None]
        return packed

    def capture(self) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """The round as a CUDA graph (warmed on a side stream first); returns a replaying callable."""
        stream = torch.cuda.Stream(self.dev)
        stream.wait_stream(torch.cuda.current_stream(self.dev))
        with torch.cuda.stream(stream):
            for _ in range(2):  # rounds write only their own block's slots: repeating one is harmless
                self.round()
        torch.cuda.current_stream(self.dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self.round()

        def replay() -> tuple[torch.Tensor, torch.Tensor]:
            graph.replay()
            return out

        return replay


def _generate_static(target: torch.nn.Module, drafter: DFlashDrafter, head: FrozenHead, prompts: list[list[int]],
                     max_new_tokens: int, stop_ids: set[int], cuda_graph: bool | None, capacity: int | None,
                     ddtype: torch.dtype, info: dict, sampling: Sampling, streams: list[int]) -> list[Generation]:
    bs, n = drafter.config.block_size, len(prompts)
    longest = max(len(p) for p in prompts)
    need = longest + max_new_tokens + bs
    capacity = capacity or -(-(need + 3 * bs) // 16) * 16
    if capacity < need:
        raise ValueError(f"capacity {capacity} < longest prompt + max_new_tokens + block_size = {need}")
    s = _StaticRounds(target, drafter, head, n, capacity, ddtype, sampling, streams)
    first = s.prefill(prompts)
    results = [Generation([first[r]], [], []) for r in range(n)]
    live = [r for r in range(n) if not (first[r] in stop_ids or max_new_tokens <= 1)]
    use_graph = s.dev.type == "cuda" and cuda_graph is not False and not torch.is_autocast_enabled("cuda")
    info.update(implementation="static", capacity=capacity, cuda_graph=False, compactions=0)
    step, used = s.round, longest
    while live:
        if used + bs > capacity:
            used = s.compact(live, used)
            info["compactions"] += 1
        s.start.fill_(used)
        if use_graph:
            use_graph = False
            try:
                step = s.capture()
                info["cuda_graph"] = True
            except Exception as exc:  # capture is an optimisation: the eager round gives the same result
                if cuda_graph:
                    raise
                info["cuda_graph_error"] = f"{type(exc).__name__}: {exc}"
        result, probs = step()
        rows, row_probs = result.tolist(), probs.tolist()
        still = []
        for r in live:
            row = rows[r]
            a = row[-1]  # accepted drafts, then the round's own token:
            if results[r].add_round(row[:a] + [row[bs - 1]], a, stop_ids, max_new_tokens, row[:bs - 1], row_probs[r]):
                still.append(r)
        if not still:
            break
        s.advance(used, result)
        used += max(rows[r][-1] for r in still) + 1
        live = still
    return results

def cache_arg(target: torch.nn.Module) -> str:
    """The name a transformers model's forward takes its KV cache by: transformers 5.2x renamed
    past_key_values to cache (the old name warns, and goes in 5.40); the floors know only the old."""
    return "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"


class _HFTarget:
    """A transformers causal LM decoded on its own cache (a `DynamicCache`), for any family.

    Attention layers keep every entry (rejected ones are masked, then cropped); each query sees
    the entries its row's mask allows, sliding-window layers only those within the window of its
    position. Linear-attention layers (Qwen3.5, Qwen3-Next) carry a recurrent state that cannot be
    cropped: a verification block runs one token at a time, the states after every position are
    kept (`RecurrentStates`), and each row is put back to the state after its last accepted token."""

    def __init__(self, target: torch.nn.Module) -> None:
        from trainer.models.target import target_family

        self.target = target
        fam = target_family(target)
        self.kinds = sorted(set(fam.layer_kinds))
        self.window = fam.sliding_window
        self.dtype = next(target.parameters()).dtype
        self.recurrent = "linear_attention" in self.kinds
        # with a config, transformers gives sliding layers a window-sized cache (our masks need every
        # entry); only linear-attention layers need their own cache layers from it
        self.cache = DynamicCache(config=hf_config(target)) if self.recurrent else DynamicCache()
        self.states = RecurrentStates(self.cache)
        self.cache_arg = cache_arg(target)

    def masks(self, visible: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
              padding: torch.Tensor | None = None) -> dict | torch.Tensor:
        """visible [b, q, k] bool -> the model's attention_mask argument: one additive mask, or
        {layer kind: mask} (sliding: within the window; linear attention: the 2D padding mask)."""
        masks: dict[str, torch.Tensor | None] = {}
        for kind in self.kinds:
            if kind == "linear_attention":
                masks[kind] = None if padding is None else padding.to(self.dtype)
            elif kind == "sliding_attention" and self.window:
                near = (q_pos[:, :, None] - k_pos[:, None, :]) < self.window
                masks[kind] = _additive((visible & near)[:, None], self.dtype)
            else:
                masks[kind] = _additive(visible[:, None], self.dtype)
        return masks if len(masks) > 1 else next(iter(masks.values()))  # type: ignore[return-value]

    def forward(self, ids: torch.Tensor, mask: dict | torch.Tensor, positions: torch.Tensor, keep: int) -> Any:
        return self.target(input_ids=ids, attention_mask=mask, position_ids=positions, **{self.cache_arg: self.cache},
                           use_cache=True, output_hidden_states=True, logits_to_keep=keep)

    def crop(self, length: int) -> None:
        """Keep the first `length` entries of every attention layer (linear layers: see `RecurrentStates`)."""
        for layer in self.cache.layers:
            keys = getattr(layer, "keys", None)
            if not self.states.is_recurrent(layer) and keys is not None:
                remove = keys.shape[-2] - length
                if remove > 0:
                    getattr(layer, "crop")(-remove)  # noqa: B009 - an attention layer's own crop

    def select(self, rows: torch.Tensor) -> None:
        for layer in self.cache.layers:
            if self.states.is_recurrent(layer):
                getattr(layer, "reorder_cache")(rows)  # noqa: B009 - linear layers select rows by reordering
            else:
                getattr(layer, "batch_select_indices")(rows)  # noqa: B009


def _generate_dynamic(target: torch.nn.Module, drafter: DFlashDrafter, head: FrozenHead, prompts: list[list[int]],
                      max_new_tokens: int, stop_ids: set[int], sampling: Sampling,
                      streams: list[int]) -> list[Generation]:
    """The general decoder (any Hugging Face causal LM): a growing `DynamicCache`, rows leave the batch."""
    c = drafter.config
    bs, layer_ids = c.block_size, c.target_layer_ids
    tdev = next(target.parameters()).device
    ddev = head.embed_weight.device
    ddtype = torch.get_autocast_dtype(ddev.type) if torch.is_autocast_enabled(ddev.type) else drafter.fc.weight.dtype
    n = len(prompts)
    hf = _HFTarget(target)

    # prefill, left-padded: cache index j of row r holds position j - pad_r (the cache as long as the prompts)
    ids, positions, _, mask, key_valid = prefill_layout(prompts, max(len(p) for p in prompts), tdev)
    key_pos = positions.clone()  # position of every cache entry, per row
    padded = None if bool(key_valid.all()) else key_valid  # linear attention: zeroed padding leaves the state at 0
    out = hf.forward(ids, hf.masks(mask, positions, positions, padded), positions, keep=1)
    noise = Noise.of(sampling.seed, streams, tdev)
    first = sample_next(out.logits[:, -1], sampling, noise,
                        torch.tensor([len(p) for p in prompts], device=tdev)).tolist()
    dcache = DrafterCache(drafter, n, ddev, ddtype)
    dcache.append(_features(out.hidden_states, layer_ids).to(ddev), positions.to(ddev), key_valid.to(ddev))

    results = [Generation([first[r]], [], []) for r in range(n)]
    lengths = [len(p) + 1 for p in prompts]  # tokens in each sequence (prompt + generated)
    rows = [r for r in range(n) if not (first[r] in stop_ids or max_new_tokens <= 1)]
    if len(rows) < n:
        keep = torch.tensor(rows, device=tdev, dtype=torch.long)
        hf.select(keep)
        key_valid, key_pos = key_valid[keep], key_pos[keep]
        dcache.select(keep.to(ddev))
        noise = noise.select(keep)
    offsets = torch.arange(bs, device=tdev)
    while rows:
        b = len(rows)
        anchor_pos = torch.tensor([lengths[r] - 1 for r in rows], device=tdev)
        block = torch.full((b, bs), c.mask_token_id, dtype=torch.long, device=ddev)
        block[:, 0] = torch.tensor([results[r].tokens[-1] for r in rows], device=ddev)
        hidden = dcache.draft(drafter.embed_block(head.embed, block), (anchor_pos[:, None] + offsets).to(ddev))
        drafts, proposal = propose_sampled(drafter, head.logits, hidden[:, 1:], block[:, 0], sampling, noise.to(ddev),
                                           (anchor_pos[:, None] + offsets[1:]).to(ddev))
        drafts = drafts.to(tdev)  # [b, bs-1]

        checked = torch.cat([block[:, :1].to(tdev), drafts], dim=1)
        past = key_valid.shape[1]
        q_index = past + offsets
        q_pos = anchor_pos[:, None] + offsets
        visible = torch.cat([key_valid, torch.ones(b, bs, dtype=torch.bool, device=tdev)], dim=1)
        mask = visible[:, None, :] & (torch.arange(past + bs, device=tdev)[None, None, :] <= q_index[None, :, None])
        all_pos = torch.cat([key_pos, q_pos], dim=1)
        if hf.recurrent:  # one position at a time, keeping the linear layers' state after each
            steps = []
            for t in range(bs):
                steps.append(hf.forward(checked[:, t:t + 1], hf.masks(mask[:, t:t + 1, :past + t + 1], q_pos[:, t:t + 1],
                                                                      all_pos[:, :past + t + 1]),
                                        q_pos[:, t:t + 1], keep=1))
                hf.states.snapshot()
            logits = torch.cat([s.logits for s in steps], dim=1)
            hidden_states = tuple(torch.cat(h, dim=1) for h in zip(*(s.hidden_states for s in steps)))
        else:
            out = hf.forward(checked, hf.masks(mask, q_pos, all_pos), q_pos, keep=bs)
            logits, hidden_states = out.logits, out.hidden_states
        verdict = verify(logits, drafts, sampling, noise, anchor_pos, None if proposal is None else proposal.to(tdev))
        matches = verdict.accepted  # accepted drafts per row
        accepted, own = matches.tolist(), verdict.token.tolist()
        drf, probs = drafts.tolist(), verdict.probs.tolist()

        still = []
        for i, r in enumerate(rows):
            a = accepted[i]
            going = results[r].add_round(drf[i][:a] + [own[i]], a, stop_ids, max_new_tokens, drf[i], probs[i])
            lengths[r] = len(prompts[r]) + len(results[r].tokens)
            if going:
                still.append(i)
        if not still:
            break
        # entries anchor..anchor+a are now context; the rest of the block is rejected
        if hf.recurrent:
            hf.states.restore(matches)
        entry_valid = offsets[None, :] <= matches[:, None]  # [b, bs]
        keep_len = int(matches[still].max()) + 1
        hf.crop(past + keep_len)
        key_valid = torch.cat([key_valid, entry_valid[:, :keep_len]], dim=1)
        key_pos = torch.cat([key_pos, q_pos[:, :keep_len]], dim=1)
        feats = _features(hidden_states, layer_ids)[:, :keep_len]
        dcache.append(feats.to(ddev), q_pos[:, :keep_len].to(ddev), entry_valid[:, :keep_len].to(ddev))
        if len(still) < b:
            keep = torch.tensor(still, device=tdev, dtype=torch.long)
            hf.select(keep)
            key_valid, key_pos = key_valid[keep], key_pos[keep]
            dcache.select(keep.to(ddev))
            noise = noise.select(keep)
        rows = [rows[i] for i in still]
    return results


@torch.no_grad()
def speculative_generate_cached(target: torch.nn.Module, drafter: DFlashDrafter, head: FrozenHead, prompts: list[list[int]],
                                max_new_tokens: int, stop_ids: set[int], *, cuda_graph: bool | None = None,
                                capacity: int | None = None, implementation: str = "auto",
                                info: dict | None = None, sampling: Sampling = GREEDY,
                                streams: list[int] | None = None) -> list[Generation]:
    """Speculative decoding of every prompt (one batch), with KV caches; see the module doc.

    sampling: greedy (the default) or the engine's sampling and accept rule (trainer.generate.sampling);
    streams: each prompt's noise stream (default 0..n-1; give the prompts' indices among all those
    evaluated, and a prompt decodes the same whatever batch it is in).

    implementation: auto (static where `static_supported`, else dynamic) | static | dynamic.
    cuda_graph (static on CUDA): None = capture the round, falling back to eager rounds if capture
    fails; True = capture or raise; False = eager. capacity: cache slots per row (static; default
    the longest prompt + max_new_tokens + 4 blocks, rounded up to 16). info, when given, receives
    what ran (implementation, cuda_graph, capacity, compactions)."""
    info = {} if info is None else info
    streams = list(range(len(prompts))) if streams is None else list(streams)
    if len(streams) != len(prompts):
        raise ValueError(f"{len(streams)} noise streams for {len(prompts)} prompts")
    ddev = head.embed_weight.device
    ddtype = torch.get_autocast_dtype(ddev.type) if torch.is_autocast_enabled(ddev.type) else drafter.fc.weight.dtype
    if implementation not in ("auto", "static", "dynamic"):
        raise ValueError(f"implementation must be auto, static or dynamic, not {implementation!r}")
    if implementation == "static" or (implementation == "auto" and static_supported(target, ddev)):
        return _generate_static(target, drafter, head, prompts, max_new_tokens, stop_ids, cuda_graph, capacity,
                                ddtype, info, sampling, streams)
    info.update(implementation="dynamic", cuda_graph=False)
    return _generate_dynamic(target, drafter, head, prompts, max_new_tokens, stop_ids, sampling, streams)
