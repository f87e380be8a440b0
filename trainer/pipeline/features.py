"""Target side: context features packed into pre-allocated, reused buffers.

A target worker owns a small pool of `FeatureSlot`s, each a flat buffer big enough for the
largest (warm) shape. A slot goes back to the pool only with the CUDA event its consumer
recorded after its last use; the target's stream waits on that event (on the GPU, no host wait)
before writing the slot again, so a buffer is never overwritten while a drafter still reads it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.models.frozen_target import Target, as_target
from trainer.models.target import base_model, packed_mask_mapping, target_context_features


@dataclass
class FeatureSlot:
    index: int
    buffer: torch.Tensor  # flat, on the target device
    released: object = None  # torch.cuda.Event recorded by the last consumer, or None

    def view(self, batch: int, length: int, width: int) -> torch.Tensor:
        n = batch * length * width
        if n > self.buffer.numel():
            raise ValueError(f"feature slot holds {self.buffer.numel()} values, batch needs {n}")
        return self.buffer[:n].view(batch, length, width)


def allocate_slots(count: int, numel: int, dtype: torch.dtype, device: torch.device) -> list[FeatureSlot]:
    return [FeatureSlot(i, torch.zeros(numel, dtype=dtype, device=device)) for i in range(count)]


def pack_context_features(target: Target | torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | dict | None,
                          layer_ids: list[int], out: torch.Tensor | None, doc_start: torch.Tensor | None = None,
                          top: torch.Tensor | None = None) -> torch.Tensor:
    """Like `trainer.models.target.target_context_features`, but writes the concatenation into `out`.

    The pipeline passes attention_mask=None: batches are right-padded and attention is causal,
    so a real position never sees padding and its features are the same. Then the mask is handed
    over as a prebuilt per-layer-type mapping of None, so SDPA runs with is_causal=True and
    transformers' mask builder (whose packed-sequence and all-ones checks each cost a host sync)
    is skipped. doc_start [B, L]: packed rows (causal per document, positions restart per
    document; see trainer.data.packing). top: the target's last hidden states too (model.loss kl)."""
    if attention_mask is None and doc_start is None:
        attention_mask = packed_mask_mapping(base_model(as_target(target).module), None)
    return target_context_features(target, input_ids, attention_mask, layer_ids, doc_start, out=out, top=top)
