"""The target drafting for itself: the τ a drafter of this block size reaches at best, at a temperature.

A DFlash drafter proposes its block as argmax drafts (vLLM's `draft_probs is None`,
trainer.generate.sampling), and the engine accepts draft j with probability p(x_j) given the anchor
and the drafts before it. The best block a drafter can learn to propose is what the target itself
would say greedily from the anchor: its greedy chain d_1 .. d_L, whose round produces
1 + sum_k prod_{j<=k} p(d_j) tokens on average. At T = 0 every draft is accepted (the ceiling is
the block size); at a temperature the ceiling is the target's own confidence along its chain,
which no training of the drafter can raise: a target that spreads its mass (high entropy at T)
caps every drafter's τ, and its ratio to n-gram lookup, however good the drafter.

(The greedy chain maximises each factor in turn; a proposal that gives up a little at one
position to gain more later could do slightly better, so this is the ceiling of drafters that
predict the target's most likely continuation, which is what every DFlash objective trains.)

It bounds argmax proposals only, the engine's default. With vLLM's `draft_sample_method:
probabilistic` the drafts are sampled from the draft's distribution q and accepted with
min(1, p/q): a draft whose first slot's q is the target's own p is accepted there always, at any
temperature, where an argmax draft is accepted with max p. Nothing here bounds those; measure them
with `python -m trainer eval --draft-sample-method probabilistic`.

Decoded like every decoder here: the same engine accept rule and noise (a prompt's tokens do not
depend on its batch), rounds of `block_size - 1` drafts: on the target decoder's slot-addressed cache as
n-gram lookup decodes (trainer.generate.slot_batch; the families the decoder runs, on one device), else
through the Hugging Face forward (any causal LM): its KV cache carried from round to round with the
rejected drafts masked (`_Chains`), or, for targets with sliding-window or linear-attention layers, each
round prefilled anew. A reference, not a serving path: a round is `block_size` one-token forwards.
"""

from __future__ import annotations

from typing import Literal

import torch

from trainer.generate.sampling import Noise, sample_next, verify
from trainer.generate.sampling_params import GREEDY, Sampling
from trainer.generate.slot_batch import SlotBatch
from trainer.generate.speculative import Generation, cache_arg
from trainer.models import decoder

Cache = Literal["slots", "carried", "anew"]  # how self_draft_generate keeps the target's cache between rounds


