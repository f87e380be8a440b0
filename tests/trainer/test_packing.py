"""Packed rows: masks against dense references, and a packed row against its documents one by one."""
import random

import pytest
import torch

from trainer.data.packing import PackedDataset, anchors_for_row, doc_start_of, positions_of, warmup_packed_batch
from trainer.models.masks import (
    dense_attention,
    dense_mask,
    document_causal_block_mask,
    document_causal_dense,
    draft_block_mask,
    flex_with,
    make_blocks,
    prepare_blocks,
    sample_packed_anchors,
)
from trainer.models.objective import drafter_loss_sums
from trainer.models.target import target_context_features

VOCAB, MASK_ID = 97, 96
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def reference_document_causal(doc_start):
    b, n = doc_start.shape
    out = torch.zeros(b, 1, n, n, dtype=torch.bool)
    for r in range(b):
        for i in range(n):
            for j in range(n):
                out[r, 0, i, j] = bool(doc_start[r, i] == doc_start[r, j] and j <= i)
    return out


def test_doc_start_and_positions_restart_per_document():
    ds = doc_start_of([3, 2], 7)
    assert ds.tolist() == [0, 0, 0, 3, 3, 5, 5]  # the padding tail is a document of its own
    assert positions_of(ds).tolist() == [0, 1, 2, 0, 1, 0, 1]


def test_document_causal_dense_matches_hand_reference():
    ds = torch.stack([doc_start_of([3, 4, 2], 12), doc_start_of([12], 12)])
    assert torch.equal(document_causal_dense(ds), reference_document_causal(ds))


def tile_level(dense, q_tile=128, kv_tile=128):
    b, _, q, kv = dense.shape
    d = torch.nn.functional.pad(dense, (0, -kv % kv_tile, 0, -q % q_tile))
    t = d.view(b, 1, d.shape[2] // q_tile, q_tile, d.shape[3] // kv_tile, kv_tile)
    return t.any(5).any(3)[:, 0], t.all(5).all(3)[:, 0]


def block_mask_tiles(block_mask):
    partial = block_mask.kv_num_blocks.new_zeros(0)
    nq, nkv = block_mask.kv_indices.shape[2:]
    b = block_mask.kv_indices.shape[0]
    partial = torch.zeros(b, nq, nkv, dtype=torch.bool)
    full = torch.zeros(b, nq, nkv, dtype=torch.bool)
    for r in range(b):
        for t in range(nq):
            for j in block_mask.kv_indices[r, 0, t, : block_mask.kv_num_blocks[r, 0, t]].tolist():
                partial[r, t, j] = True
            for j in block_mask.full_kv_indices[r, 0, t, : block_mask.full_kv_num_blocks[r, 0, t]].tolist():
                full[r, t, j] = True
    return partial, full


def assert_tiles_cover(block_mask, dense):
    """Every visible pair lies in a listed tile; a tile listed full is visible everywhere."""
    any_tile, all_tile = tile_level(dense)
    partial, full = block_mask_tiles(block_mask)
    assert not (partial & full).any()
    assert not (any_tile & ~(partial | full)).any(), "a visible tile is missing from the block mask"
    assert not (full & ~all_tile).any(), "a tile marked full hides masked pairs"
    return partial, full


def test_target_block_mask_matches_dense_reference_at_boundaries():
    ds = torch.stack([doc_start_of([100, 150, 60, 40], 384), doc_start_of([128, 256], 384),
                      doc_start_of([384], 384)])
    dense = document_causal_dense(ds)
    bm = document_causal_block_mask(ds)
    partial, full = assert_tiles_cover(bm, dense)
    assert full.any() and partial.any()  # both kinds are used (row 2: tiles below the diagonal are full)
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 4, 384, 8), torch.randn(3, 2, 384, 8), torch.randn(3, 2, 384, 8)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)
    got = flex_with(bm)(q, k, v)
    assert torch.allclose(got, want, atol=1e-5)


