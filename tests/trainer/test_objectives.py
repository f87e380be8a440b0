"""The objectives (trainer.models.objective, docs/objectives.md): D-PACE's closed form, KL to the
target, chunked = dense in value and gradient, and one normalisation for 1 or N micro-batches,
replicas and both pipelines, bucketed and packed."""

import json

import pytest
import torch

from tests.trainer.tiny_config import tiny_config
from trainer.entry import train
from trainer.models.masks import Blocks, make_blocks, sample_anchors
from trainer.models.objective import (
    CE_DECAY,
    Objective,
    base_gamma,
    chunked_objective,
    dpace_weights,
    drafter_loss_sums,
    fused_objective,
    slot_weights,
)
from trainer.models.target import last_hidden_buffer, target_context_features
from trainer.run.config import ConfigError, parse_config

VOCAB, MASK_ID = 97, 96  # as in conftest.py

OBJECTIVES = {
    "ce+decay": CE_DECAY,
    "ce+dpace": Objective(position_weight="dpace", dpace_alpha=0.3),
    "kl": Objective(ce=0.0, kl=1.0),
    "ce+kl, T=2, dpace": Objective(ce=0.5, kl=1.0, temperature=2.0, position_weight="dpace"),
    "tv": Objective(ce=0.0, tv=1.0),
    "ce+tv, T=2, dpace": Objective(ce=0.5, tv=1.0, temperature=2.0, position_weight="dpace"),
}


def test_dpace_weights_equal_the_closed_form_on_a_hand_case():
    # q~ = 0.5 + 0.5 q: [0.9, 0.75, 0.95]; C = [0.9, 0.675, 0.64125]; w_j = sum_{m >= j} C_m
    q = torch.tensor([[0.8, 0.5, 0.9]])
    w = dpace_weights(q, torch.ones_like(q, dtype=torch.bool), 0.5)
    assert torch.allclose(w, torch.tensor([[0.9 + 0.675 + 0.64125, 0.675 + 0.64125, 0.64125]]))
    # a slot without loss is a no-op in the product and weighs nothing
    w = dpace_weights(q, torch.tensor([[True, False, True]]), 0.5)
    assert torch.allclose(w, torch.tensor([[0.9 + 0.9 * 0.95, 0.0, 0.9 * 0.95]]))
    # alpha = 1: every C is 1, so the weight counts the slots left (a flat floor)
    assert torch.equal(dpace_weights(q, torch.ones_like(q, dtype=torch.bool), 1.0), torch.tensor([[3.0, 2.0, 1.0]]))


def test_dpace_weights_are_detached_non_increasing_and_only_where_loss_is():
    gen = torch.Generator().manual_seed(0)
    q = torch.rand(50, 15, generator=gen, requires_grad=True)
    w = dpace_weights(q, torch.ones(50, 15, dtype=torch.bool), 0.4)
    assert not w.requires_grad
    assert (w[:, :-1] >= w[:, 1:]).all() and (w[:, -1] >= 0.4 ** 15).all()
    base = torch.ones(50 * 15)
    base[7::15] = 0.0
    scaled = slot_weights(base, -torch.log(q.detach()).reshape(-1), Objective(position_weight="dpace"), 15)
    assert (scaled[7::15] == 0).all() and (scaled > 0).sum() == 50 * 14


