"""Drafts as the field publishes them (issue 41) warm-start a run, train and export with the same
per-layer (window, causal) as vLLM resolves it, the same attention shape, the same tensor names and
shapes, and a separate mask embedding kept; what the trainer cannot train as served is refused at
config load naming the field; `model.drafter` sets the layout of a fresh drafter."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.trainer.tiny_config import tiny_config
from trainer.entry import train
from trainer.models.drafter import DFlashDrafter, DrafterConfig
from trainer.models.export import MASK_EMBEDDING, export_checkpoint, hf_config
from trainer.run.config import ConfigError, parse_config
from trainer.run.layout import SLIDING, Layout, resolve_published

# the tiny target of tiny_config: hidden 32, 4 heads, 2 KV heads, head_dim 8, MLP 64, vocab of the synthetic tokenizer
TINY = dict(hidden_size=32, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=4096)

LAYOUTS = {
    # 3 sliding-window layers (causal: vLLM's reading of layer_types) with an attention shape unlike the target's
    "sliding_own_shape": dict(num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                              intermediate_size=48, use_sliding_window=True, sliding_window=6,
                              layer_types=[SLIDING] * 3),
    # MiMo style: every layer sliding, non-causal, the window in dflash_config
    "use_swa": dict(num_hidden_layers=2, dflash={"use_swa": True, "swa_window_size": 5}),
    # explicitly causal full-attention layers
    "causal": dict(num_hidden_layers=2, dflash={"causal": True}),
    # the 2025 layout
    "plain": dict(num_hidden_layers=1),
    # mixed sliding/full with sinks and a separate mask embedding
    "mixed_sinks_mask": dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=4,
                             layer_types=[SLIDING, SLIDING, "full_attention"],
                             dflash={"attention_sink_bias": True}, mask_embedding=True),
}


def write_draft(out, vocab, mask_id, name):
    """A draft directory of that layout: config.json as published, random weights under our export's names."""
    spec = dict(LAYOUTS[name])
    dflash = spec.pop("dflash", {})
    mask_embedding = spec.pop("mask_embedding", False)
    heads = spec.get("num_attention_heads", 4)
    config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_act": "silu", **TINY,
              "num_attention_heads": heads, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64,
              "vocab_size": vocab, "block_size": 4, "num_target_layers": 2, **spec,
              "dflash_config": {"mask_token_id": mask_id, "target_layer_ids": [1, 1], **dflash}}
    layout = resolve_published(config)
    dcfg = DrafterConfig(**{k: config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                   "num_attention_heads", "num_key_value_heads", "head_dim",
                                                   "vocab_size", "block_size", "num_target_layers")},
                         mask_token_id=mask_id, target_layer_ids=[1, 1], layout=layout)
    torch.manual_seed(5)
    weights = {k: v.normal_() if k.endswith("attention_sink_bias") else v for k, v in DFlashDrafter(dcfg).state_dict().items()}
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    if mask_embedding:
        torch.save({"embedding": torch.randn(32), "mask_token_id": mask_id}, out / MASK_EMBEDDING)
    return out


@pytest.fixture(scope="module")
def vocab_and_mask(tmp_path_factory):
    from trainer.train.components import build_components

    c = build_components(parse_config(tiny_config("optim: {total_steps: 1}")), tmp_path_factory.mktemp("v"),
                         lambda *_: None)
    return c.drafter.config.vocab_size, c.drafter.config.mask_token_id