def test_draft_block_mask_matches_dense_reference_with_document_starts():
    torch.manual_seed(1)
    bs, ctx_len = 8, 512
    ds = torch.stack([doc_start_of([190, 140, 180], ctx_len), doc_start_of([500], ctx_len)])
    lm = torch.ones(2, ctx_len, dtype=torch.bool)
    anchors, valid = sample_packed_anchors(lm, ds, 40, torch.Generator().manual_seed(0))
    valid[1, 32:] = False  # padding blocks at the end of the second row
    anchors[1, 32:] = 0
    starts = torch.gather(ds, 1, anchors)
    dense = dense_mask(anchors, valid, ctx_len, bs, starts)
    bm = draft_block_mask(anchors, valid, starts, ctx_len, bs)
    partial, full = assert_tiles_cover(bm, dense)
    assert full.any()
    q = torch.randn(2, 4, 40 * bs, 8)
    k, v = torch.randn(2, 2, ctx_len + 40 * bs, 8), torch.randn(2, 2, ctx_len + 40 * bs, 8)
    assert torch.allclose(flex_with(bm)(q, k, v), dense_attention(dense)(q, k, v), atol=1e-5)
    # a block never sees another document: keys it sees lie in [start, anchor)
    for r in range(2):
        for blk in range(40):
            seen = dense[r, 0, blk * bs, :ctx_len].nonzero().flatten()
            if len(seen):
                assert seen.min() >= starts[r, blk] and seen.max() < anchors[r, blk]


def test_packed_anchors_stay_inside_their_document_and_follow_length_shares():
    lengths = [50, 13, 200, 3, 90]
    ds = doc_start_of(lengths, 400)[None]
    lm = torch.ones(1, 400, dtype=torch.bool)
    lm[0, 356:] = False  # padding tail
    anchors, valid = sample_packed_anchors(lm, ds, 64, torch.Generator().manual_seed(3))
    a = anchors[valid]
    assert a.tolist() == sorted(a.tolist()) and not valid[0, len(a):].any()
    assert (ds[0, a] == ds[0, a + 1]).all()  # p and p+1 in the same document
    assert len(set(a.tolist())) == len(a)
    counts = [int(((a >= s) & (a < s + n)).sum()) for s, n in zip(doc_start_of(lengths, 400).unique(), lengths)]
    assert counts == [8, 2, 32, 0, 14]  # floor(64*end/400) - floor(64*start/400); doc of 3 has 2 eligible
    assert sum(counts) == len(a)


def test_block_slots_past_the_document_end_carry_nothing():
    ds = doc_start_of([6, 6], 12)[None]
    ids = torch.arange(12)[None] + 10
    lm = torch.ones(1, 12, dtype=torch.bool)
    blk = make_blocks(ids, lm, torch.tensor([[4, 6]]), torch.tensor([[True, True]]), 4, 7.0, MASK_ID, ds)
    assert blk.starts.tolist() == [[0, 6]]
    assert blk.positions[0].tolist() == [[4, 5, 6, 7], [0, 1, 2, 3]]  # positions restart per document
    assert blk.labels[0, 0].tolist() == [14, 15, 0, 0]  # 16, 17 belong to the next document
    assert (blk.weights[0, 0, 2:] == 0).all() and (blk.weights[0, 1, 1:] > 0).all()


