"""Preflight is the real check: `python -m trainer plan` and `data-report` refuse what training
refuses, with the same one line (a split that does not sum, GPUs the host lacks, a bad model
directory, a number that is not finite), instead of "fits: yes" or a traceback."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.trainer.tiny_config import tiny_config
from trainer.__main__ import main
from trainer.entry import train
from trainer.run.config import ConfigError, parse_config

RUN = """
model: {target: {tiny: null, path: %(path)s}, num_target_layers: 2, drafter_layers: 1}
optim: {total_steps: 1, micro_batches: 1}
data: {synthetic: {n_train: 8, n_eval: 2, seed: 0, min_len: 6, max_len: 16}}
devices: %(devices)s
"""


def _config(tmp_path: Path, path: Path | str, devices: str = "{target: [cpu], drafter: [cpu]}",
            *overlays: str) -> Path:
    config = tmp_path / "c.yaml"
    config.write_text(tiny_config(RUN % {"path": path, "devices": devices}, *overlays))
    return config


def _failed(run: Path) -> str:
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "failed" and status["error"]["traceback"] is None, status["error"]
    message = status["error"]["message"]
    assert "\n" not in message
    return message


def _train(config: Path, run: Path) -> str:
    from trainer.run.config import load_config

    assert train(load_config(config), run) == 1
    return _failed(run)


def test_plan_refuses_the_target_split_training_refuses(qwen3_model_dir, tmp_path, capsys):
    # 2 tapped layers of 4 are layers 1 and 2: training runs layers 0..2, and [1, 1] covers two
    config = _config(tmp_path, qwen3_model_dir, "{target: [[cpu, cpu]], target_split: [1, 1], drafter: [cpu]}")
    assert main(["plan", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("plan: devices.target_split: [1, 1] sums to 2 layers; training runs 3") and err.count("\n") == 1
    assert err[len("plan: "):].strip() in _train(config, tmp_path / "run")


def test_plan_and_training_refuse_gpus_the_host_lacks(qwen3_model_dir, tmp_path, capsys):
    config = _config(tmp_path, qwen3_model_dir, "{target: [cuda:0], drafter: [cuda:5]}")
    assert main(["plan", "--config", str(config), "--gpus", "2", "--gpu-gib", "80"]) == 1
    out = capsys.readouterr().out
    assert "MISSING: devices.drafter names cuda:5, but this host has 2 GPUs (cuda:0..cuda:1)" in out
    assert "fits: no" in out
    config = _config(tmp_path, qwen3_model_dir, "{target: [cpu], drafter: [cuda:63]}")  # no host has 64
    message = _train(config, tmp_path / "run")
    assert message.startswith("devices.drafter names cuda:63, but this host has ")


def _copy(model_dir: Path, out: Path, leave_out: tuple[str, ...] = ()) -> Path:
    out.mkdir()
    for f in model_dir.iterdir():
        if f.name not in leave_out:
            (out / f.name).symlink_to(f)
    return out


def _bad_index(model_dir, out):
    _copy(model_dir, out, ("model.safetensors.index.json",))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    return out


def _missing_shard(model_dir, out):
    _copy(model_dir, out, ("model-00001-of-00003.safetensors",))
    return out


def _block_size_zero(model_dir, out):
    _copy(model_dir, out, ("config.json",))
    doc = json.loads((model_dir / "config.json").read_text())
    doc["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [0, 0]}
    (out / "config.json").write_text(json.dumps(doc))
    return out


def _wrong_shape(model_dir, out):
    from safetensors import safe_open
    from safetensors.torch import save_file

    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    name = "model.layers.0.mlp.up_proj.weight"
    shard = index["weight_map"][name]
    _copy(model_dir, out, (shard,))
    with safe_open(str(model_dir / shard), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        metadata = f.metadata()
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, str(out / shard), metadata=metadata)
    return out


def _dims(**values):
    def make(model_dir, out):
        _copy(model_dir, out, ("config.json",))
        doc = json.loads((model_dir / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**doc, **values}))
        return out
    return make


def _not_json(model_dir, out):
    _copy(model_dir, out, ("config.json",))
    (out / "config.json").write_text("{not json")
    return out


@pytest.mark.parametrize("make, expected", [
    (lambda m, out: out, r"model\.target\.path: {out}: no such directory"),
    (lambda m, out: _copy(m, out, ("config.json",)), r"model\.target\.path: {out}: has no config\.json"),
    (_not_json, r"{out}/config\.json: not JSON"),
    (lambda m, out: _copy(m, out, ("model.safetensors.index.json",)),
     r"model\.target\.path: {out}: has no weights \(model\.safetensors\.index\.json or model\.safetensors\)"),
    (_bad_index, r"{out}/model\.safetensors\.index\.json: has no weight_map"),
    (_missing_shard, r"{out}: shard model-00001-of-00003\.safetensors \(of tensor model\..*\) is not in the directory"),
    (_block_size_zero, r"{out}/config\.json: quantization_config\.weight_block_size must be two positive integers"),
    (_wrong_shape, r"{out}: tensor model\.layers\.0\.mlp\.up_proj\.weight has shape \(\d+, \d+\), but its config\.json "
                   r"makes it \(\d+, \d+\)"),
    (_dims(num_attention_heads=0), r"{out}/config\.json: num_attention_heads must be a positive integer, got 0"),
    (_dims(hidden_size=0), r"{out}/config\.json: hidden_size must be a positive integer, got 0"),
], ids=["missing", "no-config", "config-not-json", "no-weights", "index-without-weight-map", "missing-shard",
        "block-size-0", "wrong-shape", "no-heads", "hidden-0"])
def test_a_bad_model_directory_is_one_line_in_training(qwen3_model_dir, tmp_path, make, expected):
    out = make(qwen3_model_dir, tmp_path / "model")
    message = _train(_config(tmp_path, out), tmp_path / "run")
    assert re.search(expected.format(out=re.escape(str(out))), message), message


@pytest.mark.parametrize("make, command", [
    (lambda m, out: out, "plan"), (lambda m, out: out, "data-report"),
    (lambda m, out: _copy(m, out, ("config.json",)), "data-report"),
    (_bad_index, "plan"), (_not_json, "plan"), (_dims(num_attention_heads=0), "plan"),
])
def test_plan_and_data_report_name_a_bad_model_directory_in_one_line(qwen3_model_dir, tmp_path, capsys, make,
                                                                      command):
    """data-report on the shipped configs (/models/... absent) said "Repo id must be in the form ...";
    an index without weight_map was a KeyError traceback in plan."""
    out = make(qwen3_model_dir, tmp_path / "model")
    data = tmp_path / "d.jsonl"  # data-report reports real data
    data.write_text(json.dumps({"prompt": "a?", "response": "b"}) + "\n")
    config = _config(tmp_path, out, "{target: [cpu], drafter: [cpu]}", f"data: {{synthetic: null, train_path: {data}}}")
    assert main([command, "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{command}: ") and err.count("\n") == 1 and str(out) in err
    assert "Repo id" not in err and "Traceback" not in err


@pytest.mark.parametrize("line", ["devices: {memory_gib: .inf}", "optim: {lr: .nan}", "optim: {betas: [0.9, .inf]}",
                                  "model: {target: {tiny: {fit_lr: -.inf}}}"])
def test_a_number_that_is_not_finite_is_refused_at_its_line(line):
    with pytest.raises(ConfigError, match=r"^c\.yaml:\d+: .* must be a finite number, got (-?inf|nan)$"):
        parse_config(tiny_config(line), "c.yaml")


@pytest.mark.parametrize("line, key, message", [
    ("optim: {eps: -1.0e-8}", "optim.eps", "must be positive"),
    ("optim: {betas: [1.5, 0.9]}", "optim.betas", "must be in [0, 1)"),
    ("optim: {weight_decay: -0.1}", "optim.weight_decay", "must be at least 0"),
    ("optim: {min_lr_ratio: 2.0}", "optim.min_lr_ratio", "must be in [0, 1]"),
    ("optim: {grad_clip: -1.0}", "optim.grad_clip", "must be at least 0"),
    ("run: {checkpoint_every: -5}", "run.checkpoint_every", "must be at least 0"),
    ("eval: {every: -1}", "eval.every", "must be at least 0"),
    ("eval: {samples: 0}", "eval.samples", "must be at least 1"),
    ("eval: {max_new_tokens: 0}", "eval.max_new_tokens", "must be at least 1"),
    ("run: {warmup_shapes: 0}", "run.warmup_shapes", "must be at least 1"),
])
def test_a_number_out_of_its_range_is_refused_at_its_line(line, key, message):
    """A negative grad_clip turned clipping off without a word; a negative eps or beta above 1 was
    AdamW's ValueError traceback at the first step; min_lr_ratio 2 made the lr grow."""
    with pytest.raises(ConfigError) as err:
        parse_config(tiny_config(line), "c.yaml")
    assert re.match(rf"^c\.yaml:\d+: {re.escape(key)} {re.escape(message)}", str(err.value)), str(err.value)


