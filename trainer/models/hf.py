"""What the trainer reaches into a transformers model through.

A target's config fields and submodules (embed_tokens, layers, rotary_emb, norm, the LM head)
belong to its family, and torch types any attribute of a Module as `Tensor | Module`; these
functions are the one place they are looked up, typed Any. They import nothing from the trainer,
so the models' modules (target, stages, target_loading, decoder) all use them.
"""

from __future__ import annotations

from typing import Any

import torch


def hf_config(model: torch.nn.Module) -> Any:
    """A transformers model's config: its fields depend on the family (torch types any Module
    attribute as Tensor | Module, so the config is reached through here, typed Any)."""
    return model.config


def output_embeddings(model: torch.nn.Module) -> Any:
    """A transformers model's LM head (None when it has none), by its own method."""
    return getattr(model, "get_output_embeddings")()  # noqa: B009 - typed Any: the method is the family's own


def input_embeddings(model: torch.nn.Module) -> Any:
    """A transformers model's token embedding, by its own method."""
    return getattr(model, "get_input_embeddings")()  # noqa: B009 - typed Any: the method is the family's own


def base_model(target: torch.nn.Module) -> Any:
    """The decoder stack without the LM head (no vocab logits are computed for features). Typed Any:
    its submodules (embed_tokens, layers, rotary_emb, norm) are the family's own."""
    return getattr(target, str(target.base_model_prefix))
