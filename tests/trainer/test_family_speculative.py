"""Speculative decoding is lossless for every target family: with an oracle drafter that knows the
target's greedy continuation and is wrong at chosen places (so rounds accept anything from none to
all of a block), the tokens equal plain greedy decoding and every round accepts exactly what the
oracle predicts: round for round, batched, left-padded prompts, fp32 on CPU. For the hybrid
families this needs the linear-attention state put back after each partial acceptance."""

from __future__ import annotations

import pytest
import torch

from trainer.generate.evaluate import greedy_generate
from trainer.generate.speculative import speculative_generate_cached
from trainer.models.drafter import DFlashDrafter, DrafterConfig
from trainer.models.target import FrozenHead, freeze, load_target
from trainer_tools.fixtures.hub_model import FAMILIES

BLOCK = 4
NEW = 14
PROMPTS = [[5, 17, 33, 2, 9, 40, 11], [40, 3], [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 11, 300, 250]]


class OracleHead(FrozenHead):
    """Drafts each row's greedy continuation (known in advance), wrong at draft slots whose token
    index i in the continuation has i % 7 in (1, 3, 4) (rounds then accept 0, 1, 3, 0, 1, ...). It follows acceptance itself: after a
    round from anchor index i, the next anchor is at i + (leading right drafts) + 1."""

    def __init__(self, base: FrozenHead, greedy: list[list[int]], max_new: int):
        super().__init__(base.embed_weight, base.lm_head_weight)
        self.greedy, self.max_new = greedy, max_new
        self.at = [0] * len(greedy)  # each row's anchor index in its continuation
        self.live: list[int] = list(range(len(greedy)))
        self.rows: list[int] = list(range(len(greedy)))
        self.expected: list[list[int]] = [[] for _ in greedy]  # accepted drafts per round, predicted

    def wrong(self, index: int) -> bool:
        return index % 7 in (1, 3, 4)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dim() == 2 and ids.shape[1] == BLOCK:  # a new round's block
            live = [r for r in range(len(self.greedy)) if self.at[r] + 1 < self.max_new]
            # the batch: the live rows (the dynamic decoder drops finished rows) or every row (static)
            self.rows = live if ids.shape[0] == len(live) else list(range(len(self.greedy)))
            self.live = live
            for i, r in enumerate(self.rows):
                if r in live:
                    assert int(ids[i, 0]) == self.greedy[r][self.at[r]]  # the anchor is where we said
        return super().embed(ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(*hidden.shape[:-1], self.embed_weight.shape[0])
        for i, r in enumerate(self.rows):
            if r not in self.live:
                continue
            g, at = self.greedy[r], self.at[r]
            accepted, run = 0, True
            for k in range(hidden.shape[1]):
                index = at + 1 + k
                token = g[index] if index < len(g) else 0
                if self.wrong(index):
                    token = (token + 1) % out.shape[-1]
                    run = False
                accepted += run
                out[i, k, token] = 1.0
            self.expected[r].append(accepted)
            self.at[r] = at + accepted + 1
        return out


@pytest.mark.parametrize("family", FAMILIES)
def test_speculative_equals_greedy_round_for_round(family_dirs, family):
    target = freeze(load_target(str(family_dirs[family]), "cpu", torch.float32))
    greedy = [greedy_generate(target, p, NEW + BLOCK, set()) for p in PROMPTS]
    cfg = DrafterConfig.from_target(target.config, num_layers=1, block_size=BLOCK,
                                    mask_token_id=target.config.vocab_size - 1, target_layer_ids=[1, 2])
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg).eval()
    head = OracleHead(FrozenHead.from_target(target, "cpu"), greedy, max_new=NEW)
    info: dict = {}
    out = speculative_generate_cached(target, drafter, head, PROMPTS, NEW, set(), info=info)
    for r, g in enumerate(out):
        assert g.tokens == greedy[r][:NEW], f"row {r} ({info.get('implementation')})"
        assert g.accepted == head.expected[r], f"row {r}"
    rounds = [a for g in out for a in g.accepted]
    assert 0 in rounds and any(0 < a < BLOCK - 1 for a in rounds) and BLOCK - 1 in rounds  # partial acceptances
