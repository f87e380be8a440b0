"""DFlash2 (trainer/models/dflash2.py): the grouped convolutions and the candidate selector as vLLM
defines them, trained beside the token loss, decoded losslessly, exported under vLLM's names and
warm-started from a DFlash draft."""
import copy
import json

import pytest
import torch

from tests.trainer.test_speculative_cached import OracleHead
from trainer.generate.evaluate import greedy_generate, speculative_generate
from trainer.generate.speculative import speculative_generate_cached
from trainer.models.dflash2 import CandidateSelector, GroupedConv, grouped_conv, walk
from trainer.models.drafter import DFlashDrafter, DrafterConfig, propose
from trainer.models.masks import block_attention, make_blocks, sample_anchors
from trainer.models.objective import Objective, drafter_loss_sums
from trainer.models.target import target_context_features
from trainer.run import checkpoint as ckpt
from trainer.run.config import ConfigError, parse_config

VOCAB, MASK_ID = 97, 96  # as in conftest.py
DFLASH2 = {"kind": "dflash2", "conv_kernel_size": 3, "conv_group_size": 8, "selector_rank": 4, "selector_top_k": 3}


def dflash2_drafter(target, layer_ids, seed=1, **own):
    """A 2-layer DFlash2 drafter (block 8) with random (not identity) convolutions and selector."""
    cfg = DrafterConfig.from_target(target.config, num_layers=2, block_size=8, mask_token_id=MASK_ID,
                                    target_layer_ids=layer_ids, **{**DFLASH2, **own})
    torch.manual_seed(seed)
    d = DFlashDrafter(cfg)
    with torch.no_grad():
        for m in d.modules():
            if isinstance(m, GroupedConv):
                m.base_kernel.normal_(0.0, 0.5)
                m.kernel_projection.weight.normal_(0.0, 0.1)
        d.candidate_selector.hidden_projection.weight.normal_(0.0, 0.05)
        d.candidate_selector.predecessor_codebook.normal_(0.0, 1.0)
        d.candidate_selector.successor_codebook.normal_(0.0, 1.0)
    return d


def micro_batch(target, layer_ids):
    """One training micro-batch of 2 rows of 24 random tokens: the target's features and 6 blocks a row."""
    torch.manual_seed(4)
    ids = torch.randint(0, VOCAB - 1, (2, 24))
    lm = torch.ones_like(ids, dtype=torch.bool)
    feats = target_context_features(target, ids, torch.ones_like(ids), layer_ids)
    return feats, make_blocks(ids, lm, *sample_anchors(lm, 6, torch.Generator().manual_seed(0)), 8, 7.0, MASK_ID)


