"""The drafter's linear layers trained with FP8 matmuls (model.drafter.precision fp8): each matmul of
fp8_linear and of the LM head's FP8Head equals its dequantized reference, a drafter step with them
trains like bf16, evaluation stays bf16, the compiled regions take them without a graph break, and the
config refuses it where it cannot run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.trainer.conftest import MASK_ID, VOCAB
from tests.trainer.test_objectives import OBJECTIVES, head_case
from tests.trainer.tiny_config import tiny_config
from trainer.models.drafter import DFlashDrafter
from trainer.models.fp8_training import E4M3_MAX, FP8Head, e4m3_transposed, fp8_linear, quantize_tensor
from trainer.models.masks import make_blocks, sample_anchors
from trainer.models.objective import (
    _ce_slots,
    _ce_slots_fp8,
    _mix_slots,
    _mix_slots_fp8,
    drafter_loss_sums,
    fused_objective,
)
from trainer.models.target import FrozenHead, target_context_features
from trainer.run.config import ConfigError, parse_config


def dequantized(t: torch.Tensor) -> torch.Tensor:
    q, s = quantize_tensor(t)
    return q.float() * s


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def test_quantize_tensor_maps_the_largest_magnitude_to_e4m3s_largest():
    x = torch.tensor([[0.5, -3.0], [1.0, 2.0]])
    q, s = quantize_tensor(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == ()
    assert float(q.float().abs().max()) == E4M3_MAX
    assert torch.allclose(q.float() * s, x, rtol=0.07)
    zeros, scale = quantize_tensor(torch.zeros(3, 16))  # no division by zero
    assert torch.isfinite(scale) and not zeros.float().any()


@pytest.mark.parametrize("rows", [32, 37])  # 37: the weight gradient's inner dimension padded to 16
def test_every_matmul_equals_its_dequantized_reference(rows):
    torch.manual_seed(0)
    x = torch.randn(rows, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(48, 64, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(rows, 48, dtype=torch.bfloat16)
    y = fp8_linear(x, w)
    y.backward(g)
    xd, wd, gd = dequantized(x.detach()), dequantized(w.detach()), dequantized(g)
    assert relative(y, xd @ wd.t()) < 1e-2
    assert relative(x.grad, gd @ wd) < 1e-2
    assert relative(w.grad, gd.t() @ xd) < 1e-2
    assert (y.dtype, x.grad.dtype, w.grad.dtype) == (torch.bfloat16,) * 3
    # and all three stay near the exact product: 3 mantissa bits, not a wrong layout
    exact = x.detach().float() @ w.detach().float().t()
    assert relative(y, exact) < 0.08
    assert relative(w.grad, g.float().t() @ x.detach().float()) < 0.08


def test_a_wrong_layout_would_be_caught():
    """The reference comparison above can fail: the weight's gradient of the transposed product differs."""
    torch.manual_seed(0)
    x, g = torch.randn(32, 64), torch.randn(32, 48)
    assert relative(dequantized(g).t() @ dequantized(x), g.t() @ x) < 0.08
    assert relative((dequantized(g).t() @ dequantized(x)).flip(0), g.t() @ x) > 0.5


def test_the_transposed_e4m3_copy_is_the_transpose_and_a_well_formed_operator():
    """The weight gradient's transposed operands come from one op of their own (opaque to inductor, a
    Triton tiled copy on CUDA): the transpose's bytes, any shape, and an operator torch.compile can hold."""
    for rows, cols in ((37, 16), (16, 48), (1, 1)):
        x = torch.randn(rows, cols).to(torch.float8_e4m3fn)
        y = e4m3_transposed(x)
        assert y.shape == (cols, rows) and y.is_contiguous()
        assert torch.equal(y.view(torch.uint8), x.t().contiguous().view(torch.uint8))
    torch.library.opcheck(e4m3_transposed, (torch.randn(24, 32).to(torch.float8_e4m3fn),),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))  # test_schema multiplies: no e4m3 mul on a CPU


