"""The drafter's matmuls use bf16 copies of the fp32 master weights made once per optimizer step
(trainer.models.drafter.LowPrecisionWeights), with exactly autocast's numbers. CPU bf16 autocast
runs the same code as CUDA's (the layer regions compile only on CUDA)."""
import copy

import pytest
import torch

from trainer.models.drafter import as_is
from trainer.models.masks import prepare_blocks
from trainer.models.objective import drafter_loss_sums
from trainer.run.config import OptimConfig
from trainer.train.optim import build_optimizer


def train_steps(target, head, drafter, once=True, steps=3, fused=True, autocast=True):
    drafter = copy.deepcopy(drafter).float().train()
    drafter.fused = fused
    if not once:  # every use casts under autocast, as before
        drafter.low_precision.weight = lambda dtype: as_is
    opt = build_optimizer(drafter.parameters(), OptimConfig(lr=1e-2), fused=True)  # fused: no version bumps
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 90, (2, 48), generator=gen)
    blocks = prepare_blocks(ids, torch.ones_like(ids, dtype=torch.bool), 4, 8, 4.0, drafter.config.mask_token_id,
                            gen)
    with torch.no_grad():
        feats = torch.randn(2, 48, len(drafter.config.target_layer_ids) * target.config.hidden_size, generator=gen)
    losses, grads = [], []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss, _, _ = drafter_loss_sums(drafter, head, feats, blocks, "sdpa", 64)
        loss.backward()
        losses.append(loss.detach())
        grads.append(drafter.layers[0].mlp.up_proj.weight.grad.clone())
        opt.step()
        opt.zero_grad()
    return losses, grads, drafter


def test_copies_made_once_per_step_give_autocasts_losses_and_grads_exactly(tiny):
    target, head, drafter, _ = tiny
    per_use, per_use_grads, _ = train_steps(target, head, drafter, once=False)
    once, once_grads, trained = train_steps(target, head, drafter, once=True)
    assert per_use[0] != per_use[-1]  # it trains: the copies follow the (fused) optimizer's updates
    for a, b in zip(per_use + per_use_grads, once + once_grads):
        assert a.dtype == b.dtype and torch.equal(a, b)
    cached = trained.low_precision._copies
    assert len(cached) == 1 + 7 * len(trained.layers)  # fc and every projection, nothing else
    assert all(c.dtype == torch.bfloat16 for _, c, _ in cached.values())
    assert all(w.grad is None or w.grad.dtype == torch.float32 for w in trained.parameters())


def test_a_loaded_checkpoint_replaces_the_copies(tiny):
    target, head, drafter, _ = tiny
    _, _, trained = train_steps(target, head, drafter, once=True, steps=1)
    fc = trained.fc.weight
    trained.load_state_dict(drafter.state_dict())  # copy_ into the weights: their versions change
    use = trained.low_precision.weight(torch.bfloat16)
    assert torch.equal(use(fc), drafter.fc.weight.to(torch.bfloat16))
    assert copy.deepcopy(trained).low_precision._copies == {}  # a replica makes its own


def test_the_fused_layer_regions_compute_the_previous_per_op_path(tiny):
    """fused: keys/values projected apart (then concatenated), norms and RoPE in the layer's two
    regions; the previous path concatenates first. Same function, fp32 rounding apart."""
    target, head, drafter, _ = tiny
    fused, fused_grads, _ = train_steps(target, head, drafter, fused=True, autocast=False)
    per_op, per_op_grads, _ = train_steps(target, head, drafter, fused=False, autocast=False)
    for a, b in zip(fused + fused_grads, per_op + per_op_grads):
        assert a.dtype == b.dtype == torch.float32
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    assert fused[0] != pytest.approx(fused[-1].item())


def test_the_layer_regions_compile_whole_and_never_again_after_warm_up(tiny, monkeypatch):
    """The code path CUDA compiles, compiled here with a backend that needs no C compiler: every
    region traces as whole graphs (no graph break), forward and backward are warmed by one step,
    and the steps after the freeze (with optimizer updates in between) compile nothing."""
    from torch._dynamo.utils import counters

    import trainer.models.drafter as drafter_module
    from trainer.pipeline.compile_safety import CompileGuard

    monkeypatch.setattr(drafter_module, "CPU_BACKEND", "aot_eager")
    monkeypatch.setattr(drafter_module, "_compiled", {})
    torch._dynamo.reset()
    counters.clear()
    target, head, drafter, _ = tiny
    guard = CompileGuard()
    try:
        guard.warm_up("cpu", [(2, 48)], lambda shape: train_steps(target, head, drafter, steps=1))
        warm_graphs = counters["stats"]["unique_graphs"]
        guard.freeze()
        losses, _, _ = train_steps(target, head, drafter, steps=3)
        assert guard.recompiles() == 0 and counters["stats"]["unique_graphs"] == warm_graphs
    finally:
        guard.unfreeze()
        torch._dynamo.reset()
    assert not counters["graph_break"]
    assert warm_graphs >= 3  # the two layer regions (the first layer's input needs no grad: its own graph) and more
    assert losses[0] != pytest.approx(losses[-1].item())
