"""The frozen target as one value: its torch module and every fact the trainer decided about it.

A fact about the target (where it was read from, its precision, its stages, ...) travels here, on
the target's own object, never as a private attribute stamped onto the torch module and found again
by `getattr` or by scanning its modules (SpecForge's TargetEngine, nanoGPT's GPTConfig). The loaders
build it once (trainer.models.target_loading.load_staged and place; trainer.train.components.
build_target); every replica (target_loading.replica_target), stage (trainer.models.target,
trainer.pipeline) and decoding (target_loading.complete_for_decoding) reads it; the memory plan
reads the same converter (trainer.models.memory_plan via trainer.models.fp8.converter_for).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from trainer.models.fp8 import FP8Converter
from trainer.models.hf import hf_config, input_embeddings
from trainer.models.stages import StagePlan


@dataclass(frozen=True, kw_only=True)
class Target:
    """One replica of the frozen target."""

    module: torch.nn.Module  # the Hugging Face causal LM (layers above the plan may be on the meta device)
    plan: StagePlan  # its layer stages, one device each
    dtype: torch.dtype  # model.dtype: what its non-FP8 weights and features are in
    layer_ids: tuple[int, ...] = ()  # the tapped layers (empty: not known, a target built by a caller)
    fp8: FP8Converter | None = None  # model.target.precision fp8: what converted its layers (None: bf16)
    experts: str | None = None  # the experts implementation a MoE target runs (trainer.models.moe)
    source: Path | None = None  # the model directory it was read from (None: built in code)

    @property
    def precision(self) -> Literal["bf16", "fp8"]:
        return "bf16" if self.fp8 is None else "fp8"

    @property
    def fast_accum(self) -> bool:
        return self.fp8 is not None and self.fp8.fast_accum

    @property
    def config(self) -> Any:
        """The module's (text) config."""
        return hf_config(self.module)


def as_target(target: Target | torch.nn.Module) -> Target:
    """`target` itself, or a bare module (built by a caller: tests, benchmarks, decoding) as a Target of
    one stage on its embedding's device holding every layer, in its embedding's dtype."""
    if isinstance(target, Target):
        return target
    embed = input_embeddings(target).weight
    return Target(module=target, plan=StagePlan.single(int(hf_config(target).num_hidden_layers), embed.device),
                  dtype=embed.dtype)