def test_the_fp8_heads_matmuls_equal_their_dequantized_references():
    torch.manual_seed(0)
    weight, hidden, grad = torch.randn(48, 32), torch.randn(37, 32), torch.randn(37, 48)
    head = FP8Head(weight)
    logits = head.logits(*quantize_tensor(hidden), torch.float32)
    grad_hidden = head.grad_hidden(*quantize_tensor(grad), torch.float32)
    wd = dequantized(weight)
    assert relative(logits, dequantized(hidden) @ wd.t()) < 1e-4
    assert relative(grad_hidden, dequantized(grad) @ wd) < 1e-4
    assert relative(logits, hidden @ weight.t()) < 0.08 and relative(grad_hidden, grad @ weight) < 0.08
    assert relative(grad_hidden, grad @ weight.t().flip(0).t()) > 0.5  # a wrong layout would show
    in_parts = FP8Head(weight, rows_at_once=5)  # quantized a few rows at a time: the same copies
    assert torch.equal(in_parts.rows.view(torch.uint8), head.rows.view(torch.uint8)) and in_parts.scale == head.scale
    assert torch.equal(head.rows.view(torch.uint8), quantize_tensor(weight)[0].view(torch.uint8))


@pytest.mark.parametrize("confident", [False, True])
def test_the_heads_logit_gradient_is_cast_at_its_bound_not_its_measured_largest(confident):
    """d term / d logits is scaled by its bound by construction (ce_w + kl_w * T, a softmax minus a
    one-hot lies in [-1, 1]), never saturates, and dequantizes to the exact gradient within e4m3's
    rounding, also where the largest gradient is far below the bound (a drafter sure of its tokens)."""
    torch.manual_seed(0)
    logits = torch.randn(24, 64) * (1.0 if not confident else 0.5)
    labels = torch.randint(0, 64, (24,))
    if confident:
        logits[torch.arange(24), labels] += 12.0  # every label near probability 1: gradients ~1e-5..1e-2
    target = torch.randn(24, 64)
    cases = [(_ce_slots, _ce_slots_fp8, (), 1.0), (_mix_slots, _mix_slots_fp8, (target, 0.5, 2.0, 2.0), 4.5)]
    for exact_fn, fp8_fn, args, bound in cases:
        *sums, grad = exact_fn(logits, labels, *args, compiled=False)
        *sums8, grad_q, scale = fp8_fn(logits, labels, *args, compiled=False)
        assert all(torch.equal(a, b) for a, b in zip(sums, sums8, strict=True))
        assert float(scale) == pytest.approx(bound / E4M3_MAX) and float(grad.abs().max()) <= bound
        assert grad_q.dtype == torch.float8_e4m3fn and float(grad_q.float().abs().max()) <= E4M3_MAX
        error = (grad_q.float() * scale - grad).abs()
        normal = grad.abs() >= scale * 2 ** -6  # e4m3's normal range: 3 mantissa bits
        assert normal.sum() > 24 and float((error / grad.abs())[normal].max()) <= 2 ** -4
        assert (~normal).any() == confident  # a sure drafter's small gradients: e4m3's subnormals
        assert float(torch.where(normal, 0.0, error).max()) <= float(scale) * 2 ** -10  # half their spacing


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_the_objective_through_the_fp8_head_trains_like_the_bf16_head(name):
    """Sums and the hidden states' gradient within e4m3's rounding of the exact head's, for every objective
    (kl quantizes the target's logits' inputs too); without a gradient the FP8 head is not used: an
    evaluation's sums are the exact head's."""
    hidden, weight, labels, weights, target_rows, slot_rows, block = head_case(vocab=48, width=32)
    args = (labels, weights, 8, OBJECTIVES[name], target_rows, slot_rows, block)
    loss, correct = fused_objective(hidden, weight, *args)
    loss.backward()
    exact = hidden.grad.clone()
    hidden.grad = None
    loss8, correct8 = fused_objective(hidden, weight, *args, fp8_head=FP8Head(weight))
    loss8.backward()
    loss, loss8 = loss.detach(), loss8.detach()
    assert float(loss8) == pytest.approx(float(loss), rel=0.03) and float(loss8) != float(loss)
    # TV's gradient is ½·sign(q - p) through the softmax: where drafter and target nearly agree, e4m3's rounding of
    # the logits flips the sign, so tv alone keeps less of the exact direction (0.87 here) than a smooth term
    smooth = OBJECTIVES[name].ce > 0 or OBJECTIVES[name].tv == 0
    assert F.cosine_similarity(hidden.grad.flatten(), exact.flatten(), dim=0) > (0.98 if smooth else 0.8)
    assert abs(float(correct8) - float(correct)) <= 0.1 * float(weights.sum())
    with torch.no_grad():
        assert torch.equal(fused_objective(hidden, weight, *args, fp8_head=FP8Head(weight))[0],
                           fused_objective(hidden, weight, *args)[0])


