"""model.target.precision fp8 and model.target.experts (trainer.models.fp8, trainer.models.moe), on the CPU:
the quantization math against a dequantized reference, the refusal at config load, the memory plan
counting FP8 weights at 1 byte, an FP8 checkpoint kept at 1 byte a weight, and a MoE target's grouped
expert matmuls equal to the per-expert loop with packed rows exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.trainer.tiny_config import tiny_config
from trainer.data.packing import doc_start_of
from trainer.models import fp8, moe
from trainer.models.target import freeze, load_target, target_context_features
from trainer.run.config import ConfigError, parse_config
from trainer_tools.fixtures.hub_model import write_hub_model


def _weights(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g)
    w[3] *= 1e-3  # a row of small weights: its own scale keeps its precision
    w[5] = 0.0  # an all-zero row
    return w


def test_weights_quantize_per_output_channel_within_e4m3s_rounding():
    w = _weights(64, 128)
    q, scale = fp8.quantize_rows(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and scale.shape == (64, 1)
    # each row's largest magnitude lands on e4m3's largest value
    assert torch.equal(q.float().abs().amax(dim=1)[[0, 1, 3]], torch.full((3,), 448.0))
    back = fp8.dequantize(q, scale)
    # 3 mantissa bits: half a step is 1/16 of the value (normal range), or half the smallest subnormal step
    bound = torch.maximum(w.abs() / 16, scale * 2.0**-10) * (1 + 1e-6)
    assert ((back - w).abs() <= bound).all()
    assert not back[5].any() and torch.isfinite(back).all()
    assert (back[3] - w[3]).abs().max() < w[3].abs().max() / 16 and back[3].count_nonzero() == 128  # its own scale


def test_fp8_linear_is_the_product_of_the_dequantized_tensors(monkeypatch):
    """The layer's output equals (q_x s_x)(q_w s_w)^T, rounded once to bf16, through torch._scaled_mm
    where this torch has it on the CPU and through the dequantized fallback otherwise: the two agree."""
    linear = torch.nn.Linear(128, 64, bias=True)
    with torch.no_grad():
        linear.weight.copy_(_weights(64, 128))
    layer = fp8.FP8Linear.from_linear(linear)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.scale.shape == (1, 64)
    x = torch.randn(3, 7, 128, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    qx, sx = fp8.quantize_rows(x.reshape(-1, 128))
    want = (fp8.dequantize(qx, sx) @ fp8.dequantize(layer.weight, layer.scale.t()).t()).to(torch.bfloat16)
    want = want.float() + linear.bias.detach().to(torch.bfloat16).float()
    got = layer(x)
    assert got.shape == (3, 7, 64) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.reshape(-1, 64).float(), want, rtol=2**-7, atol=1e-3)
    monkeypatch.setattr(fp8, "_CPU_SCALED_MM", False)  # a torch without the CPU kernel
    torch.testing.assert_close(layer(x).float(), got.float(), rtol=2**-7, atol=1e-3)
    # and it is close to the bf16 layer it replaces (the cost FP8 brings: e4m3 rounding of x and W)
    exact = linear(x.float()).detach().reshape(-1, 64)
    assert float((got.reshape(-1, 64).float() - exact).norm() / exact.norm()) < 0.06  # noqa: E501


def test_quantize_linears_replaces_the_decoder_layers_linears_and_features_stay_bf16_and_close(tmp_path):
    target = freeze(load_target(str(write_hub_model(tmp_path / "m", "qwen3", dtype="float32")), "cpu",
                    torch.bfloat16))
    ids = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    before = target_context_features(target, ids, None, [0, 1])
    layers = target.model.layers
    replaced = fp8.quantize_layers(list(layers)[:2])
    assert replaced == 2 * 7  # q, k, v, o, gate, up, down of each layer
    assert isinstance(layers[0].self_attn.q_proj, fp8.FP8Linear) and type(layers[-1].mlp.up_proj) is torch.nn.Linear
    assert type(target.lm_head) is torch.nn.Linear  # the head stays bf16
    after = target_context_features(target, ids, None, [0, 1])
    assert after.dtype == torch.bfloat16 and after.shape == before.shape
    assert float((after.float() - before.float()).norm() / before.float().norm()) < 0.08
    assert "14 linear layers in FP8" in fp8.fp8_summary(target)


def test_fp8_bytes_count_a_linear_weight_at_one_byte_and_its_scales():
    linear = torch.nn.Linear(128, 64, bias=False, device="meta", dtype=torch.bfloat16)
    norm = torch.nn.LayerNorm(128, device="meta", dtype=torch.bfloat16)
    module = torch.nn.Sequential(linear, norm)
    assert fp8.fp8_bytes(module) == 64 * 128 + 4 * 64 + 2 * 2 * 128
    fp8.quantize_linears(module)  # on meta too: shapes only
    assert sum(p.numel() * p.element_size() for p in module.parameters()) == fp8.fp8_bytes(
        torch.nn.Sequential(torch.nn.Linear(128, 64, bias=False, device="meta", dtype=torch.bfloat16), norm))


FP8_CUDA = ("model: {target: {tiny: null, random_8b_shape: true, precision: fp8}, dtype: bf16}\n"
            "devices: {target: [cuda:0], drafter: [cuda:0]}\n")


def test_fp8_on_the_cpu_is_refused_at_config_load_with_the_reason():
    with pytest.raises(ConfigError, match=r"c\.yaml:\d+: model\.target\.precision fp8 is refused: cpu: FP8 needs a GPU"):
        parse_config(tiny_config("model: {target: {precision: fp8}, dtype: bf16}\n"), source="c.yaml")


def test_fp8_needs_bf16_features():
    with pytest.raises(ConfigError, match="needs model.dtype bf16"):
        parse_config(tiny_config(FP8_CUDA, "model: {dtype: fp32}\n"))


def test_fp8_on_a_gpu_without_fp8_is_refused_with_its_capability(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ConfigError, match=r"cuda:0 \(NVIDIA A100-SXM4-80GB\) has compute capability 8\.0; FP8 "
                                          r"matmuls need 8\.9"):
        parse_config(tiny_config(FP8_CUDA))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    assert parse_config(tiny_config(FP8_CUDA)).model.target.precision == "fp8"


def test_check_device_refuses_the_cpu_where_the_target_is_built():
    with pytest.raises(fp8.FP8Error, match="precision fp8: cpu: FP8 needs a GPU"):
        fp8.check_device("cpu")


def test_memory_plan_counts_fp8_weights_at_one_byte():
    from trainer.models.memory_plan import build_plan

    cuda = "devices: {target: [cuda:0], drafter: [cuda:0], memory_gib: 140}\n"
    bf16 = build_plan(parse_config(tiny_config(FP8_CUDA.replace(", precision: fp8", ""), cuda)))
    import unittest.mock

    with unittest.mock.patch("trainer.run.config._fp8_refusal", lambda d: None):  # no GPU here
        cfg = parse_config(tiny_config(FP8_CUDA, cuda))
    fp = build_plan(cfg)
    b, f = bf16.stages[0]["target weights"], fp.stages[0]["target weights"]
    embed = 151936 * 4096 * 2
    # layers 0..33 of Qwen3-8B: their linear weights at 1 byte instead of 2 (norms stay bf16, scales fp32)
    assert 0.49 < (f - embed) / (b - embed) < 0.51
    assert fp.stages[0]["decoding (τ): layers above, norm, head"] == bf16.stages[0]["decoding (τ): layers above, norm, head"]
    assert any("precision fp8" in n for n in fp.notes)


def test_doctor_counts_fp8_weights_at_one_byte(tmp_path):
    import unittest.mock

    from dflash_ops.doctor.plan import plan_for
    from tests.unit.test_doctor import TARGET as target

    config = tmp_path / "c.yaml"
    config.write_text(tiny_config(FP8_CUDA))
    with unittest.mock.patch("trainer.run.config._fp8_refusal", lambda d: None):
        assert plan_for(target, config=config).dtype_bytes == 1
    config.write_text(tiny_config(FP8_CUDA.replace(", precision: fp8", "")))
    assert plan_for(target, config=config).dtype_bytes == 2


# --------------------------------------------------------------------------- an FP8 checkpoint kept at 1 byte


def test_an_fp8_checkpoint_loads_at_one_byte_a_weight_and_its_features_stay_close(tmp_path):
    from trainer.models.stages import StagePlan
    from trainer.models.target_loading import load_staged

    path = write_hub_model(tmp_path / "q", "qwen3", dtype="float32", quantization="fp8", fp8_block=(32, 32))
    plan = StagePlan.from_sizes([2], ["cpu"])
    unittest_mock = pytest.MonkeyPatch()
    unittest_mock.setattr(fp8, "check_device", lambda d: None)  # the CPU is refused; the loading is what is tested
    try:
        kept = load_staged(path, plan, torch.bfloat16, fp8=fp8.converter_for("fp8"))
    finally:
        unittest_mock.undo()
    decoded = load_staged(path, plan, torch.bfloat16)
    q = kept.module.model.layers[1].mlp.down_proj
    assert isinstance(q, fp8.FP8Linear) and q.weight.dtype == torch.float8_e4m3fn
    assert kept.precision == "fp8" and decoded.precision == "bf16"
    ids = torch.randint(0, 500, (1, 20), generator=torch.Generator().manual_seed(0))
    a = target_context_features(kept, ids, None, [0, 1]).float()
    b = target_context_features(decoded, ids, None, [0, 1]).float()
    assert float((a - b).norm() / b.norm()) < 0.08


# --------------------------------------------------------------------------- MoE: grouped expert matmuls


@pytest.fixture(scope="module")
def moe_target(tmp_path_factory) -> torch.nn.Module:
    path = write_hub_model(tmp_path_factory.mktemp("moe") / "qwen3-moe", "qwen3_moe", dtype="float32")
    return freeze(load_target(str(path), "cpu", torch.float32))


def test_grouped_expert_matmuls_are_offered_here():
    assert moe.grouped_available() is None  # transformers 5 and torch >= 2.9 both have them


def test_set_experts_switches_the_implementation_and_refuses_an_unknown_one(moe_target):
    assert moe.set_experts(moe_target, "eager") == "eager"
    assert moe.set_experts(moe_target, "grouped_mm") == "grouped_mm"
    assert moe.set_experts(moe_target, "auto") == "grouped_mm"
    with pytest.raises(ValueError, match="not one of auto, grouped_mm, eager"):
        moe.set_experts(moe_target, "fast")
    dense = torch.nn.Linear(2, 2)
    assert moe.set_experts(dense, "auto") is None


def test_grouped_experts_equal_the_per_expert_loop_and_packed_rows_stay_exact(moe_target):
    g = torch.Generator().manual_seed(0)
    lengths = [13, 21, 9, 1]
    docs = [torch.randint(0, 500, (n,), generator=g) for n in lengths]
    row = torch.cat(docs + [torch.zeros(64 - sum(lengths), dtype=torch.long)])[None]
    doc_start = doc_start_of(lengths, 64)[None]
    layers = [0, 1, 2]
    features = {}
    for impl in ("eager", "grouped_mm"):
        moe.set_experts(moe_target, impl)
        packed = target_context_features(moe_target, row, None, layers, doc_start=doc_start)
        at = 0
        for doc in docs:
            alone = target_context_features(moe_target, doc[None], None, layers)
            torch.testing.assert_close(packed[:, at:at + len(doc)], alone, rtol=1e-5, atol=1e-5)
            at += len(doc)
        features[impl] = packed
    torch.testing.assert_close(features["grouped_mm"], features["eager"], rtol=1e-5, atol=1e-5)
    moe.set_experts(moe_target, "auto")


def test_experts_config_is_read_and_grouped_refused_where_not_offered(monkeypatch):
    assert parse_config(tiny_config("model: {target: {experts: eager}}\n")).model.target.experts == "eager"
    monkeypatch.setattr("trainer.run.accel.grouped_available", lambda: "this torch (2.1) has no grouped_mm")
    with pytest.raises(ConfigError, match="model.target.experts grouped_mm is not offered here: this torch"):
        parse_config(tiny_config("model: {target: {experts: grouped_mm}}\n"))


def test_the_trainer_builds_an_fp8_target_on_cuda_only(tmp_path: Path):
    """On the CPU the trainer never gets that far: the config is refused (above). Building it on a
    device that passes the config check but cannot run FP8 stops at the target's load."""
    from trainer.train.components import build_target

    cfg = parse_config(tiny_config())
    cfg.model.target.precision = "fp8"  # past the config check, as a config read elsewhere would be
    with pytest.raises(fp8.FP8Error, match="cpu: FP8 needs a GPU"):
        build_target(cfg, _Tok(), None, tmp_path, print)  # type: ignore[arg-type]


