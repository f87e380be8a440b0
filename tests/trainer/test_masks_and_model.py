import math

import pytest
import torch

from trainer.models.masks import (
    block_attention,
    dense_attention,
    dense_mask,
    flex_attention_fn,
    loss_decay,
    make_blocks,
    sample_anchors,
)
from trainer.models.objective import chunked_weighted_ce, drafter_loss_sums, fused_weighted_ce
from trainer.models.target import target_context_features

VOCAB, MASK_ID = 97, 96  # as in conftest.py


def reference_mask(anchors, valid, ctx_len, bs):
    """Hand-written loops: strict < for context, own block only, padding sees nothing."""
    b, a = anchors.shape
    out = torch.zeros(b, 1, a * bs, ctx_len + a * bs, dtype=torch.bool)
    for bi in range(b):
        for blk in range(a):
            if not valid[bi, blk]:
                continue
            p = int(anchors[bi, blk])
            for s in range(bs):
                qi = blk * bs + s
                for j in range(p):
                    out[bi, 0, qi, j] = True
                for s2 in range(bs):
                    out[bi, 0, qi, ctx_len + blk * bs + s2] = True
    return out


def test_dense_mask_matches_hand_written_reference():
    anchors = torch.tensor([[0, 3, 7, 0], [2, 5, 0, 0]])
    valid = torch.tensor([[True, True, True, False], [True, True, False, False]])
    got = dense_mask(anchors, valid, ctx_len=10, block_size=4)
    assert torch.equal(got, reference_mask(anchors, valid, 10, 4))
    # the anchor's own context position is NOT visible (strict <): slot 0 of anchor 3 sees 0..2
    assert got[0, 0, 4, :10].nonzero().flatten().tolist() == [0, 1, 2]
    assert not got[0, 0, 12:16].any()  # padding block sees nothing


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_equals_dense_attention_including_padding_blocks():
    torch.manual_seed(0)
    anchors = torch.tensor([[1, 4, 9, 0], [0, 6, 0, 0]])
    valid = torch.tensor([[True, True, True, False], [True, True, False, False]])
    ctx_len, bs = 12, 4
    q = torch.randn(2, 4, 16, 8)
    k = torch.randn(2, 2, ctx_len + 16, 8)
    v = torch.randn(2, 2, ctx_len + 16, 8)
    dense = dense_attention(dense_mask(anchors, valid, ctx_len, bs))(q, k, v)
    flex = flex_attention_fn(anchors, valid, ctx_len, bs)(q, k, v)
    assert torch.allclose(dense, flex, atol=1e-5)
    assert dense[0, :, 12:].abs().max() == 0


def test_anchor_sampling_only_where_anchor_and_next_token_carry_loss():
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1, 0, 0]], dtype=torch.bool)
    g = torch.Generator().manual_seed(0)
    anchors, valid = sample_anchors(loss_mask, 8, g)
    assert anchors[valid].tolist() == [2, 3, 6]
    assert valid.tolist() == [[True] * 3 + [False] * 5]


def test_labels_and_weights_arithmetic():
    ids = torch.arange(10)[None] + 10
    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 0, 1, 1]], dtype=torch.bool)
    anchors, valid = torch.tensor([[5, 0]]), torch.tensor([[True, False]])
    blk = make_blocks(ids, loss_mask, anchors, valid, block_size=4, gamma=7.0, mask_token_id=MASK_ID)
    assert blk.input_ids[0, 0].tolist() == [15, MASK_ID, MASK_ID, MASK_ID]
    assert blk.positions[0, 0].tolist() == [5, 6, 7, 8]
    assert blk.labels[0, 0].tolist() == [15, 16, 17, 18]  # slot k predicts position anchor+k (no shift)
    w = blk.weights[0, 0].tolist()
    assert w[0] == 0 and w[1] == 1.0 and w[2] == 0  # slot 0 no loss; position 7 has no loss
    assert math.isclose(w[3], math.exp(-2 / 7), rel_tol=1e-6)
    assert blk.weights[0, 1].abs().sum() == 0  # padding block
    # out of bounds: anchor 8 -> positions 8, 9, 10, 11
    blk = make_blocks(ids, loss_mask, torch.tensor([[8]]), torch.tensor([[True]]), 4, 7.0, MASK_ID)
    assert blk.weights[0, 0, 2:].abs().sum() == 0
    assert torch.allclose(loss_decay(16, 7.0)[1:3], torch.tensor([1.0, math.exp(-1 / 7)]))


