"""The DFlash training objective as sums, so a step can be normalised over all micro-batches.

Every block slot k >= 1 carries a loss term and a weight (docs/objectives.md):

  term   = a·CE(drafter, the data's token) + b·T²·KL(softmax(target/T) || softmax(drafter/T))
           + c·T·TV(softmax(target/T), softmax(drafter/T))
           (model.loss: `ce` is a=1, b=c=0; `kl` b=1; `tv` c=1; `{ce: a, kl: b, tv: c}`; T = model.kl_temperature;
           TV = ½Σ|p - q|, the share of sampled proposals the engine rejects at the slot: 1 - Σ min(p, q));
           the target's logits for slot k are its next-token logits at position anchor+k-1;
  weight = base · dynamic. base is known before any forward (trainer.models.masks: 0 for slot 0,
           padding, out-of-bounds and non-loss tokens; exp(-(k-1)/γ) under `decay`, 1 under `dpace`);
           dynamic is 1 under `decay`, and under `dpace` the D-PACE weight from the drafter's own
           confidence on the data's token (`dpace_weights`, detached).

loss = Σ weight·term / Σ base over every block slot of every micro-batch and replica of a step;
accuracy = Σ base·[argmax == label] / Σ base. Callers add up the three sums and divide once: since
the denominator never depends on the model, one number per step normalises 1 or N micro-batches,
replicas and hosts alike (the same rule speculators uses for D-PACE: its weights are divided by
the count of loss tokens, not by their own sum).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from trainer.models.dflash2 import selector_sums
from trainer.models.drafter import DFlashDrafter, pointwise
from trainer.models.fp8_training import E4M3_MAX, FP8Head, fp8_linear, quantize_tensor, to_e4m3
from trainer.models.masks import Blocks, block_attention
from trainer.models.target import FrozenHead

if TYPE_CHECKING:
    from trainer.run.config import ModelConfig


@dataclass(frozen=True)
class Objective:
    """What a block slot's loss is (see the module doc): model.loss, kl_temperature, position_weight."""

    ce: float = 1.0  # weight of cross-entropy on the data's tokens
    kl: float = 0.0  # weight of forward KL to the target's next-token distribution
    temperature: float = 1.0  # softens both distributions of the KL and TV terms (scaled by T², T: their gradients keep their size)
    position_weight: str = "decay"  # "decay" (static exp(-(k-1)/γ)) | "dpace" (dpace_weights)
    dpace_alpha: float = 0.5  # D-PACE's smoothing floor: q~ = α + (1-α)·q
    selector: float = 0.0  # DFlash2: weight of the candidate selector's K-way CE (trainer.models.dflash2.selector_sums)
    tv: float = 0.0  # weight of the total variation to the target's distribution (sampled proposals' rejection)

    @property
    def needs_target(self) -> bool:
        """Whether the loss reads the target's logits (its layers above the last tapped one and its head)."""
        return self.kl > 0 or self.tv > 0

    def describe(self) -> str:
        terms = [f"{w:g}·{name}" if w != 1 else name
                 for name, w in (("ce", self.ce), ("kl", self.kl), ("tv", self.tv)) if w]
        t = f" (T={self.temperature:g})" if self.needs_target and self.temperature != 1 else ""
        weight = f"dpace α={self.dpace_alpha:g}" if self.position_weight == "dpace" else "decay"
        selector = f" + {self.selector:g}·selector CE (top-k, teacher-forced predecessor)" if self.selector else ""
        return f"{' + '.join(terms)}{t}{selector}, {weight}"


CE_DECAY = Objective()  # the DFlash recipe: hard cross-entropy, exp(-(k-1)/γ) over the block


def objective_of(model: ModelConfig) -> Objective:
    """The Objective a model config asks for (trainer.run.config has validated it)."""
    loss = model.loss
    ce, kl, tv = ((float(loss == "ce"), float(loss == "kl"), float(loss == "tv")) if isinstance(loss, str)
                  else (float(loss.ce), float(loss.kl), float(loss.tv)))
    selector = float(model.drafter.selector_loss_weight or 1.0) if model.drafter.kind == "dflash2" else 0.0
    return Objective(ce=ce, kl=kl, temperature=model.kl_temperature, position_weight=model.position_weight,
                     dpace_alpha=model.dpace_alpha, selector=selector, tv=tv)