def test_convolution_equals_the_direct_formula_and_is_causal_inside_each_block():
    torch.manual_seed(0)
    taps, groups, size, bs = 3, 2, 2, 4
    x = torch.randn(2 * bs, groups * size)  # two blocks end to end
    base = torch.randn(taps, groups * size)
    delta = torch.randn(2 * bs, taps, groups)
    out = grouped_conv(x, delta, base, bs)
    for r in range(2 * bs):
        for c in range(groups * size):
            want = sum((base[t, c] + delta[r, t, c // size]) * x[r - t, c] for t in range(taps) if r % bs >= t)
            assert out[r, c].item() == pytest.approx(float(want), abs=1e-5)
    # causal inside the block, nothing across: changing row 5 (slot 1 of block 2) moves rows 5..7 only
    bumped = x.clone()
    bumped[5] += 1.0
    moved = (grouped_conv(bumped, delta, base, bs) - out).abs().sum(-1) > 0
    assert moved.tolist() == [False] * 5 + [True] * 3
    # the module: prepare projects once, side 0 for its input, side 1 for `finish`; fresh, both are identities
    conv = GroupedConv(groups * size, taps, size)
    h, d = conv.prepare(x, bs)
    assert torch.equal(h, x) and torch.equal(conv.finish(x, d, bs), x)
    assert conv.kernel_projection.weight.shape == (2 * taps * groups, groups * size)
    assert conv.base_kernel.shape == (2, taps, groups * size)


def brute_force_walk(selector, hidden, logits, anchor):
    """vLLM's scoring and walk restated with loops: scores[s, p, c] = unary[s, c] + <pred[prev(s, p)] *
    H(h_s), succ[cand(s, c)]> with prev(0, p) = the anchor, prev(s, p) = cand(s - 1, p); the walk starts
    at index 0 and keeps the argmax index as the next slot's row."""
    k = selector.top_k
    values, ids = torch.topk(logits, k, dim=-1)
    projected = hidden @ selector.hidden_projection.weight.t()
    out = []
    for b in range(hidden.shape[0]):
        scores = torch.zeros(hidden.shape[1], k, k)
        for s in range(hidden.shape[1]):
            for p in range(k):
                prev = int(anchor[b]) if s == 0 else int(ids[b, s - 1, p])
                for c in range(k):
                    edge = (selector.predecessor_codebook[prev] * projected[b, s]
                            * selector.successor_codebook[ids[b, s, c]]).sum()
                    scores[s, p, c] = values[b, s, c] + edge
        previous, row = 0, []
        for s in range(hidden.shape[1]):
            previous = int(scores[s, previous].argmax())
            row.append(int(ids[b, s, previous]))
        out.append(row)
    return out


def test_the_selector_walk_equals_a_brute_force_reimplementation():
    torch.manual_seed(2)
    sel = CandidateSelector(hidden_size=6, vocab_size=11, rank=3, top_k=4)
    with torch.no_grad():
        sel.hidden_projection.weight.normal_(0.0, 2.0)
        sel.predecessor_codebook.normal_(0.0, 1.0)
        sel.successor_codebook.normal_(0.0, 1.0)
    hidden, logits, anchor = torch.randn(5, 7, 6), torch.randn(5, 7, 11), torch.randint(0, 11, (5,))
    got = walk(sel, hidden, logits, anchor)
    assert got.tolist() == brute_force_walk(sel, hidden, logits, anchor)
    assert not torch.equal(got, logits.argmax(-1))  # the selector changes drafts here
    # a fresh selector adds nothing: the walk is the argmax (a DFlash draft's tokens)
    assert torch.equal(walk(CandidateSelector(6, 11, 3, 4), hidden, logits, anchor), logits.argmax(-1))


def test_training_forward_equals_inference_path(tiny):
    target, head, _, layer_ids = tiny
    drafter = dflash2_drafter(target, layer_ids)
    torch.manual_seed(3)
    ids = torch.randint(0, VOCAB - 1, (1, 20))
    feats = target_context_features(target, ids, torch.ones_like(ids), layer_ids)
    anchors, valid = torch.tensor([[0, 4, 11, 0]]), torch.tensor([[True, True, True, False]])
    blk = make_blocks(ids, torch.ones_like(ids, dtype=torch.bool), anchors, valid, 8, 7.0, MASK_ID)
    with torch.no_grad():
        hidden = drafter.forward_train(feats, head.embed(blk.input_ids.view(1, -1)), blk.positions.view(1, -1),
                                       block_attention("sdpa", anchors, valid, 20, 8)).view(1, 4, 8, -1)
        for i, p in enumerate(anchors[0, :3].tolist()):
            block_ids = torch.tensor([[ids[0, p].item()] + [MASK_ID] * 7])
            ref = drafter.draft_block(feats[:, :p], head.embed(block_ids), start=p)
            assert torch.allclose(hidden[:, i], ref, atol=1e-4), p


def test_a_few_steps_lower_the_token_and_the_selector_loss(tiny):
    target, head, _, layer_ids = tiny
    drafter = dflash2_drafter(target, layer_ids)
    feats, blk = micro_batch(target, layer_ids)
    objective = Objective(selector=1.0)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    seen = []
    for _ in range(15):
        parts: dict = {}
        loss, weight, _ = drafter_loss_sums(drafter, head, feats, blk, "sdpa", chunk=17, objective=objective,
                                            parts=parts)
        assert torch.allclose(loss, parts["token_loss"] + parts["selector_loss"])
        # the selector's CE per slot it can select (the recall grows as the token loss falls)
        seen.append((float(parts["token_loss"] / weight), float(parts["selector_loss"] / parts["selector_recall"])))
        opt.zero_grad()
        (loss / weight).backward()
        for name in drafter.dflash2_parameters():  # every new part learns
            assert drafter.get_parameter(name).grad.abs().sum() > 0, name
        opt.step()
    assert seen[-1][0] < 0.97 * seen[0][0] and seen[-1][1] < 0.8 * seen[0][1], seen
    assert 0 < float(parts["selector_recall"]) <= float(weight)


def test_the_fused_objective_hands_the_selector_its_candidates_without_a_third_lm_head_pass(tiny, monkeypatch):
    """The selector's top-k candidates come from the logits the fused token loss computes anyway: the
    same sums and gradients as the checkpointed path, whose selector takes them from an LM-head pass of
    its own; the fused path never runs that pass."""
    import trainer.models.dflash2 as dflash2_module

    target, head, _, layer_ids = tiny
    feats, blk = micro_batch(target, layer_ids)
    own_pass = []
    original = dflash2_module.candidates
    monkeypatch.setattr(dflash2_module, "candidates", lambda *a, **k: own_pass.append(1) or original(*a, **k))
    results = {}
    for ce in ("checkpoint", "fused"):
        drafter = dflash2_drafter(target, layer_ids)
        parts: dict = {}
        own_pass.clear()
        loss, _, _ = drafter_loss_sums(drafter, head, feats, blk, "sdpa", chunk=17, ce=ce,
                                       objective=Objective(selector=1.0), parts=parts)
        loss.backward()
        results[ce] = (parts, {n: p.grad for n, p in drafter.named_parameters()}, len(own_pass))
    (ref, ref_grads, ref_passes), (fused, fused_grads, fused_passes) = results["checkpoint"], results["fused"]
    assert ref_passes > 0 and fused_passes == 0
    for key in ("selector_loss", "selector_correct", "selector_recall"):
        assert torch.allclose(fused[key], ref[key], rtol=1e-5), key
    for name in ("candidate_selector.hidden_projection.weight", "candidate_selector.successor_codebook",
                 "layers.0.mlp.up_proj.weight"):
        assert torch.allclose(fused_grads[name], ref_grads[name], rtol=1e-4, atol=1e-7), name


class SecondBestHead(OracleHead):
    """The bigram target's greedy chain from each block's anchor as logits, with the true token
    second best (a wrong one best) where (anchor + slot) % 4 == 0: the selector's walk decides."""

    def __init__(self, base, successor):
        super().__init__(base, successor, wrong_every=4)

    def logits(self, hidden):
        out = torch.zeros(*hidden.shape[:-1], self.embed_weight.shape[0])
        for r, anchor in enumerate(self.anchors):
            token = anchor
            for k in range(hidden.shape[1]):
                token = self.successor[token]
                out[r, k, token] = 2.0
                if (anchor + k + 1) % self.wrong_every == 0:
                    out[r, k, (token + 1) % out.shape[-1]] = 2.7
        return out


def test_speculative_decoding_with_a_dflash2_draft_is_lossless(tiny):
    from tests.trainer.test_speculative_cached import PROMPTS, bigram_target

    target, head, _, layer_ids = tiny
    bigram = bigram_target(target)
    with torch.no_grad():
        nxt = bigram(input_ids=torch.arange(VOCAB)[:, None]).logits[:, -1].argmax(-1).tolist()
    oracle = SecondBestHead(head, dict(enumerate(nxt)))
    drafter = dflash2_drafter(target, layer_ids).eval()
    refs = [speculative_generate(bigram, drafter, oracle, p, max_new_tokens=20, stop_ids=set()) for p in PROMPTS]
    for prompt, ref in zip(PROMPTS, refs):
        assert ref.tokens == greedy_generate(bigram, prompt, 20, set())
    seen = {n for ref in refs for n in ref.acceptance_lengths}
    for implementation in ("static", "dynamic"):
        cached = speculative_generate_cached(bigram, drafter, oracle, PROMPTS, max_new_tokens=20, stop_ids=set(),
                                             implementation=implementation)
        assert cached == refs  # token for token, round for round
    assert len(seen) >= 3 and max(seen) > 1  # partial and longer acceptances both happen
    # the walk is what drafted: the selector turns some second-best tokens into drafts
    with torch.no_grad():
        hidden = torch.randn(4, 7, 32)
        oracle.anchors = [3, 8, 15, 60]
        anchor = torch.tensor(oracle.anchors)
        assert not torch.equal(propose(drafter, oracle.logits, hidden, anchor), oracle.logits(hidden).argmax(-1))


def test_tau_and_the_lookup_baseline_with_a_dflash2_draft(tmp_path):
    """A run of kind dflash2 builds, says its objective, and reports τ and the lookup baseline as DFlash does."""
    from trainer.data.synth import synthetic_conversations, write_jsonl
    from trainer.generate.evaluate import acceptance_report
    from trainer.train.components import build_components

    train = write_jsonl(synthetic_conversations(16, 0, 6, 12), tmp_path / "train.jsonl")
    cfg = parse_config(f"""
model:
  target:
    tiny: {{layers: 2, hidden: 32, heads: 4, kv_heads: 2, head_dim: 8, intermediate: 64}}
  drafter_layers: 1
  drafter: {{kind: dflash2, conv_group_size: 8, selector_rank: 4, selector_top_k: 4}}
  block_size: 4
  num_target_layers: 2
  dtype: fp32
data: {{train_path: {train}, max_length: 64, num_anchors: 4, token_budget: 256, bucket_edges: [64], pad_multiple: 16}}
""")
    lines = []
    c = build_components(cfg, tmp_path, lines.append)
    assert c.drafter.candidate_selector is not None and c.objective.selector == 1.0
    assert any("selector CE" in line for line in lines)
    report = acceptance_report(c.target.module, c.drafter, c.head, c.tokenizer, c.eval_conversations[:3], 6, batch=2)
    assert report["lookup_same_output"] is True
    assert sum(report["histogram"]) == report["rounds"] > 0
    assert report["tau"] == pytest.approx(1 + sum(report["acceptance"]))
    assert report["tau_ratio"] == pytest.approx(report["tau"] / report["tau_lookup"])


def save_checkpoint(drafter, root):
    opt = torch.optim.AdamW(drafter.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    path, _ = ckpt.CheckpointManager(root, 2).save(3, drafter.state_dict(), drafter.config.to_dict(),
                                                   {"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, {})
    return path


def test_export_has_vllms_names_and_reloads_equal(tiny, tmp_path, monkeypatch):
    import transformers.dynamic_module_utils as dynamic
    from transformers import AutoModel

    from trainer.models.export import export_checkpoint, read_published

    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "hf-modules"))
    target, head, _, layer_ids = tiny
    drafter = dflash2_drafter(target, layer_ids, input_embedding_scale=1.5, final_logit_softcapping=30.0)
    out = export_checkpoint(save_checkpoint(drafter, tmp_path), tmp_path / "export", dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert {k: config["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                     "selector_top_k", "input_embedding_scale",
                                                     "final_logit_softcapping")} == \
        {"conv_kernel_size": 3, "conv_group_size": 8, "selector_rank": 4, "selector_top_k": 3,
         "input_embedding_scale": 1.5, "final_logit_softcapping": 30.0}
    assert "output_multiplier" not in config["dflash_config"]  # neutral: left out
    from safetensors.torch import load_file

    names = set(load_file(str(out / "model.safetensors")))
    for i in range(2):
        assert {f"layers.{i}.attention_conv.base_kernel", f"layers.{i}.attention_conv.kernel_projection.weight",
                f"layers.{i}.mlp_conv.base_kernel", f"layers.{i}.mlp_conv.kernel_projection.weight"} <= names
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight"} <= names
    published, weights = read_published(out)
    assert published.kind == "dflash2" and published.input_embedding_scale == 1.5
    assert weights.keys() == drafter.state_dict().keys()
    assert all(torch.equal(weights[k], v) for k, v in drafter.state_dict().items())
    loaded = AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.float32)
    assert set(dict(loaded.named_parameters())) == set(dict(drafter.named_parameters()))
    with torch.no_grad():
        ids = torch.tensor([[5, 17, 33, 2, 9, 40, 11]])
        hidden = target(input_ids=ids, output_hidden_states=True).hidden_states
        ctx = torch.cat([hidden[i + 1] for i in layer_ids], dim=-1)[:, :6]
        block = torch.tensor([[11] + [MASK_ID] * 7])
        ours = drafter.draft_block(ctx, drafter.embed_block(head.embed, block), 6)
        theirs = loaded(ctx, loaded.embed_block(head.embed, block), 6)
        assert torch.allclose(ours, theirs, atol=1e-5)
        assert torch.equal(propose(drafter, head.logits, ours[:, 1:], block[:, 0]),
                           loaded.propose(theirs[:, 1:], head.logits, block[:, 0]))


TINY = """data: {synthetic: {n_train: 8, n_eval: 2}}
model:
  target: {tiny: {layers: 4, hidden: 32, heads: 4, kv_heads: 2, head_dim: 8, intermediate: 64}}
  drafter_layers: 2
  block_size: 8
  num_target_layers: 2
  dtype: fp32
"""


def test_config_fields_are_validated_at_their_line():
    assert parse_config(TINY).model.drafter.kind == "dflash"
    base = TINY.replace("  dtype: fp32\n", "  dtype: fp32\n  drafter:\n")
    cfg = parse_config(base + "    kind: dflash2\n")
    d = cfg.model.drafter
    assert (d.conv_kernel_size, d.conv_group_size, d.selector_rank, d.selector_top_k, d.selector_loss_weight) == \
        (2, 16, 256, 16, 1.0)
    for extra, message in (("    kind: dflash2\n    conv_group_size: 5\n", "conv_group_size 5 does not divide"),
                           ("    kind: dflash2\n    conv_kernel_size: 0\n", "conv_kernel_size must be at least 1"),
                           ("    kind: dflash2\n    selector_loss_weight: 0\n", "selector_loss_weight must be positive"),
                           ("    selector_rank: 8\n", "needs model.drafter.kind: dflash2"),
                           ("    kind: dflash3\n", "kind must be one of")):
        with pytest.raises(ConfigError, match=message) as e:
            parse_config(base + extra, "run.yaml")
        assert str(e.value).split(":")[1].isdigit() and "\n" not in str(e.value)


def test_warm_start_from_a_dflash_draft_keeps_the_shared_weights_bit_equal(tiny, tmp_path):
    from trainer.models.export import export_checkpoint
    from trainer.train.components import build_drafter

    target, head, drafter, layer_ids = tiny
    dflash = copy.deepcopy(drafter)
    export = export_checkpoint(save_checkpoint(dflash, tmp_path / "run"), tmp_path / "dflash", dtype=torch.float32)
    lines = []
    save_checkpoint(dflash, tmp_path / "run5")  # run5/checkpoints/step_3
    # a published DFlash draft, a checkpoint, a run directory (its latest checkpoint)
    for init in (export, save_checkpoint(dflash, tmp_path / "run2"), tmp_path / "run5"):
        cfg = parse_config(TINY + f"  drafter_init: {init}\n  mask_token_id: {MASK_ID}\n  drafter: {{kind: dflash2}}\n"
                                  "  target_layer_ids: " + json.dumps(layer_ids) + "\n")
        warm = build_drafter(cfg, target, MASK_ID, "cpu", lines.append)
        assert warm.config.kind == "dflash2"
        state = warm.state_dict()
        for name, tensor in dflash.state_dict().items():
            assert torch.equal(state[name], tensor), name
        assert "warm start from the DFlash draft" in lines[-1] and "initialised" in lines[-1]
        with torch.no_grad():  # it drafts what the DFlash draft drafts
            ids = torch.tensor([[5, 17, 33, 2, 9, 40, 11]])
            hs = target(input_ids=ids, output_hidden_states=True).hidden_states
            ctx = torch.cat([hs[i + 1] for i in layer_ids], dim=-1)[:, :6]
            block = torch.tensor([[11] + [MASK_ID] * 7])
            a = dflash.draft_block(ctx, head.embed(block), 6)
            b = warm.draft_block(ctx, head.embed(block), 6)
            assert torch.equal(a, b)
            assert torch.equal(propose(dflash, head.logits, a[:, 1:], block[:, 0]),
                               propose(warm, head.logits, b[:, 1:], block[:, 0]))
    # a published DFlash2 directory: its own fields decide; kind dflash refuses it
    d2 = dflash2_drafter(target, layer_ids)
    export2 = export_checkpoint(save_checkpoint(d2, tmp_path / "run3"), tmp_path / "dflash2", dtype=torch.float32)
    text = TINY + f"  drafter_init: {export2}\n  mask_token_id: {MASK_ID}\n  target_layer_ids: {json.dumps(layer_ids)}\n"
    cfg = parse_config(text)
    assert (cfg.model.drafter.kind, cfg.model.drafter.conv_kernel_size, cfg.model.drafter.selector_top_k) == \
        ("dflash2", 3, 3)
    loaded = build_drafter(cfg, target, MASK_ID, "cpu")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in d2.state_dict().items())
    with pytest.raises(ConfigError, match="is a DFlash2 draft"):
        parse_config(text + "  drafter: {kind: dflash}\n")
    # a DFlash2 run's checkpoint: the same (its drafter_config.json decides)
    step = save_checkpoint(d2, tmp_path / "run4")
    cfg = parse_config(TINY + f"  drafter_init: {step}\n  mask_token_id: {MASK_ID}\n"
                              f"  target_layer_ids: {json.dumps(layer_ids)}\n")
    assert (cfg.model.drafter.kind, cfg.model.drafter.conv_kernel_size) == ("dflash2", 3)
    resumed = build_drafter(cfg, target, MASK_ID, "cpu")
    assert all(torch.equal(resumed.state_dict()[k], v) for k, v in d2.state_dict().items())
    with pytest.raises(ConfigError, match="selector_top_k is 5, but"):
        parse_config(text + "  drafter: {selector_top_k: 5}\n")


def test_an_unknown_architecture_is_refused(tmp_path):
    from trainer.run.layout import LayoutError, generation

    with pytest.raises(LayoutError, match="architectures"):
        generation({"architectures": ["LiLiCorrDraftModel"]})
    with pytest.raises(LayoutError, match="dflash_config.selector_rank must be a positive integer"):
        generation({"architectures": ["DFlash2DraftModel"], "dflash_config": {"conv_kernel_size": 2,
                                                                              "conv_group_size": 16}})


def test_threaded_packed_dflash2_with_a_sliding_layer_matches_the_reference_loop(tmp_path):
    """kind dflash2 on packed rows, with a sliding-window layer, activation checkpointing: the threaded
    pipeline (two drafter replicas) gives the reference loop's numbers, and the run checkpoints the
    DFlash2 parts."""
    from tests.trainer.test_pipeline_threaded import config, events
    from trainer.entry import train

    extra = """
data: {pack_length: 128, pack_rows: 2}
model:
  checkpoint_drafter: true
  drafter: {kind: dflash2, conv_group_size: 8, selector_rank: 4, selector_top_k: 4,
            layer_types: [sliding_attention], sliding_window: 8}
optim: {total_steps: 3}
"""
    assert train(config(kind="reference", targets="cpu", drafters="cpu", extra=extra), tmp_path / "ref") == 0
    assert train(config(extra=extra), tmp_path / "thr") == 0
    ref, thr = events(tmp_path / "ref", "step"), events(tmp_path / "thr", "step")
    assert [e["step"] for e in thr] == [e["step"] for e in ref] == [1, 2, 3]
    for a, b in zip(ref, thr):
        for key in ("loss", "acc", "grad_norm", "selector_loss", "selector_acc", "candidate_recall"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (key, a["step"])
        assert 0 < a["candidate_recall"] <= 1 and 0 <= a["selector_acc"] <= 1 and a["selector_loss"] > 0
    saved = json.loads(next((tmp_path / "thr" / "checkpoints").glob("step_*/drafter_config.json")).read_text())
    assert saved["kind"] == "dflash2" and saved["layer_types"] == ["sliding_attention"]


def test_the_memory_plan_counts_the_dflash2_parts():
    from trainer.models.memory_plan import _sizes, build_plan

    base = TINY.replace("  dtype: fp32\n", "  dtype: fp32\n  drafter:\n")
    cfg1, cfg2 = parse_config(TINY), parse_config(base + "    kind: dflash2\n    conv_group_size: 8\n")
    z1, z2 = _sizes(cfg1, None), _sizes(cfg2, None)
    assert z2.drafter.kind == "dflash2" and z2.drafter.conv_group_size == 8
    with torch.device("meta"):
        new = DFlashDrafter(z2.drafter)
        added = sum(new.get_parameter(n).numel() for n in new.dflash2_parameters())
    vocab = z2.drafter.vocab_size  # per layer two convolutions [2, 2, 32] + [16, 32]; the selector 2 x [V, 256] + [256, 32]
    assert added == 2 * 2 * (2 * 2 * 32 + 16 * 32) + 2 * vocab * 256 + 256 * 32
    assert z2.drafter_params - z1.drafter_params == added
    one, two = build_plan(cfg1).drafter, build_plan(cfg2).drafter
    assert two["weights (fp32)"] - one["weights (fp32)"] == 4 * added
    assert two["activations"] > one["activations"]


def test_compiled_regions_train_as_eager_and_compile_nothing_after_warm_up(tiny, monkeypatch):
    """The DFlash2 layer's compiled regions (here with a backend that needs no C compiler, as CUDA
    compiles them): the same loss and gradients as eager, nothing compiled after one warm-up step."""
    from torch._dynamo.utils import counters

    import trainer.models.drafter as drafter_module
    from trainer.pipeline.compile_safety import CompileGuard

    target, head, _, layer_ids = tiny
    feats, blk = micro_batch(target, layer_ids)

    def step(drafter):
        loss, _, _ = drafter_loss_sums(drafter, head, feats, blk, "sdpa", objective=Objective(selector=1.0))
        loss.backward()
        return float(loss.detach()), [p.grad.clone() for p in drafter.parameters()]

    eager = step(dflash2_drafter(target, layer_ids))
    monkeypatch.setattr(drafter_module, "CPU_BACKEND", "aot_eager")
    monkeypatch.setattr(drafter_module, "_compiled", {})
    torch._dynamo.reset()
    counters.clear()
    guard = CompileGuard()
    try:
        guard.warm_up("cpu", [(2, 24)], lambda shape: step(dflash2_drafter(target, layer_ids)))
        guard.freeze()
        compiled = step(dflash2_drafter(target, layer_ids))
        assert guard.recompiles() == 0
    finally:
        guard.unfreeze()
        torch._dynamo.reset()
    # the layer's two fused regions, convolutions inside (as the DFlash layer's)
    assert drafter_module._dflash2_inputs_of in drafter_module._compiled
    assert drafter_module._dflash2_out_and_mlp_of in drafter_module._compiled
    assert not counters["graph_break"]
    assert compiled[0] == pytest.approx(eager[0], rel=1e-5)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(compiled[1], eager[1]))


def test_the_fused_layer_computes_what_the_unfused_one_does(tiny):
    """model.fuse_drafter on a DFlash2 drafter: the layer's two regions (convolutions inside) give the
    loss and gradients of the per-op path, with trained (not identity) convolutions and selector."""
    target, head, _, layer_ids = tiny
    torch.manual_seed(5)
    ids = torch.randint(0, VOCAB - 1, (2, 24))
    lm = torch.ones_like(ids, dtype=torch.bool)
    feats = target_context_features(target, ids, torch.ones_like(ids), layer_ids)
    blk = make_blocks(ids, lm, *sample_anchors(lm, 6, torch.Generator().manual_seed(0)), 8, 7.0, MASK_ID)
    drafter = dflash2_drafter(target, layer_ids)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if ".attention_conv." in name or ".mlp_conv." in name:
                p.add_(0.05 * torch.randn_like(p))

    def step(fused):
        drafter.fused = fused
        drafter.zero_grad()
        loss, _, _ = drafter_loss_sums(drafter, head, feats, blk, "sdpa", objective=Objective(selector=1.0))
        loss.backward()
        return float(loss.detach()), [p.grad.clone() for p in drafter.parameters()]

    fused, per_op = step(True), step(False)
    assert fused[0] == pytest.approx(per_op[0], rel=1e-5)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(fused[1], per_op[1]))


def test_the_doctor_sizes_a_dflash2_checkpoint_from_its_parts():
    from dflash_ops.doctor.plan import drafter_params

    dims = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                vocab_size=100)
    own = dict(kind="dflash2", conv_kernel_size=3, conv_group_size=8, selector_rank=4, selector_top_k=5)
    with torch.device("meta"):
        drafter = DFlashDrafter(DrafterConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                              num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=100,
                                              block_size=4, mask_token_id=1, target_layer_ids=[1, 1],
                                              num_target_layers=2, **own))
    assert drafter_params(dims, 3, 2, own) == sum(p.numel() for p in drafter.parameters())


