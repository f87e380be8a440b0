"""model.drafter_init: a published-format draft starts training (checked against the target);
run.keep_best: the checkpoint with the best τ is kept beside the latest ones."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.trainer.tiny_config import tiny_config
from trainer.entry import train
from trainer.models.export import export_checkpoint
from trainer.run.config import ConfigError, parse_config
from trainer.train.components import build_components


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A drafter trained 2 steps on the tiny config, exported in fp32 (the published layout)."""
    tmp = tmp_path_factory.mktemp("init")
    assert train(parse_config(tiny_config("optim: {total_steps: 2}")), tmp / "run") == 0
    return export_checkpoint(tmp / "run" / "checkpoints" / "step_2", tmp / "export", dtype=torch.float32)


def init_config(path) -> str:
    return tiny_config(f"model: {{drafter_init: {path}}}", "optim: {total_steps: 1}")


def test_the_drafter_starts_from_the_published_weights(exported, tmp_path):
    c = build_components(parse_config(init_config(exported)), tmp_path / "b", lambda *_: None)
    weights = load_file(str(exported / "model.safetensors"))
    state = c.drafter.state_dict()
    assert set(state) == set(weights) and all(torch.equal(state[k], weights[k]) for k in weights)


def test_a_specforge_style_draft_with_a_model_prefix_and_extra_tensors_loads(exported, tmp_path):
    other = tmp_path / "specforge"
    other.mkdir()
    (other / "config.json").write_text((exported / "config.json").read_text())
    weights = {f"model.{k}": v for k, v in load_file(str(exported / "model.safetensors")).items()}
    weights["embed_tokens.weight"] = torch.zeros(3, 3)  # the target's, not the drafter's
    save_file(weights, str(other / "model.safetensors"))
    c = build_components(parse_config(init_config(other)), tmp_path / "b", lambda *_: None)
    assert torch.equal(c.drafter.fc.weight, weights["model.fc.weight"])


def test_a_draft_for_another_target_is_one_error_naming_every_mismatch(exported, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((exported / "config.json").read_text())
    config["hidden_size"] = 48
    config["dflash_config"]["target_layer_ids"] = [0, 9]
    (bad / "config.json").write_text(json.dumps(config))
    (bad / "model.safetensors").write_bytes((exported / "model.safetensors").read_bytes())
    with pytest.raises(ConfigError) as e:
        build_components(parse_config(init_config(bad)), tmp_path / "b", lambda *_: None)
    message = str(e.value)
    assert "hidden size (the target's) 48 (this run: 32)" in message and "target layer ids (model.target_layer_ids) [0, 9]" in message
    # through the trainer: the run fails in one line, no traceback
    assert train(parse_config(init_config(bad)), tmp_path / "run") == 1
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["error"]["message"].startswith("config error: model.drafter_init: ")
    assert "Traceback" not in (tmp_path / "run" / "train.log").read_text()
    with pytest.raises(ConfigError, match="not a draft model directory"):
        build_components(parse_config(init_config(tmp_path / "nothing")), tmp_path / "c", lambda *_: None)


def test_keep_best_keeps_the_best_tau_checkpoint_beside_the_latest(tmp_path):
    cfg = parse_config(tiny_config("optim: {total_steps: 4, lr: 0.05}", "eval: {every: 1, samples: 2, max_new_tokens: 6}",
                                   "run: {checkpoint_every: 1, keep_checkpoints: 1, keep_best: true}"))
    assert train(cfg, tmp_path / "run") == 0
    events = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    taus = {e["step"]: e["tau"] for e in events if e["event"] == "eval"}
    best_step = min(s for s, t in taus.items() if t == max(taus.values()))
    best = json.loads((tmp_path / "run" / "checkpoints" / "best.json").read_text())
    assert best == {"step": best_step, "tau": taus[best_step]}
    kept = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*"))
    assert kept == sorted({f"step_{best_step}", "step_4"})
    with pytest.raises(ConfigError, match="multiple of run.checkpoint_every"):
        parse_config(tiny_config("eval: {every: 3}", "run: {checkpoint_every: 2, keep_best: true}"))


def _foreign(tmp_path, exported, case):
    """A directory that is not a drafter of this run's shape, as case makes it."""
    d = tmp_path / case
    d.mkdir()
    config = json.loads((exported / "config.json").read_text())
    weights = load_file(str(exported / "model.safetensors"))
    if case == "list-config":
        (d / "config.json").write_text("[1, 2]")
        return d, "a JSON list, not an object"
    if case == "no-hidden-size":
        del config["hidden_size"]
    if case == "wrong-shape":
        weights["fc.weight"] = torch.zeros(5, 7)
    if case == "integer-tensor":
        weights["norm.weight"] = torch.ones_like(weights["norm.weight"], dtype=torch.int64)
    if case == "missing-tensor":
        del weights["fc.weight"]
    if case == "extra-layer":
        weights["layers.7.input_layernorm.weight"] = weights["norm.weight"].clone()
    (d / "config.json").write_text(json.dumps(config))
    if case == "corrupt-weights":
        (d / "model.safetensors").write_bytes(b"not a safetensors file")
    elif case != "no-weights":
        save_file(weights, str(d / "model.safetensors"))
    return d, {"no-hidden-size": "no hidden_size", "wrong-shape": "tensor fc.weight has shape [5, 7]; this drafter's is [32, 64]",
               "integer-tensor": "tensor norm.weight is int64, not floating point",
               "missing-tensor": "no tensor fc.weight", "extra-layer": "tensor layers.7.input_layernorm.weight is not one",
               "corrupt-weights": "not a readable safetensors file", "no-weights": "no model.safetensors"}[case]


@pytest.mark.parametrize("case", ["list-config", "no-hidden-size", "wrong-shape", "integer-tensor", "missing-tensor",
                                  "extra-layer", "corrupt-weights", "no-weights"])
def test_a_warm_start_from_a_foreign_directory_is_one_line_naming_it_and_what_does_not_fit(exported, tmp_path, case):
    """A directory that is not a drafter of this shape (another config, tensors of another shape,
    an integer tensor, no weights) ended in a torch traceback, or trained on an integer tensor cast
    to float: it is refused at config load or at the start, in one line naming the directory and
    the field or tensor (#55 item 8)."""
    d, says = _foreign(tmp_path, exported, case)
    try:
        cfg = parse_config(init_config(d))
    except ConfigError as e:  # what config.json alone shows is refused at load, with the config's line
        assert says in str(e) and str(d) in str(e) and "\n" not in str(e)
        return
    assert train(cfg, tmp_path / "run") == 1
    error = json.loads((tmp_path / "run" / "status.json").read_text())["error"]
    assert error["message"].startswith(f"config error: model.drafter_init: {d}") and says in error["message"]
    assert "\n" not in error["message"] and error["traceback"] is None
    assert "Traceback" not in (tmp_path / "run" / "train.log").read_text()


def test_a_resume_after_the_drafters_shape_changed_names_the_checkpoint_and_tensor(tmp_path):
    assert train(parse_config(tiny_config("optim: {total_steps: 1}")), tmp_path / "run") == 0
    grown = parse_config(tiny_config("optim: {total_steps: 2}", "model: {drafter_layers: 2}"))
    assert train(grown, tmp_path / "run", resume="latest") == 1
    error = json.loads((tmp_path / "run" / "status.json").read_text())["error"]
    assert error["message"].startswith("config error: resume from ") and "step_1: no tensor layers.1." in error["message"]
    assert error["traceback"] is None