def base_gamma(objective: Objective, gamma: float) -> float:
    """The γ the blocks' base weights are built with: the decay's, or ∞ (uniform) under D-PACE."""
    return math.inf if objective.position_weight == "dpace" else gamma


def dpace_weights(confidence: torch.Tensor, mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE's per-slot weights (arXiv:2605.18810 Eq. 7-8; speculators' and Model-Optimizer's default).

    confidence [..., K]: the drafter's probability of the label at slots 1..K of each block;
    mask [..., K]: the slots that carry loss. With q~ = α + (1-α)·q (masked slots: 1, a no-op)
    and C_j = Π_{i<=j} q~_i, the weight of slot j is Σ_{m>=j} C_m·mask_m (0 where masked): the
    gradient of the expected accepted length Σ_m C_m with respect to log q~_j. Non-increasing
    along the slots that carry loss (w_j - w_{j+1} = C_j >= 0). Detached: it only reweights."""
    with torch.no_grad():
        keep = mask.bool()
        smoothed = torch.where(keep, alpha + (1.0 - alpha) * confidence.float(), torch.ones_like(confidence.float()))
        cumulative = torch.cumprod(smoothed, dim=-1) * keep
        suffix = cumulative.flip(-1).cumsum(-1).flip(-1)
        return suffix * keep


def slot_weights(base: torch.Tensor, ce: torch.Tensor, objective: Objective, block: int) -> torch.Tensor:
    """weight = base · dynamic for flat slots [N] (N a multiple of `block`, the slots 1..bs-1 of each
    block in order); ce [N]: the drafter's cross-entropy on the label (D-PACE's confidence)."""
    if objective.position_weight != "dpace":
        return base
    q = torch.exp(-ce.detach().float()).view(-1, block)
    return base * dpace_weights(q, (base > 0).view(-1, block), objective.dpace_alpha).view(-1)


# ---------------------------------------------------------------------------- the reference path


def _kl_terms(logits: torch.Tensor, target_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """T²·KL(softmax(target/T) || softmax(drafter/T)) per row, fp32."""
    log_q = F.log_softmax(logits.float() / temperature, dim=-1)
    log_p = F.log_softmax(target_logits.float() / temperature, dim=-1)
    return F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1) * temperature ** 2


def _tv_terms(logits: torch.Tensor, target_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """T·½Σ|softmax(target/T) - softmax(drafter/T)| per row, fp32."""
    q = torch.softmax(logits.float() / temperature, dim=-1)
    p = torch.softmax(target_logits.float() / temperature, dim=-1)
    return 0.5 * (q - p).abs().sum(-1) * temperature


def _chunk_terms(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor,
                 target_hidden: torch.Tensor | None, ce_w: float, kl_w: float,
                 temperature: float, tv_w: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(term, CE, correct) per slot of one chunk, from its logits (and the target's)."""
    w = lm_head_weight.to(hidden.dtype)
    logits = (hidden @ w.t()).float()
    ce = F.cross_entropy(logits, labels, reduction="none")
    correct = (logits.argmax(dim=-1) == labels).float()
    term = ce * ce_w if ce_w else torch.zeros_like(ce)
    if target_hidden is not None and (kl_w or tv_w):
        target_logits = (target_hidden.to(hidden.dtype) @ w.t()).float()
        if kl_w:
            term = term + kl_w * _kl_terms(logits, target_logits, temperature)
        if tv_w:
            term = term + tv_w * _tv_terms(logits, target_logits, temperature)
    return term, ce.detach(), correct