@pytest.mark.parametrize("drafter", ["{layer_types: []}", "{layer_types: [], causal: []}"])
def test_a_drafter_of_no_layers_is_refused_after_derivation(drafter):
    """`layer_types: []` (model.drafter_layers not given) derived drafter_layers = 0 after its own
    range was checked: a drafter of no layers was built (issue 55). The derived value is checked
    again, at the key that set it."""
    text = tiny_config(f"model: {{drafter: {drafter}}}").replace("  drafter_layers: 1\n", "")
    with pytest.raises(ConfigError, match=r"^c\.yaml:\d+: model\.drafter\.layer_types gives the drafter 0 layers"):
        parse_config(text, "c.yaml")


@pytest.mark.parametrize("line, key", [
    ("optim: {total_steps: 100000000000000000000000000000}", "optim.total_steps"),
    ("run: {seed: -100000000000000000000000000000}", "run.seed"),
    ("model: {drafter_layers: 99999999999999999999}", "model.drafter_layers"),
])
def test_a_huge_integer_is_refused_at_its_line(line, key):
    """A 30-digit integer passed every `>= 1` (YAML reads any length) and overflowed far from its line."""
    with pytest.raises(ConfigError, match=rf"^c\.yaml:\d+: {key} must be at most 9223372036854775807 in magnitude"):
        parse_config(tiny_config(line), "c.yaml")
