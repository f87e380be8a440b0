"""The target in layer stages: features from only the tapped layers, split or not, equal the full model's."""

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

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
def test_tapping_the_last_layer_reads_it_after_the_final_norm_as_transformers_does(family):
    model = _model(family)
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        full = model(ids, output_hidden_states=True).hidden_states
    feats = target_context_features(model, ids, None, [2, 5])
    assert torch.equal(feats, torch.cat([full[3], full[6]], dim=-1))  # full[6]: normed, as the drafts had it


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


# ---------------------------------------------------------------------------- split targets

from tests.trainer.tiny_config import tiny_config  # noqa: E402
from trainer.entry import train  # noqa: E402
from trainer.models.stages import StagePlan  # noqa: E402
from trainer.models.target_loading import complete_for_decoding, load_staged, partition, place  # noqa: E402
from trainer.run.config import ConfigError, parse_config  # noqa: E402


@pytest.mark.parametrize("family", FAMILIES)
def test_a_target_placed_in_three_stages_gives_the_same_features_and_logits(family):
    whole, split = _model(family), place(_model(family), StagePlan.from_sizes([1, 2, 1], ["cpu"] * 3))
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(4))
    layer_ids = [0, 1, 3]
    assert torch.equal(target_context_features(split, ids, None, layer_ids),
                       target_context_features(whole, ids, None, layer_ids))
    with torch.no_grad():
        assert torch.equal(split.module(ids).logits, whole(ids).logits)


def test_a_model_directory_is_read_stage_by_stage_up_to_the_last_tapped_layer(qwen3_model_dir):
    from transformers import AutoModelForCausalLM

    full = AutoModelForCausalLM.from_pretrained(qwen3_model_dir, dtype=torch.float32).eval()
    plan = StagePlan.from_sizes([1, 1, 1], ["cpu"] * 3)  # layers 0..2 of 4
    staged = load_staged(qwen3_model_dir, plan, torch.float32, log=lambda _: None)
    layers = base_model(staged.module).layers
    assert [layers[i].self_attn.q_proj.weight.is_meta for i in range(4)] == [False, False, False, True]
    assert staged.module.lm_head.weight.is_meta and base_model(staged.module).norm.weight.is_meta
    ids = torch.randint(0, 300, (2, 10), generator=torch.Generator().manual_seed(5))
    assert torch.equal(target_context_features(staged, ids, None, [0, 2]),
                       target_context_features(full, ids, None, [0, 2]))
    assert complete_for_decoding(staged, log=lambda _: None)  # τ needs the rest: loaded on demand
    with torch.no_grad():
        assert torch.equal(staged.module(ids).logits, full(ids).logits)


def test_partition_balances_bytes_with_the_embedding_on_the_first_stage():
    assert partition([10] * 6, 3) == [2, 2, 2]
    assert partition([10] * 6, 3, first_extra=20) == [1, 2, 3] or partition([10] * 6, 3, first_extra=20)[0] == 1
    assert sum(partition([5, 9, 1, 7, 3], 2)) == 5
    with pytest.raises(ValueError):
        partition([1, 2], 3)


SPLIT = """
model: {target: {tiny: {layers: 4}}, target_layer_ids: [1, 2]}
data: {synthetic: {n_train: 64, n_eval: 2}}
optim: {total_steps: 3, micro_batches: 2}
devices: {target: %(targets)s, drafter: [cpu]}
eval: {samples: 2, max_new_tokens: 6}
pipeline: {kind: %(kind)s}
"""


def _events(run_dir, kind):
    import json

    return [e for e in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if e["event"] == kind]


@pytest.mark.parametrize("kind", ["reference", "threaded"])
def test_a_split_target_trains_with_the_same_losses_and_tau_as_unsplit(tmp_path, kind):
    runs = {}
    for name, targets in (("whole", "[cpu]"), ("split", "[[cpu, cpu, cpu]]")):
        assert train(parse_config(tiny_config(SPLIT % dict(targets=targets, kind=kind))), tmp_path / name) == 0
        runs[name] = _events(tmp_path / name, "step"), _events(tmp_path / name, "eval")
    (whole_steps, whole_eval), (split_steps, split_eval) = runs["whole"], runs["split"]
    assert [e["loss"] for e in split_steps] == [e["loss"] for e in whole_steps]
    assert len(split_steps) == 3
    if kind == "threaded":  # three stage workers with bounded queues between them
        assert {"target0.0->target0.1", "target0.1->target0.2"} <= set(split_steps[0]["queues"])
    assert split_eval[-1]["tau"] == whole_eval[-1]["tau"] and split_eval[-1]["tau"] >= 1