def test_the_pipeline_bench_measures_a_dflash2_drafter_beside_dflash(tmp_path):
    """bench/pipeline.py --drafter-layouts full full/dflash2: both train through the threaded pipeline
    (the GPU command of issue 37's tokens/s), keyed <mode>@<layout>."""
    import bench.pipeline as bench

    assert bench.drafter_layout("swa4+1/dflash2", 5, 2048)[1].endswith("sliding_window: 2048, kind: dflash2")
    assert bench.drafter_layout("full/dflash2", 5, 2048) == (5, "kind: dflash2")
    assert bench.drafter_layout("full/dflash2/fp8", 5, 2048) == (5, "kind: dflash2, precision: fp8")
    results = bench.main([
        "--tiny", "--target", "cpu", "--drafter", "cpu", "--steps", "2", "--micro", "1", "--log-every", "1",
        "--min-len", "16", "--max-len", "64", "--samples", "40", "--anchors", "8", "--stage-micro", "1",
        "--modes", "packed", "--pack-length", "128", "--drafter-layouts", "full", "full/dflash2",
        "--out", str(tmp_path / "bench.json")])
    one, two = results["packed@full"], results["packed@full/dflash2"]
    assert one["pipeline"]["loss"] != two["pipeline"]["loss"]  # the selector's term is in DFlash2's loss
    assert two["pipeline"]["recompiles_after_warmup"] == 0
