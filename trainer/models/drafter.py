"""The DFlash drafter: Qwen3-style decoder layers with the target's context injected as K/V.

Parameter names match the published DFlash drafts (fc, hidden_norm, layers.N.self_attn.*,
layers.N.mlp.*, norm), so an exported directory loads in SGLang / vLLM.

Two forwards over the same layers, deliberately separate so their parity can be tested:
`forward_train` (many blocks of one sequence at once, under a block mask) and
`draft_block` (one block after a context, everything visible, as at inference).
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Any, Callable, cast

import torch
import torch.nn.functional as F
from torch import nn


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

    @classmethod
    def from_target(cls, target_config: Any, num_layers: int, block_size: int, mask_token_id: int,
                    target_layer_ids: list[int]) -> "DrafterConfig":
        rope = getattr(target_config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(target_config, "rope_theta", 1000000.0))
        return cls(
            hidden_size=target_config.hidden_size,
            intermediate_size=target_config.intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=target_config.num_attention_heads,
            num_key_value_heads=target_config.num_key_value_heads,
            head_dim=getattr(target_config, "head_dim", None)
            or target_config.hidden_size // target_config.num_attention_heads,
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
        return asdict(self)


# Pointwise pieces run as one fused kernel each (forward and backward) on CUDA via torch.compile
# while training (grad enabled); eagerly elsewhere: CPU tests need no compiler, and inference
# (evaluation, drafting) meets a new context length at every call. Static shapes: the pipeline
# warms each shape once on one thread before its workers start (trainer.pipeline.compile_safety).
COMPILE_POINTWISE = True  # bench/drafter_mfu.py turns it off for its baseline
_compiled: dict[Callable, Callable] = {}


def pointwise(fn: Callable) -> Callable:
    @functools.wraps(fn)  # call.__wrapped__ is fn
    def call(x: torch.Tensor, *args: Any, compiled: bool | None = None) -> Any:
        if compiled is None:
            compiled = torch.is_grad_enabled()
        if not (compiled and COMPILE_POINTWISE and x.is_cuda):
            return fn(x, *args)
        if fn not in _compiled:
            _compiled[fn] = torch.compile(fn, dynamic=False)
        return _compiled[fn](x, *args)

    return call


@pointwise
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalised in fp32; returned in x's dtype (the fp32 master weight is cast, not x upcast)."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(dtype) * x.to(dtype)


@pointwise
def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


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


@pointwise
def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE to x [B, heads, T, D] with cos/sin [B, T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    return x * cos + rotated * sin


Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class DrafterAttention(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, rope_q: tuple[torch.Tensor, torch.Tensor],
                rope_kv: tuple[torch.Tensor, torch.Tensor], attention: Attention) -> torch.Tensor:
        """Queries from the block x; keys/values from [context | block]."""
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.heads, self.head_dim)).transpose(1, 2)
        kv_in = torch.cat([ctx, x], dim=1)
        k = self.k_norm(self.k_proj(kv_in).view(b, kv_in.shape[1], self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, kv_in.shape[1], self.kv_heads, self.head_dim).transpose(1, 2)
        q = _rotate(q, *rope_q)
        k = _rotate(k, *rope_kv)
        out = attention(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class DrafterMLP(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


class DrafterLayer(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DrafterAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = DrafterMLP(c)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, rope_q: tuple[torch.Tensor, torch.Tensor],
                rope_kv: tuple[torch.Tensor, torch.Tensor], attention: Attention) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_q, rope_kv, attention)
        return x + self.mlp(self.post_attention_layernorm(x))


def build_drafter_modules(module: nn.Module, c: DrafterConfig) -> None:
    """The drafter's parameters, named as in the published drafts, set on `module`.

    Shared by DFlashDrafter and the exported model's `DFlashDraftModel` (a transformers
    PreTrainedModel), so both hold the same weights under the same names and run the same code."""
    module.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
    module.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
    module.layers = nn.ModuleList(DrafterLayer(c) for _ in range(c.num_hidden_layers))
    module.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
    module.rope = (c.head_dim, c.rope_theta)  # type: ignore[assignment]  # torch types Module attributes as Tensor | Module


class DFlashDrafter(nn.Module):
    fc: nn.Linear  # as build_drafter_modules sets them
    hidden_norm: RMSNorm
    layers: nn.ModuleList
    norm: RMSNorm
    rope: tuple[int, float]

    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.config = c
        build_drafter_modules(self, c)
        self.reset_parameters()

    def blocks(self) -> list[DrafterLayer]:
        """The layers, typed (ModuleList's stubs type its items as Module)."""
        return cast(list[DrafterLayer], list(self.layers))

    def reset_parameters(self, std: float = 0.02) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    def _compute_dtype(self, device_type: str) -> torch.dtype:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
        return self.fc.weight.dtype

    def _run(self, ctx_features: torch.Tensor, block_embeds: torch.Tensor, ctx_positions: torch.Tensor,
             block_positions: torch.Tensor, attention: Attention) -> torch.Tensor:
        dtype = self._compute_dtype(block_embeds.device.type)
        ctx = self.hidden_norm(self.fc(ctx_features.to(dtype)))
        x = block_embeds.to(dtype)
        head_dim, theta = self.rope
        rope_q = rope_cos_sin(block_positions, head_dim, theta)
        rope_kv = rope_cos_sin(torch.cat([ctx_positions, block_positions], dim=1), head_dim, theta)
        for layer in self.layers:
            x = layer(x, ctx, rope_q, rope_kv, attention)
        return self.norm(x)

    def forward_train(self, ctx_features: torch.Tensor, block_embeds: torch.Tensor, block_positions: torch.Tensor,
                      attention: Attention,
                      ctx_positions: torch.Tensor | None = None) -> torch.Tensor:
        """Training forward: all blocks of each sequence at once.

        ctx_features [B, L, n*H] (context position j = j, unless ctx_positions [B, L] says
        otherwise: packed rows restart positions per document), block_embeds [B, A*bs, H],
        block_positions [B, A*bs]; `attention` applies the block mask (see trainer.models.masks).
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

        Everything is visible (the context lies strictly before the anchor by construction,
        the block is bidirectional), so no mask is needed. Returns hidden states [B, bs, H].
        """
        b, length = ctx_features.shape[:2]
        assert length == start, f"context holds {length} positions but the block starts at {start}"
        dev = ctx_features.device
        ctx_positions = torch.arange(length, device=dev).expand(b, length)
        block_positions = torch.arange(start, start + block_embeds.shape[1], device=dev).expand(b, -1)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=k.shape[1] != q.shape[1])

        return self._run(ctx_features, block_embeds, ctx_positions, block_positions, attend)
