import json

import pytest
import torch
from safetensors.torch import load_file

from trainer.generate.evaluate import greedy_generate, speculative_generate
from trainer.models.export import export_checkpoint
from trainer.run import checkpoint as ckpt


def test_speculative_decoding_is_lossless_and_counts_acceptance(tiny):
    target, head, drafter, _ = tiny
    prompt = [5, 17, 33, 2, 9]
    spec = speculative_generate(target, drafter, head, prompt, max_new_tokens=20, stop_ids=set())
    assert spec.tokens == greedy_generate(target, prompt, 20, set())
    assert sum(spec.acceptance_lengths) == len(spec.tokens) - 1  # the first token comes from prefill
    assert all(1 <= n <= drafter.config.block_size for n in spec.acceptance_lengths)


def test_export_writes_the_published_draft_layout(tiny, tmp_path):
    _, _, drafter, layer_ids = tiny
    opt = torch.optim.AdamW(drafter.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    path, _ = ckpt.CheckpointManager(tmp_path, 2).save(7, drafter.state_dict(), drafter.config.to_dict(),
                                                           {"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, {})
    out = export_checkpoint(path, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"] == {"mask_token_id": 96, "target_layer_ids": layer_ids}
    assert config["block_size"] == 8 and config["num_target_layers"] == 4 and config["num_hidden_layers"] == 2
    weights = load_file(str(out / "model.safetensors"))
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{n}.weight" for i in range(2) for n in (
            "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
            "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert set(weights) == expected
    assert weights["fc.weight"].dtype == torch.bfloat16
    assert weights["fc.weight"].shape == (32, 64)
    assert torch.allclose(weights["fc.weight"].float(), drafter.fc.weight.detach(), atol=1e-2)


def test_per_position_acceptance_from_a_hand_histogram():
    from trainer.generate.evaluate import position_acceptance

    # 6 rounds: 2 produced 1 token (nothing accepted), 1 produced 2, 3 produced 4 (all 3 drafts accepted)
    assert position_acceptance([2, 1, 0, 3]) == pytest.approx([4 / 6, 3 / 6, 3 / 6])
    assert 1 + sum(position_acceptance([2, 1, 0, 3])) == pytest.approx((2 * 1 + 1 * 2 + 3 * 4) / 6)  # tau
    assert position_acceptance([0, 0, 0, 0]) == [0.0, 0.0, 0.0]


def test_without_an_eval_file_tau_is_measured_not_reported_as_zero(tmp_path):
    """train_path alone: the evaluation falls back to the same conversations for τ as for accuracy."""
    from trainer.data.synth import synthetic_conversations, write_jsonl
    from trainer.generate.evaluate import acceptance_report, mean_acceptance_length
    from trainer.run.config import parse_config
    from trainer.train.components import build_components

    train = write_jsonl(synthetic_conversations(16, 0, 6, 12), tmp_path / "train.jsonl")
    cfg = parse_config(f"""
model:
  target:
    tiny: {{layers: 2, hidden: 32, heads: 4, kv_heads: 2, head_dim: 8, intermediate: 64}}
  drafter_layers: 1
  block_size: 4
  num_target_layers: 2
  dtype: fp32
data: {{train_path: {train}, max_length: 64, num_anchors: 4, token_budget: 256, bucket_edges: [64], pad_multiple: 16}}
""")
    c = build_components(cfg, tmp_path, lambda *_: None)
    assert c.eval_conversations
    tau, samples = mean_acceptance_length(c.target.module, c.drafter, c.head, c.tokenizer, c.eval_conversations[:2], 4)
    assert samples == 2 and tau >= 1.0
    report = acceptance_report(c.target.module, c.drafter, c.head, c.tokenizer, c.eval_conversations[:3], 6, batch=2)
    histogram, rounds = report["histogram"], report["rounds"]
    assert len(histogram) == 4 and sum(histogram) == rounds > 0
    assert report["tau"] == pytest.approx(sum((k + 1) * n for k, n in enumerate(histogram)) / rounds)
    assert 1.0 <= report["tau_per_prompt"] <= 4.0 and report["samples"] == 3
    # per-position acceptance: the share of rounds accepting draft position k = 1..3; tau = 1 + its sum
    assert len(report["acceptance"]) == 3 and report["tau"] == pytest.approx(1 + sum(report["acceptance"]))
    # the n-gram prompt lookup baseline on the same prompts: same greedy output, its own τ, the ratio
    assert report["lookup_same_output"] is True
    assert sum(report["lookup_histogram"]) == report["lookup_rounds"] > 0
    assert report["tau_lookup"] == pytest.approx(
        sum((k + 1) * n for k, n in enumerate(report["lookup_histogram"])) / report["lookup_rounds"])
    assert report["tau_ratio"] == pytest.approx(report["tau"] / report["tau_lookup"])


def test_export_loads_with_automodel_trust_remote_code_and_drafts_like_the_trainer(tiny, tmp_path, monkeypatch):
    """The loading route of the DFlash authors' README builds the draft with every weight used and
    none missing, and it drafts the same hidden states (so the same logits) as the trained drafter."""
    import transformers.dynamic_module_utils as dynamic
    from transformers import AutoModel

    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "hf-modules"))
    target, head, drafter, layer_ids = tiny
    opt = torch.optim.AdamW(drafter.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    path, _ = ckpt.CheckpointManager(tmp_path, 2).save(3, drafter.state_dict(), drafter.config.to_dict(),
                                                           {"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, {})
    out = export_checkpoint(path, tmp_path / "export", dtype=torch.float32)
    assert json.loads((out / "config.json").read_text())["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"}
    loaded, info = AutoModel.from_pretrained(out, trust_remote_code=True, output_loading_info=True,
                                             dtype=torch.float32)
    assert type(loaded).__name__ == "DFlashDraftModel"
    assert info["missing_keys"] in ([], set()) and info["unexpected_keys"] in ([], set())
    assert set(dict(loaded.named_parameters())) == set(dict(drafter.named_parameters()))
    with torch.no_grad():
        ids = torch.tensor([[5, 17, 33, 2, 9, 40, 11]])
        hidden = target(input_ids=ids, output_hidden_states=True).hidden_states
        ctx = torch.cat([hidden[i + 1] for i in layer_ids], dim=-1)[:, :6]
        block = head.embed(torch.tensor([[ids[0, 6].item()] + [drafter.config.mask_token_id] * 7]))
        ours, theirs = drafter.draft_block(ctx, block, 6), loaded(ctx, block, 6)
    assert torch.allclose(ours, theirs, atol=1e-5)
    assert torch.equal(head.logits(ours).argmax(-1), head.logits(theirs).argmax(-1))
