"""A batch of prompts decoded in rounds on the target decoder's slot-addressed KV cache
(`trainer.models.decoder`): what n-gram lookup and the target drafting for itself share.

Every row is prefilled once (left-padded); then all rows write each round's entries at one shared
pointer `used`, each at its own position, and keep the slots of what they accepted: a rejected
slot is masked, never seen, and overwritten by a later round. The pointer advances by the longest
accepted length among the rows still decoding; when a round would run past the capacity, each
live row's kept slots are packed to the front.
"""

from __future__ import annotations

import torch

from trainer.models import decoder


def prefill_layout(prompts: list[list[int]], capacity: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Left-padded prompts in slots 0..L-1 (slot j of row r holds position j - pad_r): ids [B, L], positions
    [B, L], the slots [L], each query's visible slots [B, L, capacity] (its own row's tokens up to itself; a pad
    sees itself, so no softmax row is empty) and which slots hold a prompt token [B, L]."""
    longest = max(len(p) for p in prompts)
    pads = torch.tensor([longest - len(p) for p in prompts], device=device)
    ids = torch.tensor([[0] * (longest - len(p)) + list(p) for p in prompts], device=device)
    index = torch.arange(longest, device=device)
    key_valid = index[None, :] >= pads[:, None]
    positions = (index[None, :] - pads[:, None]).clamp(min=0)
    visible = torch.zeros(len(prompts), longest, capacity, dtype=torch.bool, device=device)
    visible[:, :, :longest] = (key_valid[:, None, :] & (index[:, None] >= index[None, :])) | \
        torch.eye(longest, dtype=torch.bool, device=device)
    return ids, positions, index, visible, key_valid


class SlotBatch:
    def __init__(self, target: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int, block_size: int):
        """Prefill every prompt; `self.logits` [B, V] are each prompt's last position's."""
        d = self.decoder = decoder.TargetDecoder(target)
        self.device, self.rows = d.device, len(prompts)
        dev, n = self.device, self.rows
        longest = max(len(p) for p in prompts)
        self.capacity = -(-(longest + max_new_tokens + 4 * block_size) // 16) * 16
        self.cache = d.cache(n, self.capacity)
        self.slot = torch.arange(self.capacity, device=dev)
        self.offsets = torch.arange(block_size, device=dev)
        self.block_size = block_size
        ids, positions, index, visible, key_valid = prefill_layout(prompts, self.capacity, dev)
        logits, _ = d.forward(ids, positions, self.cache, index, visible, last_only=True, expand_kv=dev.type == "cuda")
        self.logits = logits[:, -1]
        self.valid = torch.zeros(n, self.capacity, dtype=torch.bool, device=dev)  # slot holds an accepted entry
        self.valid[:, :longest] = key_valid
        self.used = longest

    def make_room(self, live: list[int]) -> None:
        """Before a round: pack each live row's kept slots to the front if the round would not fit."""
        if self.used + self.block_size <= self.capacity:
            return
        alive = torch.zeros(self.rows, dtype=torch.bool, device=self.device)
        alive[live] = True
        kept = self.valid[:, :self.used] & alive[:, None]
        order = torch.sort((~kept).to(torch.int8), dim=1, stable=True).indices
        kept_counts = kept.sum(dim=1)
        packed = int(kept_counts.max())
        self.cache.compact(order, packed, self.used)
        self.valid.zero_()
        self.valid[:, :packed] = self.slot[None, :packed] < kept_counts[:, None]
        self.used = packed

    def forward(self, ids: torch.Tensor, anchor_pos: torch.Tensor, at: int = 0) -> torch.Tensor:
        """Logits [B, T, V] of ids [B, T], the round's entries `at`..`at` + T - 1 (the anchor is entry 0, at
        position anchor_pos [B]): each sees the rows' kept slots and the round's entries up to itself."""
        t = ids.shape[1]
        slots = self.used + at + self.offsets[:t]
        in_round = (self.slot[None, :] >= self.used) & (self.slot[None, :] <= slots[:, None])  # [T, capacity]
        context = self.valid & (self.slot < self.used)
        logits, _ = self.decoder.forward(ids, anchor_pos[:, None] + at + self.offsets[:t], self.cache, slots,
                                         context[:, None, :] | in_round[None])
        return logits

    def keep(self, accepted: torch.Tensor, still: list[int]) -> None:
        """After a round: each row keeps its anchor and accepted [B] drafts; the pointer moves past the longest
        kept among the rows still decoding."""
        self.valid[:, self.used:self.used + self.block_size] = self.offsets[None, :] <= accepted[:, None]
        if still:
            self.used += int(accepted[still].max()) + 1
