"""The target's decoder run in layer stages: only the layers the drafter taps, on their devices.

Training needs the hidden states of the tapped layers (the drafter's `target_layer_ids`) and
nothing above them: the layers past the last tapped one and the final norm run only to decode
(τ evaluation). So features come from our own walk over the decoder layers, the same calls the
Hugging Face base model makes (embedding, rotary embedding, each layer with the mask of its layer
type), stopping after the last tapped layer and writing each tapped layer's output straight into
its columns of the feature tensor: no tuple of every hidden state is kept alive.

A split target runs the same walk in consecutive stages, each a contiguous range of layers on its
own device (`StagePlan`); trainer.pipeline.workers runs one stage per thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from trainer.models.hf import hf_config


@dataclass(frozen=True)
class StagePlan:
    """Layer ranges [lo, hi) covering 0..last tapped layer, one per device, in order."""

    bounds: tuple[tuple[int, int], ...]
    devices: tuple[torch.device, ...]

    @classmethod
    def single(cls, layers: int, device: torch.device | str) -> "StagePlan":
        return cls(((0, layers),), (torch.device(device),))

    @classmethod
    def from_sizes(cls, sizes: Sequence[int], devices: Sequence[torch.device | str]) -> "StagePlan":
        bounds, lo = [], 0
        for n in sizes:
            bounds.append((lo, lo + n))
            lo += n
        return cls(tuple(bounds), tuple(torch.device(d) for d in devices))

    @property
    def layers(self) -> int:
        """Layers run for features: the last tapped layer + 1."""
        return self.bounds[-1][1]

    def __len__(self) -> int:
        return len(self.bounds)

    def stage_of(self, layer: int) -> int:
        for s, (lo, hi) in enumerate(self.bounds):
            if lo <= layer < hi:
                return s
        return len(self.bounds) - 1  # above the tapped layers: with the last stage (evaluation only)


def feature_layers(layer_ids: Sequence[int]) -> int:
    """How many decoder layers the features need: up to and including the last tapped one."""
    return max(layer_ids) + 1


def tap_columns(layer_ids: Sequence[int]) -> dict[int, list[int]]:
    """layer id -> the positions it fills in the concatenated features (an id may be tapped twice)."""
    taps: dict[int, list[int]] = {}
    for k, layer in enumerate(layer_ids):
        taps.setdefault(layer, []).append(k)
    return taps


class StageInputs(NamedTuple):
    """What every decoder layer is called with besides the hidden states, on one device."""

    mask_mapping: dict
    position_ids: torch.Tensor
    position_embeddings: Any  # (cos, sin) from the model's rotary embedding


def layer_types(model: torch.nn.Module) -> list[str]:
    n = int(hf_config(model).num_hidden_layers)
    kinds = getattr(model.config, "layer_types", None)
    return list(kinds) if kinds else ["full_attention"] * n


def stage_inputs(model: Any, hidden: torch.Tensor, mask_mapping: dict,
                 doc_start: torch.Tensor | None) -> StageInputs:
    """Positions (restarting at each document of a packed row) and rotary embeddings for `hidden`'s device.

    mask_mapping: per layer type, as trainer.models.target.packed_mask_mapping builds it."""
    length = hidden.shape[1]
    if doc_start is not None:
        position_ids = torch.arange(length, device=hidden.device) - doc_start
    else:
        position_ids = torch.arange(length, device=hidden.device).unsqueeze(0)
    rotary = model.rotary_emb
    return StageInputs(mask_mapping, position_ids, rotary(hidden, rotary_positions(rotary, position_ids)))


def rotary_positions(rotary: Any, position_ids: torch.Tensor) -> torch.Tensor:
    """`position_ids` [B, L] as the model's rotary embedding takes them.

    A multimodal rotary (Qwen3.5's: its config's `mrope_section` splits the frequencies between
    the temporal, height and width grids) wants one row of positions per grid, [len(mrope_section), B, L],
    as the text model's own forward builds them; a text token has the same position in every grid.
    transformers 5.17's Qwen3.5 rotary indexes `position_ids[:, :, None, :]` and fails on [B, L]
    (IndexError: too many indices), 5.24's broadcasts [B, L] itself: both take the 3-D form.
    The decoder layers keep the [B, L] positions (the text model passes them its text row)."""
    sections = getattr(rotary, "mrope_section", None)
    if sections and position_ids.ndim == 2:
        return position_ids.unsqueeze(0).expand(len(sections), *position_ids.shape)
    return position_ids


def run_layers(model: torch.nn.Module, hidden: torch.Tensor, lo: int, hi: int, inputs: StageInputs,
               taps: dict[int, list[int]], out: torch.Tensor,
               pending: list[tuple[int, torch.Tensor]] | None = None) -> torch.Tensor:
    """Decoder layers lo..hi-1 of the base model `model` on `hidden`; each tapped layer's output is
    copied into its columns of `out` [B, L, n*H]. Returns the hidden states after layer hi-1.

    pending: when `out` is on another device, each tapped output is instead copied whole (contiguous)
    to out's device and appended as (column, tensor), for the stage on that device to write into
    `out` on its own stream (`write_pending`). A strided write across devices may stage through a
    temporary on the destination's default stream, which no event of ours covers."""
    width = hidden.shape[-1]
    kinds, layers = layer_types(model), model.layers
    assert isinstance(layers, torch.nn.ModuleList)
    elsewhere = pending is not None and out.device != hidden.device
    last, norm = len(kinds) - 1, model.norm
    assert callable(norm)
    for i in range(lo, hi):
        hidden = layers[i](hidden, attention_mask=inputs.mask_mapping[kinds[i]],
                           position_ids=inputs.position_ids, position_embeddings=inputs.position_embeddings,
                           use_cache=False)
        if isinstance(hidden, tuple):  # transformers < 4.54 returns (hidden_states, ...)
            hidden = hidden[0]
        # the model's last layer, when tapped, is read as transformers' hidden_states[-1] reads it:
        # after the final norm (the drafts' features always were; real taps stop 2 layers short of it)
        tapped = norm(hidden) if i == last and i in taps else hidden
        for k in taps.get(i, ()):
            if elsewhere:
                assert pending is not None
                pending.append((k, tapped.to(out.device, non_blocking=True)))
            else:
                out[..., k * width:(k + 1) * width].copy_(tapped, non_blocking=True)
    return hidden


def write_pending(out: torch.Tensor, pending: list[tuple[int, torch.Tensor]],
                  stream: torch.cuda.Stream | None = None) -> None:
    """Write the tapped outputs earlier stages sent to out's device into their columns (on this
    thread's stream; each tensor was allocated by another thread, so it is marked used by `stream`)."""
    for k, tensor in pending:
        if stream is not None:
            tensor.record_stream(stream)
        width = tensor.shape[-1]
        out[..., k * width:(k + 1) * width].copy_(tensor, non_blocking=True)
