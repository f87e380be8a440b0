"""`python -m trainer_tools.onpolicy` on a tiny target and a drafter trained for a few steps against
it: rows whose weights sit on the answer's canonical tokens, the missed positions exactly the
characters of the rounds' correction tokens (checked against the uncached reference decoder), a
resumed rerun adding only the missing rows, and a trainer run warm-started from the drafter on the
rows (mixed with plain rows). The move of weights from a rollout's non-canonical tokens to the
template's (a merge split, a character's bytes split) on a byte-level BPE built in code."""

from __future__ import annotations

import json

import pytest
import torch

from tests.trainer.tiny_config import tiny_config
from trainer.data.chat import assistant_spans, encode_conversation
from trainer_tools import onpolicy

TARGET = "tiny: {layers: 2, hidden: 32, heads: 4, kv_heads: 2, head_dim: 8, intermediate: 64, fit_steps: 60, fit_lr: 0.01}"
PROMPTS = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"step{(1, 3, 7)[i % 3]} v{5 * i}"}]}
           for i in range(4)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A target fitted on the synthetic walks, saved as a model directory, and a drafter trained
    against it for a few steps (its checkpoint)."""
    from safetensors.torch import load_file

    from trainer.data.synth import synthetic_words
    from trainer.data.tokenizer import synthetic_tokenizer
    from trainer.entry import train
    from trainer.models.target import tiny_target
    from trainer.run.config import TinyTargetConfig, parse_config

    root = tmp_path_factory.mktemp("onpolicy")
    config = parse_config(tiny_config(f"model: {{target: {{{TARGET}}}}}", "optim: {total_steps: 30, lr: 0.01}",
                                      "run: {checkpoint_every: 30}"))
    assert train(config, root / "run") == 0
    tok = synthetic_tokenizer(synthetic_words())
    target = tiny_target(TinyTargetConfig(layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, intermediate=64),
                         len(tok))
    target.load_state_dict(load_file(str(root / "run" / "target" / "model.safetensors")))
    target.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    (checkpoint,) = sorted((root / "run" / "checkpoints").glob("step_*"))
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return root, root / "target", checkpoint, prompts


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def expected_weights(models, row, miss_weight):
    """The row decoded again by the uncached reference (trainer.generate.evaluate.speculative_generate)
    with the row's noise stream and proposals, and the weight each of its tokens should carry: the round's
    own token after a rejected draft weighs miss_weight."""
    from trainer.generate.evaluate import generation_prompt_ids, speculative_generate
    from trainer.generate.sampling_params import Sampling

    prompt = generation_prompt_ids(models.tokenizer, row["messages"][:-1])
    g = speculative_generate(models.target, models.drafter, models.head, prompt, 24, models.stop_ids,
                             Sampling(temperature=1.0, seed=0, draft=row["draft_sample_method"]), stream=row["seed"])
    weights = [1.0]
    for n, accepted in zip(g.acceptance_lengths, g.accepted):
        round_weights = [1.0] * n
        if accepted < models.drafter.config.block_size - 1 and accepted < n:
            round_weights[accepted] = miss_weight  # the target's correction of the first rejected draft
        weights += round_weights
    return g.tokens, weights


def test_onpolicy_rows_weigh_the_missed_positions_resume_and_train(trained, capsys):
    from trainer.__main__ import main as trainer_main

    root, target, checkpoint, prompts = trained
    out = root / "rows.jsonl"
    argv = ["--target", str(target), "--drafter", str(checkpoint), "--in", str(prompts), "--out", str(out),
            "--max-tokens", "24", "--batch", "3", "--miss-weight", "3"]
    assert onpolicy.main([*argv, "--samples-per-prompt", "2"]) == 0
    summary = capsys.readouterr().out
    assert summary.startswith("onpolicy: 8 rows written, 0 already done, 0 kept out") and "on-policy tau" in summary
    first = rows(out)
    assert [r["id"] for r in first] == [f"p{i}#{k}" for i in range(4) for k in range(2)]
    models = onpolicy.Models(str(target), str(checkpoint), "cpu", "fp32")
    tok = models.tokenizer
    accepted = missed = 0
    for r in first:
        tokens, weights = expected_weights(models, r, 3.0)
        assert r["rollout_tokens"] == tokens and r["rollout_weights"] == weights
        stop = r["finish_reasons"] == ["stop"]
        content = r["messages"][-1]["content"]
        assert tok.decode(tokens[:-1] if stop else tokens, skip_special_tokens=False) == content
        # answer_tokens: the template's tokens of the last assistant span, up to the answer's end
        text, spans = assistant_spans(tok, r["messages"])
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        span = [(t, o) for t, o in zip(enc["input_ids"], enc["offset_mapping"]) if spans[-1][0] <= o[0] < spans[-1][1]]
        start = text.index(content, spans[-1][0])
        end = start + len(content) + (len(tok.eos_token) if stop else 0)
        canonical = [(t, o) for t, o in span if o[0] < end]
        assert r["answer_tokens"] == [t for t, _ in canonical]
        # the miss weight on exactly the canonical tokens over a correction token's characters
        missed_chars = set()
        for k, w in enumerate(weights):
            if w == 3.0:
                own = tok.decode(tokens[k: k + 1], skip_special_tokens=False)
                at = start + len(tok.decode(tokens[: k + 1], skip_special_tokens=False)) - len(own)
                if stop and k == len(tokens) - 1:
                    at = start + len(content)  # the end of turn follows the content, no space between
                assert text[at: at + len(own)] == own
                missed_chars |= set(range(at, at + len(own)))
        assert r["loss_weights"] == [3.0 if missed_chars & set(range(*o)) else 1.0 for _, o in canonical]
        assert r["loss_weights"].count(3.0) == weights.count(3.0)  # word-level: the same tokens
        encode_conversation(tok, r["messages"], 10**6, None, (r["answer_tokens"], r["loss_weights"]))
        missed += weights.count(3.0)
        accepted += r["accepted"]
    assert missed and accepted  # both kinds of position occur: the test can tell them apart
    tau = float(summary.split("on-policy tau ")[1].split()[0])
    assert tau == pytest.approx(sum(len(r["rollout_tokens"]) - 1 for r in first) / sum(r["rounds"] for r in first),
                                abs=1e-3)

    # an interrupted run: the last 3 rows never written; a rerun with 3 samples adds those and the new ones
    out.write_text("".join(json.dumps(r) + "\n" for r in first[:5]))
    assert onpolicy.main([*argv, "--samples-per-prompt", "3"]) == 0
    assert capsys.readouterr().out.startswith("onpolicy: 7 rows written, 5 already done")
    again = rows(out)
    assert sorted(r["id"] for r in again) == sorted(f"p{i}#{k}" for i in range(4) for k in range(3))
    by_id = {r["id"]: r for r in again}
    assert all(by_id[r["id"]] == r for r in first)  # a row decodes the same in any batch

    # rollouts decoded with sampled proposals (as served with vLLM's draft_sample_method probabilistic): each row
    # is the reference decoder's with those proposals, which decode other rollouts than argmax proposals
    sampled = root / "sampled.jsonl"
    assert onpolicy.main([*argv[:7], str(sampled), *argv[8:], "--draft-sample-method", "probabilistic"]) == 0
    capsys.readouterr()
    differ = 0
    for r in rows(sampled):
        assert r["draft_sample_method"] == "probabilistic"
        assert (r["rollout_tokens"], r["rollout_weights"]) == expected_weights(models, r, 3.0)
        differ += (r["rollout_tokens"], r["rollout_weights"]) != expected_weights(
            models, {**r, "draft_sample_method": "greedy"}, 3.0)
    assert differ

    plain = root / "plain.jsonl"
    from trainer.data.synth import synthetic_conversations, write_jsonl

    write_jsonl(synthetic_conversations(16, 3, 8, 20), plain)
    config = root / "warm.yaml"
    config.write_text(tiny_config(f"model: {{target: {{path: {target}, tiny: null}}, drafter_init: {checkpoint}}}",
                                  f"data: {{synthetic: null, train_path: [{out}, {plain}], eval_path: {plain}}}",
                                  "optim: {total_steps: 2}"))
    assert trainer_main(["--config", str(config), "--run-dir", str(root / "warm")]) == 0
    assert "12 of 28 training conversations weigh their last answer's tokens" in capsys.readouterr().out
    steps = [json.loads(line) for line in (root / "warm" / "metrics.jsonl").read_text().splitlines()
             if '"event": "step"' in line]
    assert len(steps) == 2 and all(torch.isfinite(torch.tensor(s["loss"])) for s in steps)


def test_bad_input_is_one_line_naming_it(trained, tmp_path, capsys):
    root, target, checkpoint, prompts = trained
    base = ["--target", str(target), "--drafter", str(checkpoint), "--in", str(prompts), "--out", str(tmp_path / "o")]
    assert onpolicy.main([*base, "--miss-weight", "0"]) == 2
    assert capsys.readouterr().err == "onpolicy: --miss-weight must be a finite number > 0 (a weight of the loss), got 0\n"
    assert onpolicy.main([*base[:2], "--drafter", str(target), *base[4:]]) == 2
    assert capsys.readouterr().err.startswith(f"onpolicy: --drafter {target}")
    assert not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def byte_bpe():
    """A byte-level BPE (GPT-2's byte alphabet, merges learnt here from a few lines) with the tiny
    tokenizer's specials and chat template: what a real target's tokenizer does to text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from trainer.data.tokenizer import CHAT_TEMPLATE, SPECIALS

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(["abc abc abc déjà vu", "abc déjà"] * 5, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=SPECIALS,
        show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def rollout_row(tok, pieces, finish="stop"):
    """The messages of a rollout whose tokens are `pieces` (token strings of the byte-level
    vocabulary), and its token ids, the stop token added when finish is "stop"."""
    ids = tok.convert_tokens_to_ids(pieces)
    assert None not in ids, pieces
    content = tok.decode(ids, skip_special_tokens=False)
    tokens = ids + ([tok.eos_token_id] if finish == "stop" else [])
    return [{"role": "user", "content": "q"}, {"role": "assistant", "content": content}], tokens


def test_a_non_canonical_rollout_gets_the_templates_tokens_its_weights_moved_by_characters(byte_bpe):
    tok = byte_bpe
    assert tok.tokenize(" abc abc") == ["Ġabc", "Ġabc"]
    # " abc abc" sampled as " abc", " ", "a", "b", "c": the second word's merge split in four, its "b" missed
    messages, tokens = rollout_row(tok, ["Ġabc", "Ġ", "a", "b", "c"])
    weights = [1.0, 1.0, 1.0, 2.0, 1.0, 1.0]
    answer, answer_weights = onpolicy.canonical_answer(tok, messages, {}, tokens, weights, "stop")
    assert answer == tok.convert_tokens_to_ids(["Ġabc", "Ġabc"]) + [tok.eos_token_id]
    assert answer_weights == [1.0, 2.0, 1.0]  # the merged token holding the missed "b" keeps its weight
    encode_conversation(tok, messages, 100, None, (answer, answer_weights))  # the trainer takes the row
    # a miss on the stop token stays on it; a rollout cut at max tokens has no end-of-turn token
    assert onpolicy.canonical_answer(tok, messages, {}, tokens, [1.0] * 5 + [2.0], "stop")[1] == [1.0, 1.0, 2.0]
    cut, cut_weights = onpolicy.canonical_answer(tok, messages, {}, tokens[:-1], [2.0, 1, 1, 1, 1], "length")
    assert cut == tok.convert_tokens_to_ids(["Ġabc", "Ġabc"]) and cut_weights == [2.0, 1.0]


def test_a_character_split_across_rollout_tokens_weighs_the_token_that_holds_it(byte_bpe):
    tok = byte_bpe
    canonical = tok.tokenize(" déjà")
    assert canonical == ["ĠdÃ©jÃł"]  # "é" and "à" are two bytes each, inside one canonical token
    # " abc déjà" sampled byte by byte after "abc": "é"'s bytes in two tokens, one of them missed
    pieces = ["Ġabc", "Ġ", "d", "Ã", "©", "j", "Ã", "ł"]
    messages, tokens = rollout_row(tok, pieces)
    assert messages[1]["content"] == " abc déjà"
    assert [tok.decode(tokens[:k]) for k in (4, 5)] == [" abc d\ufffd", " abc dé"]  # the first byte alone is no text
    assert onpolicy.token_ranges(tok, tokens[:-1]) == [(0, 4), (4, 5), (5, 6), (6, 7), (6, 7), (7, 8), (8, 9), (8, 9)]
    for missed in (3, 4):  # either byte of the character
        weights = [1.0] * len(tokens)
        weights[missed] = 2.0
        answer, answer_weights = onpolicy.canonical_answer(tok, messages, {}, tokens, weights, "stop")
        assert answer == tok.convert_tokens_to_ids(["Ġabc", *canonical]) + [tok.eos_token_id]
        assert answer_weights == [1.0, 2.0, 1.0]
    # cut at max tokens inside "à": its first byte alone decodes to U+FFFD, text the template renders as such
    messages, tokens = rollout_row(tok, pieces[:-1], "length")
    assert messages[1]["content"].endswith("j\ufffd")
    answer, answer_weights = onpolicy.canonical_answer(tok, messages, {}, tokens, [1.0] * 6 + [2.0], "length")
    assert tok.decode(answer) == messages[1]["content"] and answer_weights[-1] == 2.0 and answer_weights[0] == 1.0


def test_an_answer_the_template_rewrites_is_kept_out(byte_bpe):
    tok = byte_bpe
    messages, tokens = rollout_row(tok, ["Ġabc", "Ġ"])
    with pytest.raises(onpolicy.DataError, match="does not render the answer's text as it is"):
        onpolicy.canonical_answer(tok, messages, {"chat_template": tok.chat_template.replace(
            "{{ m['content'] }}", "{{ m['content'] | trim }}")}, tokens, [1.0] * 3, "stop")
    with pytest.raises(onpolicy.DataError, match="the answer stopped with '<|endoftext|>'"):
        onpolicy.canonical_answer(tok, messages, {}, [*tokens[:-1], tok.pad_token_id], [1.0] * 3, "stop")
