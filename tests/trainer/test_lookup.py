"""N-gram prompt lookup: its drafts, and decoding with them is exactly the target's greedy output."""

from trainer.generate.evaluate import greedy_generate
from trainer.generate.lookup import lookup_drafts, lookup_generate


def test_lookup_drafts_match_the_longest_suffix_at_its_earliest_occurrence():
    seq = [1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3]
    assert lookup_drafts(seq, 3) == [4, 9, 2]  # [1, 2, 3] occurred at 0
    assert lookup_drafts([7, 2, 3, 5, 8, 2, 3], 2) == [5, 8]  # 3-gram unseen; [2, 3] at 1
    assert lookup_drafts([4, 5, 6, 4, 7, 8, 4], 5) == [5, 6, 4, 7, 8]  # 1-gram: the first 4
    assert lookup_drafts([1, 2, 3], 4) == []
    assert lookup_drafts([5, 5], 3) == [5]
    assert lookup_drafts([1, 2, 3, 1, 2], 9) == [3, 1, 2]  # cut by the sequence's end


def test_lookup_decoding_is_the_targets_greedy_output(tiny):
    target, _, _, _ = tiny
    prompts = [[5, 17, 33, 2, 9, 5, 17], [3, 3, 3], [40, 41, 42, 40, 41]]
    expected = [greedy_generate(target, p, 24, set()) for p in prompts]
    for block_size in (2, 4):
        for g, want in zip(lookup_generate(target, prompts, 24, set(), block_size), expected):
            assert g.tokens == want
            assert sum(g.acceptance_lengths) == len(g.tokens) - 1
            assert all(1 <= n <= block_size for n in g.acceptance_lengths)
    stop = expected[0][12]
    (g,) = lookup_generate(target, prompts[:1], 24, {stop}, 4)
    assert g.tokens == expected[0][: expected[0].index(stop) + 1]


def test_lookup_accepts_what_repeats():
    """A target that repeats its prompt forever: lookup drafts are all accepted after the first round."""
    import torch

    class Repeat(torch.nn.Module):  # greedy next token = the token 3 back: seq ... a b c -> a
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.config = type("Config", (), {"model_type": "repeat"})()  # not a decoder family: uncached path

        def forward(self, input_ids, use_cache=False):
            ids = input_ids[0]
            nxt = torch.roll(ids, 2)  # position i predicts ids[i - 2]
            return type("Out", (), {"logits": torch.nn.functional.one_hot(nxt, 16).float()[None]})()

    (g,) = lookup_generate(Repeat(), [[1, 2, 3] * 3], 16, set(), 5)
    assert g.tokens == ([1, 2, 3] * 6)[:16]
    assert g.acceptance_lengths == [5, 5, 5]