def test_the_frozen_heads_fp8_copies_are_made_once_and_remade_for_a_new_weight():
    head = FrozenHead(torch.randn(48, 32), torch.randn(48, 32))
    first = head.fp8()
    assert head.fp8() is first and first.source is head.lm_head_weight
    head.to(torch.float64)  # a new tensor: the copies follow it
    assert head.fp8() is not first and head.fp8().source is head.lm_head_weight


def test_an_fp8_drafter_step_takes_the_fp8_head(tiny, monkeypatch):
    calls = []
    for method in ("logits", "grad_hidden"):
        original = getattr(FP8Head, method)
        monkeypatch.setattr(FP8Head, method, lambda self, *a, _m=method, _o=original: calls.append(_m) or _o(self, *a))
    _step(tiny, F.linear)
    assert calls == []
    _step(tiny, fp8_linear)
    assert calls.count("logits") == calls.count("grad_hidden") >= 1


def _step(tiny, linear, seed=4):
    target, head, drafter, layer_ids = tiny
    drafter = DFlashDrafter(drafter.config)
    torch.manual_seed(1)
    drafter.reset_parameters()
    drafter.linear = linear
    torch.manual_seed(seed)
    ids = torch.randint(0, VOCAB - 1, (2, 24))
    lm = torch.ones_like(ids, dtype=torch.bool)
    feats = target_context_features(target, ids, torch.ones_like(ids), layer_ids)
    blk = make_blocks(ids, lm, *sample_anchors(lm, 6, torch.Generator().manual_seed(0)), 8, 7.0, MASK_ID)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _, _ = drafter_loss_sums(drafter, head, feats, blk, "sdpa")
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}


def test_a_drafter_step_with_fp8_matmuls_trains_like_bf16(tiny):
    loss_bf16, grads_bf16 = _step(tiny, F.linear)
    loss_fp8, grads_fp8 = _step(tiny, fp8_linear)
    assert loss_fp8 == pytest.approx(loss_bf16, rel=0.02)
    assert grads_fp8.keys() == grads_bf16.keys()
    for name in ("fc.weight", "layers.0.self_attn.q_proj.weight", "layers.1.mlp.down_proj.weight"):
        cosine = F.cosine_similarity(grads_fp8[name].flatten(), grads_bf16[name].flatten(), dim=0)
        assert cosine > 0.98, (name, float(cosine))
        assert not torch.equal(grads_fp8[name], grads_bf16[name])  # the FP8 path really ran


def test_evaluation_drafts_in_bf16_as_the_export_serves(tiny):
    target, head, drafter, layer_ids = tiny
    ids = torch.randint(0, VOCAB - 1, (1, 12))
    feats = target_context_features(target, ids, torch.ones_like(ids), layer_ids)
    block = head.embed(torch.tensor([[ids[0, -1].item()] + [MASK_ID] * 7]))
    plain = drafter.draft_block(feats, block, start=12)
    drafter.linear = fp8_linear
    try:
        assert torch.equal(drafter.draft_block(feats, block, start=12), plain)
    finally:
        drafter.linear = F.linear


