"""The exported draft's model code, for `AutoModel.from_pretrained(export, trust_remote_code=True)`.

`trainer.models.export` writes this file beside the weights as `modeling_dflash.py`, with the
trainer modules it reaches (drafter.py, dflash2.py, layout.py), their imports of each other made
relative (`export.model_code`: so they may import only torch, transformers, the standard library and
each other), and names the class in config.json's `auto_map`. The class holds the drafter's weights under the
published names (fc, hidden_norm, layers.N.*, norm; DFlash2: layers.N.attention_conv.*,
layers.N.mlp_conv.*, candidate_selector.*) and runs the trainer's own drafting code, so it drafts
exactly what the trained drafter drafts (`propose(hidden, logits_of, anchor)`: DFlash2's selector
walk). config.json stays the Qwen3 config SGLang and vLLM read; a separate mask embedding is read
from mask_embedding.pt beside the weights, as vLLM reads it (`from_pretrained`).
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
from torch import nn
from transformers import PreTrainedModel, Qwen3Config
from transformers.utils import cached_file

# transformers copies into its module cache only the files this one imports itself (5.5, a declared
# floor: not those its imports import), so it names every module of the export (export.model_code checks)
from trainer.models.dflash2 import walk  # noqa: F401 - imported for the copy (drafter.py uses it)
from trainer.models.drafter import DFlashDrafter, DrafterConfig, build_drafter_modules, propose
from trainer.run.layout import MASK_EMBEDDING, generation, resolve_published


def load_mask_embedding(path: str | os.PathLike, mask_token_id: int) -> torch.Tensor:
    """A draft's mask_embedding.pt as a [hidden] fp32 tensor: a tensor, or {"embedding": tensor,
    "mask_token_id": id} (vLLM's two forms; ValueError when the id is not the config's)."""
    state = torch.load(path, weights_only=True, map_location="cpu")
    if isinstance(state, dict):
        if state.get("mask_token_id", mask_token_id) != mask_token_id:
            raise ValueError(f"{path}: mask_token_id {state.get('mask_token_id')} is not "
                             f"dflash_config.mask_token_id {mask_token_id}")
        state = state["embedding"]
    return state.reshape(-1).float()


def drafter_config(config: Qwen3Config) -> DrafterConfig:
    """The DrafterConfig a published DFlash config.json describes: its layout and generation as
    trainer.run.layout reads them for vLLM (resolve_published, generation: written beside this file)."""
    published = config.to_dict()
    rope = getattr(config, "rope_parameters", None) or {}
    dflash = config.dflash_config
    return DrafterConfig(
        hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads or config.num_attention_heads,  # None: no grouping
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        vocab_size=config.vocab_size, block_size=config.block_size, mask_token_id=dflash["mask_token_id"],
        target_layer_ids=list(dflash["target_layer_ids"]), num_target_layers=config.num_target_layers,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 1000000.0))),
        max_position_embeddings=config.max_position_embeddings, layout=resolve_published(published),
        **generation(published))


class DFlashDraftModel(PreTrainedModel):
    """A DFlash draft: `draft_block(ctx_features, block_embeds, start)` -> hidden states [B, bs, H].

    ctx_features: the target's hidden states of the tapped layers (dflash_config.target_layer_ids,
    concatenated) for positions 0..start-1; block_embeds: the target's embeddings of the anchor
    token followed by block_size - 1 mask tokens. The target's LM head turns the result into drafts."""

    config_class = Qwen3Config
    _no_split_modules = ["DrafterLayer"]

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        self.dflash = drafter_config(config)
        build_drafter_modules(self, self.dflash)
        self.post_init()

    _compute_dtype = DFlashDrafter._compute_dtype
    _run = DFlashDrafter._run
    draft_block = DFlashDrafter.draft_block  # the same code on the same weight names

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any) -> Any:
        """transformers' loading, then the mask slots' own embedding where the draft ships one
        (mask_embedding.pt: vLLM reads it from there, so it is not among model.safetensors' tensors)."""
        loaded = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        model: Any = loaded[0] if isinstance(loaded, tuple) else loaded  # output_loading_info=True: (model, info)
        path = cached_file(pretrained_model_name_or_path, MASK_EMBEDDING, _raise_exceptions_for_missing_entries=False,
                           **{k: kwargs[k] for k in ("cache_dir", "revision", "token", "local_files_only",
                                                    "subfolder") if k in kwargs})
        if path is not None:
            weight = model.fc.weight
            embedding = load_mask_embedding(path, model.dflash.mask_token_id)
            model.mask_embedding = nn.Parameter(embedding.to(weight.device, weight.dtype))
            model.dflash.mask_embedding = True
        return loaded

    def forward(self, ctx_features: torch.Tensor, block_embeds: torch.Tensor, start: int) -> torch.Tensor:
        return self.draft_block(ctx_features, block_embeds, start)  # type: ignore[misc]  # borrowed method

    def embed_block(self, embed: Callable[[torch.Tensor], torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
        """The block's input embeddings from the target's `embed` (mask embedding, DFlash2's scale)."""
        return DFlashDrafter.embed_block(self, embed, ids)  # type: ignore[arg-type]  # same attributes

    def propose(self, hidden: torch.Tensor, logits_of: Callable[[torch.Tensor], torch.Tensor],
                anchor: torch.Tensor) -> torch.Tensor:
        """Greedy draft tokens of the slots past the anchor (hidden [B, bs - 1, H]; logits_of: the
        target's LM head): the argmax (DFlash) or the candidate selector's walk (DFlash2)."""
        return propose(self, logits_of, hidden, anchor)