def chunked_objective(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor,
                      weights: torch.Tensor, chunk: int, objective: Objective = CE_DECAY,
                      target_rows: torch.Tensor | None = None, slot_rows: torch.Tensor | None = None,
                      block: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ weight·term and Σ base·correct (the module doc), computing vocab logits `chunk` slots at a time.

    Each chunk runs under activation checkpointing, so only the hidden states are kept for backward
    and the [slots, vocab] logits (the drafter's and the target's) never exist for more than one
    chunk. target_rows [M, H]: the target's final hidden states; slot_rows [N]: each slot's row in
    them (its position anchor+k-1); both only when objective.kl. block: slots per block (bs - 1)."""
    if objective.needs_target and (target_rows is None or slot_rows is None):
        raise ValueError("model.loss kl needs the target's final hidden states at the block positions")
    terms, ces, corrects = [], [], []
    for start in range(0, hidden.shape[0], chunk):
        sl = slice(start, start + chunk)
        th = None
        if target_rows is not None and slot_rows is not None and objective.needs_target:
            th = target_rows.index_select(0, slot_rows[sl])
        args = (hidden[sl], lm_head_weight, labels[sl], th, objective.ce, objective.kl, objective.temperature,
                objective.tv)
        if torch.is_grad_enabled() and hidden.requires_grad:
            t, e, c = checkpoint(_chunk_terms, *args, use_reentrant=False)
        else:
            t, e, c = _chunk_terms(*args)
        terms.append(t)
        ces.append(e)
        corrects.append(c)
    term, ce, correct = torch.cat(terms), torch.cat(ces), torch.cat(corrects)
    loss_sum = (term * slot_weights(weights, ce, objective, block)).sum()
    return loss_sum, (correct * weights).sum().detach()


def chunked_weighted_ce(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor,
                        weights: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ w·CE and Σ w·correct (the `ce`, `decay` objective) by `chunked_objective`."""
    return chunked_objective(hidden, lm_head_weight, labels, weights, chunk)


# ---------------------------------------------------------------------------- the fused path


@pointwise
def _ce_slots(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CE, correct and d CE / d logits per slot of one chunk (one fused pass on CUDA)."""
    logits32 = logits.float()
    lse = torch.logsumexp(logits32, dim=-1)
    picked = logits32.gather(1, labels[:, None]).squeeze(1)
    correct = (logits32.argmax(dim=-1) == labels).float()
    grad = torch.exp(logits32 - lse[:, None])
    grad = grad.scatter_add(1, labels[:, None], -torch.ones_like(lse)[:, None])
    return lse - picked, correct, grad.to(logits.dtype)


@pointwise
def _mix_slots(logits: torch.Tensor, labels: torch.Tensor, target_logits: torch.Tensor, ce_w: float, kl_w: float,
               temperature: float, tv_w: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """term, CE, correct and d term / d logits per slot of one chunk, with the KL and TV terms (module doc).

    d(T²·KL)/d logits = T·(q - p); d(T·TV)/d logits = q·(g - Σ q·g) with g = ½·sign(q - p), where
    q = softmax(drafter/T), p = softmax(target/T)."""
    logits32 = logits.float()
    lse = torch.logsumexp(logits32, dim=-1)
    picked = logits32.gather(1, labels[:, None]).squeeze(1)
    correct = (logits32.argmax(dim=-1) == labels).float()
    ce = lse - picked
    log_q = torch.log_softmax(logits32 / temperature, dim=-1)
    log_p = torch.log_softmax(target_logits.float() / temperature, dim=-1)
    p, q = torch.exp(log_p), torch.exp(log_q)
    kl = (p * (log_p - log_q)).sum(-1) * temperature ** 2
    grad = (kl_w * temperature) * (q - p)
    term = ce_w * ce + kl_w * kl
    if tv_w:
        g = 0.5 * torch.sign(q - p)
        term = term + tv_w * temperature * 0.5 * (q - p).abs().sum(-1)
        grad = grad + tv_w * q * (g - (q * g).sum(-1, keepdim=True))
    if ce_w:
        grad = grad + ce_w * torch.exp(logits32 - lse[:, None])
        grad = grad.scatter_add(1, labels[:, None], torch.full_like(lse, -ce_w)[:, None])
    return term, ce, correct, grad.to(logits.dtype)


def _with_quantized_grad(slots: Any, bound: Callable[..., float]) -> Any:
    """`slots` (a @pointwise function whose last result is d term / d logits) returning that gradient as
    e4m3 and its scale instead, cast in the same compiled pass (FP8Head's gradient matmul).

    The scale is not the gradient's measured largest magnitude but its bound by construction (`bound` of
    the slots' arguments after the labels): a softmax minus a one-hot lies in [-1, 1], so the CE term's
    gradient never exceeds ce_w, the KL term's kl_w * T and the TV term's tv_w. A measured scale would need a reduction over
    the whole [chunk, vocabulary] gradient before the cast could start, a pass over the logits of its own;
    the bound's scale lets the cast fuse into the softmax's pass. The two differ where a chunk's largest
    gradient is far below the bound (a drafter sure of every token): its small values are not scaled up
    but land among e4m3's subnormals, exact to half their spacing (2^-10 x bound / 448; the tests check it)."""
    def fn(logits: torch.Tensor, labels: torch.Tensor, *args: Any) -> tuple[torch.Tensor, ...]:
        *sums, grad = slots.__wrapped__(logits, labels, *args)
        scale = torch.full((), bound(*args) / E4M3_MAX, dtype=torch.float32, device=logits.device)
        return (*sums, to_e4m3(grad, scale), scale)

    fn.__name__ = fn.__qualname__ = f"{slots.__name__}_fp8"
    return pointwise(fn)


_ce_slots_fp8 = _with_quantized_grad(_ce_slots, lambda: 1.0)
_mix_slots_fp8 = _with_quantized_grad(_mix_slots, lambda _target, ce_w, kl_w, temperature, tv_w=0.0:
                                      abs(ce_w) + abs(kl_w) * temperature + abs(tv_w))
_quantized = pointwise(quantize_tensor)


class _HeadLoss(torch.autograd.Function):
    """Σ weight·term through a frozen LM head, with d/d hidden computed chunk by chunk in the forward.

    The loss is a scalar and the weights are detached, so its gradient is grad_output x (each slot's
    weight x the gradient of its own term, computed here at unit weight and scaled once the weights
    are known: D-PACE's need every slot of a block): the backward is one multiply, the [slots, vocab]
    logits never outlive their chunk, and the LM-head matmul runs twice (logits, grad of hidden), not
    three times as under checkpointing (three and four with the target's logits under kl).
    fp8_head: both matmuls in e4m3 (model.drafter.precision fp8), each chunk's operands quantized where
    they are made. top_k > 0: also each slot's top_k logits and their ids while the chunk's logits exist
    (DFlash2's selector candidates, which would otherwise take a third LM-head matmul)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor,
                weights: torch.Tensor, chunk: int, need_grad: bool, objective: Objective,
                target_rows: torch.Tensor | None, slot_rows: torch.Tensor | None,
                block: int, fp8_head: FP8Head | None,
                top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        dtype = torch.get_autocast_dtype(hidden.device.type) if torch.is_autocast_enabled(hidden.device.type) \
            else hidden.dtype
        n = hidden.shape[0]
        kl = objective.needs_target
        with torch.autocast(hidden.device.type, enabled=False):
            w = lm_head_weight.to(dtype)
            term = hidden.new_empty(n, dtype=torch.float32)
            ce = hidden.new_empty(n, dtype=torch.float32)
            correct = hidden.new_empty(n, dtype=torch.float32)
            grad_hidden = hidden.new_empty(hidden.shape, dtype=dtype) if need_grad else None
            top_values = hidden.new_empty((n, top_k), dtype=dtype)
            top_ids = torch.empty((n, top_k), dtype=torch.long, device=hidden.device)

            def logits_of(h: torch.Tensor) -> torch.Tensor:
                if fp8_head is None:
                    return h.to(dtype) @ w.t()
                h_q, h_scale = _quantized(h.to(dtype), compiled=True)
                return fp8_head.logits(h_q, h_scale, dtype)

            for start in range(0, n, chunk):
                sl = slice(start, start + chunk)
                logits = logits_of(hidden[sl])
                if top_k:
                    torch.topk(logits, top_k, dim=-1, out=(top_values[sl], top_ids[sl]))
                if kl:
                    assert target_rows is not None and slot_rows is not None, "fused_objective checks them"
                    target_logits = logits_of(target_rows.index_select(0, slot_rows[sl]))
                    mix = _mix_slots if fp8_head is None else _mix_slots_fp8
                    t, e, c, *grad_logits = mix(logits, labels[sl], target_logits, objective.ce, objective.kl,
                                                objective.temperature, objective.tv, compiled=need_grad)
                    term[sl] = t
                else:
                    e, c, *grad_logits = (_ce_slots if fp8_head is None else _ce_slots_fp8)(logits, labels[sl],
                                                                                      compiled=need_grad)
                ce[sl], correct[sl] = e, c
                if grad_hidden is None:
                    continue
                if fp8_head is None:
                    torch.matmul(grad_logits[0], w, out=grad_hidden[sl])
                else:  # the gradient as e4m3 and its scale
                    grad_q, grad_scale = grad_logits
                    grad_hidden[sl] = fp8_head.grad_hidden(grad_q, grad_scale, dtype)
            scale = slot_weights(weights.float(), ce, objective, block)
            if not kl:  # the term is ce_w·CE: the factor folds into the scale
                term, scale = ce, scale * objective.ce
            loss_sum = (term * scale).sum()
            correct_sum = (correct * weights.float()).sum()
            if grad_hidden is not None:
                grad_hidden.mul_(scale[:, None].to(dtype))
        ctx.save_for_backward(grad_hidden)
        ctx.hidden_dtype = hidden.dtype
        ctx.mark_non_differentiable(correct_sum, top_values, top_ids)
        return loss_sum, correct_sum, top_values, top_ids

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor, *_grad_others: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (grad_hidden,) = ctx.saved_tensors
        grad = (grad_hidden * grad_loss.to(grad_hidden.dtype)).to(ctx.hidden_dtype)
        return (grad,) + (None,) * 11


def fused_objective(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor,
                    weights: torch.Tensor, chunk: int, objective: Objective = CE_DECAY,
                    target_rows: torch.Tensor | None = None, slot_rows: torch.Tensor | None = None,
                    block: int = 1, fp8_head: FP8Head | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same sums as `chunked_objective`, without recomputing the LM head in backward (fp8_head: its two
    matmuls in e4m3 while training, `_HeadLoss`)."""
    loss_sum, correct_sum, _ = fused_objective_and_top_k(hidden, lm_head_weight, labels, weights, chunk, objective,
                                                         target_rows, slot_rows, block, fp8_head)
    return loss_sum, correct_sum


def fused_objective_and_top_k(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor,
                              weights: torch.Tensor, chunk: int, objective: Objective = CE_DECAY,
                              target_rows: torch.Tensor | None = None, slot_rows: torch.Tensor | None = None,
                              block: int = 1, fp8_head: FP8Head | None = None, top_k: int = 0,
                              ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """`fused_objective`'s sums and, with top_k, each slot's top_k logits and their ids [N, top_k] (largest
    first, as torch.topk; no gradient), from the logits the loss computes anyway."""
    if objective.needs_target and (target_rows is None or slot_rows is None):
        raise ValueError("model.loss kl needs the target's final hidden states at the block positions")
    need_grad = torch.is_grad_enabled() and hidden.requires_grad
    loss_sum, correct_sum, values, ids = _HeadLoss.apply(hidden, lm_head_weight, labels, weights, chunk, need_grad,
                                                         objective, target_rows, slot_rows, block,
                                                         fp8_head if need_grad else None, top_k)
    return loss_sum, correct_sum.detach(), (values, ids) if top_k else None


def fused_weighted_ce(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor,
                      weights: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ w·CE and Σ w·correct (the `ce`, `decay` objective) by `fused_objective`."""
    return fused_objective(hidden, lm_head_weight, labels, weights, chunk)


WEIGHTED_CE = {"fused": fused_weighted_ce, "checkpoint": chunked_weighted_ce}
OBJECTIVE_PATHS = {"fused": fused_objective, "checkpoint": chunked_objective}


def selector_sums_of(parts: dict) -> tuple[torch.Tensor, ...]:
    """(selector_loss, selector_correct, selector_recall) of a drafter_loss_sums `parts`, () without a selector."""
    if "selector_loss" not in parts:
        return ()
    return parts["selector_loss"], parts["selector_correct"], parts["selector_recall"]


def selector_metrics(loss_sum: float, correct_sum: float, recall_sum: float, weight: float) -> dict:
    """A DFlash2 step's selector metrics from its sums over a step's base weight Σw: selector_loss (its
    K-way CE, Σ / Σw, before selector_loss_weight), candidate_recall (the share of weight whose token is
    among the top-k) and selector_acc (the selector's best is the token, among those slots)."""
    weight = max(weight, 1e-6)
    return {"selector_loss": loss_sum / weight, "candidate_recall": recall_sum / weight,
            "selector_acc": correct_sum / max(recall_sum, 1e-6)}


def slot_rows_of(blocks: Blocks, length: int) -> torch.Tensor:
    """Each loss slot's row in the target's flattened [B*L, H] hidden states: slot k >= 1 of the block
    anchored at p reads the target's next-token distribution at position p+k-1 (clamped: a slot past
    the row's end carries no weight)."""
    b, a, bs = blocks.input_ids.shape
    offsets = torch.arange(bs - 1, device=blocks.anchors.device)
    positions = (blocks.anchors[..., None] + offsets).clamp(max=length - 1)
    rows = torch.arange(b, device=positions.device)[:, None, None] * length
    return (rows + positions).reshape(-1)


def drafter_loss_sums(
    drafter: DFlashDrafter,
    head: FrozenHead,
    ctx_features: torch.Tensor,
    blocks: Blocks,
    backend: str,
    chunk: int = 2048,
    ce: str = "fused",
    doc_start: torch.Tensor | None = None,
    objective: Objective = CE_DECAY,
    target_hidden: torch.Tensor | None = None,
    parts: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Training forward of the drafter on one micro-batch.

    ctx_features: [B, L, n*H] from `target_context_features`; blocks: from
    `trainer.models.masks.prepare_blocks` (on the drafter's device, its base weights built for
    `objective`: `base_gamma`). Returns (loss_sum, weight_sum, correct_sum) as 0-d fp32 tensors
    (loss_sum differentiable; weight_sum = Σ base); no host sync happens here.
    ce: "fused" (default) or "checkpoint" (the reference implementation, kept for parity and as a baseline).
    doc_start [B, L]: packed rows (trainer.data.packing): context positions restart per document, a
    block sees only its own document, and flex builds its mask from tiles (long rows).
    target_hidden [B, L, H]: the target's final (normed) hidden states, what its LM head reads
    (`target_context_features(top=...)`): needed when objective.kl.
    A DFlash2 drafter (its candidate selector) adds objective.selector x the selector's sum
    (trainer.models.dflash2.selector_sums: the data's previous token as each slot's predecessor,
    the base weights). parts, when given, receives the terms apart (0-d tensors, detached):
    token_loss, selector_loss, selector_correct, selector_recall (sums over the same weights).
    """
    b, a, bs = blocks.input_ids.shape
    ctx_len = ctx_features.shape[1]
    packed = doc_start is not None
    attend = block_attention(backend, blocks.anchors, blocks.valid, ctx_len, bs, blocks.starts if packed else None,
                             tiled=packed, kinds=drafter.config.layout.kinds(drafter.config.num_hidden_layers))
    embeds = drafter.embed_block(head.embed, blocks.input_ids.view(b, a * bs))
    ctx_positions = None
    if doc_start is not None:  # packed
        doc_start = doc_start.to(ctx_features.device)
        ctx_positions = torch.arange(ctx_len, device=doc_start.device) - doc_start
    hidden = drafter.forward_train(ctx_features, embeds, blocks.positions.view(b, a * bs), attend, ctx_positions)
    hidden = hidden.view(b, a, bs, -1)[:, :, 1:].reshape(-1, hidden.shape[-1])  # slot 0 carries no loss
    labels = blocks.labels[:, :, 1:].reshape(-1)
    weights = blocks.weights[:, :, 1:].reshape(-1)
    target_rows = slot_rows = None
    if objective.needs_target:
        if target_hidden is None:
            raise ValueError("model.loss kl needs the target's final hidden states (target_hidden)")
        target_rows = target_hidden.reshape(-1, target_hidden.shape[-1])
        slot_rows = slot_rows_of(blocks, target_hidden.shape[1])
    args = (hidden, head.lm_head_weight, labels, weights, chunk, objective, target_rows, slot_rows, bs - 1)
    selector = getattr(drafter, "candidate_selector", None)
    top_k = selector.top_k if selector is not None and objective.selector else 0
    top = None
    if ce == "fused":  # model.drafter.precision fp8: the LM head's matmuls too
        fp8_head = head.fp8() if getattr(drafter, "linear", None) is fp8_linear else None
        loss_sum, correct_sum, top = fused_objective_and_top_k(*args, fp8_head=fp8_head, top_k=top_k)
    else:
        loss_sum, correct_sum = OBJECTIVE_PATHS[ce](*args)
    if parts is not None:
        parts["token_loss"] = loss_sum.detach()
    if selector is not None and objective.selector:
        c = drafter.config
        previous = blocks.labels[:, :, :-1].reshape(-1)  # slot k's predecessor: the data's token at k - 1
        sel_loss, sel_correct, sel_recall = selector_sums(selector, hidden, head.lm_head_weight, labels, previous,
                                                          weights, chunk, c.output_multiplier,
                                                          c.final_logit_softcapping, top)
        loss_sum = loss_sum + objective.selector * sel_loss
        if parts is not None:
            parts.update(selector_loss=sel_loss.detach(), selector_correct=sel_correct, selector_recall=sel_recall)
    return loss_sum, weights.sum(), correct_sum
