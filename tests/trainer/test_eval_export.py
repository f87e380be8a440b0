import json

import torch
from safetensors.torch import load_file

from trainer import checkpoint as ckpt
from trainer.evaluate import greedy_generate, speculative_generate
from trainer.export import export_checkpoint


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
    path, _ = ckpt.CheckpointManager(tmp_path, 2).save(7, drafter, drafter.config.to_dict(), opt, sched, {})
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