def test_training_forward_equals_inference_path_for_each_anchor(tiny):
    """The bug that makes τ≈1: the training view of a block must be what inference sees."""
    target, head, drafter, layer_ids = tiny
    torch.manual_seed(3)
    ids = torch.randint(0, VOCAB - 1, (1, 20))
    feats = target_context_features(target, ids, torch.ones_like(ids), layer_ids)
    anchors = torch.tensor([[0, 4, 11, 17, 0]])
    valid = torch.tensor([[True, True, True, True, False]])
    blk = make_blocks(ids, torch.ones_like(ids, dtype=torch.bool), anchors, valid, 8, 7.0, MASK_ID)
    bs = 8
    with torch.no_grad():
        for backend in ("sdpa", "flex"):
            attend = block_attention(backend, anchors, valid, 20, bs)
            hidden = drafter.forward_train(feats, head.embed(blk.input_ids.view(1, -1)), blk.positions.view(1, -1),
                                           attend).view(1, 5, bs, -1)
            for i, p in enumerate(anchors[0, :4].tolist()):
                block_ids = torch.tensor([[ids[0, p].item()] + [MASK_ID] * (bs - 1)])
                ref = drafter.draft_block(feats[:, :p], head.embed(block_ids), start=p)
                assert torch.allclose(head.logits(hidden[:, i]), head.logits(ref), atol=1e-4), (backend, p)


def test_context_features_come_from_the_named_layers(tiny):
    target, _, _, layer_ids = tiny
    ids = torch.randint(0, VOCAB - 1, (2, 9))
    feats = target_context_features(target, ids, torch.ones_like(ids), layer_ids)
    out = target(ids, output_hidden_states=True)
    assert torch.allclose(feats[..., :32], out.hidden_states[layer_ids[0] + 1])
    assert torch.allclose(feats[..., 32:], out.hidden_states[layer_ids[1] + 1])


def test_loss_sums_normalise_over_micro_batches_and_gradients_flow(tiny):
    target, head, drafter, layer_ids = tiny
    torch.manual_seed(4)
    ids = torch.randint(0, VOCAB - 1, (2, 24))
    lm = torch.ones_like(ids, dtype=torch.bool)
    lm[1, 12:] = False
    feats = target_context_features(target, ids, torch.ones_like(ids), layer_ids)
    blk = make_blocks(ids, lm, *sample_anchors(lm, 6, torch.Generator().manual_seed(0)), 8, 7.0, MASK_ID)
    whole = drafter_loss_sums(drafter, head, feats, blk, "sdpa", chunk=7)
    parts = [drafter_loss_sums(drafter, head, feats[i:i + 1], type(blk)(*(getattr(blk, f)[i:i + 1]
             for f in blk.__dataclass_fields__)), "sdpa", chunk=1000) for i in range(2)]
    for j in range(3):
        assert torch.allclose(whole[j], parts[0][j] + parts[1][j], atol=1e-4)
    assert 0 <= whole[2] <= whole[1]
    whole[0].backward()
    assert drafter.fc.weight.grad is not None and drafter.fc.weight.grad.abs().sum() > 0
    drafter.zero_grad(set_to_none=True)


@pytest.mark.parametrize("chunk", [5, 64])
def test_fused_head_ce_matches_checkpointed_ce_in_value_and_gradient(chunk):
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(23, 16, generator=gen, requires_grad=True)
    head = torch.randn(40, 16, generator=gen)
    labels = torch.randint(0, 40, (23,), generator=gen)
    weights = torch.rand(23, generator=gen) * (torch.arange(23) % 4 != 0)
    sums, grads = [], []
    for ce in (chunked_weighted_ce, fused_weighted_ce):
        hidden.grad = None
        loss_sum, correct_sum = ce(hidden, head, labels, weights, chunk)
        (loss_sum * 0.37).backward()  # a scaled loss, as after normalising by the step's weight
        sums.append((loss_sum.detach(), correct_sum))
        grads.append(hidden.grad.clone())
    assert torch.allclose(sums[0][0], sums[1][0]) and torch.equal(sums[0][1], sums[1][1])
    assert torch.allclose(grads[0], grads[1], atol=1e-6)
    assert grads[1].abs().sum() > 0
    with torch.no_grad():
        assert torch.allclose(fused_weighted_ce(hidden, head, labels, weights, chunk)[0], sums[0][0])