def head_case(seed=3, n_blocks=6, block=5, vocab=40, width=16):
    gen = torch.Generator().manual_seed(seed)
    n = n_blocks * block
    hidden = torch.randn(n, width, generator=gen, requires_grad=True)
    head = torch.randn(vocab, width, generator=gen)
    labels = torch.randint(0, vocab, (n,), generator=gen)
    weights = torch.rand(n, generator=gen) * (torch.arange(n) % 7 != 3)  # some slots carry no loss
    target_rows = torch.randn(11, width, generator=gen)
    slot_rows = torch.randint(0, 11, (n,), generator=gen)
    return hidden, head, labels, weights, target_rows, slot_rows, block


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_chunked_equals_dense_and_fused_equals_checkpointed(name):
    objective = OBJECTIVES[name]
    hidden, head, labels, weights, target_rows, slot_rows, block = head_case()
    results = []
    for path in (chunked_objective, fused_objective):
        for chunk in (4, 7, 10_000):  # 10_000: every slot in one chunk, the dense computation
            hidden.grad = None
            loss_sum, correct_sum = path(hidden, head, labels, weights, chunk, objective, target_rows, slot_rows, block)
            (loss_sum * 0.37).backward()  # a scaled loss, as after normalising by the step's weight
            results.append((path.__name__, chunk, loss_sum.detach(), correct_sum, hidden.grad.clone()))
    _, _, loss0, correct0, grad0 = results[0]
    assert grad0.abs().sum() > 0
    for path, chunk, loss, correct, grad in results[1:]:
        assert torch.allclose(loss, loss0, rtol=1e-5), (path, chunk)
        assert torch.equal(correct, correct0), (path, chunk)
        assert torch.allclose(grad, grad0, atol=1e-6, rtol=1e-4), (path, chunk)


def test_tv_is_the_share_of_sampled_proposals_the_engine_rejects():
    """The TV term at a slot is 1 - Σ min(p, q): a draft x ~ q is accepted with min(1, p(x)/q(x))."""
    from trainer.models.objective import _tv_terms

    torch.manual_seed(0)
    logits, target_logits = torch.randn(5, VOCAB) * 3, torch.randn(5, VOCAB) * 3
    p, q = target_logits.softmax(-1), logits.softmax(-1)
    assert torch.allclose(_tv_terms(logits, target_logits, 1.0), 1 - torch.minimum(p, q).sum(-1), atol=1e-6)
    assert torch.allclose(_tv_terms(target_logits, target_logits, 1.0), torch.zeros(5), atol=1e-7)


def test_kl_is_zero_when_the_drafters_logits_are_the_targets():
    hidden, head, labels, weights, target_rows, slot_rows, block = head_case()
    same = target_rows[slot_rows].clone().requires_grad_(True)  # the drafter's hidden = the target's at each slot
    for temperature in (1.0, 2.5):
        objective = Objective(ce=0.0, kl=1.0, temperature=temperature)
        for path in (chunked_objective, fused_objective):
            same.grad = None
            loss_sum, _ = path(same, head, labels, weights, 8, objective, target_rows, slot_rows, block)
            loss_sum.backward()
            assert abs(float(loss_sum.detach())) < 1e-5 and same.grad.abs().max() < 1e-5, (path.__name__, temperature)
    # and positive anywhere else
    loss_sum, _ = fused_objective(hidden, head, labels, weights, 8, Objective(ce=0.0, kl=1.0), target_rows, slot_rows,
                                  block)
    assert float(loss_sum.detach()) > 0.01


def test_kl_without_the_targets_states_is_refused():
    hidden, head, labels, weights, *_ = head_case()
    with pytest.raises(ValueError, match="kl needs the target"):
        fused_objective(hidden, head, labels, weights, 8, Objective(kl=1.0))


def micro_batch_case(tiny, objective):
    """Two rows with uneven anchor counts (the second has loss on a third of its tokens), the
    target's features and last hidden states, and blocks with the objective's base weights."""
    target, head, drafter, layer_ids = tiny
    torch.manual_seed(4)
    ids = torch.randint(0, VOCAB - 1, (2, 24))
    lm = torch.ones_like(ids, dtype=torch.bool)
    lm[1, 5:] = False
    top = last_hidden_buffer(target, *ids.shape)
    feats = target_context_features(target, ids, torch.ones_like(ids), layer_ids, top=top)
    anchors, valid = sample_anchors(lm, 6, torch.Generator().manual_seed(0))
    assert valid[0].sum() == 6 and valid[1].sum() < 6
    blk = make_blocks(ids, lm, anchors, valid, 8, base_gamma(objective, 7.0), MASK_ID)
    return drafter, head, feats, top, blk


