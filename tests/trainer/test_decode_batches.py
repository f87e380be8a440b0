"""The evaluation's decode batches: `eval.batch` prompts at once, fewer where the prefill mask of long
prompts would not fit (64 prompts of 38K tokens at once: a 94 GB mask)."""
from trainer.generate.evaluate import PREFILL_MASK_ELEMENTS, decode_batches


def test_short_prompts_batch_as_eval_batch_says():
    assert decode_batches([300] * 10, 4, 300) == [(0, 4), (4, 8), (8, 10)]
    assert decode_batches([], 4, 300) == []


def test_long_prompts_split_so_the_prefill_mask_stays_bounded():
    lengths = [1000] * 3 + [9000] * 2 + [38000] * 3
    groups = decode_batches(lengths, 64, 320)
    assert [i for g in groups for i in range(*g)] == list(range(len(lengths)))  # every prompt, in order, once
    for i, j in groups:
        wide = max(lengths[i:j])
        assert j - i == 1 or (j - i) * wide * (wide + 320) <= PREFILL_MASK_ELEMENTS
    assert groups[-3:] == [(5, 6), (6, 7), (7, 8)]  # a 38K prompt's mask is 1.4G booleans: one at a time
    assert groups[0] == (0, 5)  # the short ones and the 9K ones together (5 x 9K x 9.3K)


def test_a_prompt_over_the_budget_still_goes_alone():
    assert decode_batches([10, 100000, 10], 8, 16) == [(0, 1), (1, 2), (2, 3)]