def test_packed_row_gives_each_documents_loss_and_gradients(tiny):
    """Per document: loss sum, weight sum and drafter gradients of the packed row equal those of
    the document run alone; the packed step's loss is their exact weighted mean."""
    target, head, drafter, layer_ids = tiny
    bs = drafter.config.block_size
    g = torch.Generator().manual_seed(5)
    lengths = [21, 34, 17]
    docs = [torch.randint(0, 90, (n,), generator=g) for n in lengths]
    masks = [torch.tensor([0] * 4 + [1] * (n - 4), dtype=torch.bool) for n in lengths]
    row = 80
    ds = doc_start_of(lengths, row)[None]
    ids = torch.cat(docs + [torch.zeros(row - sum(lengths), dtype=torch.long)])[None]
    lm = torch.cat(masks + [torch.zeros(row - sum(lengths), dtype=torch.bool)])[None]
    blocks = prepare_blocks(ids, lm, 24, bs, 7.0, MASK_ID, g, ds)
    feats = target_context_features(target, ids, None, layer_ids, ds)

    def grads_of(loss):
        drafter.zero_grad(set_to_none=True)
        loss.backward()
        return [p.grad.clone() for p in drafter.parameters()]

    total_loss, total_weight = 0.0, 0.0
    start = 0
    for doc, mask, n in zip(docs, masks, lengths):
        mine = (blocks.starts == start) & blocks.valid
        own = type(blocks)(**{f: getattr(blocks, f) for f in blocks.__dataclass_fields__})
        own.weights = blocks.weights * mine[..., None]
        loss_p, w_p, _ = drafter_loss_sums(drafter, head, feats, own, "sdpa", doc_start=ds)
        g_p = grads_of(loss_p)
        k = int(mine.sum())
        assert k > 0
        rel = (blocks.anchors[mine] - start)[None]
        alone = make_blocks(doc[None], mask[None], rel, torch.ones_like(rel, dtype=torch.bool), bs, 7.0, MASK_ID)
        feats_alone = target_context_features(target, doc[None], torch.ones(1, n, dtype=torch.long), layer_ids)
        assert torch.allclose(feats[:, start:start + n], feats_alone, atol=1e-5)  # causal per document
        loss_a, w_a, _ = drafter_loss_sums(drafter, head, feats_alone, alone, "sdpa")
        g_a = grads_of(loss_a)
        assert torch.allclose(w_p, w_a) and torch.allclose(loss_p, loss_a, rtol=1e-5, atol=1e-5)
        for a, b in zip(g_p, g_a):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)
        total_loss, total_weight = total_loss + float(loss_a.detach()), total_weight + float(w_a)
        start += n
    loss_all, w_all, _ = drafter_loss_sums(drafter, head, feats, blocks, "sdpa", doc_start=ds)
    assert abs(float(loss_all.detach()) / float(w_all) - total_loss / total_weight) < 1e-5


def lognormal_samples(n, seed=0, median=900, sigma=0.6, lo=64, hi=3072):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = int(min(hi, max(lo, rng.lognormvariate(__import__("math").log(median), sigma))))
        out.append(([rng.randrange(5, 90) for _ in range(length)], [0] * 8 + [1] * (length - 8)))
    return out


def test_packed_dataset_places_every_conversation_whole_once_per_epoch():
    samples = lognormal_samples(1000)
    data = PackedDataset(samples, 8192, 2, pad_id=0, seed=3)
    plan = data.plan_epoch(0)
    members = sorted(i for batch in plan for row in batch for i in row)
    assert members == list(range(len(samples)))
    assert all(sum(len(samples[i][0]) for i in row) <= 8192 for batch in plan for row in batch)
    assert data.pad_share() < 0.03
    assert data.plan_epoch(1) != plan and PackedDataset(samples, 8192, 2, 0, seed=3).plan_epoch(0) == plan
    b = data.next_batch()
    assert b.input_ids.shape == (2, 8192) and b.doc_start.shape == (2, 8192)
    row0 = plan[0][0]
    assert b.documents == len(row0) + len(plan[0][1])
    first = samples[row0[0]][0]
    assert b.input_ids[0, : len(first)].tolist() == first and b.doc_start[0, len(first)] == len(first)
    state = data.state_dict()
    again = PackedDataset(samples, 8192, 2, 0, seed=3)
    again.load_state_dict(state)
    assert torch.equal(again.next_batch().input_ids, data.next_batch().input_ids)


def test_anchor_density_per_row_and_warmup_batch():
    assert anchors_for_row(512, 3072, 8192, 16) == 1368  # 1365.3 rounded up to whole 128-slot tiles
    assert anchors_for_row(512, 3072, 3072, 16) == 512
    b = warmup_packed_batch(2, 1024, VOCAB, torch.Generator().manual_seed(0))
    assert b.input_ids.shape == (2, 1024) and b.documents > 2


def test_target_features_through_the_flex_block_mask_equal_the_dense_path(tiny):
    """The CUDA path (a BlockMask handed to the target's attention) computes what the dense mask does."""
    target, _, _, layer_ids = tiny
    from trainer.models.target import base_model

    ds = torch.stack([doc_start_of([100, 90, 50], 256), doc_start_of([256], 256)])
    ids = torch.randint(0, 90, (2, 256), generator=torch.Generator().manual_seed(2))
    dense = target_context_features(target, ids, None, layer_ids, ds)
    model = base_model(target)
    bm = document_causal_block_mask(ds)
    with torch.no_grad():
        hidden = model(input_ids=ids, attention_mask={"full_attention": bm}, position_ids=positions_of(ds),
                       output_hidden_states=True, use_cache=False).hidden_states
    flex = torch.cat([hidden[i + 1] for i in layer_ids], dim=-1)
    assert torch.allclose(flex, dense, atol=1e-5)
    # and plain calls (no BlockMask) still reach SDPA unchanged
    alone = target_context_features(target, ids[:1, :100], torch.ones(1, 100, dtype=torch.long), layer_ids)
    assert torch.allclose(alone, dense[:1, :100], atol=1e-5)


