"""The export served by vLLM's CPU build: lossless, and its acceptance is the project's τ.

Counted the project's way: a round is one verification (vLLM's `num_drafts`), the tokens are the
generated ones minus the first of each prompt (it comes from the prefill, not a round). vLLM's own
accepted-token counter also counts drafts accepted past max_tokens, so it is not used.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from tests.engine.conftest import MAX_TOKENS, EngineSession

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.xdist_group("engine")]


def engine_tau(session: EngineSession, name: str) -> tuple[Fraction, int]:
    run = session.out["runs"][name]
    produced = sum(len(t) for t in run["tokens"]) - len(session.prompts)
    return Fraction(produced, run["num_drafts"]), run["num_drafts"]


def project_tau(session: EngineSession, name: str) -> tuple[Fraction, int]:
    """acceptance_report on the export's weights (read back from the exported directory)."""
    from transformers import AutoTokenizer

    from trainer.data.chat import read_conversations
    from trainer.generate.evaluate import acceptance_report
    from trainer.models.drafter import DFlashDrafter
    from trainer.models.export import read_published
    from trainer.models.target import FrozenHead, freeze, load_target

    target = freeze(load_target(str(session.target), "cpu", torch.float32))
    published, weights = read_published(session.drafts[name])
    drafter = DFlashDrafter(published)
    drafter.load_state_dict(weights)
    tok = AutoTokenizer.from_pretrained(session.target, local_files_only=True)
    report = acceptance_report(target, drafter, FrozenHead.from_target(target, "cpu"), tok,
                               read_conversations(session.dir / "eval.jsonl"), MAX_TOKENS)
    produced = sum((k + 1) * n for k, n in enumerate(report["histogram"]))
    assert Fraction(produced, report["rounds"]) == Fraction(report["tau"]).limit_denominator(10**6)
    return Fraction(produced, report["rounds"]), report["rounds"]


def test_greedy_text_with_each_draft_equals_text_without(engine_session):
    runs = engine_session.out["runs"]
    plain = runs["plain"]["tokens"]
    assert len(plain) == len(engine_session.prompts) and all(plain)
    for name in engine_session.drafts:
        assert runs[name]["tokens"] == plain, name
        assert runs[name]["num_drafts"] > 0, name


def test_one_layer_draft_acceptance_equals_acceptance_report_exactly(engine_session):
    ours, rounds = project_tau(engine_session, "d1")
    theirs, drafts = engine_tau(engine_session, "d1")
    assert (theirs, drafts) == (ours, rounds)
    assert ours > 1  # the trained draft is accepted at all: an equality of two 1.0s would prove little


def known_k_norm_difference(session: EngineSession, name: str) -> str:
    """Checks that a 2-layer draft's difference is exactly vLLM-CPU's k_norm one; returns the report."""
    ours, rounds = project_tau(session, name)
    theirs, drafts = engine_tau(session, name)
    kernel = session.out["k_norm"]
    assert kernel == {"per_layer_weight": False, "layer0_weight_everywhere": True}, (
        f"{name}: vLLM tau {float(theirs):.4f} ({drafts} rounds) != ours {float(ours):.4f} ({rounds}), "
        f"and not the known k_norm kernel difference: {kernel}")
    equal_ours, equal_theirs = project_tau(session, "d2_equal_k_norm"), engine_tau(session, "d2_equal_k_norm")
    assert equal_theirs == equal_ours, "with equal k_norm weights vLLM must draft as the project does"
    return (f"known vLLM-CPU {session.out['vllm']} k_norm difference (docs/engine-vllm.md): {name} tau in vLLM "
            f"{float(theirs):.4f} over {drafts} rounds vs {float(ours):.4f} over {rounds} in the project; with "
            f"equal k_norm weights both {float(equal_ours[0]):.4f}")


def test_the_k_norm_difference_is_detected_when_draft_layers_norm_keys_differently(engine_session):
    """Layers whose k_norm weights differ clearly: vLLM-CPU drafts them differently from their
    weights (kernel: row 0 for every layer), detected and reported; a fixed engine agrees."""
    ours = project_tau(engine_session, "d2_distinct_k_norm")
    theirs = engine_tau(engine_session, "d2_distinct_k_norm")
    if engine_session.out["k_norm"]["per_layer_weight"]:
        assert theirs == ours
        return
    assert theirs != ours, "the kernel norms every layer with row 0, yet vLLM drafted as the project does"
    pytest.xfail(known_k_norm_difference(engine_session, "d2_distinct_k_norm"))


def test_two_layer_draft_equals_ours_or_shows_the_known_k_norm_difference(engine_session):
    """vLLM-CPU 0.32 norms every draft layer's context keys with layer 0's k_norm weight
    (docs/engine-vllm.md). Either the engine agrees (fixed), or the difference is exactly that:
    the kernel reproduction shows it and the same draft with equal k_norm weights agrees."""
    if project_tau(engine_session, "d2") != engine_tau(engine_session, "d2"):
        pytest.xfail(known_k_norm_difference(engine_session, "d2"))
