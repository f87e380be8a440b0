"""The target in layer stages: features from only the tapped layers, split or not, equal the full model's."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from trainer.data.packing import doc_start_of
from trainer.models.target import base_model, target_context_features

DIMS = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=256, tie_word_embeddings=False)


def _model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "qwen3":
        config = Qwen3Config(**DIMS)
        model = Qwen3ForCausalLM(config)
    elif family == "llama":
        config = LlamaConfig(**DIMS)
        model = LlamaForCausalLM(config)
    else:
        config = Qwen3MoeConfig(**DIMS, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
        model = Qwen3MoeForCausalLM(config)
    config._attn_implementation = "sdpa"
    return model.eval()


FAMILIES = ["qwen3", "llama", "qwen3_moe"]


@pytest.mark.parametrize("family", FAMILIES)
def test_features_equal_the_full_models_hidden_states_exactly(family):
    model = _model(family)
    layer_ids = [0, 2, 3]
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids, output_hidden_states=True).hidden_states
    feats = target_context_features(model, ids, torch.ones_like(ids), layer_ids)
    assert torch.equal(feats, torch.cat([full[i + 1] for i in layer_ids], dim=-1))


@pytest.mark.parametrize("family", FAMILIES)
def test_layers_above_the_last_tapped_one_and_the_final_norm_never_run(family):
    model = _model(family)
    ran = []
    handles = [layer.register_forward_hook(lambda m, a, o, i=i: ran.append(i))
               for i, layer in enumerate(base_model(model).layers)]
    handles.append(base_model(model).norm.register_forward_hook(lambda m, a, o: ran.append("norm")))
    ids = torch.randint(0, 96, (1, 9))
    target_context_features(model, ids, None, [1, 3])
    for h in handles:
        h.remove()
    assert ran == [0, 1, 2, 3]


def test_packed_rows_equal_each_document_alone_through_the_truncated_walk():
    model = _model("qwen3")
    lengths, row = [5, 7], 16
    g = torch.Generator().manual_seed(2)
    docs = [torch.randint(0, 96, (n,), generator=g) for n in lengths]
    ids = torch.cat(docs + [torch.zeros(row - sum(lengths), dtype=torch.long)])[None]
    packed = target_context_features(model, ids, None, [1, 4], doc_start_of(lengths, row)[None])
    start = 0
    for doc, n in zip(docs, lengths):
        with torch.no_grad():
            alone = model(doc[None], output_hidden_states=True).hidden_states
        assert torch.allclose(packed[:, start:start + n], torch.cat([alone[2], alone[5]], dim=-1), atol=1e-5)
        start += n