def test_flop_counts_of_real_tokens_never_exceed_what_was_computed(tiny):
    from trainer.pipeline.flops import drafter_step_flops, micro_batch_flops, target_forward_flops

    target, _, drafter, _ = tiny
    bs = drafter.config.block_size
    g = torch.Generator().manual_seed(0)
    # a bucketed batch: two short sequences padded to (3, 64)
    attn = torch.zeros(3, 64, dtype=torch.long)
    attn[0, :20], attn[1, :33] = 1, 1
    ids = torch.randint(0, 90, (3, 64), generator=g)
    blocks = prepare_blocks(ids, attn.bool(), 8, bs, 7.0, MASK_ID, g)
    counts = micro_batch_flops(target.config, drafter.config, attn, None, blocks)
    assert counts["tokens_real"] == 53 and counts["tokens_padded"] == 192
    used = max(drafter.config.target_layer_ids) + 1  # only the layers up to the last tapped one run
    assert used < target.config.num_hidden_layers
    assert counts["target_padded"] == target_forward_flops(target.config, 3, 64, used)
    assert 0 < counts["target_real"] < counts["target_padded"] / 2
    assert 0 < counts["drafter_real"] < counts["drafter_padded"]  # the empty third row's blocks are padding
    # a full unpadded row whose every anchor is valid: both counts agree, and match the formula's scale
    full = torch.ones(1, 64, dtype=torch.long)
    blocks = prepare_blocks(ids[:1], full.bool(), 8, bs, 7.0, MASK_ID, g)
    counts = micro_batch_flops(target.config, drafter.config, full, None, blocks)
    assert counts["target_real"] == counts["target_padded"]
    assert counts["drafter_real"] == counts["drafter_padded"]
    assert abs(counts["drafter_real"] / drafter_step_flops(drafter.config, 1, 64, 8) - 1) < 0.05
    # a packed row: attention only inside documents, so less than one causal sequence of the row
    ds = doc_start_of([20, 30, 10], 64)[None]
    row = (torch.arange(64) < 60).long()[None]
    blocks = prepare_blocks(ids[:1], row.bool(), 16, bs, 7.0, MASK_ID, g, ds)
    counts = micro_batch_flops(target.config, drafter.config, row, ds, blocks)
    assert counts["target_real"] < counts["target_padded"] < target_forward_flops(target.config, 1, 64)


def test_compiled_target_layers_can_be_returned_to_eager(tiny):
    from trainer.models.target import base_model, compile_decoder_layers, uncompile_decoder_layers

    target, _, _, layer_ids = tiny
    ids = torch.randint(0, 90, (1, 12))
    before = target_context_features(target, ids, torch.ones_like(ids), layer_ids)
    assert compile_decoder_layers(target) == len(base_model(target).layers)
    assert all(layer._compiled_call_impl is not None for layer in base_model(target).layers)
    uncompile_decoder_layers(target)
    assert all(layer._compiled_call_impl is None for layer in base_model(target).layers)
    assert torch.equal(target_context_features(target, ids, torch.ones_like(ids), layer_ids), before)


def test_flex_traced_inside_a_compiled_layer_leaves_the_cached_compiled_flex_alone(monkeypatch):
    """A compiled target layer traces _flex_fn; that must not cache anything in its place: on an H200
    the trace stored the raw flex_attention as the 'compiled' one, and the drafter then ran flex's
    unfused math path (a 78 GiB score matrix, OOM) in a fresh process with model.compile_target."""
    from trainer.models import masks

    monkeypatch.setattr(masks, "_compiled_flex", None)

    @torch.compile(backend="eager", fullgraph=False)
    def layer(x):
        masks._flex_fn("cuda")
        return x + 1

    assert torch.equal(layer(torch.ones(2)), torch.full((2,), 2.0))
    assert masks._compiled_flex is None
