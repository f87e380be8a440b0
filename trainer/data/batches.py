"""Conversations -> token ids with an assistant loss mask; in-memory length-bucketed batches."""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from trainer.data.chat import DataError, encode_conversation, read_conversations, tokenize_conversation, trained_tokens  # noqa: F401
from trainer.data.encoding import Encoded, encode_all


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L] right-padded
    attention_mask: torch.Tensor  # [B, L] 1 on real tokens
    loss_mask: torch.Tensor  # [B, L] bool: 1 on assistant tokens; float32 (their weights) where the data weighs tokens

    @property
    def tokens(self) -> int:
        return int(self.attention_mask.sum())


def mask_dtype(samples: list[tuple[list[int], list[float]]]) -> torch.dtype:
    """The batches' loss-mask dtype: bool (0/1, as always), or float32 when a conversation carries
    per-token weights (trainer.data.chat.answer_weights: its mask is floats) and every batch then
    carries weights, 1.0 on the tokens of conversations without."""
    return torch.float32 if any(m and isinstance(m[0], float) for _, m in samples) else torch.bool


class PreloadedDataset:
    """Token ids held in memory, grouped into length buckets, served as token-budget batches.

    Batch order is a pure function of (seed, epoch); `state_dict()` is the position
    (epoch, cursor), so a resumed run continues with exactly the next batch.
    """

    def __init__(self, samples: list[tuple[list[int], list[float]]], bucket_edges: list[int], token_budget: int,
                 pad_id: int, seed: int = 0, pad_multiple: int = 16):
        keep = [(ids, m) for ids, m in samples if trained_tokens(m) >= 2]
        if not keep:
            raise DataError("no conversation has two or more assistant tokens to train on")
        self.samples = keep
        self.mask_dtype = mask_dtype(keep)
        self.bucket_edges = list(bucket_edges)
        self.token_budget = token_budget
        self.pad_id = pad_id
        self.seed = seed
        self.pad_multiple = pad_multiple
        self.bucket_of = [min(bisect.bisect_left(self.bucket_edges, len(ids)), len(self.bucket_edges) - 1)
                          for ids, _ in keep]
        self.epoch, self.cursor = 0, 0
        self._plan = self.plan_epoch(0)

    def __len__(self) -> int:
        return len(self.samples)

    def padded_length(self, indices: list[int]) -> int:
        longest = max(len(self.samples[i][0]) for i in indices)
        return -(-longest // self.pad_multiple) * self.pad_multiple

    def plan_epoch(self, epoch: int) -> tuple[list[list[int]], list[int]]:
        """(batches as lists of sample indices, bucket id of each batch) for one epoch."""
        rng = random.Random(self.seed * 1_000_003 + epoch)
        batches, bucket_ids = [], []
        for bucket in range(len(self.bucket_edges)):
            members = [i for i, b in enumerate(self.bucket_of) if b == bucket]
            rng.shuffle(members)
            current: list[int] = []
            for i in members:
                if current and self.padded_length(current + [i]) * (len(current) + 1) > self.token_budget:
                    batches.append(current)
                    bucket_ids.append(bucket)
                    current = []
                current.append(i)
            if current:
                batches.append(current)
                bucket_ids.append(bucket)
        order = list(range(len(batches)))
        rng.shuffle(order)
        return [batches[i] for i in order], [bucket_ids[i] for i in order]

    def collate(self, indices: list[int]) -> Batch:
        length = self.padded_length(indices)
        ids = torch.full((len(indices), length), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(indices), length), dtype=torch.long)
        loss = torch.zeros((len(indices), length), dtype=self.mask_dtype)
        for row, i in enumerate(indices):
            t, m = self.samples[i]
            ids[row, : len(t)] = torch.tensor(t)
            attn[row, : len(t)] = 1
            loss[row, : len(t)] = torch.tensor(m, dtype=self.mask_dtype)
        return Batch(ids, attn, loss)

    def next_batch(self) -> Batch:
        batches, _ = self._plan
        if self.cursor >= len(batches):
            self.epoch, self.cursor = self.epoch + 1, 0
            self._plan = self.plan_epoch(self.epoch)
            batches = self._plan[0]
        indices = batches[self.cursor]
        self.cursor += 1
        return self.collate(indices)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "samples": len(self.samples)}

    def load_state_dict(self, state: dict) -> None:
        if state["samples"] != len(self.samples) or state["seed"] != self.seed:
            raise DataError("the checkpoint's data position belongs to a different dataset or seed")
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self._plan = self.plan_epoch(self.epoch)


def select_target_warmup_shapes(
    dataset: PreloadedDataset,
    batches: list[list[int]],
    bucket_ids: list[int],
    max_shapes: int,
) -> list[tuple[int, int]]:
    """The largest padded shape (batch, seq) of each bucket, for warming up compiled kernels.

    dataset: gives each batch's padded length; batches: sample-index lists (e.g. from
    `dataset.plan_epoch(e)[0]`); bucket_ids: the bucket of each batch (same order);
    max_shapes: at most this many shapes, the largest by padded tokens first.
    Largest means most padded tokens (batch * seq), ties broken by longer seq.
    """
    if len(batches) != len(bucket_ids):
        raise ValueError("batches and bucket_ids must have the same length")
    best: dict[int, tuple[int, int]] = {}
    for indices, bucket in zip(batches, bucket_ids):
        shape = (len(indices), dataset.padded_length(indices))
        key = (shape[0] * shape[1], shape[1])
        if bucket not in best or key > (best[bucket][0] * best[bucket][1], best[bucket][1]):
            best[bucket] = shape
    shapes = sorted(best.values(), key=lambda s: (s[0] * s[1], s[1]), reverse=True)
    return shapes[:max_shapes]


def build_dataset(tokenizer: Any, conversations: list[dict], max_length: int, bucket_edges: list[int],
                  token_budget: int, seed: int, pad_multiple: int = 16,
                  template_kwargs: dict | None = None, processes: int = 1,
                  progress: Callable[[int], None] | None = None) -> PreloadedDataset:
    """processes: encode in that many processes (trainer.data.encoding; 1: in this one); progress(n):
    n conversations encoded so far."""
    encoded = encode_all(tokenizer, conversations, max_length, template_kwargs, processes, progress)
    return dataset_of(tokenizer, encoded, bucket_edges, token_budget, seed, pad_multiple)


def dataset_of(tokenizer: Any, encoded: list[Encoded], bucket_edges: list[int], token_budget: int, seed: int,
               pad_multiple: int = 16) -> PreloadedDataset:
    """The dataset of conversations encoded already (trainer.data.encoding, or trainer.data.token_cache)."""
    samples = [(ids, mask) for ids, mask, _ in encoded]
    return PreloadedDataset(samples, bucket_edges, token_budget, pad_id(tokenizer), seed, pad_multiple)


def pad_id(tokenizer: Any) -> int:
    """The tokenizer's pad token, else its end of sequence (Llama 3 ships no pad token; padded
    positions are masked out, so the id only has to exist)."""
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    raise DataError("the tokenizer has neither a pad nor an end-of-sequence token")
