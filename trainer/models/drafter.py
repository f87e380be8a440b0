"""The DFlash drafter: Qwen3-style decoder layers with the target's context injected as K/V.

Parameter names match the published DFlash drafts (fc, hidden_norm, layers.N.self_attn.*,
layers.N.mlp.*, norm), so an exported directory loads in SGLang / vLLM.

Two forwards over the same layers, deliberately separate so their parity can be tested:
`forward_train` (many blocks of one sequence at once, under a block mask) and
`draft_block` (one block after a context, everything visible, as at inference).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, cast

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from trainer.models.dflash2 import CandidateSelector, GroupedConv, grouped_conv, walk


def drafter_intermediate_size(target_config: Any) -> int:
    """The drafter's (dense) MLP width: the target's `intermediate_size`, as the published drafts take
    it (Qwen3-30B-A3B's config gives 6144 beside its experts' 768). A sparse target whose config has
    none (Qwen3.5-MoE) gets 3 x hidden_size, the Qwen3 ratio (2048 -> 6144, 4096 -> 12288)."""
    return int(getattr(target_config, "intermediate_size", None) or 3 * target_config.hidden_size)


from trainer.run.layout import LAYOUT_FIELDS, Layout, checked_layout  # noqa: E402 - the layout and its one check

DRAFTER_KINDS = ("dflash", "dflash2")  # the draft's generations (DrafterConfig.kind)


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int  # layers of the target model (published config field)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_position_embeddings: int = 40960
    # the draft's own layout (trainer.run.layout: per layer full or sliding, causal or not inside the
    # block, sinks; as vLLM resolves the published fields), checked there at construction. The
    # default is the 2025 one: every layer full attention, non-causal inside the block, no sinks
    layout: Layout = field(default_factory=Layout)
    mask_embedding: bool = False  # a separate learned embedding of the mask slots (exported as mask_embedding.pt)
    # the draft's generation (trainer.models.dflash2): "dflash" or "dflash2" (grouped convolutions
    # around every layer's attention and MLP, a candidate selector over each slot's top-k); the rest
    # are DFlash2's dflash_config fields, as vLLM reads them
    kind: str = "dflash"
    conv_kernel_size: int = 2  # taps of the convolutions
    conv_group_size: int = 16  # channels sharing one dynamic coefficient
    selector_rank: int = 256  # rank of the selector's codebooks
    selector_top_k: int = 16  # candidates per draft slot
    input_embedding_scale: float = 1.0  # multiplies the block's input embeddings
    output_multiplier: float = 1.0  # multiplies the candidates' unary logits
    final_logit_softcapping: float | None = None  # soft cap of the unary logits (None or 0: none)

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        if self.kind not in DRAFTER_KINDS:
            raise ValueError(f"drafter kind {self.kind!r} must be 'dflash' or 'dflash2'")
        if self.kind == "dflash2":
            if self.conv_kernel_size < 1 or self.conv_group_size < 1 or self.hidden_size % self.conv_group_size:
                raise ValueError(f"conv_group_size {self.conv_group_size} must divide hidden_size {self.hidden_size} "
                                 f"and conv_kernel_size {self.conv_kernel_size} be at least 1")
            if self.selector_rank < 1 or not 1 <= self.selector_top_k <= self.vocab_size:
                raise ValueError(f"selector_rank {self.selector_rank} must be at least 1 and selector_top_k "
                                 f"{self.selector_top_k} in 1..{self.vocab_size} (the vocabulary)")
        elif (self.input_embedding_scale, self.output_multiplier, self.final_logit_softcapping or 0.0) != (1.0, 1.0, 0.0):
            raise ValueError("input_embedding_scale, output_multiplier and final_logit_softcapping are DFlash2 fields: "
                             "a DFlash draft has none")
        self.layout = checked_layout(self.layout, n)
        if self.num_attention_heads % self.num_key_value_heads or self.head_dim % 2:
            raise ValueError(f"attention heads {self.num_attention_heads} must be a multiple of the key/value heads "
                             f"{self.num_key_value_heads}, and head_dim {self.head_dim} even (RoPE)")

    @classmethod
    def from_target(cls, target_config: Any, num_layers: int, block_size: int, mask_token_id: int,
                    target_layer_ids: list[int], **own: Any) -> "DrafterConfig":
        """The drafter for a target; `own`: fields of the draft's own architecture (heads, KV heads,
        head_dim, MLP width, `layout`: a trainer.run.layout.Layout) that replace what the target's
        config gives (None: the default)."""
        rope = getattr(target_config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(target_config, "rope_theta", 1000000.0))
        heads = own.pop("num_attention_heads", None) or target_config.num_attention_heads
        kv_heads = own.pop("num_key_value_heads", None) or (target_config.num_key_value_heads
                                                            if heads % target_config.num_key_value_heads == 0 else heads)
        head_dim = own.pop("head_dim", None) or getattr(target_config, "head_dim", None) \
            or target_config.hidden_size // target_config.num_attention_heads
        intermediate = own.pop("intermediate_size", None) or drafter_intermediate_size(target_config)
        return cls(
            hidden_size=target_config.hidden_size,
            intermediate_size=intermediate,
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            **{k: v for k, v in own.items() if v is not None},
            vocab_size=target_config.vocab_size,
            block_size=block_size,
            mask_token_id=mask_token_id,
            target_layer_ids=list(target_layer_ids),
            num_target_layers=target_config.num_hidden_layers,
            rms_norm_eps=target_config.rms_norm_eps,
            rope_theta=float(theta),
            max_position_embeddings=target_config.max_position_embeddings,
        )

    def to_dict(self) -> dict:
        """The fields as a checkpoint's drafter_config.json holds them: the layout's flat, under the
        names and in the places they have always had (older checkpoints and run directories read the same)."""
        out: dict[str, Any] = {}
        for name, value in asdict(self).items():
            out.update(self.layout.to_dict() if name == "layout" else {name: value})
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "DrafterConfig":
        """A drafter_config as to_dict writes it (an older checkpoint's missing fields: the defaults);
        a key that is no field raises TypeError."""
        fields = {k: v for k, v in d.items() if k not in LAYOUT_FIELDS}
        return cls(**fields, layout=Layout.from_dict(d))


# Pointwise pieces run as one fused kernel each (forward and backward) on CUDA via torch.compile
# while training (grad enabled); eagerly elsewhere: CPU tests need no compiler, and inference
# (evaluation, drafting) meets a new context length at every call. Static shapes: the pipeline
# warms each shape once on one thread before its workers start (trainer.pipeline.compile_safety).
COMPILE_POINTWISE = True  # False: every piece eager (the baseline that fusing them is measured against)
CPU_BACKEND: str | None = None  # tests: also compile on the CPU with this backend ("aot_eager": no C compiler)
_compiled: dict[Callable, Callable] = {}


def pointwise(fn: Callable) -> Callable:
    @functools.wraps(fn)  # call.__wrapped__ is fn
    def call(x: torch.Tensor, *args: Any, compiled: bool | None = None) -> Any:
        if compiled is None:
            compiled = torch.is_grad_enabled()
        if not (compiled and COMPILE_POINTWISE and (x.is_cuda or CPU_BACKEND)):
            return fn(x, *args)
        if fn not in _compiled:
            _compiled[fn] = torch.compile(fn, dynamic=False, backend="inductor" if x.is_cuda else (CPU_BACKEND or ""))
        return _compiled[fn](x, *args)

    return call


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalised in fp32; returned in x's dtype (the fp32 master weight is cast, not x upcast)."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(dtype) * x.to(dtype)


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


rms_norm, silu_mul = pointwise(_rms_norm), pointwise(_silu_mul)
dflash2_conv = pointwise(grouped_conv)  # DFlash2's convolution: one compiled region on CUDA while training


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [B, T, head_dim] for integer positions [B, T] (computed in fp32)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.float()[..., None] * inv_freq
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos(), emb.sin()


def _rotate_raw(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE to x [B, heads, T, D] with cos/sin [B, T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    return x * cos + rotated * sin


_rotate = pointwise(_rotate_raw)


Attention = Callable[..., torch.Tensor]  # attend(q, k, v) or, on a layer with sinks, attend(q, k, v, sink=sink)
Weight = Callable[[torch.Tensor], torch.Tensor]  # a layer's weight -> the tensor its matmul uses
Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # F.linear, or fp8_training.fp8_linear (model.drafter.precision)


def as_is(weight: torch.Tensor) -> torch.Tensor:
    return weight


def serving_mask(ctx_valid: torch.Tensor, ctx_pos: torch.Tensor, block_pos: torch.Tensor, window: int | None,
                 causal: bool) -> torch.Tensor:
    """What a draft layer's block queries see at serving time, [B, 1, T, S + T] (or [B, 1, 1, S + T]
    for a full non-causal layer): context entries ctx_valid [B, S] at positions ctx_pos [B, S], then
    the block's own T slots at block_pos [B, T]. Query position i sees key position j iff i - j <
    window (a sliding layer), j - i < window (sliding, non-causal: vLLM's window is symmetric) and
    j <= i (a causal layer); the context lies before the anchor, so only the first rule touches it."""
    b, t = block_pos.shape
    if window is None and not causal:
        return torch.cat([ctx_valid, torch.ones(b, t, dtype=torch.bool, device=ctx_valid.device)], dim=1)[:, None, None]
    ctx = ctx_valid[:, None, :].expand(b, t, -1)
    if window is not None:
        ctx = ctx & (block_pos[:, :, None] - ctx_pos[:, None, :] < window)
    d = block_pos[:, :, None] - block_pos[:, None, :]  # query minus key position
    own = d >= 0 if causal else torch.ones_like(d, dtype=torch.bool)
    if window is not None:
        own = own & (d < window) & (-d < window)
    return torch.cat([ctx, own], dim=2)[:, None]


def attend_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                  sink: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA of q [B, heads, T, D] over k/v [B, kv_heads, S, D] under a boolean or additive mask;
    with a per-head sink logit [heads], a key of value 0 every query sees (vLLM's s_aux). Rows that
    see nothing give zeros only with a sink (callers without one never build such rows)."""
    if sink is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    column = sink.float()[None, :, None, None].expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    return (probs.to(v.dtype) @ v).to(q.dtype)


def serving_attention(kinds: Sequence[tuple[int | None, bool]], ctx_valid: torch.Tensor, ctx_pos: torch.Tensor,
                      block_pos: torch.Tensor) -> list[Attention]:
    """One attend(q, k, v[, sink]) per layer over [context | block] under its `serving_mask`."""
    masks: dict[tuple[int | None, bool], torch.Tensor] = {}
    out: list[Attention] = []
    for kind in kinds:
        if kind not in masks:
            masks[kind] = serving_mask(ctx_valid, ctx_pos, block_pos, *kind)
        out.append(functools.partial(attend_masked, mask=masks[kind]))
    return out


def _attention_inputs_of(x: torch.Tensor, ctx: torch.Tensor, w_norm: torch.Tensor, wq: torch.Tensor,
                         wk: torch.Tensor, wv: torch.Tensor, w_qnorm: torch.Tensor, w_knorm: torch.Tensor,
                         cos_q: torch.Tensor, sin_q: torch.Tensor, cos_kv: torch.Tensor, sin_kv: torch.Tensor,
                         eps: float, heads: int, kv_heads: int, head_dim: int,
                         fused: bool, linear: Linear = F.linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Everything of a layer before attention: input norm, q/k/v projections, q/k norms, RoPE.
    Queries from the block x; keys/values from [context | block].

    fused (the default, `_attention_inputs`): one compiled region (forward and backward) on CUDA,
    keys/values projected apart and concatenated at 1/4 of the width (GQA). Not fused: the
    previous path, each norm and RoPE its own compiled kernel, [context | block] concatenated at
    full width before the projections (model.fuse_drafter false: the baseline fusing is measured against)."""
    norm = _rms_norm if fused else rms_norm
    return _qkv_of(norm(x, w_norm, eps), ctx, wq, wk, wv, w_qnorm, w_knorm, cos_q, sin_q, cos_kv, sin_kv,
                   eps, heads, kv_heads, head_dim, fused, fused, linear)


def _qkv_of(h: torch.Tensor, ctx: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor,
            w_qnorm: torch.Tensor, w_knorm: torch.Tensor, cos_q: torch.Tensor, sin_q: torch.Tensor,
            cos_kv: torch.Tensor, sin_kv: torch.Tensor, eps: float, heads: int, kv_heads: int, head_dim: int,
            raw: bool, apart: bool, linear: Linear = F.linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q/k/v of the normed block input h (DFlash: the layer's input norm; DFlash2: its convolution of it):
    projections, q/k norms, RoPE. raw: the plain norm and RoPE (inside a compiled region), else each
    its own compiled kernel; apart: context and block projected apart and concatenated (1/4 width),
    else [context | block] concatenated before the projections."""
    norm, rotate = (_rms_norm, _rotate_raw) if raw else (rms_norm, _rotate)
    b, t, _ = h.shape
    n = ctx.shape[1] + t
    q = norm(linear(h, wq).view(b, t, heads, head_dim), w_qnorm, eps).transpose(1, 2)
    if apart:
        k = torch.cat([linear(ctx, wk), linear(h, wk)], dim=1)
        v = torch.cat([linear(ctx, wv), linear(h, wv)], dim=1)
    else:
        kv_in = torch.cat([ctx, h], dim=1)
        k, v = linear(kv_in, wk), linear(kv_in, wv)
    k = norm(k.view(b, n, kv_heads, head_dim), w_knorm, eps).transpose(1, 2)
    v = v.view(b, n, kv_heads, head_dim).transpose(1, 2)
    return rotate(q, cos_q, sin_q), rotate(k, cos_kv, sin_kv), v


def _attention_out_and_mlp_of(x: torch.Tensor, attended: torch.Tensor, wo: torch.Tensor, w_norm: torch.Tensor,
                              w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, eps: float,
                              fused: bool, linear: Linear = F.linear) -> torch.Tensor:
    """Everything of a layer after attention: output projection and residual, post-attention
    norm, SiLU-gated MLP and residual (fused: one compiled region on CUDA)."""
    norm, silu = (_rms_norm, _silu_mul) if fused else (rms_norm, silu_mul)
    b, heads, t, d = attended.shape
    x = x + linear(attended.transpose(1, 2).reshape(b, t, heads * d), wo)
    h = norm(x, w_norm, eps)
    return x + linear(silu(linear(h, w_gate), linear(h, w_up)), w_down)


_attention_inputs = pointwise(_attention_inputs_of)
_attention_out_and_mlp = pointwise(_attention_out_and_mlp_of)


def _conv_coefficients(h: torch.Tensor, w_conv: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """A DFlash2 convolution's dynamic coefficients of h: [..., T, 2 sides, taps, groups]."""
    taps = base.shape[1]
    return F.linear(h, w_conv).unflatten(-1, (2, taps, w_conv.shape[0] // (2 * taps)))


def _dflash2_inputs_of(x: torch.Tensor, ctx: torch.Tensor, w_norm: torch.Tensor, w_conv: torch.Tensor,
                       base: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, w_qnorm: torch.Tensor,
                       w_knorm: torch.Tensor, cos_q: torch.Tensor, sin_q: torch.Tensor, cos_kv: torch.Tensor,
                       sin_kv: torch.Tensor, eps: float, heads: int, kv_heads: int, head_dim: int, block_size: int,
                       linear: Linear = F.linear) -> tuple[torch.Tensor, ...]:
    """DFlash2's layer before attention as one region (fused, like DFlash's `_attention_inputs_of`): the
    input norm, the attention convolution's coefficients and its side 0, then q/k/v as in DFlash; side
    1's coefficients are returned for `_dflash2_out_and_mlp_of`. GroupedConv.prepare's arithmetic."""
    h = _rms_norm(x, w_norm, eps)
    delta = _conv_coefficients(h, w_conv, base)
    h = grouped_conv(h, delta[..., 0, :, :], base[0], block_size)
    q, k, v = _qkv_of(h, ctx, wq, wk, wv, w_qnorm, w_knorm, cos_q, sin_q, cos_kv, sin_kv, eps, heads, kv_heads,
                      head_dim, True, True, linear)
    return q, k, v, delta[..., 1, :, :]


def _dflash2_out_and_mlp_of(x: torch.Tensor, attended: torch.Tensor, wo: torch.Tensor, delta: torch.Tensor,
                            base_a: torch.Tensor, w_norm: torch.Tensor, w_conv: torch.Tensor, base_m: torch.Tensor,
                            w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, eps: float,
                            block_size: int, linear: Linear = F.linear) -> torch.Tensor:
    """DFlash2's layer after attention as one region: the output projection convolved (side 1) and the
    residual, then the MLP between its own convolution's two sides, and the residual."""
    b, heads, t, d = attended.shape
    x = x + grouped_conv(linear(attended.transpose(1, 2).reshape(b, t, heads * d), wo), delta, base_a[1], block_size)
    h = _rms_norm(x, w_norm, eps)
    delta = _conv_coefficients(h, w_conv, base_m)
    h = grouped_conv(h, delta[..., 0, :, :], base_m[0], block_size)
    out = linear(_silu_mul(linear(h, w_gate), linear(h, w_up)), w_down)
    return x + grouped_conv(out, delta[..., 1, :, :], base_m[1], block_size)


_dflash2_inputs = pointwise(_dflash2_inputs_of)
_dflash2_out_and_mlp = pointwise(_dflash2_out_and_mlp_of)


class DrafterAttention(nn.Module):
    """The attention's parameters (the published names); DrafterLayer runs them."""

    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        # vLLM's per-head sink logit (a key of value 0 every query also attends to): learned here
        self.attention_sink_bias = nn.Parameter(torch.zeros(c.num_attention_heads)) if c.layout.attention_sink else None


class DrafterMLP(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # cached drafting (trainer.generate.speculative)
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


class DrafterLayer(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DrafterAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = DrafterMLP(c)
        # DFlash2: a grouped convolution around the attention and one around the MLP (vLLM's names)
        dflash2 = c.kind == "dflash2"
        self.attention_conv = GroupedConv(c.hidden_size, c.conv_kernel_size, c.conv_group_size) if dflash2 else None
        self.mlp_conv = GroupedConv(c.hidden_size, c.conv_kernel_size, c.conv_group_size) if dflash2 else None
        self.block_size = c.block_size  # the convolutions' block (a served block is one)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, rope_q: tuple[torch.Tensor, torch.Tensor],
                rope_kv: tuple[torch.Tensor, torch.Tensor], attention: Attention, weight: Weight = as_is,
                fused: bool = True, linear: Linear = F.linear) -> torch.Tensor:
        """weight: what each matmul uses for its fp32 weight (LowPrecisionWeights while training);
        fused: two compiled regions around attention on CUDA (see `_attention_inputs_of`); linear: the
        projections' matmul (fp8_linear while training with model.drafter.precision fp8)."""
        if self.attention_conv is not None:
            return self._forward_dflash2(x, ctx, rope_q, rope_kv, attention, weight, linear, fused)
        a, m, eps = self.self_attn, self.mlp, self.input_layernorm.eps
        before, after = ((_attention_inputs, _attention_out_and_mlp) if fused
                         else (_attention_inputs_of, _attention_out_and_mlp_of))
        q, k, v = before(x, ctx, self.input_layernorm.weight, weight(a.q_proj.weight), weight(a.k_proj.weight),
                         weight(a.v_proj.weight), a.q_norm.weight, a.k_norm.weight, *rope_q, *rope_kv, eps, a.heads,
                         a.kv_heads, a.head_dim, fused, linear)
        sink = a.attention_sink_bias
        attended = attention(q, k, v) if sink is None else attention(q, k, v, sink=sink)
        return after(x, attended, weight(a.o_proj.weight), self.post_attention_layernorm.weight,
                     weight(m.gate_proj.weight), weight(m.up_proj.weight), weight(m.down_proj.weight), eps, fused,
                     linear)

    def _forward_dflash2(self, x: torch.Tensor, ctx: torch.Tensor, rope_q: tuple[torch.Tensor, torch.Tensor],
                         rope_kv: tuple[torch.Tensor, torch.Tensor], attention: Attention,
                         weight: Weight, linear: Linear = F.linear, fused: bool = True) -> torch.Tensor:
        """vLLM's DFlash2 layer: norm, convolve (side 0), attention (the block's queries, keys and values
        from the convolved input; the context's as in DFlash), convolve its output (side 1 of the same
        projection), residual; the same around the MLP. fused: two compiled regions around attention on
        CUDA while training, as the DFlash layer's (convolutions inside); else the norms, RoPE, SiLU and
        each convolution are compiled regions of their own."""
        a, m, eps, bs = self.self_attn, self.mlp, self.input_layernorm.eps, self.block_size
        conv_a, conv_m = cast(GroupedConv, self.attention_conv), cast(GroupedConv, self.mlp_conv)
        sink = a.attention_sink_bias
        if fused:
            q, k, v, delta = _dflash2_inputs(
                x, ctx, self.input_layernorm.weight, weight(conv_a.kernel_projection.weight), conv_a.base_kernel,
                weight(a.q_proj.weight), weight(a.k_proj.weight), weight(a.v_proj.weight), a.q_norm.weight,
                a.k_norm.weight, *rope_q, *rope_kv, eps, a.heads, a.kv_heads, a.head_dim, bs, linear)
            attended = attention(q, k, v) if sink is None else attention(q, k, v, sink=sink)
            return _dflash2_out_and_mlp(
                x, attended, weight(a.o_proj.weight), delta, conv_a.base_kernel, self.post_attention_layernorm.weight,
                weight(conv_m.kernel_projection.weight), conv_m.base_kernel, weight(m.gate_proj.weight),
                weight(m.up_proj.weight), weight(m.down_proj.weight), eps, bs, linear)
        b, t, _ = x.shape
        h, delta = conv_a.prepare(rms_norm(x, self.input_layernorm.weight, eps), bs, weight, dflash2_conv)
        q, k, v = _qkv_of(h, ctx, weight(a.q_proj.weight), weight(a.k_proj.weight), weight(a.v_proj.weight),
                          a.q_norm.weight, a.k_norm.weight, *rope_q, *rope_kv, eps, a.heads, a.kv_heads, a.head_dim,
                          raw=False, apart=True, linear=linear)
        attended = attention(q, k, v) if sink is None else attention(q, k, v, sink=sink)
        out = linear(attended.transpose(1, 2).reshape(b, t, a.heads * a.head_dim), weight(a.o_proj.weight))
        x = x + conv_a.finish(out, delta, bs, dflash2_conv)
        h, delta = conv_m.prepare(rms_norm(x, self.post_attention_layernorm.weight, eps), bs, weight, dflash2_conv)
        out = linear(silu_mul(linear(h, weight(m.gate_proj.weight)), linear(h, weight(m.up_proj.weight))),
                       weight(m.down_proj.weight))
        return x + conv_m.finish(out, delta, bs, dflash2_conv)


def run_layer(layer: nn.Module, checkpointed: bool, x: torch.Tensor, *args: Any) -> torch.Tensor:
    """One layer; checkpointed (model.checkpoint_drafter, training only): through activation
    checkpointing, only its input kept for backward, which runs its forward again (a third more
    drafter compute), so the drafter's activations no longer grow with layers x anchors (rows of
    65,536 tokens on one H200). Non-reentrant: the recompute sees the same autocast state and the
    same low-precision weight copies; no RNG state is kept, the layers draw none."""
    if checkpointed and torch.is_grad_enabled():
        return torch.utils.checkpoint.checkpoint(layer, x, *args, use_reentrant=False, preserve_rng_state=False)
    return layer(x, *args)


class _UseCopy(torch.autograd.Function):
    """A weight as its low-precision copy: the forward returns the copy (no cast kernel), the
    backward hands the gradient back in the weight's dtype - what autocast's per-use cast does."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
        ctx.dtype = weight.dtype
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.to(ctx.dtype), None


class LowPrecisionWeights:
    """Low-precision copies of the fp32 master weights, made once per optimizer step, not at every
    use under autocast (one cast kernel per weight per micro-batch). Same numbers as autocast.

    A copy is remade after any optimizer step over its weight (a global optimizer post-hook: a
    fused AdamW does not bump the weights' version counters) or when the weight's version changes
    (a checkpoint load, an init)."""

    def __init__(self) -> None:
        self._copies: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}  # id -> (weight, copy, version)
        _LIVE.add(self)

    def __deepcopy__(self, memo: dict) -> "LowPrecisionWeights":
        return LowPrecisionWeights()  # a replica makes its own copies, on its own device

    def forget(self, weight_ids: set[int]) -> None:
        """Those weights changed: remake their copies at the next use (the buffers are kept)."""
        for key in weight_ids & self._copies.keys():
            weight, copy, _ = self._copies[key]
            self._copies[key] = (weight, copy, -1)

    def weight(self, dtype: torch.dtype) -> Weight:
        def use(weight: torch.Tensor) -> torch.Tensor:
            if weight.dtype == dtype:
                return weight
            entry = self._copies.get(id(weight))
            if entry is None or entry[0] is not weight or entry[1].dtype != dtype:
                entry = (weight, torch.empty_like(weight, dtype=dtype, requires_grad=False), -1)
            if entry[2] != weight._version:
                with torch.no_grad():
                    entry[1].copy_(weight)
                entry = (weight, entry[1], weight._version)
                self._copies[id(weight)] = entry
            return _UseCopy.apply(weight, entry[1])

        return use


_LIVE: weakref.WeakSet[LowPrecisionWeights] = weakref.WeakSet()


def _after_optimizer_step(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
    caches = [cache for cache in list(_LIVE) if cache._copies]
    if caches:
        updated = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for cache in caches:
            cache.forget(updated)


register_optimizer_step_post_hook(_after_optimizer_step)


def build_drafter_modules(module: nn.Module, c: DrafterConfig) -> None:
    """The drafter's parameters, named as in the published drafts, set on `module`.

    Shared by DFlashDrafter and the exported model's `DFlashDraftModel` (a transformers
    PreTrainedModel), so both hold the same weights under the same names and run the same code."""
    module.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
    module.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
    module.layers = nn.ModuleList(DrafterLayer(c) for _ in range(c.num_hidden_layers))
    module.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
    # DFlash2: the candidate selector (vLLM: candidate_selector.*), else None
    module.candidate_selector = CandidateSelector(c.hidden_size, c.vocab_size, c.selector_rank, c.selector_top_k) \
        if c.kind == "dflash2" else None  # type: ignore[assignment]  # torch types Module attributes as Tensor | Module
    # the mask slots' own embedding where the draft ships one (vLLM: mask_embedding.pt), else None:
    # the target's embedding row of mask_token_id
    module.mask_embedding = nn.Parameter(torch.zeros(c.hidden_size)) if c.mask_embedding else None  # type: ignore[assignment]  # torch types Module attributes as Tensor | Module
    module.rope = (c.head_dim, c.rope_theta)  # type: ignore[assignment]  # torch types Module attributes as Tensor | Module


def propose(drafter: nn.Module, logits_of: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
            anchor: torch.Tensor) -> torch.Tensor:
    """Greedy draft tokens [B, bs - 1] of the block's final hidden states past the anchor slot [B, bs - 1, H]
    (anchor [B]: the block's first token): each slot's LM-head argmax (DFlash), or the candidate
    selector's walk over each slot's top-k (DFlash2, trainer.models.dflash2.walk). No host sync."""
    logits = logits_of(hidden)
    selector = getattr(drafter, "candidate_selector", None)
    if selector is None:
        return logits.argmax(dim=-1)
    c: DrafterConfig = getattr(drafter, "dflash", None) or drafter.config  # type: ignore[assignment]
    return walk(selector, hidden, logits, anchor, c.output_multiplier, c.final_logit_softcapping)


class DFlashDrafter(nn.Module):
    fc: nn.Linear  # as build_drafter_modules sets them
    hidden_norm: RMSNorm
    layers: nn.ModuleList
    norm: RMSNorm
    mask_embedding: nn.Parameter | None
    candidate_selector: CandidateSelector | None
    rope: tuple[int, float]

    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.config = c
        build_drafter_modules(self, c)
        self.reset_parameters()
        # training (grad on) under a lower autocast dtype: matmuls use copies made once per step
        self.low_precision = LowPrecisionWeights()
        self.fused = True  # model.fuse_drafter: copies once per step, compiled layer regions (CUDA)
        self.linear: Linear = F.linear  # the projections' matmul while training (model.drafter.precision fp8: fp8_linear)
        self.checkpoint_layers = 0  # model.checkpoint_drafter: the first this many layers recomputed in backward (run_layer)

    def blocks(self) -> list[DrafterLayer]:
        """The layers, typed (ModuleList's stubs type its items as Module)."""
        return cast(list[DrafterLayer], list(self.layers))

    def reset_parameters(self, std: float = 0.02) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)
        for m in self.modules():  # DFlash2's parts: identity convolutions, a selector adding nothing yet
            if isinstance(m, GroupedConv):
                m.reset_parameters()
            elif isinstance(m, CandidateSelector):
                m.reset_parameters(std)

    def dflash2_parameters(self) -> list[str]:
        """The names of the DFlash2 parts' parameters (what a DFlash1 draft lacks)."""
        return [name for name, _ in self.named_parameters()
                if name.startswith("candidate_selector.") or ".attention_conv." in name or ".mlp_conv." in name]

    def embed_block(self, embed: Callable[[torch.Tensor], torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
        """The block slots' input embeddings: embed(ids) (the target's), with the draft's own mask
        embedding in the mask slots where it has one (as vLLM's embed_input_ids)."""
        embeds = embed(ids)
        own = getattr(self, "mask_embedding", None)
        c: DrafterConfig = getattr(self, "dflash", None) or self.config  # the exported model's config is Qwen3Config
        if own is not None:
            is_mask = (ids == c.mask_token_id)[..., None].to(embeds.device)
            embeds = torch.where(is_mask, own.to(embeds.dtype), embeds)
        return embeds * c.input_embedding_scale if c.input_embedding_scale != 1.0 else embeds

    def _compute_dtype(self, device_type: str) -> torch.dtype:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
        return self.fc.weight.dtype

    def _run(self, ctx_features: torch.Tensor, block_embeds: torch.Tensor, ctx_positions: torch.Tensor,
             block_positions: torch.Tensor, attention: Attention | Sequence[Attention]) -> torch.Tensor:
        """attention: one for every layer, or one per layer (layers of different windows/causality)."""
        dtype = self._compute_dtype(block_embeds.device.type)
        weight: Weight = as_is
        cached = getattr(self, "low_precision", None)  # the exported model (hf_modeling) has none
        fused = getattr(self, "fused", True)
        if cached is not None and fused and torch.is_grad_enabled() and self.fc.weight.dtype != dtype:
            weight = cached.weight(dtype)
        # FP8 matmuls while training only: evaluation drafts as the export serves, in bf16
        linear: Linear = getattr(self, "linear", F.linear) if torch.is_grad_enabled() else F.linear
        ctx = self.hidden_norm(linear(ctx_features.to(dtype), weight(self.fc.weight)))
        x = block_embeds.to(dtype)
        head_dim, theta = self.rope
        rope_q = rope_cos_sin(block_positions, head_dim, theta)
        rope_kv = rope_cos_sin(torch.cat([ctx_positions, block_positions], dim=1), head_dim, theta)
        attends = list(attention) if isinstance(attention, (list, tuple)) else [attention] * len(self.layers)
        checkpointed = getattr(self, "checkpoint_layers", 0)  # the exported model has none
        for i, (layer, attend) in enumerate(zip(self.layers, attends, strict=True)):
            x = run_layer(layer, i < checkpointed, x, ctx, rope_q, rope_kv, attend, weight, fused, linear)
        return self.norm(x)

    def forward_train(self, ctx_features: torch.Tensor, block_embeds: torch.Tensor, block_positions: torch.Tensor,
                      attention: Attention | Sequence[Attention],
                      ctx_positions: torch.Tensor | None = None) -> torch.Tensor:
        """Training forward: all blocks of each sequence at once.

        ctx_features [B, L, n*H] (context position j = j, unless ctx_positions [B, L] says
        otherwise: packed rows restart positions per document), block_embeds [B, A*bs, H],
        block_positions [B, A*bs]; `attention` applies the block mask (see trainer.models.masks), one
        per layer where the layers' windows or causality differ (masks.block_attention).
        Returns the final hidden states of every block slot, [B, A*bs, H].
        """
        b, length = ctx_features.shape[:2]
        if block_embeds.shape[0] != b or block_positions.shape[0] != b:
            raise ValueError(f"context features hold {b} rows but the blocks {block_embeds.shape[0]}")
        if ctx_positions is None:
            ctx_positions = torch.arange(length, device=ctx_features.device).expand(b, length)
        return self._run(ctx_features, block_embeds, ctx_positions, block_positions, attention)

    @torch.no_grad()
    def draft_block(self, ctx_features: torch.Tensor, block_embeds: torch.Tensor, start: int) -> torch.Tensor:
        """Inference: one block at positions start.. after a context of positions 0..start-1.

        A full-attention non-causal layer sees everything (the context lies strictly before the
        anchor by construction, the block is bidirectional); a sliding or causal layer sees what
        vLLM's draft layer sees (`serving_mask`). Returns hidden states [B, bs, H].
        """
        b, length = ctx_features.shape[:2]
        assert length == start, f"context holds {length} positions but the block starts at {start}"
        dev = ctx_features.device
        ctx_positions = torch.arange(length, device=dev).expand(b, length)
        block_positions = torch.arange(start, start + block_embeds.shape[1], device=dev).expand(b, -1)

        valid = torch.ones(b, length, dtype=torch.bool, device=dev)
        c: DrafterConfig = getattr(self, "dflash", None) or self.config  # the exported model's config is Qwen3Config
        attends = serving_attention(c.layout.kinds(c.num_hidden_layers), valid, ctx_positions, block_positions)
        return self._run(ctx_features, block_embeds, ctx_positions, block_positions, attends)