def rows(blk, i):
    return Blocks(*(getattr(blk, f)[i:i + 1] for f in blk.__dataclass_fields__))


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_one_micro_batch_or_two_give_the_same_loss_and_gradient(tiny, name):
    objective = OBJECTIVES[name]
    drafter, head, feats, top, blk = micro_batch_case(tiny, objective)
    drafter.zero_grad(set_to_none=True)
    whole = drafter_loss_sums(drafter, head, feats, blk, "sdpa", chunk=7, objective=objective, target_hidden=top)
    (whole[0] / whole[1]).backward()
    grad_whole = [p.grad.clone() for p in drafter.parameters()]
    drafter.zero_grad(set_to_none=True)
    total_weight = blk.weights[:, :, 1:].sum()  # known before any forward: the step's normaliser
    parts = []
    for i in range(2):
        sums = drafter_loss_sums(drafter, head, feats[i:i + 1], rows(blk, i), "sdpa", chunk=1000, objective=objective,
                                 target_hidden=top[i:i + 1])
        (sums[0] / total_weight).backward()
        parts.append(sums)
    assert parts[0][1] != parts[1][1]  # uneven
    for j in range(3):
        assert torch.allclose(whole[j], parts[0][j] + parts[1][j], atol=1e-5)
    assert torch.allclose(whole[1], total_weight)
    for g, p in zip(grad_whole, drafter.parameters()):
        assert torch.allclose(g, p.grad, atol=1e-6, rtol=1e-4)
    drafter.zero_grad(set_to_none=True)


def test_the_targets_last_hidden_states_give_its_own_logits(tiny, qwen3_model_dir):
    """`top` is what the target's LM head reads: its logits equal the Hugging Face forward's, for a
    target built in code and for a model directory read in two stages (the layers above the tapped
    ones loaded onto the last stage), while the features stay those of the tapped layers."""
    from trainer.models.stages import StagePlan
    from trainer.models.target_loading import complete_for_decoding, load_staged

    target, head, _, layer_ids = tiny
    ids = torch.randint(0, VOCAB - 1, (2, 20), generator=torch.Generator().manual_seed(1))
    top = last_hidden_buffer(target, *ids.shape)
    feats = target_context_features(target, ids, torch.ones_like(ids), layer_ids, top=top)
    out = target(ids, output_hidden_states=True)
    assert torch.allclose(head.logits(top), out.logits, atol=1e-5)
    assert torch.equal(feats, target_context_features(target, ids, torch.ones_like(ids), layer_ids))
    staged = load_staged(qwen3_model_dir, StagePlan.from_sizes([1, 1], ["cpu", "cpu"]), torch.float32)
    assert complete_for_decoding(staged, lambda *_: None)
    ids = torch.randint(0, 200, (1, 12), generator=torch.Generator().manual_seed(2))
    top = last_hidden_buffer(staged, *ids.shape)
    target_context_features(staged, ids, torch.ones_like(ids), [0, 1], top=top)
    assert torch.allclose(top @ staged.module.get_output_embeddings().weight.t(), staged.module(ids).logits, atol=1e-4)


def test_slot_k_reads_the_targets_state_at_the_previous_position(tiny):
    """The target's next-token distribution for the token at anchor+k is its output at anchor+k-1."""
    from trainer.models.objective import slot_rows_of

    _, _, _, top, blk = micro_batch_case(tiny, CE_DECAY)
    b, a, bs = blk.input_ids.shape
    length = top.shape[1]
    got = slot_rows_of(blk, length).view(b, a, bs - 1)
    for i in range(b):
        for j in range(a):
            for k in range(1, bs):
                position = min(int(blk.anchors[i, j]) + k - 1, length - 1)
                assert int(got[i, j, k - 1]) == i * length + position


