"""gpt-oss as the hub ships it (MXFP4 expert matrices): decoded at load exactly as transformers
decodes them, so it trains like its bf16 copy (trainer.models.mxfp4)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.trainer.tiny_config import tiny_config
from trainer.entry import train
from trainer.models import mxfp4
from trainer.models.stages import StagePlan
from trainer.models.target import target_context_features
from trainer.models.target_loading import MissingWeights, ShardReader, complete_for_decoding, load_staged
from trainer.train.config import parse_config
from trainer_tools.fixtures.hub_model import write_hub_model

EXPERTS = ("gate_up_proj", "down_proj")


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory) -> Path:
    return write_hub_model(tmp_path_factory.mktemp("gpt-oss") / "gpt-oss-mxfp4", "gpt_oss", dtype="float32",
                           quantization="mxfp4")


def test_a_byte_holds_two_values_low_nibble_first_times_its_blocks_power_of_two():
    blocks = torch.zeros(1, 1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0, 0] = 0x2F  # low 0xF = -6.0, high 0x2 = 1.0
    blocks[0, 0, 0, 15] = 0x71  # low 0x1 = 0.5, high 0x7 = 6.0
    scales = torch.full((1, 1, 1), 128, dtype=torch.uint8)  # 2 ** 1
    decoded = mxfp4.decode(blocks, scales, torch.bfloat16)
    assert decoded.shape == (1, 32, 1)  # (experts, in, out)
    assert decoded[0, :2, 0].tolist() == [-12.0, 2.0] and decoded[0, 30:, 0].tolist() == [1.0, 12.0]
    assert not decoded[0, 2:30].any()


def test_decode_equals_transformers_own_conversion():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 5, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 140, (3, 40, 5), generator=g, dtype=torch.uint8)
    ours = mxfp4.decode(blocks, scales, torch.bfloat16)
    assert ours.is_contiguous() and ours.shape == (3, 160, 40)
    assert torch.equal(ours, convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=torch.bfloat16))


@pytest.mark.parametrize("blocks, scales, message", [
    ((2, 4, 3, 16), (2, 4, 2), "scales"),
    ((2, 4, 3, 8), (2, 4, 3), "blocks"),
])
def test_blocks_and_scales_that_do_not_match_are_refused_by_shape(blocks, scales, message):
    with pytest.raises(mxfp4.Mxfp4Error, match=message):
        mxfp4.decode(torch.zeros(blocks, dtype=torch.uint8), torch.zeros(scales, dtype=torch.uint8), torch.float32)


def test_the_hub_checkpoint_loads_as_its_bf16_copy(mxfp4_dir, tmp_path):
    """The MXFP4 directory, read stage by stage, equals the directory a user converts it to
    (transformers' conversion of each expert matrix, written as plain tensors)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    reader = ShardReader(mxfp4_dir)
    plain: dict[str, torch.Tensor] = {}
    for name in reader.weight_map:
        if name.endswith("_scales"):
            continue
        got = reader.read([name], torch.device("cpu"), torch.uint8 if name.endswith("_blocks") else torch.float32)
        if name.endswith("_blocks"):
            base = name[: -len("_blocks")]
            scales = reader.read([base + "_scales"], torch.device("cpu"), torch.uint8)[base + "_scales"]
            plain[base] = convert_moe_packed_tensors(got[name], scales, dtype=torch.float32)
        else:
            plain[name] = got[name]
    copy = write_hub_model(tmp_path / "gpt-oss-bf16", "gpt_oss", dtype="float32", state_dict=plain)
    assert not any(n.endswith(("_blocks", "_scales")) for n in ShardReader(copy).weight_map)

    plan = StagePlan.single(3, "cpu")
    quantized = load_staged(mxfp4_dir, plan, torch.float32, log=lambda _: None)
    converted = load_staged(copy, plan, torch.float32, log=lambda _: None)
    experts = quantized.model.layers[0].mlp.experts
    assert experts.gate_up_proj.abs().max() > 0 and experts.down_proj.dtype == torch.float32
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    assert torch.equal(target_context_features(quantized, ids, None, [0, 2]),
                       target_context_features(converted, ids, None, [0, 2]))
    assert complete_for_decoding(quantized, plan, log=lambda _: None)  # the layer above, read for τ
    assert complete_for_decoding(converted, plan, log=lambda _: None)
    with torch.no_grad():
        assert torch.equal(quantized(ids).logits, converted(ids).logits)


def test_blocks_without_their_scales_name_the_missing_tensor(mxfp4_dir, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in mxfp4_dir.iterdir():
        (broken / f.name).symlink_to(f)
    index = json.loads((mxfp4_dir / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.1.mlp.experts.down_proj_scales"]
    (broken / "model.safetensors.index.json").unlink()
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(MissingWeights, match=r"model\.layers\.1\.mlp\.experts\.down_proj_scales"):
        load_staged(broken, StagePlan.single(2, "cpu"), torch.float32, log=lambda _: None)


@pytest.mark.slow
def test_training_on_the_hub_checkpoint_measures_tau(mxfp4_dir, tmp_path):
    run = f"""
model:
  target: {{tiny: null, path: {mxfp4_dir}}}
  num_target_layers: 2
optim: {{total_steps: 2, micro_batches: 1}}
data: {{synthetic: {{n_train: 16, n_eval: 2, seed: 0, min_len: 6, max_len: 16}}, pack_length: 128, pack_rows: 1}}
eval: {{samples: 2, max_new_tokens: 6}}
pipeline: {{kind: threaded}}
"""
    run_dir = tmp_path / "run"
    rc = train(parse_config(tiny_config(run)), run_dir)
    status = json.loads((run_dir / "status.json").read_text())
    assert rc == 0, status.get("error", {}).get("message")
    log = (run_dir / "train.log").read_text()
    assert "target family: gpt-oss" in log
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    [evaluation] = [e for e in events if e["event"] == "eval"]
    assert evaluation["tau"] >= 1.0


def _fp8_checkpoint(directory: Path) -> Path:
    """A Qwen3-8B-FP8-style config.json: float8 weights with block scales, which cast as plain
    weights would train on wrong features without a word."""
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_hidden_layers": 2, "hidden_size": 32,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64,
        "vocab_size": 384, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}))
    return directory


def test_a_checkpoint_quantized_otherwise_is_refused_at_config_load_with_file_and_line(tmp_path, mxfp4_dir):
    from trainer.train.config import ConfigError, load_config

    config = tmp_path / "c.yaml"
    config.write_text(tiny_config("model: {target: {tiny: null, path: %s}}" % _fp8_checkpoint(tmp_path / "fp8")))
    with pytest.raises(ConfigError) as err:
        load_config(config)
    message = str(err.value)
    assert message.startswith(f"{config}:") and "model.target.path" in message and "quantized (fp8)" in message
    assert "bf16 checkpoint" in message and "\n" not in message
    config.write_text(tiny_config("model: {target: {tiny: null, path: %s}}" % mxfp4_dir))
    assert load_config(config).model.target.path == str(mxfp4_dir)


def test_load_staged_refuses_it_too_before_reading_a_tensor(tmp_path):
    with pytest.raises(ValueError, match=r"quantized \(fp8\)"):
        load_staged(_fp8_checkpoint(tmp_path / "fp8"), StagePlan.single(2, "cpu"), torch.float32,
                    log=lambda _: None)

