"""The declared transformers range (#41 item 5): the floors agree wherever they are written, a family
newer than the floor is refused at config load in one line naming both versions, and the rotary
embedding gets positions in the shape the model's own forward gives it (Qwen3.5's multimodal rotary).

The families' training cells under each floor: the deps_floor tier (.ci/deps-venv, tests/trainer/test_families.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.trainer.tiny_config import tiny_config
from trainer.run import family as family_mod
from trainer.run.config import ConfigError, parse_config
from trainer.run.family import (
    SUPPORTED,
    TRANSFORMERS_FLOOR,
    TRANSFORMERS_MIN,
    transformers_minimum,
    transformers_refusal,
    version_tuple,
)

REPO = Path(__file__).resolve().parents[2]


def _deps_floors():
    """.ci/deps_floors.py, what the deps_floor tier's venvs are built from."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("deps_floors", REPO / ".ci" / "deps_floors.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _floor(requirements: list[str], name: str) -> str | None:
    for line in requirements:
        m = re.match(rf"^\s*{re.escape(name)}\s*>=\s*([0-9][0-9.]*)", line.split("#")[0])
        if m:
            return m.group(1)
    return None


def test_the_declared_floors_agree():
    """pyproject's trainer extra, the container's trainer/requirements.txt and the config-load check
    name one transformers floor; every family minimum is above it and names a supported model_type;
    the tier builds a venv for each (.ci/deps_floors.py)."""
    extra = _deps_floors().declared_floors((REPO / "pyproject.toml").read_text())
    shipped = (REPO / "trainer" / "requirements.txt").read_text().splitlines()
    assert extra["transformers"] == TRANSFORMERS_FLOOR
    assert _floor(shipped, "transformers") == TRANSFORMERS_FLOOR
    assert extra["torch"] == _floor(shipped, "torch")
    assert extra["safetensors"] == _floor(shipped, "safetensors")
    for model_type, need in TRANSFORMERS_MIN.items():
        assert model_type in SUPPORTED
        assert version_tuple(need) > version_tuple(TRANSFORMERS_FLOOR), model_type
    floors = _deps_floors().floor_pins((REPO / "pyproject.toml").read_text())
    assert floors[0] == (f"transformers-{TRANSFORMERS_FLOOR}", [f"transformers=={TRANSFORMERS_FLOOR}",
                                                                f"safetensors=={extra['safetensors']}",
                                                                f"tokenizers=={extra['tokenizers']}"])
    assert [name for name, _ in floors[1:]] == [f"transformers-{v}" for v in sorted(
        set(TRANSFORMERS_MIN.values()), key=version_tuple)]


@pytest.mark.parametrize(("version", "numbers"), [("5.13.0", (5, 13, 0)), ("5.13.0.dev0", (5, 13, 0)),
                                                  ("2.13.0+cpu", (2, 13, 0)), ("5.5", (5, 5)), ("6.0.0rc1", (6, 0, 0))])
def test_version_tuple(version, numbers):
    assert version_tuple(version) == numbers


def test_refusals_name_the_family_and_both_versions():
    assert transformers_refusal("qwen3_5_text", "5.12.1") == \
        "Qwen3.5 targets need transformers >= 5.14 (installed: 5.12.1)"
    assert transformers_refusal("qwen3_next", "5.5.0") == \
        "Qwen3-Next targets need transformers >= 5.14 (installed: 5.5.0)"
    assert transformers_refusal("qwen3_5_text", "5.14.0") is None
    assert transformers_refusal("qwen3", "5.4.0") == "the trainer needs transformers >= 5.5 (installed: 5.4.0)"
    assert transformers_refusal("qwen3", "5.5.0") is None
    assert transformers_refusal("qwen3_5", None) is None  # not installed here: a config read for a run elsewhere
    assert transformers_minimum("llama") == TRANSFORMERS_FLOOR


RUN = """
model:
  target: {tiny: null, path: %s}
  num_target_layers: 2
optim: {total_steps: 2, micro_batches: 1}
data:
  synthetic: {n_train: 16, n_eval: 2, seed: 0, min_len: 6, max_len: 16}
"""


def test_config_load_refuses_a_family_newer_than_the_installed_transformers(family_dirs, tmp_path, monkeypatch):
    """The installed version is read from package metadata at config load; here it is stated (an older
    transformers is not installed in this venv: the deps_floor tier runs the real one)."""
    path = tmp_path / "run.yaml"
    path.write_text(tiny_config(RUN % family_dirs["qwen3_5"]))
    monkeypatch.setattr(family_mod, "installed_transformers", lambda: "5.12.0")
    with pytest.raises(ConfigError) as refused:
        parse_config(path.read_text(), source=str(path))
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"{path}:")
    assert message.endswith("model.target.path " + f"{family_dirs['qwen3_5']}: "
                            "Qwen3.5 targets need transformers >= 5.14 (installed: 5.12.0)")
    parse_config(tiny_config(RUN % family_dirs["qwen3"]))  # at 5.12 a Qwen3 target loads


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3"])
def test_rotary_gets_positions_shaped_as_the_models_own_forward_gives_them(family_dirs, family):
    """Qwen3.5's rotary is multimodal (mrope): its text model's forward hands it [3, B, L] positions.
    transformers 5.17's indexes them as 3-D (IndexError on [B, L]); the trainer's stage walk gives it
    the same shape and gets the same cos/sin as the model's own forward."""
    from trainer.models.stages import stage_inputs
    from trainer.models.target import base_model, load_target

    target = load_target(str(family_dirs[family]), "cpu", torch.float32)
    base = base_model(target)
    seen: list[tuple[torch.Size, tuple[torch.Tensor, torch.Tensor]]] = []
    base.rotary_emb.register_forward_hook(lambda _m, args, out: seen.append((args[1].shape, out)))
    ids = torch.arange(3, 13).unsqueeze(0)
    with torch.no_grad():
        target(input_ids=ids)
        inputs = stage_inputs(base, base.embed_tokens(ids), {}, None)
    (theirs, (cos, sin)), (ours, _) = seen
    assert ours == theirs
    assert torch.equal(inputs.position_embeddings[0], cos) and torch.equal(inputs.position_embeddings[1], sin)
    assert inputs.position_ids.shape == ids.shape  # the decoder layers keep the text positions