def _left_padded(rows: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids, attention mask and positions [B, longest] of token rows, padded on the left."""
    longest = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (longest - len(r)) + r for r in rows], device=device)
    mask = torch.tensor([[0] * (longest - len(r)) + [1] * len(r) for r in rows], device=device)
    return ids, mask, (mask.cumsum(dim=-1) - 1).clamp(min=0)


class _Chains:
    """The rows' KV cache, carried from round to round: prefilled once with the prompts, then each round
    appends the anchor and the chain (one forward a token, every row at once) and masks the drafts the
    round rejected, so a round costs `width + 1` one-token forwards and no prefill. Positions are explicit,
    so a masked entry is never seen and moves nothing where every layer is full attention (a sliding window
    counts entries, linear attention folds them into its state: such targets take the same rounds prefilled
    anew, `greedy_chain`)."""

    def __init__(self, target: torch.nn.Module, prompts: list[list[int]]) -> None:
        from transformers import DynamicCache

        self.target, self.cache, self.arg = target, DynamicCache(), cache_arg(target)
        ids, self.mask, positions = _left_padded(prompts, next(target.parameters()).device)
        self.logits = target(input_ids=ids, attention_mask=self.mask, position_ids=positions, use_cache=True,
                             logits_to_keep=1, **{self.arg: self.cache}).logits[:, -1].float()

    def chain(self, anchors: torch.Tensor, positions: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's greedy chain of `width` tokens after its anchor [B] at positions [B], and the logits
        [B, width + 1, V] (fp32) at the anchor and at each chain token."""
        token, logits, chain = anchors, [], []
        self.width = width
        for k in range(width + 1):
            self.mask = torch.cat([self.mask, self.mask.new_ones(len(token), 1)], dim=1)
            out = self.target(input_ids=token[:, None], attention_mask=self.mask, position_ids=(positions + k)[:, None],
                              use_cache=True, **{self.arg: self.cache})
            logits.append(out.logits[:, -1].float())
            if k < width:
                token = logits[-1].argmax(dim=-1)
                chain.append(token)
        return torch.stack(chain, dim=1), torch.stack(logits, dim=1)

    def keep(self, accepted: torch.Tensor, still: list[int]) -> None:
        """After a round: each row keeps its anchor and its accepted drafts [B]; the rest of the chain is masked
        (`still`, the rows decoding on, matters only to _SlotChains' pointer)."""
        drafts = torch.arange(1, self.width + 1, device=accepted.device)
        self.mask[:, -self.width:] = (drafts[None, :] <= accepted[:, None]).to(self.mask.dtype)


class _SlotChains:
    """_Chains' rounds on the target decoder's slot-addressed cache (trainer.generate.slot_batch), as n-gram
    lookup decodes: each token's entry written at the shared pointer, none concatenated (the Hugging Face
    cache copies itself at every one-token forward), kept slots packed to the front when a round would not fit."""

    def __init__(self, target: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int, block_size: int):
        self.batch = SlotBatch(target, prompts, max_new_tokens, block_size)
        self.logits = self.batch.logits.float()

    def chain(self, anchors: torch.Tensor, positions: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        token, logits, chain = anchors, [], []
        for k in range(width + 1):
            logits.append(self.batch.forward(token[:, None], positions, at=k)[:, -1].float())
            if k < width:
                token = logits[-1].argmax(dim=-1)
                chain.append(token)
        return torch.stack(chain, dim=1), torch.stack(logits, dim=1)

    def keep(self, accepted: torch.Tensor, still: list[int]) -> None:
        self.batch.keep(accepted, still)
        self.batch.make_room(still)


def _every_layer_full_attention(target: torch.nn.Module) -> bool:
    """Whether a masked cache entry is never seen: every layer full attention (a sliding window counts entries,
    masked or not; linear attention folds every token into its state). The target's Family, as the cached
    decoders read it."""
    from trainer.models.target import target_family

    try:
        return set(target_family(target).layer_kinds) == {"full_attention"}
    except (AttributeError, KeyError, TypeError):  # no transformers config: each round prefilled anew (any causal LM)
        return False


def greedy_chain(target: torch.nn.Module, rows: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's greedy continuation of each row (at least 2 tokens), `width` tokens [B, width], and its logits
    [B, width + 1, V] (fp32) at each row's last token and at each chain token: what a verification of that chain
    sees. The rows are prefilled anew (any causal LM)."""
    device = next(target.parameters()).device
    chains = _Chains(target, [r[:-1] for r in rows])
    return chains.chain(torch.tensor([r[-1] for r in rows], device=device),
                        torch.tensor([len(r) - 1 for r in rows], device=device), width)


@torch.no_grad()
def self_draft_generate(target: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int, stop_ids: set[int],
                        block_size: int, sampling: Sampling = GREEDY, streams: list[int] | None = None,
                        cache: Cache | None = None) -> list[Generation]:
    """Decoding of every prompt with the target's own greedy chain as each round's `block_size - 1` drafts
    (see the module doc); sampling and streams as trainer.generate.lookup.lookup_generate. Rows that have
    ended ride along to the end of the batch (their outputs unused). cache: "slots" (the target decoder's
    slot-addressed cache, as lookup decodes), "carried" (the Hugging Face forward's cache carried from round
    to round, `_Chains`) or "anew" (each round prefilled); None: the first of them the target allows."""
    streams = list(range(len(prompts))) if streams is None else list(streams)
    device = next(target.parameters()).device
    noise = Noise.of(sampling.seed, streams, device)
    width = block_size - 1
    cache = cache or _cache_for(target)
    chains = (_SlotChains(target, prompts, max_new_tokens, block_size) if cache == "slots"
              else _Chains(target, prompts))
    positions = torch.tensor([len(p) for p in prompts], device=device)  # each row's anchor position
    anchors = sample_next(chains.logits, sampling, noise, positions)
    first = anchors.tolist()
    results = [Generation([first[r]], [], []) for r in range(len(prompts))]
    live = [r for r in range(len(prompts)) if not (first[r] in stop_ids or max_new_tokens <= 1)]
    seqs = [list(p) + [first[r]] for r, p in enumerate(prompts)]
    while live:
        if cache == "anew":
            chain, logits = greedy_chain(target, seqs, width)
        else:
            chain, logits = chains.chain(anchors, positions, width)
        verdict = verify(logits, chain, sampling, noise, positions)
        drafts, accepted, own, probs = (chain.tolist(), verdict.accepted.tolist(), verdict.token.tolist(),
                                        verdict.probs.tolist())
        still = []
        for r in live:
            new = drafts[r][:accepted[r]] + [own[r]]
            if results[r].add_round(new, accepted[r], stop_ids, max_new_tokens, drafts[r], probs[r]):
                still.append(r)
            seqs[r] += new
        if cache != "anew":
            chains.keep(verdict.accepted, still)
        positions = positions + verdict.accepted + 1
        anchors = verdict.token
        live = still
    return results


def _cache_for(target: torch.nn.Module) -> Cache:
    """The fastest way the target allows: the decoder's slots (one device, a family it runs), else the carried
    Hugging Face cache where every layer is full attention, else rounds prefilled anew."""
    if decoder.supports(target) and len({p.device for p in target.parameters()}) == 1:
        return "slots"
    return "carried" if _every_layer_full_attention(target) else "anew"