def test_the_config_names_the_objective():
    from trainer.models.objective import objective_of

    c = parse_config(tiny_config("model: {loss: {ce: 0.25, kl: 1}, kl_temperature: 2, position_weight: dpace}"))
    assert objective_of(c.model) == Objective(ce=0.25, kl=1.0, temperature=2.0, position_weight="dpace")
    # the default is what the recipe ablation supports (#50): cross-entropy with D-PACE position weights
    assert objective_of(parse_config(tiny_config("")).model) == Objective(position_weight="dpace")
    assert objective_of(parse_config(tiny_config("model: {position_weight: decay}")).model) == CE_DECAY
    assert objective_of(parse_config(tiny_config("model: {loss: kl}")).model) == Objective(ce=0.0, kl=1.0,
                                                                                          position_weight="dpace")
    assert objective_of(parse_config(tiny_config("model: {loss: {ce: 1, tv: 0.5}}")).model) == Objective(
        ce=1.0, tv=0.5, position_weight="dpace")
    for overlay, message in [("model: {loss: mse}", r"model.loss must be one of 'ce', 'kl', 'tv' or a mapping, got 'mse'"),
                             ("model: {loss: {ce: 1, kld: 1}}", r"unknown key 'model.loss.kld' \(did you mean 'kl'\?\)"),
                             ("model: {loss: {ce: 0, kl: 0}}", r"model.loss needs non-negative weights"),
                             ("model: {kl_temperature: 0}", r"model.kl_temperature must be positive"),
                             ("model: {position_weight: dpace, dpace_alpha: 1.5}", r"model.dpace_alpha must be in"),
                             ("model: {position_weight: pace}", r"model.position_weight must be one of 'decay', 'dpace'")]:
        with pytest.raises(ConfigError, match=r"^x.yaml:\d+: " + message):
            parse_config(tiny_config(overlay), "x.yaml")


def test_a_knob_of_another_objective_is_an_error_naming_it_and_the_objective_in_use():
    """kl_temperature under loss ce, dpace_alpha under decay and gamma under dpace had no effect and
    said nothing (#55 item 8): each is refused at load with the file's line, the knob and the
    objective in use; set under its own objective it is taken."""
    for overlay, message in [
            ("model: {kl_temperature: 2}", r"model.kl_temperature applies only to a loss with a KL \(or TV\) term, and model.loss is ce"),
            ("model: {loss: {ce: 1, kl: 0}, kl_temperature: 2}", r"model.kl_temperature .* model.loss is \{ce: 1, kl: 0\}"),
            ("model: {position_weight: decay, dpace_alpha: 0.3}",
             r"model.dpace_alpha applies only to position_weight: dpace, and model.position_weight is decay:"),
            ("model: {position_weight: dpace, gamma: 5}", r"model.gamma shapes position_weight: decay, and model.position_weight is dpace \("),
            # dpace is the default (the recipe ablation, #50): a gamma left from a decay-era config is named as such
            ("model: {gamma: 5}", r"model.gamma shapes position_weight: decay, and model.position_weight is dpace \(the default\)")]:
        with pytest.raises(ConfigError, match=r"^x.yaml:\d+: " + message):
            parse_config(tiny_config(overlay), "x.yaml")
    for overlay in ("model: {loss: kl, kl_temperature: 2}", "model: {loss: {ce: 1, kl: 0.5}, kl_temperature: 2}",
                    "model: {position_weight: dpace, dpace_alpha: 0.3}", "model: {dpace_alpha: 0.3}",
                    "model: {position_weight: decay, gamma: 5}"):
        parse_config(tiny_config(overlay), "x.yaml")


# ---------------------------------------------------------------------------- both pipelines

