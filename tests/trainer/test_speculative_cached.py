"""KV-cached speculative decoding gives exactly what the uncached reference gives: the same
tokens (which are the target's own greedy tokens) and the same acceptance length every round;
decoding prompts as one batch gives what decoding each alone gives."""
import copy

import pytest
import torch

from trainer.generate.evaluate import greedy_generate, speculative_generate
from trainer.generate.speculative import Generation, speculative_generate_cached
from trainer.models.target import FrozenHead


def bigram_target(target):
    """The tiny target with every attention and MLP output zeroed: its next token depends on the
    current token only, so a draft of g(g(...)) is knowable in advance."""
    t = copy.deepcopy(target)
    with torch.no_grad():
        for layer in t.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return t


class OracleHead(FrozenHead):
    """Drafts the bigram target's greedy chain from the block's anchor, wrong wherever
    (anchor + slot) % wrong_every == 0, so rounds accept anything from 0 to all drafts."""

    def __init__(self, base: FrozenHead, successor: dict[int, int], wrong_every: int):
        super().__init__(base.embed_weight, base.lm_head_weight)
        self.successor, self.wrong_every, self.anchors = successor, wrong_every, None

    def embed(self, ids):
        if ids.dim() == 2 and ids.shape[1] > 1:
            self.anchors = ids[:, 0].tolist()
        return super().embed(ids)

    def logits(self, hidden):
        out = torch.zeros(*hidden.shape[:-1], self.embed_weight.shape[0])
        for r, anchor in enumerate(self.anchors):
            token = anchor
            for k in range(hidden.shape[1]):
                token = self.successor[token]
                wrong = (anchor + k + 1) % self.wrong_every == 0
                out[r, k, (token + 1) % out.shape[-1] if wrong else token] = 1.0
        return out


@pytest.fixture(scope="module")
def oracle(tiny):
    target, head, drafter, _ = tiny
    bigram = bigram_target(target)
    vocab = head.embed_weight.shape[0]
    with torch.no_grad():
        nxt = bigram(input_ids=torch.arange(vocab)[:, None]).logits[:, -1].argmax(-1).tolist()
    return bigram, OracleHead(head, dict(enumerate(nxt)), wrong_every=5), drafter


PROMPTS = [[5, 17, 33, 2, 9], [40], [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 11], [90, 1, 64]]


def test_cached_equals_uncached_token_for_token_and_round_for_round(oracle):
    target, head, drafter = oracle
    cached = speculative_generate_cached(target, drafter, head, PROMPTS, max_new_tokens=30, stop_ids=set())
    seen_lengths = set()
    for prompt, got in zip(PROMPTS, cached):
        ref = speculative_generate(target, drafter, head, prompt, max_new_tokens=30, stop_ids=set())
        assert got.tokens == ref.tokens == greedy_generate(target, prompt, 30, set())
        assert got == ref  # one Generation type: tokens, acceptance lengths and accepted drafts, every round
        seen_lengths |= set(got.acceptance_lengths)
    assert len(seen_lengths) >= 3 and max(seen_lengths) > 1  # partial and longer acceptances both happen


def test_cached_with_the_random_drafter_and_a_stop_token(tiny):
    target, head, drafter, _ = tiny
    greedy = greedy_generate(target, PROMPTS[0], 12, set())
    stop = {greedy[6]}
    cached = speculative_generate_cached(target, drafter, head, PROMPTS, max_new_tokens=12, stop_ids=stop)
    for prompt, got in zip(PROMPTS, cached):
        ref = speculative_generate(target, drafter, head, prompt, max_new_tokens=12, stop_ids=stop)
        assert got.tokens == ref.tokens and got.acceptance_lengths == ref.acceptance_lengths
    assert cached[0].tokens[-1] in stop and len(cached[0].tokens) <= 7


