"""Quantized checkpoints as the hub ships them, decoded at load (trainer.models.quantized): gpt-oss's
MXFP4 expert matrices exactly as transformers decodes them, Qwen3-FP8's block-scaled float8
weights; each directory trains like its bf16 copy. Any other quantization is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.trainer.tiny_config import tiny_config
from trainer.entry import train
from trainer.models import quantized
from trainer.models.stages import StagePlan
from trainer.models.target import target_context_features
from trainer.models.target_loading import MissingWeights, ShardReader, complete_for_decoding, load_staged
from trainer.run.config import parse_config
from trainer_tools.fixtures.hub_model import write_hub_model

FP8_BLOCK = (48, 48)  # tiles that do not divide the tiny model's 64 and 128: partial tiles at the edges


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory) -> Path:
    return write_hub_model(tmp_path_factory.mktemp("gpt-oss") / "gpt-oss-mxfp4", "gpt_oss", dtype="float32",
                           quantization="mxfp4")


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory) -> Path:
    return write_hub_model(tmp_path_factory.mktemp("qwen3") / "qwen3-fp8", "qwen3", dtype="float32",
                           quantization="fp8", fp8_block=FP8_BLOCK)


def test_a_byte_holds_two_values_low_nibble_first_times_its_blocks_power_of_two():
    blocks = torch.zeros(1, 1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0, 0] = 0x2F  # low 0xF = -6.0, high 0x2 = 1.0
    blocks[0, 0, 0, 15] = 0x71  # low 0x1 = 0.5, high 0x7 = 6.0
    scales = torch.full((1, 1, 1), 128, dtype=torch.uint8)  # 2 ** 1
    decoded = quantized.decode_mxfp4(blocks, scales, torch.bfloat16)
    assert decoded.shape == (1, 32, 1)  # (experts, in, out)
    assert decoded[0, :2, 0].tolist() == [-12.0, 2.0] and decoded[0, 30:, 0].tolist() == [1.0, 12.0]
    assert not decoded[0, 2:30].any()


def test_mxfp4_decode_equals_transformers_own_conversion():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 5, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 140, (3, 40, 5), generator=g, dtype=torch.uint8)
    ours = quantized.decode_mxfp4(blocks, scales, torch.bfloat16)
    assert ours.is_contiguous() and ours.shape == (3, 160, 40)
    assert torch.equal(ours, convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=torch.bfloat16))


@pytest.mark.parametrize("blocks, scales, message", [
    ((2, 4, 3, 16), (2, 4, 2), "scales"),
    ((2, 4, 3, 8), (2, 4, 3), "blocks"),
])
def test_mxfp4_blocks_and_scales_that_do_not_match_are_refused_by_shape(blocks, scales, message):
    with pytest.raises(quantized.QuantizedError, match=message):
        quantized.decode_mxfp4(torch.zeros(blocks, dtype=torch.uint8), torch.zeros(scales, dtype=torch.uint8), torch.float32)


def _mxfp4_copy(mxfp4_dir: Path, out: Path) -> Path:
    """The directory a user converts an MXFP4 one to: transformers' conversion of each expert
    matrix, written as plain tensors."""
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
    copy = write_hub_model(out, "gpt_oss", dtype="float32", state_dict=plain)
    assert not any(n.endswith(("_blocks", "_scales")) for n in ShardReader(copy).weight_map)
    return copy


def test_the_mxfp4_hub_checkpoint_loads_as_its_bf16_copy(mxfp4_dir, tmp_path):
    experts = _same_model(mxfp4_dir, _mxfp4_copy(mxfp4_dir, tmp_path / "bf16")).model.layers[0].mlp.experts
    assert experts.gate_up_proj.abs().max() > 0 and experts.down_proj.dtype == torch.float32


def _same_model(quantized_dir: Path, copy: Path) -> torch.nn.Module:
    """Both directories read stage by stage (3 of 4 layers, then the rest for decoding) give the
    same features and logits; the quantized one's model."""
    plan = StagePlan.single(3, "cpu")
    packed = load_staged(quantized_dir, plan, torch.float32, log=lambda _: None)
    plain = load_staged(copy, plan, torch.float32, log=lambda _: None)
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    assert torch.equal(target_context_features(packed, ids, None, [0, 2]),
                       target_context_features(plain, ids, None, [0, 2]))
    assert complete_for_decoding(packed, log=lambda _: None)  # the layer above, read for τ
    assert complete_for_decoding(plain, log=lambda _: None)
    with torch.no_grad():
        assert torch.equal(packed.module(ids).logits, plain.module(ids).logits)
    return packed.module