OVERLAY = """
model: {target: {tiny: {layers: 4}}}
data:
  synthetic: {n_train: 200, n_eval: 4}
  num_anchors: 8
  token_budget: 256
optim: {total_steps: 3, micro_batches: 3}
devices: {target: [%(targets)s], drafter: [%(drafters)s]}
eval: {samples: 2}
pipeline: {kind: %(kind)s}
"""
PIPELINE_CASES = {"kl": "model: {loss: kl, kl_temperature: 1.5}",
                  "ce+dpace": "model: {position_weight: dpace}",
                  "ce+kl": "model: {loss: {ce: 0.5, kl: 2}, position_weight: dpace}",
                  "ce+tv": "model: {loss: {ce: 0.5, tv: 1}, position_weight: dpace}"}


def steps(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == "step"]


@pytest.mark.parametrize("name", sorted(PIPELINE_CASES))
@pytest.mark.parametrize("rows", ["bucketed", "packed"])
def test_every_objective_trains_the_same_in_both_pipelines(tmp_path, name, rows):
    """The reference loop (one replica) and the threaded pipeline (two target and two drafter replicas:
    micro-batches 2 + 1, uneven) give the same losses, bucketed and packed."""
    extra = PIPELINE_CASES[name] + ("\ndata: {pack_length: 128, pack_rows: 2}" if rows == "packed" else "")
    ref = parse_config(tiny_config(OVERLAY % dict(kind="reference", targets="cpu", drafters="cpu"), extra))
    thr = parse_config(tiny_config(OVERLAY % dict(kind="threaded", targets="cpu, cpu", drafters="cpu, cpu"), extra))
    assert train(ref, tmp_path / "ref") == 0
    assert train(thr, tmp_path / "thr") == 0
    a, b = steps(tmp_path / "ref"), steps(tmp_path / "thr")
    assert [e["step"] for e in a] == [e["step"] for e in b] == [1, 2, 3]
    for x, y in zip(a, b):
        for key in ("loss", "acc", "grad_norm"):
            assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-6), (key, x["step"])
    assert a[-1]["loss"] != a[0]["loss"]
    assert "objective: " in (tmp_path / "thr" / "train.log").read_text()
    # the final evaluation: per-position acceptance beside tau, in the event and status.json
    lines = (tmp_path / "thr" / "metrics.jsonl").read_text().splitlines()
    (ev,) = [e for e in map(json.loads, lines) if e["event"] == "eval"]
    assert len(ev["acceptance"]) == 3 and ev["tau"] == pytest.approx(1 + sum(ev["acceptance"]))
    assert json.loads((tmp_path / "thr" / "status.json").read_text())["acceptance"] == ev["acceptance"]


def trimmed_copy(model_dir, into):
    """The model directory without its last layer and final norm (what training alone reads)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, into)
    index = json.loads((into / "model.safetensors.index.json").read_text())
    dropped = {k for k in index["weight_map"] if k.startswith(("model.layers.3.", "model.norm."))}
    for shard in set(index["weight_map"].values()):
        tensors = load_file(str(into / shard))
        save_file({k: v for k, v in tensors.items() if k not in dropped}, str(into / shard), {"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k not in dropped}
    (into / "model.safetensors.index.json").write_text(json.dumps(index))
    return into


def test_kl_loads_the_layers_above_the_tapped_ones_of_a_split_target_or_says_they_are_missing(tmp_path,
                                                                                            qwen3_model_dir):
    """A model directory read stage by stage: kl loads the layers above the last tapped one, the norm
    and the head onto the last stage, and both pipelines train with the same losses; a directory
    without them is refused in one line."""
    overlay = """
