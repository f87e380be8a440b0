"""What kind of target a model directory holds, read from its config.json alone (stdlib only: the
config loader, `python -m trainer data-report` and `dflash-ops doctor --config` read it without torch).

A family is the architecture transformers ships for the config's model_type. The trainer never
copies modelling code; what it needs to know about a family is here: the kind of each decoder
layer (full attention, sliding-window attention, linear attention), which layers are MoE, the
attention implementation the family needs, whether packed rows are exact for it, and about how
many parameters (so bytes) the target holds.

    full_attention     causal attention; packed rows: causal inside each document (a mask)
    sliding_attention  the same inside a window of `sliding_window` keys (the window is cut at the
                       document's start too, so a packed row equals each conversation alone)
    linear_attention   a recurrent layer (Gated DeltaNet in Qwen3.5 / Qwen3-Next): its state runs
                       along the row, so a packed row runs these layers per document
                       (trainer.models.target: the state starts from zero at each document)
"""

from __future__ import annotations

import importlib.metadata
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

KINDS = ("full_attention", "sliding_attention", "linear_attention")

# model_type -> the family's name in logs and docs. Every one is tested end to end on CPU
# (tests/trainer/test_families.py) from a directory written by trainer_tools.fixtures.hub_model.
SUPPORTED = {
    "qwen3": "Qwen3", "qwen2": "Qwen2/Qwen2.5", "llama": "Llama 3.x", "qwen3_moe": "Qwen3-MoE",
    "gpt_oss": "gpt-oss", "qwen3_5": "Qwen3.5 (text part)", "qwen3_5_text": "Qwen3.5 (text part)",
    "qwen3_5_moe": "Qwen3.5-MoE (text part)", "qwen3_5_moe_text": "Qwen3.5-MoE (text part)",
    "qwen3_next": "Qwen3-Next",
}
# Families whose attention needs an implementation other than SDPA, and why (said in the run log).
ATTENTION = {
    "gpt_oss": ("eager", "attention sinks: transformers' SDPA path has none for gpt-oss"),
}
# The oldest transformers the trainer runs with (pyproject's trainer extra and trainer/requirements.txt
# declare the same; tests/trainer/test_dependency_floors.py holds them equal), and, where a family needs a
# newer one, that family's own minimum. Both are checked at config load (`transformers_refusal`). The
# deps_floor tier (.ci/deps-venv) trains every family under each of these versions and under the newest.
TRANSFORMERS_FLOOR = "5.5"  # 5.5: transformers.cache_utils.LinearAttentionCacheLayerMixin (τ on a model's cache)
# Linear-attention models (Qwen3.5, Qwen3-Next) take a per-layer-type mask mapping (the trainer's packed
# and τ masks) from 5.13 on (before: 'dict' object has no attribute 'ndim'), and 5.13's linear-attention
# cache layers hold their states in a layout τ's per-row restore does not match (a size mismatch): 5.14.
_LINEAR_MIN = "5.14"
TRANSFORMERS_MIN = {"qwen3_5": _LINEAR_MIN, "qwen3_5_text": _LINEAR_MIN, "qwen3_5_moe": _LINEAR_MIN,
                    "qwen3_5_moe_text": _LINEAR_MIN, "qwen3_next": _LINEAR_MIN}
LINEAR_MIXER = "linear_attn"  # the decoder layer's attribute holding a linear-attention layer
# Quantized checkpoints the loader reads (quantization_config.quant_method), and how; any other is
# refused by name: its tensors cast as plain weights would be wrong without a word.
QUANTIZATIONS = {"mxfp4": "MXFP4 experts decoded to the run's dtype at load",
                 "fp8": "FP8 weights decoded to the run's dtype at load"}