def test_fp8_weights_are_their_tiles_times_their_multipliers():
    weight = torch.tensor([[1.0, -2.0, 0.5], [4.0, 0.25, -1.5]]).to(torch.float8_e4m3fn)
    scale_inv = torch.tensor([[2.0, 0.5], [10.0, 3.0]])  # tiles of 1 x 2: columns 0-1, then 2
    decoded = quantized.decode_fp8(weight, scale_inv, (1, 2), torch.float32)
    assert decoded.tolist() == [[2.0, -4.0, 0.25], [40.0, 2.5, -4.5]]
    assert quantized.decode_fp8(weight, torch.tensor(3.0), None, torch.float32)[1, 0] == 12.0
    with pytest.raises(quantized.QuantizedError, match=r"needs weight_scale_inv \(2, 2\), got \(2, 1\)"):
        quantized.decode_fp8(weight, scale_inv[:, :1], (1, 2), torch.float32)


def _fp8_copy(fp8_dir: Path, out: Path) -> Path:
    """The directory of an FP8 one's weights multiplied out here, tile by tile."""
    reader = ShardReader(fp8_dir)
    assert reader.fp8_block == FP8_BLOCK
    plain: dict[str, torch.Tensor] = {}
    for name in reader.weight_map:
        if name.endswith("_scale_inv"):
            continue
        [stored] = reader._read_stored([name], torch.device("cpu")).values()
        if stored.dtype == torch.float8_e4m3fn:
            [scales] = reader._read_stored([name + "_scale_inv"], torch.device("cpu")).values()
            tiles = torch.zeros(stored.shape)
            for i in range(stored.shape[0]):
                for j in range(stored.shape[1]):
                    tiles[i, j] = scales[i // FP8_BLOCK[0], j // FP8_BLOCK[1]]
            plain[name] = stored.float() * tiles
        else:
            plain[name] = stored.float()
    assert sum(t.dtype == torch.float8_e4m3fn for t in reader._read_stored(list(reader.weight_map),
                                                                         torch.device("cpu")).values()) == 4 * 7
    return write_hub_model(out, "qwen3", dtype="float32", state_dict=plain)


def test_an_fp8_checkpoint_loads_as_its_dequantized_copy(fp8_dir, tmp_path):
    """Qwen3-FP8's format (float8 e4m3 projections, weight_scale_inv per tile, partial tiles at the
    edges) read stage by stage equals the directory of its weights multiplied out."""
    q_proj = _same_model(fp8_dir, _fp8_copy(fp8_dir, tmp_path / "plain")).model.layers[0].self_attn.q_proj.weight
    assert q_proj.dtype == torch.float32 and q_proj.abs().max() > 0


def test_fp8_weights_without_their_scales_name_the_missing_tensor(fp8_dir, tmp_path):
    broken = _without(fp8_dir, tmp_path / "broken", "model.layers.1.mlp.up_proj.weight_scale_inv")
    with pytest.raises(MissingWeights, match=r"model\.layers\.1\.mlp\.up_proj\.weight_scale_inv"):
        load_staged(broken, StagePlan.single(2, "cpu"), torch.float32, log=lambda _: None)


def _without(model_dir: Path, out: Path, tensor: str) -> Path:
    """model_dir's files linked into `out`, with an index that lacks `tensor`."""
    out.mkdir()
    for f in model_dir.iterdir():
        if f.name != "model.safetensors.index.json":
            (out / f.name).symlink_to(f)
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    del index["weight_map"][tensor]
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out


def test_mxfp4_blocks_without_their_scales_name_the_missing_tensor(mxfp4_dir, tmp_path):
    broken = _without(mxfp4_dir, tmp_path / "broken", "model.layers.1.mlp.experts.down_proj_scales")
    with pytest.raises(MissingWeights, match=r"model\.layers\.1\.mlp\.experts\.down_proj_scales"):
        load_staged(broken, StagePlan.single(2, "cpu"), torch.float32, log=lambda _: None)


@pytest.mark.slow
@pytest.mark.parametrize("which, family", [("mxfp4_dir", "gpt-oss"), ("fp8_dir", "Qwen3")])
def test_training_on_the_hub_checkpoint_measures_tau(which, family, request, tmp_path):
    model_dir = request.getfixturevalue(which)
    run = f"""
model:
  target: {{tiny: null, path: {model_dir}}}
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
    assert f"target family: {family}" in log and "decoded to the run's dtype at load" in log
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    [evaluation] = [e for e in events if e["event"] == "eval"]
    assert evaluation["tau"] >= 1.0


def _awq_checkpoint(directory: Path) -> Path:
    """An AWQ config.json (Qwen3-8B-AWQ's quantization_config): int4 weights packed into int32
    `qweight` with `scales` and `qzeros`, which the trainer does not read."""
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_hidden_layers": 2, "hidden_size": 32,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64,
        "vocab_size": 384, "quantization_config": {"bits": 4, "group_size": 128, "quant_method": "awq",
                                                    "version": "gemm", "zero_point": True}}))
    return directory


def test_a_checkpoint_quantized_otherwise_is_refused_at_config_load_with_file_and_line(tmp_path, mxfp4_dir,
                                                                                       fp8_dir):
    from trainer.run.config import ConfigError, load_config

    config = tmp_path / "c.yaml"
    config.write_text(tiny_config("model: {target: {tiny: null, path: %s}}" % _awq_checkpoint(tmp_path / "awq")))
    with pytest.raises(ConfigError) as err:
        load_config(config)
    message = str(err.value)
    assert message.startswith(f"{config}:") and "model.target.path" in message and "quantized (awq)" in message
    assert "bf16 checkpoint" in message and "\n" not in message
    for readable in (mxfp4_dir, fp8_dir):
        config.write_text(tiny_config("model: {target: {tiny: null, path: %s}}" % readable))
        assert load_config(config).model.target.path == str(readable)


def test_load_staged_refuses_it_too_before_reading_a_tensor(tmp_path):
    with pytest.raises(ValueError, match=r"quantized \(awq\)"):
        load_staged(_awq_checkpoint(tmp_path / "awq"), StagePlan.single(2, "cpu"), torch.float32,
                    log=lambda _: None)



def test_per_expert_fp8_weights_of_a_moe_checkpoint_are_decoded_then_stacked(tmp_path):
    """Qwen3-30B-A3B-FP8's layout: every expert's projections float8 with their own multipliers,
    one tensor per expert; decoded, then stacked into the fused expert tensors."""
    from safetensors.torch import save_file
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from trainer_tools.fixtures.hub_model import fp8_quantization, fp8_quantize, is_fp8_weight

    config = Qwen3MoeConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, vocab_size=384, num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=32)
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(tmp_path / "saved")
    reader = ShardReader(tmp_path / "saved")
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in reader  # the hub's per-expert names
    stored = reader._read_stored(list(reader.weight_map), torch.device("cpu"))
    packed, plain = {}, {}
    for name, tensor in stored.items():
        if is_fp8_weight(name, tuple(tensor.shape)):
            q, scales = fp8_quantize(tensor, FP8_BLOCK)
            packed[name], packed[name + "_scale_inv"] = q, scales
            plain[name] = quantized.decode_fp8(q, scales, FP8_BLOCK, torch.float32)
        else:
            packed[name] = plain[name] = tensor
    assert sum(".experts." in n and n.endswith("_scale_inv") for n in packed) == 2 * 4 * 3
    dirs = {}
    for kind, tensors in (("fp8", packed), ("plain", plain)):
        out = tmp_path / kind
        out.mkdir()
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
        doc = json.loads((tmp_path / "saved" / "config.json").read_text())
        if kind == "fp8":
            doc["quantization_config"] = fp8_quantization(FP8_BLOCK)
        (out / "config.json").write_text(json.dumps(doc))
        dirs[kind] = load_staged(out, StagePlan.single(2, "cpu"), torch.float32, log=lambda _: None)
    ids = torch.randint(0, 384, (2, 10), generator=torch.Generator().manual_seed(2))
    assert torch.equal(target_context_features(dirs["fp8"], ids, None, [0, 1]),
                       target_context_features(dirs["plain"], ids, None, [0, 1]))
    experts = dirs["fp8"].module.model.layers[1].mlp.experts
    assert experts.gate_up_proj.dtype == torch.float32 and experts.gate_up_proj.abs().max() > 0


@pytest.mark.parametrize("which, copy", [("mxfp4_dir", _mxfp4_copy), ("fp8_dir", _fp8_copy)])
def test_regen_hf_engine_answers_from_a_quantized_directory_as_from_its_copy(which, copy, request, tmp_path):
    """`regen --engine hf` reads these directories through the trainer's loader (transformers' own
    path needs accelerate, and a GPU kernel package for MXFP4): greedy answers equal its copy's."""
    from trainer_tools import regen

    model_dir = request.getfixturevalue(which)
    assert regen.quantized_checkpoint(str(model_dir))
    answers = []
    for directory in (model_dir, copy(model_dir, tmp_path / "copy")):
        engine = regen.HFEngine(str(directory), regen.Sampling(max_tokens=8), dtype="fp32", batch_size=1)
        try:
            answers.append(engine.complete([{"role": "user", "content": "The quick brown fox"}]).content)
        finally:
            engine.close()
    assert answers[0] == answers[1] and answers[0]


def _altered(model_dir: Path, out: Path, tensor: str, change) -> Path:
    """model_dir's files linked into `out`, except the shard holding `tensor`, rewritten with
    change(tensor) in its place (the other tensors and the shard's metadata as they were)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    shard = index["weight_map"][tensor]
    out.mkdir()
    for f in model_dir.iterdir():
        if f.name != shard:
            (out / f.name).symlink_to(f)
    with safe_open(str(model_dir / shard), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        metadata = f.metadata()
    tensors[tensor] = change(tensors[tensor].clone())
    save_file(tensors, str(out / shard), metadata=metadata)
    return out


def _set_first(value):
    def change(t: torch.Tensor) -> torch.Tensor:
        t.view(-1)[0] = value
        return t
    return change


@pytest.mark.parametrize("which, tensor, value, named", [
    # an E8M0 scale byte 0xFF is NaN: the decoded experts would be NaN wherever the block is not zero
    ("mxfp4_dir", "model.layers.1.mlp.experts.down_proj_scales", 0xFF,
     r"tensor model\.layers\.1\.mlp\.experts\.down_proj_scales holds 1 NaN scale"),
    # 2 ** 127 times a block's values overflows: the decoded matrix holds inf
    ("mxfp4_dir", "model.layers.1.mlp.experts.gate_up_proj_scales", 254,
     r"tensor model\.layers\.1\.mlp\.experts\.gate_up_proj \(decoded with "
     r"model\.layers\.1\.mlp\.experts\.gate_up_proj_scales\) holds \d+ NaN/inf"),
    ("fp8_dir", "model.layers.1.mlp.up_proj.weight_scale_inv", float("inf"),
     r"tensor model\.layers\.1\.mlp\.up_proj\.weight_scale_inv holds 1 NaN/inf value"),
    ("fp8_dir", "model.layers.0.self_attn.q_proj.weight_scale_inv", float("nan"),
     r"tensor model\.layers\.0\.self_attn\.q_proj\.weight_scale_inv holds 1 NaN/inf value"),
    # a float8 e4m3 byte 0x7F is NaN: the weight decodes to NaN there
    ("fp8_dir", "model.layers.0.mlp.down_proj.weight", float("nan"),
     r"tensor model\.layers\.0\.mlp\.down_proj\.weight \(decoded with "
     r"model\.layers\.0\.mlp\.down_proj\.weight_scale_inv\) holds 1 NaN/inf"),
    ("fp8_dir", "model.layers.0.input_layernorm.weight", float("-inf"),
     r"tensor model\.layers\.0\.input_layernorm\.weight holds 1 NaN/inf"),
])
def test_a_tensor_that_holds_nan_or_inf_is_refused_at_load_by_name(which, tensor, value, named, request, tmp_path):
    from trainer.models.target_loading import NonFiniteWeights

    broken = _altered(request.getfixturevalue(which), tmp_path / "broken", tensor, _set_first(value))
    with pytest.raises(NonFiniteWeights, match=named) as err:
        load_staged(broken, StagePlan.single(2, "cpu"), torch.float32, log=lambda _: None)
    assert str(err.value).startswith(f"{broken}: ") and "\n" not in str(err.value)


def test_the_layers_decoding_adds_are_checked_too(fp8_dir, tmp_path):
    from trainer.models.target_loading import NonFiniteWeights

    broken = _altered(fp8_dir, tmp_path / "broken", "model.layers.3.mlp.up_proj.weight_scale_inv",
                      _set_first(float("nan")))
    plan = StagePlan.single(3, "cpu")
    model = load_staged(broken, plan, torch.float32, log=lambda _: None)  # layer 3 is not read for training
    with pytest.raises(NonFiniteWeights, match=r"model\.layers\.3\.mlp\.up_proj\.weight_scale_inv"):
        complete_for_decoding(model, log=lambda _: None)


def test_a_run_on_a_checkpoint_with_nan_scales_fails_at_load_naming_the_tensor(mxfp4_dir, tmp_path):
    """Not `done` with a NaN loss and the best τ: `failed` before the first step, one line."""
    broken = _altered(mxfp4_dir, tmp_path / "broken", "model.layers.0.mlp.experts.down_proj_scales",
                      _set_first(0xFF))
    run = f"""
model:
  target: {{tiny: null, path: {broken}}}
  num_target_layers: 2
optim: {{total_steps: 2, micro_batches: 1}}
data: {{synthetic: {{n_train: 16, n_eval: 2, seed: 0, min_len: 6, max_len: 16}}}}
"""
    run_dir = tmp_path / "run"
    assert train(parse_config(tiny_config(run)), run_dir) == 1
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "failed" and status["step"] == 0
    message = status["error"]["message"]
    assert "model.layers.0.mlp.experts.down_proj_scales holds 1 NaN scale" in message and "\n" not in message
    assert status["error"]["traceback"] is None
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert not [e for e in events if e["event"] == "step"]