model: {target: {tiny: null, path: %s}, target_layer_ids: [0, 1], loss: {ce: 1, kl: 1}}
data: {synthetic: {n_train: 32, n_eval: 2}}
optim: {total_steps: 2}
devices: {target: [[cpu, cpu]]}
pipeline: {kind: %s}
"""
    losses = {}
    for kind in ("reference", "threaded"):
        assert train(parse_config(tiny_config(overlay % (qwen3_model_dir, kind))), tmp_path / kind) == 0
        losses[kind] = [e["loss"] for e in steps(tmp_path / kind)]
    assert losses["threaded"] == pytest.approx(losses["reference"], rel=1e-5) and len(losses["reference"]) == 2
    trimmed = trimmed_copy(qwen3_model_dir, tmp_path / "trimmed")
    run = tmp_path / "refused"
    assert train(parse_config(tiny_config(overlay % (trimmed, "reference"))), run) == 1
    error = json.loads((run / "status.json").read_text())["error"]
    assert error["message"].startswith("config error: model.loss: kl (or tv) needs the target's layers above the last")
    assert error["traceback"] is None


def test_the_compiled_pointwise_path_cuda_takes_gives_the_eager_sums_without_graph_breaks(monkeypatch):
    """The slot kernels CUDA compiles (_ce_slots, _mix_slots), compiled here with a backend that needs
    no C compiler: the same sums and gradients as eager, whole graphs, no recompile on a second call."""
    from torch._dynamo.utils import counters

    import trainer.models.drafter as drafter_module

    hidden, head, labels, weights, target_rows, slot_rows, block = head_case()
    eager = {}
    for name, objective in OBJECTIVES.items():
        hidden.grad = None
        loss, correct = fused_objective(hidden, head, labels, weights, 8, objective, target_rows, slot_rows, block)
        loss.backward()
        eager[name] = (loss.detach(), correct, hidden.grad.clone())
    monkeypatch.setattr(drafter_module, "CPU_BACKEND", "aot_eager")
    monkeypatch.setattr(drafter_module, "_compiled", {})
    torch._dynamo.reset()
    counters.clear()
    try:
        for _ in range(2):
            for name, objective in OBJECTIVES.items():
                hidden.grad = None
                loss, correct = fused_objective(hidden, head, labels, weights, 8, objective, target_rows, slot_rows,
                                                block)
                loss.backward()
                assert torch.allclose(loss.detach(), eager[name][0], rtol=1e-5) and torch.equal(correct, eager[name][1])
                assert torch.allclose(hidden.grad, eager[name][2], atol=1e-6, rtol=1e-4), name
            if _ == 0:
                graphs = counters["stats"]["unique_graphs"]
        assert counters["stats"]["unique_graphs"] == graphs and graphs >= 2
        assert not counters["graph_break"]
    finally:
        torch._dynamo.reset()


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_ranks_across_hosts_train_like_one_host(tmp_path):
    """Two torchrun ranks on this machine (`python -m trainer launch`, gloo; each host one micro-batch
    of the step, rows with fewer eligible positions than num_anchors: uneven anchor counts) give the
    losses of one host running both micro-batches, under ce+kl with D-PACE weights."""
    import subprocess
    import sys

    from tests.trainer.tiny_config import two_host_config

    config = tmp_path / "run.yaml"
    config.write_text(two_host_config(3, "model: {loss: {ce: 0.5, kl: 1}, position_weight: dpace}",
                                      "data: {num_anchors: 24}"))
    port = free_port()
    ranks = [subprocess.Popen([sys.executable, "-m", "trainer", "launch", "--nnodes", "2", "--rdzv-endpoint",
                               f"127.0.0.1:{port}", "--rdzv-id", "objectives", *(["--store-host"] if r == 0 else []),
                               "--local-addr", "127.0.0.1", "--config", str(config), "--run-dir", str(tmp_path / f"rank{r}")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for r in range(2)]
    assert train(parse_config(config.read_text()), tmp_path / "one") == 0
    assert [rank.wait(timeout=300) for rank in ranks] == [0, 0]
    one = [e["loss"] for e in steps(tmp_path / "one")]
    assert len(one) == 3
    for r in range(2):
        assert [e["loss"] for e in steps(tmp_path / f"rank{r}")] == pytest.approx(one, rel=1e-6)
