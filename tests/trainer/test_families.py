"""Every target family, from a hub-format model directory, through train -> τ -> export on CPU:
bucketed and packed rows, the reference loop and the threaded pipeline (issue 23)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.trainer.tiny_config import tiny_config
from trainer.entry import train
from trainer.models.export import export_checkpoint
from trainer.run.config import ConfigError, parse_config
from trainer.run.family import family_of_dir, installed_transformers, transformers_minimum, version_tuple
from trainer_tools.fixtures.hub_model import FAMILIES

RUN = """
model:
  target: {tiny: null, path: %(path)s}
  num_target_layers: 2
optim: {total_steps: 2, micro_batches: 1}
data:
  synthetic: {n_train: 16, n_eval: 2, seed: 0, min_len: 6, max_len: 16}
eval: {samples: 2, max_new_tokens: 6}
pipeline: {kind: %(kind)s}
"""
PACKED = "data: {pack_length: 128, pack_rows: 1}"


def _events(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == kind]


@pytest.mark.slow
# deps_floor: the reference loop's cells (bucketed and packed: the transformers calls differ); the
# threaded pipeline makes the same calls from its threads, so the floor tier leaves it to the main run
@pytest.mark.parametrize("kind", [pytest.param("reference", marks=pytest.mark.deps_floor), "threaded"])
@pytest.mark.parametrize("packed", [False, True], ids=["bucketed", "packed"])
@pytest.mark.parametrize("family", FAMILIES)
def test_family_trains_evaluates_and_exports(family_dirs, tmp_path, family, packed, kind):
    """Under the newest transformers and, in the deps_floor tier (.ci/deps-venv), under each floor the
    project declares: a family whose own minimum is newer than the installed transformers is refused at
    config load in one line naming both versions, every other family trains."""
    text = tiny_config(RUN % {"path": family_dirs[family], "kind": kind}, *([PACKED] if packed else []))
    model_type = family_of_dir(family_dirs[family]).model_type
    installed = installed_transformers()
    if version_tuple(installed) < version_tuple(transformers_minimum(model_type)):
        with pytest.raises(ConfigError) as refused:
            parse_config(text)
        need = transformers_minimum(model_type)
        assert f"targets need transformers >= {need} (installed: {installed})" in str(refused.value)
        assert "\n" not in str(refused.value)
        return
    cfg = parse_config(text)
    run_dir = tmp_path / "run"
    rc = train(cfg, run_dir)
    status = json.loads((run_dir / "status.json").read_text())
    assert rc == 0, status.get("error", {}).get("message")
    assert status["state"] == "done" and status["step"] == 2
    losses = [e["loss"] for e in _events(run_dir, "step")]
    assert losses and all(torch.isfinite(torch.tensor(losses)))
    log = (run_dir / "train.log").read_text()
    assert "target family: " in log  # the family, its layers and the attention implementation picked
    assert ("attention eager (attention sinks" in log) == (family == "gpt_oss")
    [evaluation] = _events(run_dir, "eval")
    assert evaluation["tau"] >= 1.0
    checkpoint = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    out = export_checkpoint(checkpoint, tmp_path / "export", dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    target = json.loads((family_dirs[family] / "config.json").read_text())
    text = target.get("text_config", target)
    assert config["num_target_layers"] == text["num_hidden_layers"]
    assert config["hidden_size"] == text["hidden_size"]
    assert config["dflash_config"]["target_layer_ids"] == [1, 2]


def test_moe_flops_count_the_active_experts():
    """MFU of a MoE target counts the tokens' own experts (top-k), the router and a shared expert."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    from trainer.models.target import QWEN3_30B_A3B_DIMS
    from trainer.pipeline.flops import mlp_flops_per_token

    moe = Qwen3MoeConfig(**QWEN3_30B_A3B_DIMS)
    h = moe.hidden_size
    assert mlp_flops_per_token(moe) == 2.0 * (8 * 3 * h * 768 + h * 128)
    dense = Qwen3Config(hidden_size=h, intermediate_size=6144)
    assert mlp_flops_per_token(dense) == 2.0 * 3 * h * 6144
