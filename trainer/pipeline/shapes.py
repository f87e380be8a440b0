"""Which (rows, length) shapes the drafter is warmed for, and which one each batch is padded to.

`select_target_warmup_shapes` gives the largest shape of each bucket, but batches of a bucket
come in many (rows, length) pairs (length rounds up to pad_multiple; rows follow the token
budget). Compiled code specialises on shape, so every batch is padded to a warmed shape:
its bucket's longest padded length, and the smallest warmed row count that holds it. Row counts
are warmed per bucket for every count the run's data plan contains, unless that would exceed
`max_shapes`, in which case each bucket keeps only its largest row count.
"""
from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.data.batches import Batch, PreloadedDataset


def bucket_of_length(bucket_edges: list[int], length: int) -> int:
    return min(bisect.bisect_left(bucket_edges, length), len(bucket_edges) - 1)


class WarmShapes:
    def __init__(self, dataset: PreloadedDataset, micro_batches_needed: int, max_shapes: int) -> None:
        rows: dict[int, set[int]] = {}
        lengths: dict[int, int] = {}
        epoch, seen = dataset.epoch, -dataset.cursor
        while seen < micro_batches_needed:  # whole epochs: every batch the run can meet
            batches, bucket_ids = dataset.plan_epoch(epoch)
            for indices, bucket in zip(batches, bucket_ids):
                rows.setdefault(bucket, set()).add(len(indices))
                lengths[bucket] = max(lengths.get(bucket, 0), dataset.padded_length(indices))
            seen += len(batches)
            epoch += 1
        if sum(len(r) for r in rows.values()) > max(max_shapes, len(rows)):
            rows = {b: {max(r)} for b, r in rows.items()}
        self.rows = {b: sorted(r) for b, r in rows.items()}
        self.lengths = lengths
        self.bucket_edges = dataset.bucket_edges

    def shapes(self) -> list[tuple[int, int]]:
        """Every warmed shape, largest first (most memory first, so an OOM shows at once)."""
        out = [(r, self.lengths[b]) for b, rs in self.rows.items() for r in rs]
        return sorted(out, key=lambda s: (s[0] * s[1], s[1]), reverse=True)

    def shape_for(self, batch: Batch) -> tuple[int, int]:
        longest = int(batch.attention_mask.sum(dim=1).max())
        bucket = bucket_of_length(self.bucket_edges, longest)
        rows = batch.input_ids.shape[0]
        if bucket not in self.rows:
            raise ValueError(f"batch of bucket {bucket} was not in the data plan the warm-up used")
        fitting = [r for r in self.rows[bucket] if r >= rows]
        if not fitting or batch.input_ids.shape[1] > self.lengths[bucket]:
            raise ValueError(f"batch {tuple(batch.input_ids.shape)} exceeds bucket {bucket}'s warm shapes")
        return fitting[0], self.lengths[bucket]


class PackedShape:
    """Packed rows (trainer.data.packing): every micro-batch has the one shape (rows, pack_length)."""

    def __init__(self, rows: int, length: int) -> None:
        self.shape = (rows, length)

    def shapes(self) -> list[tuple[int, int]]:
        return [self.shape]

    def shape_for(self, batch: Batch) -> tuple[int, int]:
        if tuple(batch.input_ids.shape) != self.shape:
            raise ValueError(f"packed batch {tuple(batch.input_ids.shape)} is not the run's shape {self.shape}")
        return self.shape