def run_config(path, *extra):
    """The tiny config warm-started from `path`, without its drafter_layers (the draft decides)."""
    import yaml

    config = yaml.safe_load(tiny_config(f"model: {{drafter_init: {path}}}", "optim: {total_steps: 4}", *extra))
    if "drafter_layers" not in "".join(extra):
        del config["model"]["drafter_layers"]
    return yaml.safe_dump(config, sort_keys=False)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_a_published_layout_round_trips_through_init_training_and_export(vocab_and_mask, tmp_path, name):
    vocab, mask_id = vocab_and_mask
    draft = write_draft(tmp_path / "draft", vocab, mask_id, name)
    cfg = parse_config(run_config(draft))
    assert train(cfg, tmp_path / "run") == 0, (tmp_path / "run" / "train.log").read_text()[-2000:]
    out = export_checkpoint(tmp_path / "run" / "checkpoints" / "step_4", tmp_path / "export", dtype=torch.float32)
    source, exported = (json.loads((d / "config.json").read_text()) for d in (draft, out))
    n = source["num_hidden_layers"]
    assert resolve_published(exported).kinds(n) == resolve_published(source).kinds(n)
    assert resolve_published(exported).attention_sink == resolve_published(source).attention_sink
    for key in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size"):
        assert exported[key] == source[key], key
    before, after = load_file(str(draft / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert {k: v.shape for k, v in after.items()} == {k: v.shape for k, v in before.items()}
    assert any(not torch.equal(before[k], after[k]) for k in before)  # it trained
    assert (out / MASK_EMBEDDING).is_file() == (draft / MASK_EMBEDDING).is_file()
    if (draft / MASK_EMBEDDING).is_file():
        state = torch.load(out / MASK_EMBEDDING, weights_only=True)
        assert state["mask_token_id"] == mask_id and state["embedding"].shape == (32,)


def test_the_published_fields_resolve_as_vllm_reads_them():
    base = {"num_hidden_layers": 3, "hidden_size": 32}
    kinds = lambda **c: resolve_published({**base, **c}).kinds(3)  # noqa: E731
    assert kinds() == [(None, False)] * 3
    # sliding_window without use_sliding_window is dropped by transformers: a sliding layer then has no window
    with pytest.raises(ValueError, match="sliding layers need a window"):
        kinds(layer_types=[SLIDING] * 3, sliding_window=8)
    assert kinds(layer_types=[SLIDING, SLIDING, "full_attention"], sliding_window=8, use_sliding_window=True) == \
        [(8, True), (8, True), (None, False)]
    assert kinds(dflash_config={"use_swa": True, "swa_window_size": 7}) == [(7, False)] * 3
    assert kinds(dflash_config={"use_swa": True, "swa_window_size": 7, "causal": True}) == [(7, True)] * 3
    assert kinds(layer_types=[SLIDING] * 3, dflash_config={"swa_window_size": 5, "causal": False}) == [(5, False)] * 3
    assert kinds(is_causal=True, dflash_config={"causal": False}) == [(None, True)] * 3
    # without layer_types, transformers makes layers >= max_window_layers sliding when a window is kept
    assert kinds(use_sliding_window=True, sliding_window=9, max_window_layers=1) == [(None, False), (9, True), (9, True)]


@pytest.mark.parametrize("field,value,says", [
    ("dflash_config.fancy_new_thing", 1, "dflash_config.fancy_new_thing is a field the trainer does not know"),
    ("dflash_config.attention_value_scale", 0.5, "dflash_config.attention_value_scale 0.5 cannot be trained"),
    ("target_hidden_size", 64, "target_hidden_size 64 cannot be trained"),
    ("layer_types", ["sliding_attention", "chunked_attention"], "layer_types[1] 'chunked_attention'"),
    ("dflash_config.use_aux_hidden_state", False, "use_aux_hidden_state False"),
])
def test_what_cannot_be_trained_as_served_is_refused_at_config_load(vocab_and_mask, tmp_path, field, value, says):
    vocab, mask_id = vocab_and_mask
    draft = write_draft(tmp_path / "draft", vocab, mask_id, "use_swa")
    config = json.loads((draft / "config.json").read_text())
    if field.startswith("dflash_config."):
        config["dflash_config"][field.split(".", 1)[1]] = value
    else:
        config[field] = value
    (draft / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="model.drafter_init") as e:
        parse_config(run_config(draft), "run.yaml")
    assert says in str(e.value) and str(e.value).startswith("run.yaml:")


def test_model_drafter_must_agree_with_the_draft_and_names_the_difference(vocab_and_mask, tmp_path):
    vocab, mask_id = vocab_and_mask
    draft = write_draft(tmp_path / "draft", vocab, mask_id, "sliding_own_shape")
    cfg = parse_config(run_config(draft))  # unset keys: the draft decides, and plan/doctor see its shape
    assert (cfg.model.drafter_layers, cfg.model.drafter.head_dim, cfg.model.drafter.sliding_window) == (3, 16, 6)
    with pytest.raises(ConfigError) as e:
        parse_config(run_config(draft, "model: {drafter: {head_dim: 8, sliding_window: 6}, drafter_layers: 2}"))
    assert "model.drafter.head_dim 8 (the draft: 16)" in str(e.value) and "model.drafter_layers 2 (the draft: 3)" in str(e.value)
    assert "sliding_window" not in str(e.value).split("differs:")[1]  # what agrees is not named


def test_model_drafter_builds_a_fresh_drafter_of_that_layout_and_export_warns_for_mixed_layers(tmp_path, capsys):
    from trainer.models.memory_plan import build_plan

    text = tiny_config("optim: {total_steps: 2}", """
model:
  drafter_layers: 3
  drafter:
    layer_types: [sliding_attention, sliding_attention, full_attention]
    sliding_window: 16
    num_attention_heads: 8
    num_key_value_heads: 4
    head_dim: 16
    intermediate_size: 40
    attention_sink: true
""")
    cfg = parse_config(text)
    assert cfg.model.drafter_layers == 3 and cfg.model.drafter.causal == [True, True, False]
    assert train(cfg, tmp_path / "run") == 0
    out = export_checkpoint(tmp_path / "run" / "checkpoints" / "step_2", tmp_path / "export", dtype=torch.float32)
    assert "VLLM_USE_V2_MODEL_RUNNER=1" in capsys.readouterr().err
    published = json.loads((out / "config.json").read_text())
    assert resolve_published(published).kinds(3) == [(16, True), (16, True), (None, False)]
    assert (published["num_attention_heads"], published["num_key_value_heads"], published["head_dim"]) == (8, 4, 16)
    assert published["dflash_config"]["attention_sink_bias"] is True
    weights = load_file(str(out / "model.safetensors"))
    assert weights["layers.2.self_attn.attention_sink_bias"].shape == (8,)
    assert weights["layers.0.self_attn.q_proj.weight"].shape == (128, 32)
    # the memory plan sizes the draft from its own shape
    with torch.device("meta"):
        params = sum(p.numel() for p in DFlashDrafter(DrafterConfig(
            hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=4,
            head_dim=16, vocab_size=published["vocab_size"], block_size=4, mask_token_id=0, target_layer_ids=[0, 1],
            num_target_layers=2, layout=Layout(published["layer_types"], 16, attention_sink=True))).parameters())
    assert build_plan(cfg).drafter["weights (fp32)"] == 4 * params


@pytest.mark.parametrize("overlay,says", [
    ("model: {drafter: {layer_types: [sliding_attention]}}", "sliding layers need a positive sliding_window, got None"),
    ("model: {drafter: {sliding_window: 8}}", "no layer of model.drafter.layer_types is sliding_attention"),
    ("model: {drafter_layers: 2, drafter: {layer_types: [full_attention]}}", "(the drafter has 2 layers)"),
    ("model: {drafter_layers: 3, drafter: {layer_types: [sliding_attention, full_attention, full_attention], "
     "sliding_window: 4, causal: [false, true, false]}}", "vLLM cannot serve it"),
    ("model: {drafter: {head_dim: 7}}", "must be even"),
    ("model: {drafter: {num_attention_heads: 6, num_key_value_heads: 4}}", "must divide num_attention_heads"),
    ("model: {drafter: {layer_types: [swa]}}", "model.drafter.layer_types[0] must be one of"),
])
def test_model_drafter_keys_are_validated_with_file_and_line(overlay, says):
    with pytest.raises(ConfigError, match=r"^run\.yaml:\d+: ") as e:
        parse_config(tiny_config(overlay), "run.yaml")
    assert says in str(e.value)


def test_hf_config_of_an_old_checkpoint_is_the_2025_layout():
    d = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, vocab_size=100, block_size=4, mask_token_id=1, target_layer_ids=[0, 1], num_target_layers=2,
             rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=4096)
    c = hf_config(DrafterConfig.from_dict(d))
    assert c["use_sliding_window"] is False and c["sliding_window"] is None and "layer_types" not in c
    assert c["dflash_config"] == {"mask_token_id": 1, "target_layer_ids": [0, 1]}


def test_doctor_sizes_the_checkpoint_from_the_drafts_own_shape(tmp_path):
    from dflash_ops.doctor.plan import RunPlan, drafter_params

    dims = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    shape = dict(num_attention_heads=8, num_key_value_heads=4, head_dim=16, intermediate_size=40)
    own = dict(shape, attention_sink=True)
    with torch.device("meta"):
        drafter = DFlashDrafter(DrafterConfig(hidden_size=32, num_hidden_layers=3, vocab_size=100, block_size=4,
                                              mask_token_id=1, target_layer_ids=[1, 1], num_target_layers=2,
                                              **shape, layout=Layout(attention_sink=True)))
    assert drafter_params(dims, 3, 2, own) == sum(p.numel() for p in drafter.parameters())
    config = tmp_path / "run.yaml"
    config.write_text(tiny_config("model: {drafter_layers: 3, drafter: {num_attention_heads: 8, num_key_value_heads: 4, "
                                  "head_dim: 16, intermediate_size: 40, attention_sink: true}}"))
    from dflash_ops.doctor.plan import plan_for
    from tests.unit.test_doctor import TARGET

    plan = plan_for(TARGET, [], config)
    assert plan.checkpoint_bytes() == RunPlan(dims={**dims, "num_hidden_layers": 2}, drafter_layers=3, num_target_layers=2,
                                              drafter_shape=own).checkpoint_bytes()
    assert plan.checkpoint_bytes() != RunPlan(dims={**dims, "num_hidden_layers": 2}, drafter_layers=3,
                                              num_target_layers=2).checkpoint_bytes()


def test_packed_rows_through_the_threaded_pipeline_train_a_mixed_layout(tmp_path):
    cfg = parse_config(tiny_config("optim: {total_steps: 2}", "pipeline: {kind: threaded}",
                                   "data: {pack_length: 128, max_length: 64}", """
model:
  drafter_layers: 2
  drafter: {layer_types: [sliding_attention, full_attention], sliding_window: 8, attention_sink: true}
"""))
    assert train(cfg, tmp_path / "run") == 0
    saved = json.loads((tmp_path / "run" / "checkpoints" / "step_2" / "drafter_config.json").read_text())
    assert (saved["layer_types"], saved["sliding_window"], saved["causal"], saved["attention_sink"]) == (
        [SLIDING, "full_attention"], 8, [True, False], True)


def test_the_exported_model_code_loads_a_layout_draft_and_drafts_as_the_trainer(vocab_and_mask, tmp_path, monkeypatch):
    import transformers.dynamic_module_utils as dynamic
    from transformers import AutoModel

    from trainer.models.export import read_published

    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "hf-modules"))
    vocab, mask_id = vocab_and_mask
    draft = write_draft(tmp_path / "draft", vocab, mask_id, "mixed_sinks_mask")
    cfg = parse_config(run_config(draft))
    assert train(cfg, tmp_path / "run") == 0
    out = export_checkpoint(tmp_path / "run" / "checkpoints" / "step_4", tmp_path / "export", dtype=torch.float32)
    loaded, info = AutoModel.from_pretrained(out, trust_remote_code=True, output_loading_info=True, dtype=torch.float32)
    assert info["missing_keys"] in ([], set()) and info["unexpected_keys"] in ([], set())
    assert loaded.dflash.layout.kinds(3) == [(4, True), (4, True), (None, False)] and loaded.dflash.layout.attention_sink
    published, weights = read_published(out)
    trained = DFlashDrafter(published)
    trained.load_state_dict(weights)
    torch.manual_seed(0)
    ctx, block = torch.randn(1, 9, 64), torch.randn(1, 4, 32)
    assert torch.allclose(trained.draft_block(ctx, block, 9), loaded(ctx, block, 9), atol=1e-5)
