"""Packed rows: whole conversations back to back in fixed-length rows, one shape for the whole run.

A row holds documents (tokenized conversations) d0, d1, ... followed by padding. `doc_start[i]`
is the row index where token i's document begins; the padding tail counts as one more document
(so every query of the target sees at least itself). From it follow, everywhere:

* the target's attention: causal inside each document (trainer.models.masks.document_causal_*);
* positions: i - doc_start[i], restarting at 0 in every document (target RoPE and drafter);
* anchors: sampled per document, `anchors_per_row * len(doc) / row length` of them (largest
  remainder, so a row gets exactly its share), at positions p where p and p+1 carry loss and
  belong to the same document; a block's slots past its document's end carry no label or weight;
* the drafter's mask: a block sees context [doc_start(anchor), anchor) only (Blocks.starts).

Loss normalisation is unchanged: Σ w·CE / Σ w over every block slot of the step.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from trainer.data.batches import Batch, DataError, PreloadedDataset, mask_dtype, trained_tokens
from trainer.run.config import anchors_for_row, row_anchors  # noqa: F401 - their home is the config; imported from here too


@dataclass
class PackedBatch(Batch):
    doc_start: torch.Tensor | None = None  # [B, L] row index where each token's document begins

    @property
    def documents(self) -> int:
        assert self.doc_start is not None, "a packed batch has document starts"
        ar = torch.arange(self.doc_start.shape[1])
        return int(((self.doc_start == ar) & (self.attention_mask > 0)).sum())


def doc_start_of(lengths: list[int], row_length: int) -> torch.Tensor:
    """[row_length] doc start per token for documents of `lengths` packed from index 0."""
    out = torch.empty(row_length, dtype=torch.long)
    at = 0
    for n in lengths:
        out[at: at + n] = at
        at += n
    out[at:] = at
    return out


def positions_of(doc_start: torch.Tensor) -> torch.Tensor:
    """Position inside its document of every token: i - doc_start[i]."""
    return torch.arange(doc_start.shape[-1], device=doc_start.device) - doc_start


class PackedDataset:
    """Conversations packed into rows of `pack_length`, `rows` rows per micro-batch.

    Each epoch shuffles the conversations (seed, epoch) and places each, whole, into the first of
    at most `window` open rows where it fits; when none has room and the window is full, the
    fullest open row is closed. Batch order is a pure function of (seed, epoch); `state_dict()`
    is (epoch, cursor), as for `trainer.data.batches.PreloadedDataset`.
    """

    def __init__(self, samples: list[tuple[list[int], list[float]]], pack_length: int, rows: int, pad_id: int,
                 seed: int = 0, window: int = 16):
        keep = [(ids[:pack_length], m[:pack_length]) for ids, m in samples if trained_tokens(m[:pack_length]) >= 2]
        if not keep:
            raise DataError("no conversation has two or more assistant tokens to train on")
        self.samples, self.pack_length, self.rows, self.pad_id = keep, pack_length, rows, pad_id
        self.mask_dtype = mask_dtype(keep)
        self.seed, self.window = seed, window
        self.epoch, self.cursor = 0, 0
        self._plan = self.plan_epoch(0)

    @classmethod
    def from_dataset(cls, dataset: PreloadedDataset, pack_length: int, rows: int, window: int = 16) -> "PackedDataset":
        return cls(dataset.samples, pack_length, rows, dataset.pad_id, dataset.seed, window)

    def __len__(self) -> int:
        return len(self.samples)

    def pack_rows(self, order: list[int]) -> list[list[int]]:
        """Rows (lists of sample indices) for conversations taken in `order`."""
        rows: list[list[int]] = []
        open_rows: list[tuple[int, list[int]]] = []  # (free tokens, members)
        for i in order:
            n = len(self.samples[i][0])
            for k, (free, members) in enumerate(open_rows):
                if n <= free:
                    members.append(i)
                    open_rows[k] = (free - n, members)
                    break
            else:
                if len(open_rows) >= self.window:
                    k = min(range(len(open_rows)), key=lambda j: open_rows[j][0])
                    rows.append(open_rows.pop(k)[1])
                open_rows.append((self.pack_length - n, [i]))
        rows.extend(members for _, members in open_rows)
        return rows

    def plan_epoch(self, epoch: int) -> list[list[list[int]]]:
        """Micro-batches of one epoch, each a list of `rows` rows of sample indices."""
        rng = random.Random(self.seed * 1_000_003 + epoch)
        order = list(range(len(self.samples)))
        rng.shuffle(order)
        rows = self.pack_rows(order)
        return [rows[i: i + self.rows] for i in range(0, len(rows), self.rows)]

    def collate(self, rows: list[list[int]]) -> PackedBatch:
        b, length = self.rows, self.pack_length
        ids = torch.full((b, length), self.pad_id, dtype=torch.long)
        attn = torch.zeros((b, length), dtype=torch.long)
        loss = torch.zeros((b, length), dtype=self.mask_dtype)
        doc_start = torch.zeros((b, length), dtype=torch.long)
        for r, members in enumerate(rows):
            at = 0
            for i in members:
                t, m = self.samples[i]
                ids[r, at: at + len(t)] = torch.tensor(t)
                loss[r, at: at + len(t)] = torch.tensor(m, dtype=self.mask_dtype)
                at += len(t)
            attn[r, :at] = 1
            doc_start[r] = doc_start_of([len(self.samples[i][0]) for i in members], length)
        return PackedBatch(ids, attn, loss, doc_start)

    def next_batch(self) -> PackedBatch:
        if self.cursor >= len(self._plan):
            self.epoch, self.cursor = self.epoch + 1, 0
            self._plan = self.plan_epoch(self.epoch)
        rows = self._plan[self.cursor]
        self.cursor += 1
        return self.collate(rows)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "samples": len(self.samples),
                "pack_length": self.pack_length}

    def load_state_dict(self, state: dict) -> None:
        if state["samples"] != len(self.samples) or state["seed"] != self.seed \
                or state.get("pack_length", self.pack_length) != self.pack_length:
            raise DataError("the checkpoint's data position belongs to a different dataset, seed or packing")
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self._plan = self.plan_epoch(self.epoch)

    def pad_share(self, epoch: int = 0) -> float:
        """Share of pad tokens over one epoch's rows (the packing's waste)."""
        batches = self.plan_epoch(epoch)
        real = sum(len(self.samples[i][0]) for batch in batches for row in batch for i in row)
        return 1 - real / (len(batches) * self.rows * self.pack_length)


def warmup_packed_batch(rows: int, pack_length: int, vocab: int, generator: torch.Generator) -> PackedBatch:
    """Random ids in rows of several documents (and a padding tail), for compiling the packed shape."""
    ids = torch.randint(0, vocab, (rows, pack_length), generator=generator)
    doc_start = torch.zeros((rows, pack_length), dtype=torch.long)
    attn = torch.zeros((rows, pack_length), dtype=torch.long)
    for r in range(rows):
        lengths, left = [], pack_length - pack_length // 16
        while left > 0:
            n = min(left, int(torch.randint(64, max(65, pack_length // 3), (1,), generator=generator)))
            lengths.append(n)
            left -= n
        doc_start[r] = doc_start_of(lengths, pack_length)
        attn[r, : sum(lengths)] = 1
    return PackedBatch(ids, attn, attn.bool(), doc_start)
