"""N-gram prompt lookup: the training-free baseline every τ is shown beside.

What vLLM (`method: ngram`) and SGLang ship and what costs no GPU hour: the last 3 tokens of the
sequence (prompt + generated), else the last 2, else the last 1, are looked up at their earliest
occurrence in the sequence (vLLM's rule: the longest n-gram, its earliest position); the up to `block_size - 1` tokens that followed it are the
drafts. The target verifies them exactly as it verifies a DFlash block (greedy: the matching
prefix plus the target's own next token are kept, so the output is the target's greedy output; at
a temperature: the engine's rule for argmax proposals, trainer.generate.sampling, vLLM's
`draft_probs is None`), and τ (tokens per verification round) is directly comparable with the
drafter's. A round with no match verifies the anchor alone and produces one token.

The target runs through the one target decoder (`trainer.models.decoder`) on a slot-addressed
KV cache (`trainer.generate.slot_batch`), the whole batch at once, each round a fixed [B, block_size]
verification (rows with fewer drafts pad their block; padding is never accepted). Targets the decoder does
not support are verified by the Hugging Face forward on the whole sequence (no cache: slower, same tokens).
"""

from __future__ import annotations

import torch

from trainer.generate.sampling import Noise, sample_next, verify
from trainer.generate.sampling_params import GREEDY, Sampling
from trainer.generate.slot_batch import SlotBatch
from trainer.generate.speculative import Generation
from trainer.models import decoder

NGRAMS = (3, 2, 1)


def lookup_drafts(seq: list[int], k: int, ngrams: tuple[int, ...] = NGRAMS) -> list[int]:
    """Up to k tokens that followed the earliest occurrence of the sequence's last n tokens (not the
    tail itself), for the first n in `ngrams` that occurs; [] when none does."""
    for n in ngrams:
        if len(seq) <= n:
            continue
        tail = seq[-n:]
        for start in range(len(seq) - n):
            if seq[start:start + n] == tail:
                return seq[start + n:start + n + k]
    return []


@torch.no_grad()
def lookup_generate(target: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int, stop_ids: set[int],
                    block_size: int, sampling: Sampling = GREEDY, streams: list[int] | None = None) -> list[Generation]:
    """Decoding of every prompt with n-gram prompt lookup drafts (see the module doc); sampling and
    streams as trainer.generate.speculative.speculative_generate_cached."""
    streams = list(range(len(prompts))) if streams is None else list(streams)
    if not decoder.supports(target) or len({p.device for p in target.parameters()}) != 1:
        return [_lookup_uncached(target, p, max_new_tokens, stop_ids, block_size, sampling, stream)
                for p, stream in zip(prompts, streams, strict=True)]
    b = SlotBatch(target, prompts, max_new_tokens, block_size)
    dev, bs, n = b.device, block_size, len(prompts)
    noise = Noise.of(sampling.seed, streams, dev)
    first = sample_next(b.logits, sampling, noise, torch.tensor([len(p) for p in prompts], device=dev)).tolist()
    results = [Generation([first[r]], [], []) for r in range(n)]
    seqs = [list(p) + [first[r]] for r, p in enumerate(prompts)]
    live = [r for r in range(n) if not (first[r] in stop_ids or max_new_tokens <= 1)]
    while live:
        b.make_room(live)
        drafts = [lookup_drafts(seqs[r], bs - 1) if r in live else [] for r in range(n)]
        block = torch.tensor([[seqs[r][-1]] + dr + [0] * (bs - 1 - len(dr)) for r, dr in enumerate(drafts)],
                             device=dev)
        counts = torch.tensor([len(dr) for dr in drafts], device=dev)
        anchor_pos = torch.tensor([len(s) - 1 for s in seqs], device=dev)
        logits = b.forward(block, anchor_pos)
        verdict = verify(logits, block[:, 1:], sampling, noise, anchor_pos, valid=b.offsets[None, :-1] < counts[:, None])
        acc, own, probs = verdict.accepted.tolist(), verdict.token.tolist(), verdict.probs.tolist()
        still = []
        for r in live:
            a = acc[r]
            new = drafts[r][:a] + [own[r]]
            if results[r].add_round(new, a, stop_ids, max_new_tokens, drafts[r], probs[r][:len(drafts[r])]):
                still.append(r)
            seqs[r] += new
        b.keep(verdict.accepted, still)
        live = still
    return results


def _lookup_uncached(target: torch.nn.Module, prompt: list[int], max_new_tokens: int, stop_ids: set[int],
                     block_size: int, sampling: Sampling = GREEDY, stream: int = 0) -> Generation:
    """The same rounds with the target re-run on the whole sequence (any causal LM)."""
    dev = next(target.parameters()).device
    noise = Noise.of(sampling.seed, [stream], dev)

    def logits_of(ids: list[int]) -> torch.Tensor:
        return target(input_ids=torch.tensor([ids], device=dev), use_cache=False).logits

    first = int(sample_next(logits_of(prompt)[:, -1], sampling, noise, torch.tensor([len(prompt)], device=dev))[0])
    seq = list(prompt) + [first]
    g = Generation([first], [], [])
    going = not (seq[-1] in stop_ids or max_new_tokens <= 1)
    while going:
        drafts = lookup_drafts(seq, block_size - 1)
        logits = logits_of(seq + drafts)[:, len(seq) - 1:]
        padded = torch.tensor([drafts + [0] * (block_size - 1 - len(drafts))], device=dev)
        if len(drafts) < block_size - 1:  # a fixed-shape block, as the cached decoder verifies
            logits = torch.cat([logits, logits[:, -1:].expand(1, block_size - 1 - len(drafts), -1)], dim=1)
        valid = torch.arange(block_size - 1, device=dev)[None] < len(drafts)
        verdict = verify(logits, padded, sampling, noise, torch.tensor([len(seq) - 1], device=dev), valid=valid)
        a = int(verdict.accepted[0])
        new = drafts[:a] + [int(verdict.token[0])]
        going = g.add_round(new, a, stop_ids, max_new_tokens, drafts, verdict.probs[0, :len(drafts)].tolist())
        seq += new
    return g
