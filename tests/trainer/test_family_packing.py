"""Packed rows are exact for every target family: the context features of a packed row equal,
position by position, the features of each conversation run alone (fp32, CPU), and those equal
the Hugging Face model's own hidden states. Covers sliding-window layers (gpt-oss: window 8, so
documents longer than the window) and linear-attention layers (Qwen3.5, Qwen3-Next: state reset
at each document start)."""

from __future__ import annotations

import pytest
import torch

from trainer.data.packing import doc_start_of
from trainer.models.target import freeze, load_target, target_context_features
from trainer_tools.fixtures.hub_model import FAMILIES

LAYERS = [0, 1, 2]  # hidden_states[1..3]: every layer but the last (whose HF output is normed)


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_features_equal_each_conversation_alone(family_dirs, family):
    target = freeze(load_target(str(family_dirs[family]), "cpu", torch.float32))
    g = torch.Generator().manual_seed(0)
    lengths = [13, 21, 9, 1]  # the last, a one-token document; then 20 padding tokens
    docs = [torch.randint(0, 500, (n,), generator=g) for n in lengths]
    row = torch.cat(docs + [torch.zeros(64 - sum(lengths), dtype=torch.long)])[None]
    doc_start = doc_start_of(lengths, 64)[None]
    packed = target_context_features(target, row, None, LAYERS, doc_start=doc_start)
    at = 0
    for doc in docs:
        alone = target_context_features(target, doc[None], None, LAYERS)
        torch.testing.assert_close(packed[:, at:at + len(doc)], alone, rtol=1e-5, atol=1e-5)
        hf = target(input_ids=doc[None], output_hidden_states=True).hidden_states
        torch.testing.assert_close(alone, torch.cat([hf[i + 1] for i in LAYERS], dim=-1), rtol=1e-5, atol=1e-5)
        at += len(doc)


def test_sliding_window_and_linear_state_really_cross_documents_without_the_reset(family_dirs):
    """The test above can fail: without document boundaries, the second document's features differ
    (a window or a recurrent state reaching back into the first)."""
    for family in ("gpt_oss", "qwen3_5"):
        target = freeze(load_target(str(family_dirs[family]), "cpu", torch.float32))
        first, second = torch.arange(3, 23), torch.arange(40, 52)
        row = torch.cat([first, second])[None]
        alone = target_context_features(target, second[None], None, LAYERS)
        joined = target_context_features(target, row, None, LAYERS)[:, len(first):]
        assert not torch.allclose(joined, alone, atol=1e-3)


def test_packing_is_refused_at_config_load_where_it_cannot_be_exact(tmp_path):
    """A family with layers the trainer knows no per-document form of: one line, at load."""
    import json

    from tests.trainer.tiny_config import tiny_config
    from trainer.run.config import ConfigError, parse_config

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text", "num_hidden_layers": 2,
        "hidden_size": 32, "num_attention_heads": 4, "layer_types": ["chunked_attention", "full_attention"]}))
    overlay = "model: {target: {tiny: null, path: %s}}" % tmp_path
    parse_config(tiny_config(overlay))  # bucketed: accepted
    with pytest.raises(ConfigError) as err:
        parse_config(tiny_config(overlay, "data: {pack_length: 128}"))
    message = str(err.value)
    assert "data.pack_length" in message and "chunked_attention" in message and "\n" not in message


def test_data_report_names_the_family_its_layers_and_the_packing_verdict(family_dirs, tmp_path, capsys):
    from trainer.__main__ import main

    data = tmp_path / "pairs.jsonl"
    data.write_text('{"prompt": "Question?", "response": "An answer."}\n')
    config = tmp_path / "c.yaml"
    config.write_text(f"model: {{target: {{path: {family_dirs['qwen3_next']}}}}}\n"
                      f"data: {{train_path: {data}, max_length: 64, token_budget: 64, bucket_edges: [64], "
                      "pack_length: 128}\n")
    capsys.readouterr()
    assert main(["data-report", "--config", str(config)]) == 0  # `python -m trainer data-report`'s main
    out = capsys.readouterr().out
    assert "target: Qwen3-Next (Qwen3NextForCausalLM): 4 layers: 1 full, 3 linear" in out
    assert "layers: full 3; linear 0-2; MoE 0-3" in out and "GiB in bf16" in out
    assert "packed rows of 128: exact" in out


def test_family_read_from_config_alone_matches_the_loaded_model(family_dirs):
    """trainer.run.family (config.json only, no torch) agrees with the model transformers builds
    on every layer's kind, also for a hybrid config.json without layer_types."""
    import json

    from trainer.models.target import target_family
    from trainer.run.family import family_of_dir, read_family
    from trainer_tools.fixtures.hub_model import FAMILIES

    for family in FAMILIES:
        path = family_dirs[family]
        loaded = target_family(load_target(str(path), "cpu", torch.float32))
        assert family_of_dir(path).layer_kinds == loaded.layer_kinds, family
    config = json.loads((family_dirs["qwen3_next"] / "config.json").read_text())
    del config["layer_types"]
    assert read_family(config).layer_kinds == ("linear_attention",) * 3 + ("full_attention",)
