"""Chat data formats, exact assistant loss masks on real templates, and data-report."""

import json

import pytest
from transformers import AutoTokenizer

from trainer.data.chat import DataError, read_conversations, tokenize_conversation

QWEN_CONV = [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": "What is 7 times 6?"},
             {"role": "assistant", "content": "<think>\nmultiply 7 by 6\n</think>\n\n42."},
             {"role": "user", "content": "And 12 plus 30?"},
             {"role": "assistant", "content": "Also 42."}]


def loss_runs(tok, ids, mask):
    """The text of each contiguous run of loss tokens."""
    runs, current = [], []
    for i, m in zip(ids, mask):
        if m:
            current.append(i)
        elif current:
            runs.append(tok.decode(current))
            current = []
    if current:
        runs.append(tok.decode(current))
    return runs


def test_qwen3_masks_follow_the_template_thinking_on(qwen3_model_dir):
    tok = AutoTokenizer.from_pretrained(qwen3_model_dir, local_files_only=True)
    ids, mask = tokenize_conversation(tok, QWEN_CONV, 1000)
    # history lost its reasoning (as rendered); the final turn is generated with its think block
    assert loss_runs(tok, ids, mask) == ["42.<|im_end|>", "<think>\n\n</think>\n\nAlso 42.<|im_end|>"]
    conv = QWEN_CONV[:3]  # the reasoning turn is the final one: its think block is rendered and trained
    ids, mask = tokenize_conversation(tok, conv, 1000)
    assert loss_runs(tok, ids, mask) == ["<think>\nmultiply 7 by 6\n</think>\n\n42.<|im_end|>"]
    conv = QWEN_CONV[:2] + [{"role": "assistant", "content": "42.", "reasoning_content": "six sevens"}]
    ids, mask = tokenize_conversation(tok, conv, 1000)
    assert loss_runs(tok, ids, mask) == ["<think>\nsix sevens\n</think>\n\n42.<|im_end|>"]


def test_qwen3_masks_thinking_off_leave_the_prefilled_think_block_in_the_prompt(qwen3_model_dir):
    tok = AutoTokenizer.from_pretrained(qwen3_model_dir, local_files_only=True)
    ids, mask = tokenize_conversation(tok, QWEN_CONV, 1000, {"enable_thinking": False})
    assert loss_runs(tok, ids, mask) == ["42.<|im_end|>", "Also 42.<|im_end|>"]
    text = tok.decode(ids)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nAlso 42.<|im_end|>\n")