def test_compiled_regions_take_fp8_matmuls_without_a_graph_break(tiny, monkeypatch):
    from torch._dynamo.utils import counters

    import trainer.models.drafter as drafter_module

    eager = _step(tiny, fp8_linear)
    monkeypatch.setattr(drafter_module, "CPU_BACKEND", "aot_eager")
    monkeypatch.setattr(drafter_module, "_compiled", {})
    torch._dynamo.reset()
    counters.clear()
    try:
        compiled = _step(tiny, fp8_linear)
    finally:
        torch._dynamo.reset()
    assert drafter_module._compiled and not counters["graph_break"]
    assert compiled[0] == pytest.approx(eager[0], rel=1e-3)  # the loss's inputs are quantized (FP8Head) too
    # the same numbers up to where a fused region rounds a product differently before it is quantized
    cosines = [float(F.cosine_similarity(compiled[1][n].flatten(), eager[1][n].flatten(), dim=0)) for n in eager[1]]
    assert min(cosines) > 0.995, cosines


FP8_DRAFTER = "model: {drafter: {precision: fp8}, dtype: bf16}\n"


def test_fp8_drafter_on_the_cpu_is_refused_at_config_load_with_the_reason():
    with pytest.raises(ConfigError, match=r"c\.yaml:\d+: model\.drafter\.precision fp8 is refused: cpu: FP8 needs"):
        parse_config(tiny_config(FP8_DRAFTER), source="c.yaml")


def test_fp8_drafter_below_compute_capability_8_9_is_refused(monkeypatch):
    cuda = "devices: {target: [cuda:0], drafter: [cuda:1]}\n"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ConfigError, match=r"model\.drafter\.precision fp8 is refused: cuda:1 \(NVIDIA A100"):
        parse_config(tiny_config(FP8_DRAFTER, cuda))
    with pytest.raises(ConfigError, match=r"model\.drafter\.precision fp8 needs model\.dtype bf16"):
        parse_config(tiny_config(FP8_DRAFTER, cuda, "model: {dtype: fp32}\n"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    assert parse_config(tiny_config(FP8_DRAFTER, cuda)).model.drafter.precision == "fp8"


def test_the_memory_plan_counts_the_fp8_operands(monkeypatch):
    from trainer.models.memory_plan import build_plan

    cuda = "devices: {target: [cuda:0], drafter: [cuda:0], memory_gib: 140}\n"
    monkeypatch.setattr("trainer.run.config._fp8_refusal", lambda d: None)  # no GPU here
    bf16 = build_plan(parse_config(tiny_config(cuda, "model: {dtype: bf16}\n")))
    fp8 = build_plan(parse_config(tiny_config(cuda, FP8_DRAFTER)))
    item, head = "fp8 operands (e4m3, kept for backward)", "LM head (e4m3, both layouts: fp8_training.FP8Head)"
    assert item not in bf16.drafter and fp8.drafter[item] > 0
    # two 1-byte copies of the [vocab, hidden] head, beside the bf16 embedding and head (2 bytes each)
    assert head not in bf16.drafter and fp8.drafter[head] == fp8.drafter["embedding + head"] // 2 > 0
    freed = bf16.drafter["activations"] - fp8.drafter["activations"]
    assert freed > 0  # the bf16 projection inputs the e4m3 copies replace
    assert sum(fp8.drafter.values()) == sum(bf16.drafter.values()) + fp8.drafter[item] + fp8.drafter[head] - freed


def test_fp8_layers_save_neither_the_normed_residual_nor_the_mlp_product_in_bf16():
    """Each uncheckpointed layer frees block_tokens x (hidden + MLP width) bf16 elements."""
    from types import SimpleNamespace

    from trainer.models.memory_plan import drafter_activation_bytes

    cfg = parse_config(tiny_config("model: {dtype: bf16}\n"))
    dcfg = SimpleNamespace(hidden_size=64, num_attention_heads=4, head_dim=16, num_key_value_heads=2,
                           intermediate_size=160, vocab_size=512, kind="dflash")
    layers, block = cfg.model.drafter_layers, 48
    one_layer = block * (64 + 160) * 2
    bf16 = drafter_activation_bytes(cfg, dcfg, 300, block, 0)
    assert bf16 - drafter_activation_bytes(cfg, dcfg, 300, block, 0, fp8=True) == layers * one_layer
