"""BatchPrefetcher: builds micro-batches ahead of time on its own thread.

It is the only thread that touches the dataset and the anchor generator, so the data order and
the sampled anchors are exactly those of the single-threaded reference loop. Each micro-batch is
padded to its bucket's warm shape (so compiled code never meets a new shape) and pinned when the
consumers are on CUDA, then routed to the target worker that owns it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from trainer.data.batches import Batch
from trainer.models.masks import Blocks
from trainer.pipeline.stages import StageQueue
from trainer.run.stopping import StopSignal


@dataclass
class MicroBatch:
    index: int  # global micro-batch number since the run (re)started
    step: int  # optimizer step it belongs to
    input_ids: torch.Tensor  # [B, L] (padded to the warm shape when padding is on)
    attention_mask: torch.Tensor
    blocks: Blocks
    tokens: int  # real (unpadded) tokens
    data_state: dict  # dataset position after this micro-batch (for checkpoints)
    doc_start: torch.Tensor | None = None  # [B, L] packed rows (trainer.data.packing); None when unpacked

    @property
    def shape(self) -> tuple[int, int]:
        rows, length = self.input_ids.shape
        return rows, length


def pad_rows_and_length(batch_ids: torch.Tensor, attention_mask: torch.Tensor, blocks: Blocks, shape: tuple[int, int],
                        pad_id: int) -> tuple[torch.Tensor, torch.Tensor, Blocks]:
    """Pad a batch to `shape` = (rows, length): extra rows carry no valid block and no loss.

    A padded row sees its first token, so the target's attention never has an all-masked row
    (which would give NaN features)."""
    b, length = batch_ids.shape
    rows, target_len = shape
    if b > rows or length > target_len:
        raise ValueError(f"batch {tuple(batch_ids.shape)} is larger than its warm shape {shape}")
    ids = F.pad(batch_ids, (0, target_len - length, 0, rows - b), value=pad_id)
    attn = F.pad(attention_mask, (0, target_len - length, 0, rows - b), value=0)
    attn[b:, 0] = 1
    padded = {}
    for f in fields(Blocks):
        t = getattr(blocks, f.name)
        padded[f.name] = F.pad(t, [0, 0] * (t.dim() - 1) + [0, rows - b])  # zeros / False: no valid block
    return ids, attn, Blocks(**padded)


class BatchPrefetcher:
    """Produces `count` micro-batches into per-target-worker queues (round robin by index)."""

    def __init__(self, next_batch: Callable[[], Batch], prepare_blocks: Callable[[Batch], Blocks],
                 data_state: Callable[[], dict], outputs: list[StageQueue], stop: StopSignal,
                 count: int, micro_batches: int, first_step: int,
                 warm_shape_of: Callable[[Batch], tuple[int, int]] | None = None, pad_id: int = 0,
                 pin: bool = False, on_built: Callable[[MicroBatch], None] | None = None) -> None:
        self.next_batch = next_batch  # () -> trainer.data.batches.Batch
        self.prepare_blocks = prepare_blocks  # (Batch) -> Blocks, using the run's anchor generator
        self.data_state = data_state  # () -> dict
        self.outputs = outputs
        self.stop = stop
        self.count = count
        self.micro_batches = micro_batches
        self.first_step = first_step
        self.warm_shape_of = warm_shape_of  # (Batch) -> (rows, length) or None for no padding
        self.pad_id = pad_id
        self.pin = pin
        self.on_built = on_built  # (MicroBatch) -> None, called with each micro-batch as it is built

    def build(self, index: int) -> MicroBatch:
        batch = self.next_batch()
        blocks = self.prepare_blocks(batch)
        ids, attn = batch.input_ids, batch.attention_mask
        doc_start = getattr(batch, "doc_start", None)
        tokens = int(attn.sum())
        if self.warm_shape_of is not None and doc_start is None:
            ids, attn, blocks = pad_rows_and_length(ids, attn, blocks, self.warm_shape_of(batch), self.pad_id)
        if self.pin:
            ids, attn = ids.pin_memory(), attn.pin_memory()
            doc_start = doc_start.pin_memory() if doc_start is not None else None
            blocks = Blocks(*(getattr(blocks, f.name).pin_memory() for f in fields(Blocks)))
        mb = MicroBatch(index, self.first_step + index // self.micro_batches, ids, attn, blocks, tokens,
                        self.data_state(), doc_start)
        if self.on_built is not None:
            self.on_built(mb)
        return mb

    def run(self) -> None:
        for index in range(self.count):
            self.stop.check()
            self.outputs[index % len(self.outputs)].put(self.build(index))
