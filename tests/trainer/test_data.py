import pytest
import torch

from trainer.data.batches import (
    DataError,
    PreloadedDataset,
    build_dataset,
    select_target_warmup_shapes,
    tokenize_conversation,
)
from trainer.data.synth import synthetic_conversations, synthetic_words
from trainer.data.tokenizer import synthetic_tokenizer


def test_loss_mask_covers_exactly_the_assistant_turns():
    tok = synthetic_tokenizer(synthetic_words())
    msgs = [{"role": "user", "content": "step1 v3"}, {"role": "assistant", "content": "v4 v5"},
            {"role": "user", "content": "step3 v0"}, {"role": "assistant", "content": "v3 v6 v9"}]
    ids, mask = tokenize_conversation(tok, msgs, 100)
    toks = tok.convert_ids_to_tokens(ids)
    on = [t for t, m in zip(toks, mask) if m]
    assert on == ["v4", "v5", "<|im_end|>", "v3", "v6", "v9", "<|im_end|>"]
    assert len(ids) == len(mask)
    ids, mask = tokenize_conversation(tok, msgs, 6)  # truncation keeps ids and mask aligned
    assert len(ids) == len(mask) == 6


def _dataset(seed=0, budget=256):
    tok = synthetic_tokenizer(synthetic_words())
    return build_dataset(tok, synthetic_conversations(120, 0, 4, 40), 128, [32, 64], budget, seed, 16)


def test_batches_respect_token_budget_and_are_deterministic_and_resumable():
    a, b = _dataset(), _dataset()
    first = [a.next_batch() for _ in range(5)]
    assert all(x.input_ids.numel() <= 256 for x in first)
    assert all(torch.equal(x.input_ids, b.next_batch().input_ids) for x in first)
    state = a.state_dict()
    expected = [a.next_batch().input_ids for _ in range(40)]  # crosses an epoch boundary
    c = _dataset()
    c.load_state_dict(state)
    assert all(torch.equal(e, c.next_batch().input_ids) for e in expected)
    assert not torch.equal(_dataset(seed=1).next_batch().input_ids, first[0].input_ids)


def test_select_target_warmup_shapes_picks_the_worst_case_per_bucket():
    samples = [([1] * n, [1] * n) for n in (10, 30, 20, 60, 50, 64)]
    ds = PreloadedDataset(samples, [32, 64], 10_000, 0, pad_multiple=16)
    batches = [[0], [1, 2], [0, 2], [3], [4, 3], [5]]
    bucket_ids = [0, 0, 0, 1, 1, 1]
    shapes = select_target_warmup_shapes(ds, batches, bucket_ids, max_shapes=8)
    assert shapes == [(2, 64), (2, 32)]  # bucket 1: [4, 3] pads to 64 x 2; bucket 0: [1, 2] pads to 32 x 2
    assert select_target_warmup_shapes(ds, batches, bucket_ids, max_shapes=1) == [(2, 64)]
    planned, ids = ds.plan_epoch(0)
    got = select_target_warmup_shapes(ds, planned, ids, 4)
    assert max(b * s for b, s in got) == max(len(x) * ds.padded_length(x) for x in planned)


def test_loss_mask_with_a_template_that_renders_the_last_assistant_turn_differently():
    """Qwen3's template adds an empty think block to the final assistant turn only, so an earlier
    turn rendered as the last message is not a prefix of the whole conversation."""
    tok = synthetic_tokenizer(synthetic_words())
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and loop.last %}<think> </think>\n{% endif %}"
        "{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    msgs = [{"role": "user", "content": "step1 v3"}, {"role": "assistant", "content": "v4 v5"},
            {"role": "user", "content": "step3 v0"}, {"role": "assistant", "content": "v3 v6 v9"}]
    ids, mask = tokenize_conversation(tok, msgs, 100)
    on = [t for t, m in zip(tok.convert_ids_to_tokens(ids), mask) if m]
    assert on == ["v4", "v5", "<|im_end|>", "<unk>", "<unk>", "v3", "v6", "v9", "<|im_end|>"]
    # a turn whose content the template rewrites is refused, not matched against a later turn
    msgs[1]["content"] = "v3 v6 v9"
    tok.chat_template = tok.chat_template.replace("{{ m['content'] }}", "{{ m['content'] if loop.last else 'v0' }}")
    with pytest.raises(DataError):
        tokenize_conversation(tok, msgs, 100)