@dataclass(frozen=True)
class Family:
    model_type: str
    name: str
    architecture: str
    layer_kinds: tuple[str, ...]  # per decoder layer, one of KINDS
    moe_layers: tuple[int, ...] = ()
    experts: int = 0
    experts_active: int = 0
    sliding_window: int | None = None
    params: int = 0  # estimated parameters of the causal LM (embeddings and LM head included)
    attn_implementation: str = "sdpa"
    attn_reason: str = ""
    pack_refusal: str | None = None  # why packed rows cannot be exact, or None
    quantization: str | None = None  # the checkpoint's quantization_config.quant_method, if any
    dims: dict = field(default_factory=dict)  # hidden_size, intermediate_size, heads, ... (the drafter's shape)

    @property
    def layers(self) -> int:
        return len(self.layer_kinds)

    def layers_of(self, kind: str) -> list[int]:
        return [i for i, k in enumerate(self.layer_kinds) if k == kind]

    def bytes(self, dtype_bytes: int = 2) -> int:
        return self.params * dtype_bytes

    @property
    def quantization_refusal(self) -> str | None:
        """Why the trainer cannot read this checkpoint's weights, or None."""
        if self.quantization is None or self.quantization in QUANTIZATIONS:
            return None
        return (f"the checkpoint is quantized ({self.quantization}); the trainer reads plain weights, FP8 "
                "(block-scaled, as Qwen3-FP8) and MXFP4 (gpt-oss) only: use the model's bf16 checkpoint")

    def summary(self) -> str:
        """One line: family, layers by kind, MoE, quantization, attention implementation."""
        counts = [f"{len(self.layers_of(k))} {k.replace('_attention', '')}" for k in KINDS if self.layers_of(k)]
        window = f" (window {self.sliding_window})" if self.layers_of("sliding_attention") else ""
        moe = (f", MoE in {len(self.moe_layers)} layers ({self.experts} experts, {self.experts_active} active)"
               if self.moe_layers else "")
        attn = f", attention {self.attn_implementation}" + (f" ({self.attn_reason})" if self.attn_reason else "")
        quant = f", {QUANTIZATIONS.get(self.quantization, self.quantization)}" if self.quantization else ""
        return (f"{self.name} ({self.architecture}): {self.layers} layers: {', '.join(counts)}{window}{moe}, "
                f"~{_count(self.params)} parameters{quant}{attn}")

    def layer_table(self) -> str:
        """Layer ids by kind, compressed into ranges: `linear 0-2,4-6; full 3,7`."""
        parts = [f"{k.replace('_attention', '')} {_ranges(self.layers_of(k))}" for k in KINDS if self.layers_of(k)]
        if self.moe_layers:
            parts.append(f"MoE {_ranges(list(self.moe_layers))}")
        return "; ".join(parts)


def _count(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def _ranges(ids: list[int]) -> str:
    out, i = [], 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)


def text_config(config: dict) -> dict:
    """The decoder's config: a vision-language checkpoint's text_config (Qwen3.5), else the config."""
    text = config.get("text_config")
    return {**text, "architectures": config.get("architectures")} if isinstance(text, dict) else config


def _layer_kinds(c: dict, n: int) -> tuple[str, ...]:
    kinds = c.get("layer_types")
    if kinds:
        return tuple(kinds[:n])
    interval = c.get("full_attention_interval")
    if interval and c.get("linear_num_value_heads"):  # hybrid configs without layer_types (transformers' default)
        return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n))
    window = c.get("sliding_window") if c.get("use_sliding_window", True) else None
    if window and c.get("model_type") in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe"):
        first = c.get("max_window_layers", n)  # Qwen: layers from max_window_layers on use the window
        return tuple("sliding_attention" if i >= first else "full_attention" for i in range(n))
    if window:
        return ("sliding_attention",) * n
    return ("full_attention",) * n


def _moe(c: dict, n: int) -> tuple[tuple[int, ...], int, int]:
    experts = c.get("num_experts") or c.get("num_local_experts") or 0
    if not experts:
        return (), 0, 0
    active = c.get("num_experts_per_tok") or c.get("experts_per_token") or 0
    step = c.get("decoder_sparse_step") or 1
    dense = set(c.get("mlp_only_layers") or [])
    return tuple(i for i in range(n) if i not in dense and (i + 1) % step == 0), experts, active


