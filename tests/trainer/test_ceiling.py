"""The target drafting for itself (trainer.generate.ceiling): greedy, every draft is accepted and the
output is the target's own; at a temperature the output is distributed as plain sampling (lossless), a
prompt decodes alike alone and in a batch of other lengths, and each round's expected length is the
target's confidence along its own greedy chain."""

import pytest
import torch

from tests.trainer.test_sampling import PROMPT, S, assert_lossless, target_joint
from trainer.generate.ceiling import greedy_chain, self_draft_generate
from trainer.generate.evaluate import acceptance_report, greedy_generate
from trainer.generate.lookup import lookup_generate
from trainer.generate.sampling import processed_probs
from trainer.generate.sampling_params import Sampling

PROMPTS = [[5, 17, 33, 2, 9, 5, 17], [3, 3, 3], [40, 41, 42, 40, 41, 7, 7, 7, 7, 12]]  # lengths differ: padding


def test_greedy_every_draft_is_accepted_and_the_output_is_the_targets(tiny):
    target = tiny[0]
    expected = [greedy_generate(target, p, 24, set()) for p in PROMPTS]
    for block_size in (2, 5):
        for g, want in zip(self_draft_generate(target, PROMPTS, 24, set(), block_size), expected, strict=True):
            assert g.tokens == want
            assert g.acceptance_lengths[:-1] == [block_size] * (len(g.acceptance_lengths) - 1)
            assert g.expected_lengths[:-1] == [float(block_size)] * (len(g.reach) - 1)
    stop = expected[0][7]
    (g,) = self_draft_generate(target, PROMPTS[:1], 24, {stop}, 4)
    assert g.tokens == expected[0][: expected[0].index(stop) + 1]


def test_the_chain_is_the_targets_greedy_continuation_with_the_logits_a_full_forward_gives(tiny):
    target = tiny[0]
    chain, logits = greedy_chain(target, PROMPTS, 4)
    for r, prompt in enumerate(PROMPTS):
        assert chain[r].tolist() == greedy_generate(target, prompt, 4, set())
        full = target(input_ids=torch.tensor([prompt + chain[r].tolist()])).logits[0, len(prompt) - 1:].float()
        assert torch.allclose(logits[r], full, atol=1e-4)


def test_sampled_output_is_the_targets_distribution(tiny):
    target = tiny[0]
    exact = target_joint(target, S)
    gens = self_draft_generate(target, [PROMPT] * 800, 3, set(), 4, sampling=S)
    assert_lossless(gens, exact)
    assert 0 < sum(g.accepted[0] for g in gens) < 800 * 2  # some first-round drafts are accepted, not all


def test_a_prompt_decodes_alike_alone_and_in_a_batch_and_its_expected_length_is_the_chains_confidence(tiny):
    target = tiny[0]
    s = Sampling(temperature=0.9, top_p=0.95, seed=5)
    batch = self_draft_generate(target, PROMPTS, 16, set(), 4, sampling=s)
    for r, prompt in enumerate(PROMPTS):
        (alone,) = self_draft_generate(target, [prompt], 16, set(), 4, sampling=s, streams=[r])
        assert (alone.tokens, alone.acceptance_lengths) == (batch[r].tokens, batch[r].acceptance_lengths)
        assert sum(alone.reach, []) == pytest.approx(sum(batch[r].reach, []), abs=1e-5)
    # the first round: its drafts are the chain after prompt + first token, accepted with the target's p
    g, prompt = batch[0], PROMPTS[0]
    chain, logits = greedy_chain(target, [prompt + g.tokens[:1]], 3)
    p = processed_probs(logits[0, :-1], s).gather(1, chain[0][:, None])[:, 0].tolist()
    assert g.reach[0] == pytest.approx([p[0], p[0] * p[1], p[0] * p[1] * p[2]], rel=1e-5)
    # the first token is lookup's (the same noise stream and position)
    assert [x.tokens[0] for x in lookup_generate(target, PROMPTS, 2, set(), 4, sampling=s)] == \
        [x.tokens[0] for x in batch]


@pytest.mark.parametrize("s", [Sampling(temperature=1.0, seed=2), Sampling(temperature=0.0)])
@pytest.mark.parametrize("cache", ["slots", "carried"])
def test_a_kept_cache_decodes_what_rounds_prefilled_anew_decode(tiny, s, cache):
    """The rounds' KV cache kept with the rejected drafts masked (the decoder's slots, the default for the families
    it runs, or the Hugging Face cache carried) gives the tokens and acceptance probabilities of each round
    prefilled from scratch."""
    target = tiny[0]
    kept = self_draft_generate(target, PROMPTS, 20, set(), 4, sampling=s, cache=cache)
    anew = self_draft_generate(target, PROMPTS, 20, set(), 4, sampling=s, cache="anew")
    for a, b in zip(kept, anew, strict=True):
        assert (a.tokens, a.acceptance_lengths) == (b.tokens, b.acceptance_lengths)
        assert sum(a.reach, []) == pytest.approx(sum(b.reach, []), abs=1e-5)
    assert any(0 < n < 4 for g in kept for n in g.acceptance_lengths[:-1]) or s.greedy  # rejections happened


def test_the_slots_are_the_default_where_the_decoder_runs_and_they_are_packed_when_full(tiny, monkeypatch):
    from trainer.generate import slot_batch

    packs = []
    real = slot_batch.SlotBatch.make_room

    def counting(self, live):
        before = self.used
        real(self, live)
        packs.extend([before] if self.used < before else [])

    monkeypatch.setattr(slot_batch.SlotBatch, "make_room", counting)
    s, prompts = Sampling(temperature=0.1, seed=3), (PROMPTS * 6)[:16]
    default = self_draft_generate(tiny[0], prompts, 40, set(), 4, sampling=s)
    # the pointer moves by the longest accepted run of 16 rows, a row's tokens by its own: the slots were packed
    assert packs
    anew = self_draft_generate(tiny[0], prompts, 40, set(), 4, sampling=s, cache="anew")
    assert [(g.tokens, g.acceptance_lengths) for g in default] == [(g.tokens, g.acceptance_lengths) for g in anew]


def test_the_report_has_the_ceiling_at_each_temperature_above_the_drafters(components):
    c = components
    convs = c.eval_conversations[:3]
    block = c.drafter.config.block_size
    greedy = acceptance_report(c.target.module, c.drafter, c.head, c.tokenizer, convs, 12, batch=2, ceiling=True)
    assert greedy["tau_ceiling"] == greedy["tau_ceiling_expected"] > greedy["tau"]
    assert greedy["ceiling_over_lookup"] == greedy["tau_ceiling"] / greedy["tau_lookup"]
    assert greedy["tau_ceiling"] <= block
    hot = acceptance_report(c.target.module, c.drafter, c.head, c.tokenizer, convs, 12, batch=2, ceiling=True,
                            sampling=Sampling(temperature=1.0, seed=1))
    assert 1.0 <= hot["tau_ceiling_expected"] < greedy["tau_ceiling"]
    assert "tau_ceiling" not in acceptance_report(c.target.module, c.drafter, c.head, c.tokenizer, convs, 12)