def test_a_model_directory_without_the_layers_above_the_tapped_ones_still_trains(tmp_path, qwen3_model_dir):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    trimmed = tmp_path / "trimmed"
    shutil.copytree(qwen3_model_dir, trimmed)
    index = json.loads((trimmed / "model.safetensors.index.json").read_text())
    dropped = {k for k in index["weight_map"] if k.startswith(("model.layers.3.", "model.norm."))}
    for shard in set(index["weight_map"].values()):
        tensors = load_file(str(trimmed / shard))
        save_file({k: v for k, v in tensors.items() if k not in dropped}, str(trimmed / shard), {"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k not in dropped}
    (trimmed / "model.safetensors.index.json").write_text(json.dumps(index))
    overlay = f"""
model: {{target: {{tiny: null, path: {trimmed}}}, target_layer_ids: [0, 2]}}
data: {{synthetic: {{n_train: 32, n_eval: 2}}}}
optim: {{total_steps: 2}}
devices: {{target: [[cpu, cpu]]}}
"""
    run = tmp_path / "run"
    assert train(parse_config(tiny_config(overlay)), run) == 0
    assert len(_events(run, "step")) == 2
    assert "τ not measured" in (run / "train.log").read_text()


@pytest.mark.parametrize("devices, message", [
    ("{target: [[cuda:0, cuda:1], [cuda:1, cuda:2]]}", "puts cuda:1 in two replicas"),
    ("{target: [[]]}", "has an empty list"),
    ("{target: [[cpu, cpu]], target_split: [1, 1, 1]}", "lists 3 stages, but the replica"),
    ("{target: [[cpu, cpu, cpu, cpu, cpu]]}", "more than the target's 4 layers"),
    ("{target: [cuda:0], target_split: [2, 2]}", "needs a split replica"),
    ("{target: [cuda:0, [cuda:1, cuda:2]]}", "mixes replicas of \\[1, 2\\] stages"),
])
def test_bad_splits_get_one_line_naming_the_problem(devices, message):
    with pytest.raises(ConfigError, match=message) as err:
        parse_config(tiny_config(f"model: {{target: {{tiny: {{layers: 4}}}}}}\ndevices: {devices}\n"))
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------- the memory plan

FAT = """
model: {target: {tiny: {layers: 12, hidden: 64, heads: 4, kv_heads: 2, head_dim: 16, intermediate: 1024}},
        target_layer_ids: [1, 10], num_target_layers: 2}
optim: {total_steps: 2, micro_batches: 1}
devices: {target: %(targets)s, drafter: [cpu], memory_gib: %(budget)s}
eval: {samples: 1, max_new_tokens: 4}
"""


def _fat(targets, budget="null"):
    return parse_config(tiny_config(FAT % dict(targets=targets, budget=budget)))


def test_the_plan_counts_stages_drafter_and_devices_from_the_config_alone():
    from trainer.models.memory_plan import build_plan, format_plan

    whole, split = build_plan(_fat("[cpu]")), build_plan(_fat("[[cpu, cpu, cpu]]"))
    assert [st["layers"] for st in split.stages] == [[0, 2], [3, 6], [7, 10]]  # layers 11 only for decoding
    assert sum(st["target weights"] for st in split.stages) == whole.stages[0]["target weights"]
    assert max(d.total for d in split.devices if "target" in d.device) < whole.devices[0].total
    assert split.drafter["optimizer (fp32)"] == 2 * split.drafter["weights (fp32)"]
    text = format_plan(split)
    assert "stage 2 on cpu: layers 7..10" in text and "fits: yes" in text


def test_a_target_that_does_not_fit_one_device_is_refused_unsplit_and_trains_split(tmp_path):
    from trainer.models.memory_plan import build_plan

    budget = 8 / 1024  # GiB: between the widest of three stages and the whole target
    plan = build_plan(_fat("[cpu]", budget))
    assert not plan.fits and plan.smallest_split in (2, 3)
    assert "cpu:target0.0 needs" in plan.refusal() and "more than its 8.00 MiB budget" in plan.refusal()
    assert train(_fat("[cpu]", budget), tmp_path / "whole") == 1
    import json

    status = json.loads((tmp_path / "whole" / "status.json").read_text())
    assert status["error"]["message"].startswith("the memory plan does not fit: cpu:target0.0 needs")
    assert status["error"]["traceback"] is None
    assert build_plan(_fat("[[cpu, cpu, cpu]]", budget)).fits
    assert train(_fat("[[cpu, cpu, cpu]]", budget), tmp_path / "split") == 0
    assert len(_events(tmp_path / "split", "step")) == 2


def test_python_m_trainer_plan_prints_the_plan_and_exits_1_when_it_does_not_fit(tmp_path, capsys):
    from trainer.__main__ import main

    config = tmp_path / "c.yaml"
    config.write_text(tiny_config(FAT % dict(targets="[cpu]", budget=8 / 1024)))
    assert main(["plan", "--config", str(config)]) == 1
    out = capsys.readouterr().out
    assert "SHORT by" in out and "smallest split of one replica that fits:" in out


def test_the_plan_tells_a_70b_user_with_h200s_the_smallest_split(tmp_path):
    """Llama-3.3-70B's config.json alone (no weights): 131 GiB of bf16 weights on a 139 GiB H200."""
    from transformers import LlamaConfig

    from trainer.models.memory_plan import build_plan

    LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False).save_pretrained(tmp_path)
    config = """
model: {target: {tiny: null, path: %s}, mask_token_id: 128255, drafter_layers: 1, dtype: bf16}
data: {synthetic: null, train_path: x.jsonl, max_length: 4096, token_budget: 4096, bucket_edges: [4096]}
devices: {target: %s, drafter: [%s], memory_gib: %d}
"""

    def plan(targets, drafter, gib=139):
        # a host of 8 such GPUs (this one's may have fewer: the plan judges the devices against the host's)
        return build_plan(parse_config(tiny_config(config % (tmp_path, targets, drafter, gib))),
                          gpu_bytes={i: gib * 2**30 for i in range(8)})

    beside = plan("[cuda:0]", "cuda:0")  # the drafter beside the whole target: no room
    assert not beside.fits and beside.refusal().startswith("cuda:0 needs")
    split = plan("[[cuda:0, cuda:1, cuda:2, cuda:3]]", "cuda:4")
    assert split.fits and len(split.stages) == 4 and split.stages[-1]["layers"][1] == 77  # the taps end at 77
    small = plan("[cuda:0]", "cuda:4", 80)  # 80 GiB GPUs: two stages at least
    assert not small.fits and small.smallest_split == 2 and "a split in 2 stages fits" in small.refusal()


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory, qwen3_model_dir):
    """A tiny Qwen3-MoE directory as transformers saves it (per-expert tensors, the hub's format),
    with the Qwen3 fixture's tokenizer."""
    import json
    import shutil

    vocab = json.loads((qwen3_model_dir / "config.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    config = Qwen3MoeConfig(**{**DIMS, "vocab_size": vocab, "num_hidden_layers": 4}, num_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=16)
    out = tmp_path_factory.mktemp("hub") / "Qwen3-MoE-tiny"
    Qwen3MoeForCausalLM(config).save_pretrained(out, max_shard_size="50KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "generation_config.json"):
        shutil.copy(qwen3_model_dir / name, out / name)
    return out


def test_a_moe_directory_in_the_hubs_per_expert_format_loads_in_stages(moe_model_dir):
    import json

    from transformers import AutoModelForCausalLM

    index = json.loads((moe_model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in index  # stacked into experts.gate_up_proj on load
    full = AutoModelForCausalLM.from_pretrained(moe_model_dir, dtype=torch.float32).eval()
    plan = StagePlan.from_sizes([1, 2], ["cpu", "cpu"])
    staged = load_staged(moe_model_dir, plan, torch.float32, log=lambda _: None)
    ids = torch.randint(0, 300, (2, 10), generator=torch.Generator().manual_seed(6))
    assert torch.equal(target_context_features(staged, ids, None, [0, 2]),
                       target_context_features(full, ids, None, [0, 2]))
    assert complete_for_decoding(staged, log=lambda _: None)
    with torch.no_grad():
        assert torch.equal(staged.module(ids).logits, full(ids).logits)


@pytest.mark.parametrize("kind", ["reference", "threaded"])
@pytest.mark.parametrize("directory", ["qwen3_model_dir", "moe_model_dir"])
def test_a_split_target_from_a_directory_trains_like_the_unsplit_one(tmp_path, request, directory, kind):
    """Dense and MoE, read stage by stage from their shards: the same losses step for step and the same τ."""
    model_dir = request.getfixturevalue(directory)
    overlay = f"""
model: {{target: {{tiny: null, path: {model_dir}}}, target_layer_ids: [0, 2]}}
data: {{synthetic: {{n_train: 32, n_eval: 2}}}}
optim: {{total_steps: 2}}
devices: {{target: %s}}
eval: {{samples: 2, max_new_tokens: 6}}
pipeline: {{kind: {kind}}}
"""
    runs = {}
    for name, targets in (("whole", "[cpu]"), ("split", "[[cpu, cpu, cpu]]")):
        assert train(parse_config(tiny_config(overlay % targets)), tmp_path / name) == 0
        runs[name] = _events(tmp_path / name, "step"), _events(tmp_path / name, "eval")
    assert [e["loss"] for e in runs["split"][0]] == [e["loss"] for e in runs["whole"][0]]
    assert runs["split"][1][-1]["tau"] == runs["whole"][1][-1]["tau"] >= 1


def test_the_loader_refuses_a_stage_above_the_budget_before_reading_it(qwen3_model_dir):
    from trainer.models.target_loading import SplitError

    plan = StagePlan.from_sizes([3], ["cpu"])
    with pytest.raises(SplitError, match=r"stage 0 on cpu \(layers 0..2\) holds .* more than the .* budget"):
        load_staged(qwen3_model_dir, plan, torch.float32, log=lambda _: None, budget=300_000)
    split = load_staged(qwen3_model_dir, StagePlan.from_sizes([1, 1, 1], ["cpu"] * 3), torch.float32,
                        log=lambda _: None, budget=300_000)
    assert not base_model(split.module).layers[2].self_attn.q_proj.weight.is_meta


def test_taps_for_a_stage_on_another_device_travel_whole_and_are_written_by_the_last_stage():
    """A stage whose feature slot lives on another device sends each tapped output there contiguous
    (`pending`); the slot's own stage writes them in (a strided write across devices could stage
    through a temporary on the destination's default stream, outside the hand-off events)."""
    from trainer.models.stages import run_layers, stage_inputs, tap_columns, write_pending
    from trainer.models.target import packed_mask_mapping

    model = _model("qwen3")
    base = base_model(model)
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(8))
    layer_ids = [0, 2, 2]
    direct = target_context_features(model, ids, None, layer_ids)
    with torch.no_grad():
        hidden = base.embed_tokens(ids)
        inputs = stage_inputs(base, hidden, packed_mask_mapping(base, None), None)
        pending: list = []
        elsewhere = torch.empty(2, 7, 96, device="meta")  # the slot on "another device"
        run_layers(base, hidden, 0, 3, inputs, tap_columns(layer_ids), elsewhere, pending)
    assert [(k, t.device.type, t.is_contiguous()) for k, t in pending] == [(0, "meta", True), (1, "meta", True),
                                                                           (2, "meta", True)]
    out = torch.zeros_like(direct)  # what arrives on the slot's device, written there in its columns
    with torch.no_grad():
        full = model(ids, output_hidden_states=True).hidden_states
    write_pending(out, [(k, full[layer_ids[k] + 1]) for k, _ in pending])
    assert torch.equal(out, direct)


def test_plan_for_8_h200s_tells_a_70b_user_what_to_write(tmp_path, capsys):
    from transformers import LlamaConfig

    from trainer.__main__ import main

    LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False).save_pretrained(tmp_path)
    config = tmp_path / "c.yaml"
    config.write_text(tiny_config(f"""
model: {{target: {{tiny: null, path: {tmp_path}}}, mask_token_id: 128255, drafter_layers: 2, dtype: bf16}}
data: {{synthetic: null, train_path: x.jsonl, max_length: 8192, token_budget: 8192, pack_length: 8192,
        bucket_edges: [8192]}}
devices: {{target: [cuda:0], drafter: [cuda:1]}}
"""))
    assert main(["plan", "--config", str(config), "--gpus", "8", "--gpu-gib", "139"]) == 1  # does not fit unsplit
    out = capsys.readouterr().out
    assert "cuda:0" in out and "SHORT by" in out and "smallest split of one replica that fits: 2 stage(s)" in out
    assert ("on this host's 8 GPUs: devices: {target: [[cuda:0, cuda:1], [cuda:2, cuda:3]], "
            "drafter: [cuda:4, cuda:5, cuda:6, cuda:7]}") in out
