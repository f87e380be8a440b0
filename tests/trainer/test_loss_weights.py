"""Per-token loss weights in training rows (`answer_tokens` + `loss_weights`, trainer.data.chat):
they land on exactly the last answer's tokens, the drafter's loss becomes their weighted mean, rows
without them train as before, and rows whose weights do not fit are refused naming the row."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tests.trainer.conftest import MASK_ID, VOCAB
from trainer.data.batches import DataError, build_dataset, read_conversations
from trainer.data.synth import synthetic_conversations, synthetic_words
from trainer.data.tokenizer import synthetic_tokenizer
from trainer.models.masks import block_attention, make_blocks, prepare_blocks, sample_anchors
from trainer.models.objective import drafter_loss_sums
from trainer.models.target import target_context_features

MESSAGES = [{"role": "user", "content": "step1 v3"}, {"role": "assistant", "content": "v4 v5"},
            {"role": "user", "content": "step3 v0"}, {"role": "assistant", "content": "v3 v6 v9"}]


@pytest.fixture(scope="module")
def tok():
    return synthetic_tokenizer(synthetic_words())


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def weighted_row(tok, weights, tokens=None):
    return {"messages": MESSAGES, "answer_tokens": tokens or tok.convert_tokens_to_ids(["v3", "v6", "v9"]),
            "loss_weights": weights}


def test_weights_land_on_the_last_answers_tokens_and_one_elsewhere(tok, tmp_path):
    path = write(tmp_path / "w.jsonl", [weighted_row(tok, [1.0, 2.0, 0.5]), {"messages": MESSAGES}])
    weighted, plain = read_conversations(path)
    data = build_dataset(tok, [weighted, plain], 100, [64], 4096, 0)
    (ids_w, mask_w), (ids_p, mask_p) = data.samples
    assert ids_w == ids_p and mask_p == [int(bool(m)) for m in mask_w]
    trained = [(t, m) for t, m in zip(tok.convert_ids_to_tokens(ids_w), mask_w) if m]
    # the first answer and the end-of-turn the template adds after the last one weigh 1
    assert trained == [("v4", 1.0), ("v5", 1.0), ("<|im_end|>", 1.0), ("v3", 1.0), ("v6", 2.0), ("v9", 0.5),
                       ("<|im_end|>", 1.0)]
    assert data.collate([0, 1]).loss_mask.dtype == torch.float32
    assert build_dataset(tok, [plain], 100, [64], 4096, 0).collate([0]).loss_mask.dtype == torch.bool


@pytest.mark.parametrize("row, message", [
    ({"loss_weights": [1.0, 2.0]}, "'loss_weights' needs 'answer_tokens' beside it"),
    ({"loss_weights": [1.0, 2.0], "answer_tokens": [30, 31, 32]}, "one weight per answer token: 3 tokens, got 2"),
    ({"loss_weights": [1.0, 0.0, 1.0], "answer_tokens": [30, 31, 32]}, "loss_weights[1] is 0.0"),
])
def test_weights_that_do_not_fit_their_tokens_are_refused_naming_the_row(tok, tmp_path, row, message):
    path = write(tmp_path / "bad.jsonl", [{"messages": MESSAGES}, {"messages": MESSAGES, **row}])
    with pytest.raises(DataError) as e:
        read_conversations(path)
    assert str(e.value).startswith(f"{path}:2: ") and message in str(e.value)


def test_answer_tokens_the_template_does_not_render_are_refused_naming_the_row(tok, tmp_path):
    other = tok.convert_tokens_to_ids(["v3", "v7", "v9"])  # the row's text says v6
    path = write(tmp_path / "bad.jsonl", [weighted_row(tok, [1.0, 2.0, 1.0], other)])
    with pytest.raises(DataError) as e:
        build_dataset(tok, read_conversations(path), 100, [64], 4096, 0)
    assert str(e.value).startswith(f"{path}:1: answer_tokens[1] is {other[1]} 'v7', the chat template renders")


def test_weights_of_one_train_exactly_as_rows_without_weights(tok):
    conversations = synthetic_conversations(12, 0, 4, 20)
    plain = build_dataset(tok, conversations, 64, [64], 4096, 0)
    ones = []
    for c in conversations:
        answer = tok(c["messages"][-1]["content"], add_special_tokens=False)["input_ids"]
        ones.append({**c, "answer_tokens": answer, "loss_weights": [1.0] * len(answer)})
    weighted = build_dataset(tok, ones, 64, [64], 4096, 0)
    a, b = plain.next_batch(), weighted.next_batch()
    assert a.loss_mask.dtype == torch.bool and b.loss_mask.dtype == torch.float32
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask.float(), b.loss_mask)
    blocks = [prepare_blocks(x.input_ids, x.loss_mask, 6, 4, 7.0, MASK_ID, torch.Generator().manual_seed(3))
              for x in (a, b)]
    for field in blocks[0].__dataclass_fields__:
        assert torch.equal(getattr(blocks[0], field), getattr(blocks[1], field)), field


def test_the_drafters_loss_is_the_weighted_mean_of_its_labels_cross_entropy(tiny):
    """The trainer's loss with weights against a weighted mean computed here from each label's
    cross-entropy (the drafter's logits) and each label's token weight, looked up by position."""
    target, head, drafter, layer_ids = tiny
    torch.manual_seed(5)
    ids = torch.randint(0, VOCAB - 1, (2, 24))
    on = torch.ones_like(ids, dtype=torch.bool)
    on[:, :3] = False  # a prompt: no loss
    token_weight = torch.where(on, torch.rand(ids.shape) * 2.5 + 0.25, torch.zeros(ids.shape))
    anchors, valid = sample_anchors(on, 5, torch.Generator().manual_seed(0))
    feats = target_context_features(target, ids, torch.ones_like(ids), layer_ids)
    plain = make_blocks(ids, on, anchors, valid, 8, 7.0, MASK_ID)
    weighted = make_blocks(ids, token_weight, anchors, valid, 8, 7.0, MASK_ID)
    with torch.no_grad():
        loss, weight, _ = drafter_loss_sums(drafter, head, feats, weighted, "sdpa", chunk=16)
        plain_loss, plain_weight, _ = drafter_loss_sums(drafter, head, feats, plain, "sdpa", chunk=16)
        b, a, bs = plain.input_ids.shape
        attend = block_attention("sdpa", anchors, valid, ids.shape[1], bs,
                                 kinds=drafter.config.layout.kinds(drafter.config.num_hidden_layers))
        hidden = drafter.forward_train(feats, drafter.embed_block(head.embed, plain.input_ids.view(b, -1)),
                                       plain.positions.view(b, -1), attend)
        ce = F.cross_entropy((hidden @ head.lm_head_weight.T).float().view(b * a * bs, -1), plain.labels.view(-1),
                             reduction="none").view(b, a, bs)
    by_position = torch.zeros(b, a, bs)
    for r in range(b):
        for j in range(a):
            for k in range(bs):
                if anchors[r, j] + k < ids.shape[1]:
                    by_position[r, j, k] = token_weight[r, anchors[r, j] + k]
    w = plain.weights * by_position  # position decay x the label's token weight
    assert torch.allclose(loss / weight, (w * ce).sum() / w.sum(), atol=1e-5)
    assert torch.allclose(plain_loss / plain_weight, (plain.weights * ce).sum() / plain.weights.sum(), atol=1e-5)
    assert abs(float(loss / weight - plain_loss / plain_weight)) > 1e-3  # the weights moved it
