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

Decoded like every decoder here: the same engine accept rule and noise (a prompt's tokens do not
depend on its batch), rounds of `block_size - 1` drafts, the Hugging Face forward with its own
KV cache for the chain (any causal LM; each round prefills its rows anew: a reference, not a
serving path).
"""

from __future__ import annotations

import torch

from trainer.generate.sampling import Noise, sample_next, verify
from trainer.generate.sampling_params import GREEDY, Sampling
from trainer.generate.speculative import Generation, cache_arg


def _left_padded(rows: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids, attention mask and positions [B, longest] of token rows, padded on the left."""
    longest = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (longest - len(r)) + r for r in rows], device=device)
    mask = torch.tensor([[0] * (longest - len(r)) + [1] * len(r) for r in rows], device=device)
    return ids, mask, (mask.cumsum(dim=-1) - 1).clamp(min=0)


def greedy_chain(target: torch.nn.Module, rows: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's greedy continuation of each row, `width` tokens [B, width], and its logits [B, width + 1, V]
    (fp32) at each row's last token and at each chain token: the logits a verification of that chain sees."""
    device = next(target.parameters()).device
    ids, mask, positions = _left_padded(rows, device)
    out = target(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
    logits = [out.logits[:, -1].float()]
    position = positions[:, -1:]
    chain = []
    for _ in range(width):
        token = logits[-1].argmax(dim=-1)
        chain.append(token)
        mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)
        position = position + 1
        out = target(input_ids=token[:, None], attention_mask=mask, position_ids=position,
                     **{cache_arg(target): out.past_key_values}, use_cache=True)
        logits.append(out.logits[:, -1].float())
    return torch.stack(chain, dim=1), torch.stack(logits, dim=1)


@torch.no_grad()
def self_draft_generate(target: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int, stop_ids: set[int],
                        block_size: int, sampling: Sampling = GREEDY,
                        streams: list[int] | None = None) -> list[Generation]:
    """Decoding of every prompt with the target's own greedy chain as each round's `block_size - 1` drafts
    (see the module doc); sampling and streams as trainer.generate.lookup.lookup_generate."""
    streams = list(range(len(prompts))) if streams is None else list(streams)
    device = next(target.parameters()).device
    noise = Noise.of(sampling.seed, streams, device)
    ids, mask, positions = _left_padded(prompts, device)
    logits = target(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False,
                    logits_to_keep=1).logits[:, -1]
    first = sample_next(logits, sampling, noise, torch.tensor([len(p) for p in prompts], device=device)).tolist()
    results = [Generation([first[r]], [], []) for r in range(len(prompts))]
    seqs = [list(p) + [first[r]] for r, p in enumerate(prompts)]
    live = [r for r in range(len(prompts)) if not (first[r] in stop_ids or max_new_tokens <= 1)]
    while live:
        chain, chain_logits = greedy_chain(target, [seqs[r] for r in live], block_size - 1)
        rows = torch.tensor(live, device=device)
        anchors = torch.tensor([len(seqs[r]) - 1 for r in live], device=device)
        verdict = verify(chain_logits, chain, sampling, noise.select(rows), anchors)
        drafts, accepted, own, probs = (chain.tolist(), verdict.accepted.tolist(), verdict.token.tolist(),
                                        verdict.probs.tolist())
        still = []
        for i, r in enumerate(live):
            new = drafts[i][:accepted[i]] + [own[i]]
            if results[r].add_round(new, accepted[i], stop_ids, max_new_tokens, drafts[i], probs[i]):
                still.append(r)
            seqs[r] += new
        live = still
    return results