def test_qwen3_masks_tool_calls_are_assistant_output_tool_results_are_not(qwen3_model_dir):
    tok = AutoTokenizer.from_pretrained(qwen3_model_dir, local_files_only=True)
    conv = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "Let me check.",
             "tool_calls": [{"function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "sunny"},
            {"role": "assistant", "content": "It is sunny."}]
    ids, mask = tokenize_conversation(tok, conv, 1000)
    runs = loss_runs(tok, ids, mask)
    assert runs == ['Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
                    "<think>\n\n</think>\n\nIt is sunny.<|im_end|>"]
    assert "sunny<" not in "".join(runs)


def test_llama3_masks_do_not_depend_on_qwen(llama3_model_dir):
    tok = AutoTokenizer.from_pretrained(llama3_model_dir, local_files_only=True)
    conv = [dict(m) for m in QWEN_CONV]
    conv[4]["content"] = "  Also 42.\n"  # the Llama 3 template trims content
    ids, mask = tokenize_conversation(tok, conv, 1000)
    assert loss_runs(tok, ids, mask) == ["<think>\nmultiply 7 by 6\n</think>\n\n42.<|eot_id|>", "Also 42.<|eot_id|>"]
    assert tok.convert_ids_to_tokens(ids[:2]) == ["<|begin_of_text|>", "<|start_header_id|>"]
    ids8, mask8 = tokenize_conversation(tok, conv, 8)
    assert (ids8, mask8) == (ids[:8], mask[:8])


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_three_formats_read_to_the_same_messages(tmp_path):
    openai = _write(tmp_path / "openai.jsonl", [{"messages": [
        {"role": "system", "content": "S"}, {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}])
    sharegpt = _write(tmp_path / "sharegpt.jsonl", ["", {"conversations": [
        {"from": "system", "value": "S"}, {"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]}])
    pairs = _write(tmp_path / "pairs.jsonl", [{"system": "S", "prompt": "Q", "response": "A"}])
    got = [read_conversations(p) for p in (openai, sharegpt, pairs)]
    assert [g[0]["messages"] for g in got] == [got[0][0]["messages"]] * 3
    assert got[1][0]["source"] == f"{sharegpt}:2"


@pytest.mark.parametrize("rows, line, words", [
    ([{"text": "hello"}], 1, "unknown record (keys: text)"),
    ([{"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]},
      {"conversations": [{"from": "human", "value": "Q"}]}], 2, "a ShareGPT conversations record in a file of OpenAI"),
    ([{"conversations": [{"from": "human", "value": "Q"}, {"from": "robot", "value": "A"}]}], 1, "from 'robot'"),
    ([{"messages": [{"role": "user", "content": "Q"}, {"role": "bot", "content": "A"}]}], 1, "role 'bot'"),
    ([{"messages": [{"role": "user", "content": "only a question"}]}], 1, "no assistant turn"),
    ([{"prompt": "Q", "response": 3}], 1, "'response' must be a string"),
    (['{"messages": [', ], 1, "not JSON"),
    (['[{"messages": []}]'], 1, "a JSON array"),
])
def test_anything_else_is_one_error_naming_file_and_line(tmp_path, rows, line, words):
    path = _write(tmp_path / "data.jsonl", rows)
    with pytest.raises(DataError) as err:
        read_conversations(path)
    message = str(err.value)
    assert message.startswith(f"{path}:{line}: ") and words in message and "\n" not in message


def test_data_report_counts_truncation_and_loss_share(qwen3_model_dir, tmp_path, capsys):
    import subprocess
    import sys

    rows = [{"prompt": f"Question {i}?", "response": "word " * (5 + 20 * i)} for i in range(4)]
    data = _write(tmp_path / "pairs.jsonl", rows)
    config = tmp_path / "c.yaml"
    config.write_text(f"model: {{target: {{path: {qwen3_model_dir}}}}}\n"
                      f"data: {{train_path: {data}, max_length: 64, token_budget: 64, bucket_edges: [64]}}\n")
    # `python -m trainer data-report` where `import torch` fails (runpy runs the same trainer/__main__.py
    # that -m runs): the report loads the tokenizer only
    no_torch = "import runpy, sys; sys.modules['torch'] = None; runpy.run_module('trainer', run_name='__main__')"
    out = subprocess.run([sys.executable, "-c", no_torch, "data-report", "--config", str(config)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    tok = AutoTokenizer.from_pretrained(qwen3_model_dir, local_files_only=True)
    lengths, kept, loss = [], 0, 0
    for r in read_conversations(data):
        text = tok.apply_chat_template(r["messages"], tokenize=False)
        lengths.append(len(tok(text, add_special_tokens=False)["input_ids"]))
        ids, mask = tokenize_conversation(tok, r["messages"], 64)
        kept, loss = kept + len(ids), loss + sum(mask)
    truncated = sum(n > 64 for n in lengths)
    assert 0 < truncated < 4
    assert "train: 4 conversations" in out.stdout and "(prompt/response pairs)" in out.stdout
    assert f"truncated at max_length: {truncated} of 4 conversations ({truncated / 4:.1%})" in out.stdout
    assert f"loss tokens (assistant turns): {loss} of {kept} kept tokens" in out.stdout
    assert "length histogram" in out.stdout
    bad = _write(tmp_path / "bad.jsonl", [{"messages": "nope"}])
    config.write_text(config.read_text().replace(str(data), str(bad)))
    from trainer.__main__ import main  # in this process: the CLI path above already ran as `python -m trainer`

    assert main(["data-report", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and f"{bad}:1:" in err


def test_a_run_whose_data_has_nothing_to_train_on_fails_in_one_line(qwen3_model_dir, tmp_path):
    """Every answer cut off by max_length: the run fails with one line naming the data problem,
    in train.log and status.json, and no traceback (it is the data, not the code)."""
    from trainer.entry import train
    from trainer.run.config import parse_config

    rows = [{"prompt": "word " * 80, "response": "yes " * 4} for _ in range(3)]
    data = _write(tmp_path / "long.jsonl", rows)
    cfg = parse_config(f"model: {{target: {{path: {qwen3_model_dir}}}, drafter_layers: 1, block_size: 4, dtype: fp32}}\n"
                       f"data: {{train_path: {data}, max_length: 32, token_budget: 64, bucket_edges: [32],"
                       f" num_anchors: 2, pad_multiple: 16}}\n"
                       f"optim: {{total_steps: 1}}\nrun: {{threads: 1}}\n")
    assert train(cfg, tmp_path / "run") == 1
    log = (tmp_path / "run" / "train.log").read_text()
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["state"] == "failed" and status["error"]["message"].startswith("data error: ")
    assert "two or more assistant tokens" in status["error"]["message"]
    failed = [line for line in log.splitlines() if "FAILED" in line]
    assert len(failed) == 1 and "data error: " in failed[0]
    assert "Traceback" not in log


def test_openai_tool_call_turns_with_null_content_load_with_qwen3(qwen3_model_dir, tmp_path):
    """OpenAI's shape of a tool-calling turn (`content: null`, `tool_calls` with id/type and JSON-string
    arguments) loads, and the call is trained as assistant output (before: 'cannot locate assistant turn 1')."""
    tok = AutoTokenizer.from_pretrained(qwen3_model_dir, local_files_only=True)
    row = {"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."}]}
    [conv] = read_conversations(_write(tmp_path / "tools.jsonl", [row]))
    ids, mask = tokenize_conversation(tok, conv["messages"] if isinstance(conv, dict) else conv, 1000)
    runs = loss_runs(tok, ids, mask)
    assert runs == ['<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
                    "<think>\n\n</think>\n\nIt is sunny.<|im_end|>"]


REFUSES_LONG_TURNS = """{%- for m in messages %}
<|im_start|>{{ m.role }}
{%- if m.content | length > 40 %}
{{- raise_exception('a turn longer than 40 characters: ' + m.role) }}
{%- endif %}
{{ m.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def _with_template(model_dir, out, template: str, as_file: bool):
    """model_dir with its chat template replaced: in chat_template.jinja (transformers 5's layout)
    or inside tokenizer_config.json (the hub's older one)."""
    out.mkdir()
    for f in model_dir.iterdir():
        if f.name != "tokenizer_config.json":
            (out / f.name).symlink_to(f)
    settings = json.loads((model_dir / "tokenizer_config.json").read_text())
    if as_file:
        settings.pop("chat_template", None)
        (out / "chat_template.jinja").write_text(template)
    else:
        settings["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(settings))
    return out


@pytest.mark.parametrize("as_file", [True, False])
def test_a_chat_template_that_raises_names_the_template_line_and_the_conversation(qwen3_model_dir, tmp_path,
                                                                                   capsys, as_file):
    """raise_exception in the template (or any error it meets) used to abort the load with a
    traceback: now one line, the data's file:line, then the template's file:line."""
    from trainer.__main__ import main
    from trainer.data import encoding

    model = _with_template(qwen3_model_dir, tmp_path / "model", REFUSES_LONG_TURNS, as_file)
    rows = [{"prompt": "short?", "response": "yes"}] * 3 + [{"prompt": "short?", "response": "word " * 20}]
    data = _write(tmp_path / "pairs.jsonl", rows)
    where = f"{model}/chat_template.jinja:4" if as_file else f"{model}/tokenizer_config.json chat_template line 4"
    expected = (f"{data}:4: {where}: the chat template failed: TemplateError: a turn longer than 40 characters: "
                "assistant")
    tok = AutoTokenizer.from_pretrained(model, local_files_only=True)
    conversations = list(read_conversations(data))
    for processes in (1, 2):  # a worker names the model directory's template, not its temporary copy
        with pytest.raises(DataError) as err:
            encoding.encode_all(tok, conversations, 64, None, processes=processes)
        assert str(err.value) == expected
    config = tmp_path / "c.yaml"
    config.write_text(f"model: {{target: {{path: {model}}}}}\n"
                      f"data: {{train_path: {data}, max_length: 64, token_budget: 64, bucket_edges: [64]}}\n")
    assert main(["data-report", "--config", str(config)]) == 2
    assert capsys.readouterr().err == f"data-report: {expected}\n"


def test_a_template_syntax_error_names_its_line(tmp_path):
    from trainer.data.chat import encode_conversation
    from trainer.data.synth import synthetic_words
    from trainer.data.tokenizer import synthetic_tokenizer

    tok = synthetic_tokenizer(synthetic_words())
    tok.chat_template = "{% for m in messages %}\n{{ m.content }\n{% endfor %}"
    with pytest.raises(DataError, match=r"^the chat template line 2: the chat template failed: TemplateSyntaxError: "):
        encode_conversation(tok, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], 16)
