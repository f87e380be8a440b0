"""The frozen target: building or loading it, and extracting DFlash context features."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from trainer.models.hf import base_model, hf_config, input_embeddings
from trainer.run.config import TinyTargetConfig
from trainer.run.family import LINEAR_MIXER, Family, family_of_dir, read_family

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

    from trainer.models.fp8 import FP8Converter
    from trainer.models.fp8_training import FP8Head
    from trainer.models.frozen_target import Target

# What Qwen3-8B and Qwen3-30B-A3B share (attention heads, vocabulary, positions, norms, rotary base)
_QWEN3_SHARED: dict[str, Any] = dict(num_attention_heads=32, head_dim=128, vocab_size=151936,
                                     max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                                     tie_word_embeddings=False)
QWEN3_8B_DIMS: dict[str, Any] = dict(_QWEN3_SHARED, hidden_size=4096, num_hidden_layers=36, num_key_value_heads=8,
                                     intermediate_size=12288)
QWEN3_8B_MASK_TOKEN_ID = 151669
# Qwen3-30B-A3B: 48 layers, every one sparse (128 experts of 768, 8 active), about 3.3B active parameters
QWEN3_30B_A3B_DIMS: dict[str, Any] = dict(_QWEN3_SHARED, hidden_size=2048, num_hidden_layers=48, num_key_value_heads=4,
                                          intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                                          num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                                          mlp_only_layers=[])

# Llama-3.3-70B (config.json of meta-llama/Llama-3.3-70B-Instruct; its llama3 rope scaling left out: shapes only)
LLAMA_3_3_70B_DIMS: dict[str, Any] = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                          num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                                          vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
                                          rope_theta=500000.0, tie_word_embeddings=False, hidden_act="silu")


def default_target_layer_ids(num_layers: int, count: int) -> list[int]:
    """`count` layer ids spaced evenly from 1 to num_layers-3 (36 layers, 5 -> 1, 9, 17, 25, 33)."""
    if count == 1:
        return [num_layers // 2]
    return spaced_layer_ids(1, min(num_layers - 1, max(num_layers - 3, count)), count)


def spaced_layer_ids(start: int, end: int, count: int) -> list[int]:
    """`count` (at least 2) layer ids spaced evenly from `start` to `end`, both included."""
    return [int(round(start + (end - start) * i / (count - 1))) for i in range(count)]


def tapped_layer_ids(configured: list[int] | None, count: int, layers: int) -> list[int]:
    """model.target_layer_ids (configured), else `count` spaced from 1 to layers-3; each must be a
    layer of the target (training and `python -m trainer plan` both ask here)."""
    layer_ids = configured or default_target_layer_ids(layers, count)
    for i in layer_ids:
        if not 0 <= i < layers:
            raise ValueError(f"model.target_layer_ids: {i} is not a layer of the {layers}-layer target")
    return layer_ids


def tiny_target(cfg: TinyTargetConfig, vocab_size: int, device: str = "cpu") -> Qwen3ForCausalLM:
    """A small random-weight Qwen3ForCausalLM of the real architecture, built in code."""
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(cfg.seed)
    return Qwen3ForCausalLM(config).to(device).eval()  # type: ignore[arg-type]  # transformers types PreTrainedModel.to's wrapper as taking the model


def random_8b_shape_target(device: str, dtype: torch.dtype = torch.bfloat16) -> Qwen3ForCausalLM:
    """A Qwen3-8B-shaped random target allocated directly on `device` in `dtype` (no CPU fp32 copy)."""
    return random_target(Qwen3Config(**QWEN3_8B_DIMS), device, dtype)


def random_target(config: Any, device: str, dtype: torch.dtype = torch.bfloat16) -> Any:
    """A random causal LM of `config`'s architecture allocated directly on `device` in `dtype`
    (e.g. Qwen3MoeConfig(**QWEN3_30B_A3B_DIMS): the 30B-A3B shape, 61 GB in bf16)."""
    config._attn_implementation = "sdpa"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def random_truncated_target(config: Any, device: str, layers: int, fp8: FP8Converter | None = None,
                            dtype: torch.dtype = torch.bfloat16, seed: int = 0, std: float = 0.02) -> Any:
    """A random causal LM of `config`'s architecture with only its embedding, LM head and decoder
    layers 0..layers-1 on `device` (the others stay on the meta device, as a target loaded for
    training: trainer.models.target_loading), built one layer at a time; fp8 converts each layer's
    linear layers as it is made (trainer.models.fp8.FP8Converter), so a 70B-shaped target never holds
    more than one layer in bf16. Weights normal(0, std), norms one, biases zero."""
    from trainer.models.hf import output_embeddings
    from trainer.models.target_loading import _rebuild_rotary, meta_model

    model = meta_model(config, dtype)
    base = base_model(model)
    generator = torch.Generator(device=device).manual_seed(seed)

    def materialize(module: torch.nn.Module) -> None:
        module.to_empty(device=device)
        with torch.no_grad():
            for name, p in module.named_parameters():
                if "norm" in name.rsplit(".", 1)[0].lower() or name.endswith("layernorm.weight"):
                    p.fill_(1.0)
                elif p.dim() < 2:
                    p.zero_()
                else:
                    p.normal_(0.0, std, generator=generator)
        for p in module.parameters():
            p.requires_grad_(False)

    materialize(base.embed_tokens)
    _rebuild_rotary(model, torch.device(device))
    for i in range(layers):
        materialize(base.layers[i])
        if fp8 is not None:
            fp8.convert(base.layers[i])
    materialize(output_embeddings(model))
    if layers == len(base.layers):
        materialize(base.norm)
    return model.eval()


def load_target(path: str, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """A Hugging Face causal LM from a local directory (nothing is downloaded), with the attention
    implementation its family needs (trainer.run.family: SDPA, or eager for gpt-oss's sinks).
    A vision-language checkpoint (Qwen3.5) loads as its text part."""
    fam = family_of_dir(path)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, local_files_only=True, attn_implementation=fam.attn_implementation if fam else "sdpa"
    )
    return model.to(device).eval()  # type: ignore[arg-type]  # transformers types PreTrainedModel.to's wrapper as taking the model


def target_family(target: torch.nn.Module) -> Family:
    """The Family of a loaded (or built) target, from its config."""
    return read_family(hf_config(target).to_dict())


def freeze(model: torch.nn.Module) -> torch.nn.Module:
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def num_layers(target: torch.nn.Module) -> int:
    return int(hf_config(target).num_hidden_layers)


def _sdpa_or_flex(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: object, dropout: float = 0.0, scaling: float | None = None,
                  **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' "sdpa" attention, extended: a flex BlockMask as the mask runs flex_attention
    (packed rows on CUDA, trainer.models.masks.document_causal_block_mask); anything else goes to the
    original SDPA function unchanged, so every other caller behaves exactly as before."""
    from torch.nn.attention.flex_attention import BlockMask

    if not isinstance(attention_mask, BlockMask):
        return _SDPA(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    from trainer.models.masks import _flex_fn

    flex = _flex_fn(query.device.type)
    out = flex(query, key, value, block_mask=attention_mask, scale=scaling, enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def _install_packed_attention() -> None:
    from transformers import AttentionInterface

    global _SDPA
    current = AttentionInterface._global_mapping["sdpa"]
    if current is not _sdpa_or_flex:
        _SDPA = current
        AttentionInterface.register("sdpa", _sdpa_or_flex)


_SDPA: Any = None  # transformers' own "sdpa" attention function, set by _install_packed_attention()
_install_packed_attention()


def base_layers(model: torch.nn.Module) -> list[Any]:
    """The decoder layers of a base model."""
    return list(getattr(model, "layers"))  # noqa: B009 - typed Any: the family's own layers


def _kinds(model: torch.nn.Module) -> list[str]:
    """The kind of each decoder layer (trainer.run.family.KINDS)."""
    return list(read_family(hf_config(model).to_dict()).layer_kinds)


def needs_explicit_masks(model: torch.nn.Module) -> bool:
    """Whether plain causal rows still need masks built by the trainer: an attention implementation
    without SDPA's is_causal (eager: gpt-oss), or sliding-window layers (a window is a mask)."""
    return hf_config(model)._attn_implementation != "sdpa" or "sliding_attention" in _kinds(model)


def packed_mask_mapping(model: torch.nn.Module, doc_start: torch.Tensor | None) -> dict:
    """The per-layer-type attention masks handed to the decoder layers (trainer.models.stages).

    None: plain causal (right-padded rows; SDPA is_causal). doc_start [B, L]: causal inside each
    document of a packed row, as a flex BlockMask on CUDA (SDPA families) and a dense mask
    elsewhere (boolean; additive float for eager attention, which adds it to the scores);
    sliding-window layers see the last `sliding_window` keys of their own document;
    linear-attention layers get no mask (they run per document, `_documents_apart`)."""
    kinds = sorted(set(_kinds(model)))
    masks: dict[str, BlockMask | torch.Tensor | None] = dict.fromkeys(kinds)
    if doc_start is None:
        return masks
    from trainer.models.masks import document_causal_block_mask, document_causal_dense

    sdpa = hf_config(model)._attn_implementation == "sdpa"
    dtype = next(model.parameters()).dtype

    def dense(window: int | None) -> torch.Tensor:
        mask = document_causal_dense(doc_start, window=window)
        if sdpa:
            return mask
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)

    for kind in kinds:
        if kind == "full_attention":
            masks[kind] = document_causal_block_mask(doc_start) if sdpa and doc_start.device.type == "cuda" \
                else dense(None)
        elif kind == "sliding_attention":
            masks[kind] = dense(hf_config(model).sliding_window)
    return masks


def _segments(doc_start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every document of a packed batch as one padded row: (row [D, T], column [D, T], valid [D, T])
    index tensors, T the longest document. The padding tail of a row counts as a document."""
    starts = doc_start.cpu()
    b, length = starts.shape
    ar = torch.arange(length)
    docs = [(r, int(s), int(e)) for r in range(b)
            for s, e in zip(*_bounds(ar[starts[r] == ar], length)) if e > s]
    longest = max(e - s for _, s, e in docs)
    offsets = torch.arange(longest)
    rows = torch.tensor([r for r, _, _ in docs])[:, None].expand(-1, longest)
    cols = torch.tensor([s for _, s, _ in docs])[:, None] + offsets
    valid = cols < torch.tensor([e for _, _, e in docs])[:, None]
    dev = doc_start.device
    return rows.to(dev), cols.clamp(max=length - 1).to(dev), valid.to(dev)


def _bounds(firsts: torch.Tensor, length: int) -> tuple[list[int], list[int]]:
    starts = firsts.tolist()
    return starts, starts[1:] + [length]


@contextlib.contextmanager
def _documents_apart(model: torch.nn.Module, doc_start: torch.Tensor | None) -> Iterator[None]:
    """Inside: every linear-attention layer of `model` runs each document of the packed batch on
    its own, from a zero state (its conv window and recurrent state never cross a document start),
    all documents of the batch in one call (right-padded: a recurrence is causal, so the padding
    after a document never reaches it). The layers' own forward runs (transformers' code, with its
    kernels where installed); only its input rows are rearranged."""
    mixers = [getattr(layer, LINEAR_MIXER) for layer, kind in zip(base_layers(model), _kinds(model))
              if kind == "linear_attention"]
    if doc_start is None or not mixers:
        yield
        return
    rows, cols, valid = _segments(doc_start)

    def per_document(forward: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def run(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            kwargs.pop("attention_mask", None)
            x = hidden_states[rows, cols] * valid[..., None].to(hidden_states.dtype)
            y = forward(x, *args, attention_mask=None, **kwargs)
            out = y.new_zeros(*hidden_states.shape[:2], y.shape[-1])
            out[rows[valid], cols[valid]] = y[valid]
            return out
        return run

    for m in mixers:
        m.forward = per_document(m.forward)
    try:
        yield
    finally:
        for m in mixers:
            del m.forward  # back to the class's forward


@torch.no_grad()
def target_context_features(
    target: Target | torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | dict | None,  # a tensor, or a prebuilt per-layer-type mapping
    layer_ids: list[int],
    doc_start: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    top: torch.Tensor | None = None,
) -> torch.Tensor:
    """Hidden states after each target layer in `layer_ids`, concatenated: [B, L, n*H].

    target: a Target (its stages), or a module: one stage on its embedding's device.
    Layer id i means the output of decoder layer i (hidden_states[i + 1] of the Hugging Face model;
    index 0 is the embedding), as the published DFlash drafts expect. Only layers 0..max(layer_ids)
    run, no final norm, and only the tapped outputs are kept (trainer.models.stages).

    attention_mask: a [B, L] tensor of right-padded rows (attention is causal, so a real position
    never sees the padding after it and its features do not depend on the mask: it runs as plain
    causal attention), or a prebuilt per-layer-type mapping. doc_start [B, L] (packed rows,
    trainer.data.packing): attention is causal inside each document, positions restart at every
    document and linear-attention layers restart their state at every document, so each
    document's features equal those of the document run alone; attention_mask is then ignored.
    out: written in place. top [B, L, H]: also run the layers above the last tapped one and the final
    norm on the last stage, written into `top`: the target's last hidden states, what its LM head reads
    (model.loss kl; the layers must be loaded: trainer.models.target_loading.complete_for_decoding).
    """
    from trainer.models.frozen_target import as_target
    from trainer.models.stages import feature_layers, tap_columns

    plan, target = as_target(target).plan, as_target(target).module
    taps = tap_columns(layer_ids)
    last = feature_layers(layer_ids)
    x: torch.Tensor = input_ids
    if out is None:
        width = len(layer_ids) * int(hf_config(target).hidden_size)
        out = torch.empty(*input_ids.shape, width, dtype=input_embeddings(target).weight.dtype,
                          device=plan.devices[-1])
    for s, ((lo, hi), device) in enumerate(zip(plan.bounds, plan.devices)):
        hi = min(hi, last) if s < len(plan) - 1 else last
        if lo >= hi:
            break
        mapping = attention_mask if isinstance(attention_mask, dict) and s == 0 and doc_start is None else None
        x = stage_context_features(target, x.to(device, non_blocking=True), lo, hi, taps, out,
                                   None if doc_start is None else doc_start.to(device, non_blocking=True), mapping,
                                   top=top if s == len(plan) - 1 else None)
    return out


def last_hidden_buffer(target: Target | torch.nn.Module, batch: int, length: int) -> torch.Tensor:
    """An uninitialised [B, L, H] tensor for `target_context_features(top=...)`, on the last stage."""
    from trainer.models.frozen_target import as_target

    t = as_target(target)
    return torch.empty(batch, length, int(hf_config(t.module).hidden_size),
                       dtype=input_embeddings(t.module).weight.dtype, device=t.plan.devices[-1])


def stage_context_features(target: torch.nn.Module, x: torch.Tensor, lo: int, hi: int, taps: dict[int, list[int]],
                           out: torch.Tensor, doc_start: torch.Tensor | None = None,
                           mapping: dict | None = None,
                           pending: list[tuple[int, torch.Tensor]] | None = None,
                           top: torch.Tensor | None = None) -> torch.Tensor:
    """One stage of `target_context_features`: decoder layers lo..hi-1 on x's device (x: input ids when
    lo == 0, else the hidden states after layer lo-1), tapped outputs copied into `out`; returns the
    hidden states after layer hi-1. mapping: a prebuilt per-layer-type mask mapping, else built here
    (causal, or per document when doc_start is given). pending: see trainer.models.stages.run_layers.
    top: the last stage of a model.loss kl run: also the layers from hi to the model's last and the
    final norm, written into top [B, L, H] (see target_context_features)."""
    from trainer.models.stages import run_layers, stage_inputs

    model = base_model(target)
    hidden = model.embed_tokens(x) if lo == 0 else x
    if mapping is None and doc_start is None and needs_explicit_masks(model):
        # one document per row: the causal (and windowed) masks eager attention and windows need
        mapping = packed_mask_mapping(model, torch.zeros(hidden.shape[:2], dtype=torch.long, device=hidden.device))
    elif mapping is None:
        mapping = packed_mask_mapping(model, doc_start)
    with _documents_apart(model, doc_start):
        inputs = stage_inputs(model, hidden, mapping, doc_start)
        hidden = run_layers(model, hidden, lo, hi, inputs, taps, out, pending)
        if top is not None:
            above = run_layers(model, hidden, hi, len(model.layers), inputs, {}, out)  # pre-norm, as returned
            top.copy_(model.norm(above))
        return hidden


def compile_decoder_layers(target: torch.nn.Module) -> int:
    """torch.compile every decoder layer of the target (static shapes), fusing its norms, RoPE and
    SiLU into the matmuls' neighbours. Layers share one compiled graph (their parameters are
    inputs, not constants). Only for a fixed set of shapes warmed on one thread before workers
    start (trainer.pipeline.compile_safety); returns the number of layers wrapped.

    Linear-attention layers stay eager: packed rows run them per document by swapping their
    mixer's forward for the batch (`_documents_apart`), which a compiled graph would guard on and
    recompile for at every batch."""
    model = base_model(target)
    wrapped = 0
    for layer, kind in zip(base_layers(model), _kinds(model)):
        if kind == "linear_attention":
            continue
        if not _compiled(layer):
            layer.compile(dynamic=False)
        wrapped += 1
    return wrapped


def uncompile_decoder_layers(target: torch.nn.Module) -> None:
    """Undo `compile_decoder_layers` (evaluation and drafting meet a new length at every call)."""
    for layer in base_model(target).layers:
        if _compiled(layer):
            layer._compiled_call_impl = None


def _compiled(layer: torch.nn.Module) -> bool:
    """Whether `nn.Module.compile` wrapped the layer: torch's own record of it (what its __call__ runs)."""
    return getattr(layer, "_compiled_call_impl", None) is not None


