"""`python -m trainer_tools.onpolicy` on a tiny target and a drafter trained for a few steps against
it: rows whose weights sit on the answer's tokens, the missed positions exactly the correction tokens
of the rounds (checked against the uncached reference decoder), a resumed rerun adding only the
missing rows, and a trainer run warm-started from the drafter on the rows (mixed with plain rows)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.trainer.tiny_config import tiny_config
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
    with the row's noise stream, and the weight each of its tokens should carry: the round's own
    token after a rejected draft weighs miss_weight."""
    from trainer.generate.evaluate import generation_prompt_ids, speculative_generate
    from trainer.generate.sampling_params import Sampling

    prompt = generation_prompt_ids(models.tokenizer, row["messages"][:-1])
    g = speculative_generate(models.target, models.drafter, models.head, prompt, 24, models.stop_ids,
                             Sampling(temperature=1.0, seed=0), stream=row["seed"])
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
    accepted = missed = 0
    for r in first:
        tokens, weights = expected_weights(models, r, 3.0)
        assert r["answer_tokens"] == tokens and r["loss_weights"] == weights
        assert models.tokenizer.decode(tokens[:-1] if r["finish_reasons"] == ["stop"] else tokens,
                                       skip_special_tokens=False) == r["messages"][-1]["content"]
        missed += weights.count(3.0)
        accepted += r["accepted"]
    assert missed and accepted  # both kinds of position occur: the test can tell them apart
    tau = float(summary.split("on-policy tau ")[1].split()[0])
    assert tau == pytest.approx(sum(len(r["answer_tokens"]) - 1 for r in first) / sum(r["rounds"] for r in first),
                                abs=1e-3)

    # an interrupted run: the last 3 rows never written; a rerun with 3 samples adds those and the new ones
    out.write_text("".join(json.dumps(r) + "\n" for r in first[:5]))
    assert onpolicy.main([*argv, "--samples-per-prompt", "3"]) == 0
    assert capsys.readouterr().out.startswith("onpolicy: 7 rows written, 5 already done")
    again = rows(out)
    assert sorted(r["id"] for r in again) == sorted(f"p{i}#{k}" for i in range(4) for k in range(3))
    by_id = {r["id"]: r for r in again}
    assert all(by_id[r["id"]] == r for r in first)  # a row decodes the same in any batch

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