@pytest.fixture(scope="module")
def guessing(tiny):
    """The real tiny target and a head drafting its single-token successor chain: right now and
    then, so rows accept different numbers of drafts (masked holes in the batch's cache) while
    the target's attention over the cache matters (unlike the bigram target's)."""
    target, head, drafter, _ = tiny
    vocab = head.embed_weight.shape[0]
    with torch.no_grad():
        nxt = target(input_ids=torch.arange(vocab)[:, None]).logits[:, -1].argmax(-1).tolist()
    return target, OracleHead(head, dict(enumerate(nxt)), wrong_every=vocab * 64), drafter


def test_batched_equals_each_prompt_alone_with_holes_and_compaction(guessing):
    target, head, drafter = guessing
    info = {}
    # capacity 43 = 11 + 24 + 8, the least allowed: holes do not fit, so the cache gets packed
    batched = speculative_generate_cached(target, drafter, head, PROMPTS, 24, set(), capacity=43, info=info)
    assert info["implementation"] == "static" and info["compactions"] >= 1
    dynamic = speculative_generate_cached(target, drafter, head, PROMPTS, 24, set(), implementation="dynamic")
    for prompt, got, other in zip(PROMPTS, batched, dynamic):
        alone, = speculative_generate_cached(target, drafter, head, [prompt], 24, set())
        assert got.tokens == alone.tokens == other.tokens
        assert got.acceptance_lengths == alone.acceptance_lengths == other.acceptance_lengths
        assert got.accepted == alone.accepted == other.accepted
    per_round = [a for g in batched for a in g.accepted]
    assert len(set(per_round)) >= 3  # rows and rounds accept different numbers of drafts


def test_static_capacity_below_one_decode_is_refused(tiny):
    target, head, drafter, _ = tiny
    with pytest.raises(ValueError, match="capacity 40 < longest prompt"):
        speculative_generate_cached(target, drafter, head, PROMPTS, 24, set(), capacity=40)


def test_static_equals_dynamic_on_a_llama_target(llama3_model_dir):
    """The static decoder runs the target from its modules: also right without Qwen3's q/k norms."""
    from trainer.models.drafter import DFlashDrafter, DrafterConfig
    from trainer.models.target import default_target_layer_ids, freeze, load_target

    target = freeze(load_target(str(llama3_model_dir), "cpu", torch.float32))
    n = target.config.num_hidden_layers
    cfg = DrafterConfig.from_target(target.config, num_layers=1, block_size=4,
                                    mask_token_id=target.config.vocab_size - 1,
                                    target_layer_ids=default_target_layer_ids(n, 2))
    torch.manual_seed(0)
    drafter, head = DFlashDrafter(cfg).eval(), FrozenHead.from_target(target, "cpu")
    info = {}
    static = speculative_generate_cached(target, drafter, head, PROMPTS[:3], 10, set(), info=info)
    dynamic = speculative_generate_cached(target, drafter, head, PROMPTS[:3], 10, set(), implementation="dynamic")
    assert info["implementation"] == "static" and target.config.model_type == "llama"
    for prompt, got, other in zip(PROMPTS[:3], static, dynamic):
        assert got.tokens == other.tokens == greedy_generate(target, prompt, 10, set())
        assert got.acceptance_lengths == other.acceptance_lengths


def test_a_round_is_cut_after_a_stop_token_and_at_max_new_tokens():
    """The one round cut every decoder applies (Generation.add_round)."""
    g = Generation([1], [], [])
    assert g.add_round([2, 3], 1, stop_ids={9}, max_new_tokens=10, drafts=[2, 7, 7])
    assert not g.add_round([4, 9, 5], 2, stop_ids={9}, max_new_tokens=10, drafts=[4, 9, 6])  # cut after the stop
    assert (g.tokens, g.acceptance_lengths, g.accepted) == ([1, 2, 3, 4, 9], [2, 2], [1, 2])
    assert g.expected_lengths == [2.0, 2.0]  # the greedy expected length is the produced length
    h = Generation([1], [], [])
    assert not h.add_round([2, 3, 4], 3, stop_ids=set(), max_new_tokens=3, drafts=[2, 3, 4])  # cut at max_new_tokens
    assert (h.tokens, h.acceptance_lengths, h.accepted, h.expected_lengths) == ([1, 2, 3], [2], [3], [2.0])
