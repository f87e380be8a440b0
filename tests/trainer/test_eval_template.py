"""Evaluation renders its prompts with the data config's chat-template arguments, as training did
(a Qwen3 run trained with `enable_thinking: false` is evaluated on prompts with the pre-filled
empty think block, the distribution it was trained on and will be served)."""

import json

from transformers import AutoTokenizer

from trainer.data.chat import tokenize_conversation
from trainer.generate.evaluate import prompt_ids

CONV = [{"role": "user", "content": "What is 7 times 6?"},
        {"role": "assistant", "content": "42."},
        {"role": "user", "content": "And 12 plus 30?"},
        {"role": "assistant", "content": "Also 42."}]


def trained_prompt(tok, messages, kwargs):
    """The token ids training saw before the last assistant turn's first loss token."""
    ids, mask = tokenize_conversation(tok, messages, 1000, kwargs)
    first_of_last_turn = max(i for i in range(1, len(mask)) if mask[i] and not mask[i - 1])
    return ids[:first_of_last_turn]


def test_prompt_ids_render_with_the_training_template_arguments(qwen3_model_dir):
    tok = AutoTokenizer.from_pretrained(qwen3_model_dir, local_files_only=True)
    off = {"enable_thinking": False}
    assert prompt_ids(tok, CONV, off) == trained_prompt(tok, CONV, off)
    assert tok.decode(prompt_ids(tok, CONV, off)).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert prompt_ids(tok, CONV) == trained_prompt(tok, CONV, {})
    assert prompt_ids(tok, CONV) != prompt_ids(tok, CONV, off)


def test_the_runs_evaluation_uses_data_enable_thinking(qwen3_model_dir, tmp_path):
    """A run with data.enable_thinking: false evaluates the prompts training rendered: its eval
    event's prompt token count is that of the thinking-off prompts (more than thinking on)."""
    from trainer.entry import train
    from trainer.run.config import parse_config

    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": CONV}) + "\n" for _ in range(4)))
    cfg = parse_config(f"model: {{target: {{path: {qwen3_model_dir}}}, drafter_layers: 1, block_size: 4, dtype: fp32}}\n"
                       f"data: {{train_path: {data}, max_length: 64, token_budget: 128, bucket_edges: [64],"
                       f" num_anchors: 2, pad_multiple: 16, enable_thinking: false}}\n"
                       f"optim: {{total_steps: 1}}\nrun: {{threads: 1}}\neval: {{samples: 2, max_new_tokens: 2}}\n")
    assert train(cfg, tmp_path / "run") == 0
    events = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    (evaluation,) = [e for e in events if e["event"] == "eval"]
    tok = AutoTokenizer.from_pretrained(qwen3_model_dir, local_files_only=True)
    assert evaluation["prompt_tokens"] == 2 * len(trained_prompt(tok, CONV, {"enable_thinking": False}))
    assert evaluation["prompt_tokens"] != 2 * len(trained_prompt(tok, CONV, {}))
    # τ is reported beside n-gram prompt lookup's on the same prompts, in the event and status.json
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert evaluation["tau_lookup"] >= 1.0 and evaluation["tau_ratio"] == evaluation["tau"] / evaluation["tau_lookup"]
    assert (status["tau"], status["tau_lookup"], status["tau_ratio"]) == (
        evaluation["tau"], evaluation["tau_lookup"], evaluation["tau_ratio"])