class _Tok:
    def __len__(self) -> int:
        return 512


def test_the_plan_fits_a_70b_shaped_fp8_target_beside_a_2_layer_drafter_on_one_h200():
    """Llama-3.3-70B truncated at its last tap (layers 0..77): ~64 GiB in FP8; a 5-layer drafter at its width
    (~74 GB with fp32 weights, gradients and AdamW) does not fit beside it on a 139 GiB H200, 2 layers do.
    3 layers fit only with drafter activation checkpointing, which `auto` turns on for exactly 2 of them."""
    import unittest.mock

    from transformers import LlamaConfig

    from trainer.models.memory_plan import build_plan
    from trainer.models.target import LLAMA_3_3_70B_DIMS

    config = LlamaConfig(**LLAMA_3_3_70B_DIMS).to_dict()
    verdict = {}
    for checkpointing in ("false", "auto"):
        for layers in (5, 3, 2):
            text = tiny_config(FP8_CUDA, f"model: {{drafter_layers: {layers}, mask_token_id: 128255, block_size: 16, "
                               f"num_target_layers: 5, checkpoint_drafter: {checkpointing}}}\n"
                               "devices: {memory_gib: 139}\ndata: {pack_length: 8192, max_length: 3072, num_anchors: 512, "
                               "token_budget: 3072}\n")
            with unittest.mock.patch("trainer.run.config._fp8_refusal", lambda d: None):
                plan = build_plan(parse_config(text), config)
            verdict[checkpointing, layers] = (plan.fits, plan.checkpoint_drafter if plan.fits else None)
            assert 63 < plan.stages[0]["target weights"] / 2**30 < 65
    assert verdict == {("false", 5): (False, None), ("false", 3): (False, None), ("false", 2): (True, 0),
                       ("auto", 5): (False, None), ("auto", 3): (True, 2), ("auto", 2): (True, 0)}