def _params(c: dict, kinds: tuple[str, ...], moe_layers: tuple[int, ...], experts: int) -> int:
    h, v = c["hidden_size"], c.get("vocab_size", 0)
    heads, kv = c["num_attention_heads"], c.get("num_key_value_heads") or c["num_attention_heads"]
    hd = c.get("head_dim") or h // heads
    gate = 2 if c.get("attn_output_gate") or c.get("model_type") == "qwen3_next" else 1
    attention = h * heads * hd * (gate + 1) + 2 * h * kv * hd
    nk, nv = c.get("linear_num_key_heads", 0), c.get("linear_num_value_heads", 0)
    dk, dv = c.get("linear_key_head_dim", 0), c.get("linear_value_head_dim", 0)
    conv = 2 * nk * dk + nv * dv
    linear = h * (conv + nv * dv + 2 * nv) + nv * dv * h + conv * c.get("linear_conv_kernel_dim", 4)
    dense = 3 * h * c.get("intermediate_size", 0)
    expert = 3 * h * (c.get("moe_intermediate_size") or c.get("intermediate_size", 0))
    shared = 3 * h * c.get("shared_expert_intermediate_size", 0)
    total = v * h * (1 if c.get("tie_word_embeddings") else 2)
    for i, kind in enumerate(kinds):
        total += linear if kind == "linear_attention" else attention
        total += experts * expert + h * experts + shared if i in moe_layers else dense
    return total


def read_family(config: dict) -> Family:
    """The Family of a model's config.json (as a dict). A model_type outside SUPPORTED still gets a
    Family (the trainer tries it as a dense model); its pack_refusal says what is unknown."""
    c = text_config(config)
    model_type = c.get("model_type") or config.get("model_type") or "?"
    n = c["num_hidden_layers"]
    kinds = _layer_kinds(c, n)
    moe_layers, experts, active = _moe(c, n)
    impl, reason = ATTENTION.get(model_type, ("sdpa", ""))
    refusal = None
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        refusal = (f"{model_type} has {', '.join(unknown)} layers: the trainer knows no exact per-document form "
                   f"of them (packing is exact for {', '.join(KINDS)})")
    elif model_type not in SUPPORTED:
        refusal = f"{model_type} is not a family the trainer has tested packing for ({', '.join(sorted(SUPPORTED))})"
    arch = (config.get("architectures") or ["?"])[0]
    dims = {k: c[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                              "head_dim", "num_hidden_layers", "vocab_size") if k in c}
    return Family(model_type=model_type, name=SUPPORTED.get(model_type, model_type), architecture=arch,
                  layer_kinds=kinds, moe_layers=moe_layers, experts=experts, experts_active=active,
                  sliding_window=c.get("sliding_window") if "sliding_attention" in kinds else None,
                  params=_params(c, kinds, moe_layers, experts), attn_implementation=impl, attn_reason=reason,
                  pack_refusal=refusal, dims=dims,
                  quantization=(config.get("quantization_config") or {}).get("quant_method"))


def version_tuple(version: str) -> tuple[int, ...]:
    """The release numbers of a version string: "5.13.0.dev0" -> (5, 13, 0), "2.13.0+cpu" -> (2, 13, 0)."""
    numbers = []
    for part in version.split("+")[0].split("."):
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        numbers.append(int(digits.group()))
        if digits.group() != part:
            break
    return tuple(numbers)


def installed_transformers() -> str | None:
    """The version of transformers this python would import (package metadata: nothing imported), or None."""
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None


def transformers_minimum(model_type: str) -> str:
    """The oldest transformers a target of this model_type trains with: its family's own, else the floor."""
    return TRANSFORMERS_MIN.get(model_type, TRANSFORMERS_FLOOR)


def transformers_refusal(model_type: str, installed: str | None) -> str | None:
    """One line where the installed transformers is older than this family needs, else None (also when
    transformers is not installed here: the operator's side reads configs of runs elsewhere)."""
    need = transformers_minimum(model_type)
    if installed is None or version_tuple(installed) >= version_tuple(need):
        return None
    if model_type in TRANSFORMERS_MIN:
        return f"{SUPPORTED[model_type].split(' (')[0]} targets need transformers >= {need} (installed: {installed})"
    return f"the trainer needs transformers >= {need} (installed: {installed})"


def family_of_dir(path: str | Path) -> Family | None:
    """The Family of a model directory, or None where it has no readable config.json (e.g. a path on
    another machine)."""
    try:
        return read_family(json.loads((Path(path) / "config.json").read_text()))
    except (OSError, ValueError, KeyError):
        return None