class FrozenHead(torch.nn.Module):
    """The target's input embedding and LM head, frozen, on the drafter's device."""

    embed_weight: torch.Tensor  # buffers (register_buffer below)
    lm_head_weight: torch.Tensor

    def __init__(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor):
        super().__init__()
        self.register_buffer("embed_weight", embed_weight, persistent=False)
        self.register_buffer("lm_head_weight", lm_head_weight, persistent=False)
        self.fp8_copies: FP8Head | None = None  # fp8(): made at first use

    @classmethod
    def from_target(cls, target: Target | torch.nn.Module, device: str | torch.device) -> "FrozenHead":
        from trainer.models.target_loading import head_weights

        return cls(*head_weights(target, device))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, self.embed_weight)

    def fp8(self) -> FP8Head:
        """The LM head in e4m3 for FP8 training matmuls (model.drafter.precision fp8), made at first use
        and kept while the head's weight is the same tensor (it is frozen)."""
        from trainer.models.fp8_training import FP8Head

        if self.fp8_copies is None or self.fp8_copies.source is not self.lm_head_weight:
            self.fp8_copies = FP8Head(self.lm_head_weight)
        return self.fp8_copies

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.lm_head_weight.to(hidden.dtype).t()


def fit_tiny_target(
    target: torch.nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    steps: int,
    lr: float,
    log: Callable[[str], None] = print,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Briefly train a tiny random target as a language model on the training conversations.

    A random-weight target's greedy continuations are noise, so a drafter could not match
    them and τ would say nothing. After this fit the target continues the synthetic patterns,
    and the drafter is measured against the target's own greedy outputs.
    """
    target.train()
    for p in target.parameters():
        p.requires_grad_(True)
    opt = torch.optim.AdamW(target.parameters(), lr=lr, weight_decay=0.0)
    for step in range(steps):
        input_ids, attention_mask = batches[step % len(batches)]
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        loss = target(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if progress is not None:
            progress(step + 1)
        if step % 50 == 0 or step == steps - 1:
            log(f"target fit step {step + 1}/{steps} lm_loss {loss.item():.3f}")
    freeze(target).eval()