def test_fast_accumulation_is_a_choice_of_fp8_only():
    with pytest.raises(ConfigError, match="model.target.fp8_fast_accum needs precision fp8"):
        parse_config(tiny_config("model: {target: {fp8_fast_accum: true}}\n"))
    import unittest.mock

    with unittest.mock.patch("trainer.run.config._fp8_refusal", lambda d: None):
        cfg = parse_config(tiny_config(FP8_CUDA.replace("precision: fp8", "precision: fp8, fp8_fast_accum: true")))
    assert cfg.model.target.fp8_fast_accum
    layers = [torch.nn.Sequential(torch.nn.Linear(32, 16)), torch.nn.Sequential(torch.nn.Linear(32, 16))]
    fp8.quantize_layers(layers, fast_accum=True)
    assert all(layer[0].fast_accum for layer in layers)
    assert not fp8.FP8Linear.from_linear(torch.nn.Linear(32, 16)).fast_accum  # an instance's choice, off by default
    x = torch.randn(4, 32).to(torch.bfloat16)
    assert layers[0](x).shape == (4, 16)  # the CPU ignores it (the flag is Hopper's kernel choice)


def test_the_trainer_quantizes_the_layers_training_runs(tmp_path: Path, monkeypatch):
    """With the device check passed (a GPU's), a target built in code has its layers up to the last tap
    in FP8, those above (decoding) in bf16, and says so in the log."""
    from trainer.train.components import build_target

    cfg = parse_config(tiny_config("model: {target: {tiny: {layers: 4, hidden: 32, heads: 2, kv_heads: 1, head_dim: 16, "
                                   "intermediate: 64}}, target_layer_ids: [0, 1]}\n"))
    cfg.model.target.precision, cfg.model.target.fp8_fast_accum = "fp8", True
    monkeypatch.setattr(fp8, "check_device", lambda d: None)
    lines: list[str] = []
    target = build_target(cfg, _Tok(), None, tmp_path, lines.append)  # type: ignore[arg-type]
    layers = target.module.model.layers
    assert isinstance(layers[1].mlp.down_proj, fp8.FP8Linear) and layers[1].mlp.down_proj.fast_accum
    assert type(layers[2].mlp.down_proj) is torch.nn.Linear  # above the last tap: decoding, bf16
    assert target.precision == "fp8" and target.fast_accum and target.layer_ids == (0, 1)
    assert any(line.startswith("target precision fp8, fast accumulation: 14 linear layers in FP8") for line in lines)
