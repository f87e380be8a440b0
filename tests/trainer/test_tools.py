"""A row's tools reach the chat template wherever the row is rendered (training, held-out τ,
data-report), in the OpenAI, ShareGPT (LLaMA-Factory) and Hermes forms; tool calls are trained,
tool results are not. The reference is transformers' own `apply_chat_template(..., tools=...)`
with the fixture's Qwen3 template (trainer_tools.fixtures.chat_templates.QWEN3: Qwen3's tool
rendering)."""

import json

import pytest
from transformers import AutoTokenizer

from trainer.data.chat import DataError, encode_conversation, read_conversations, template_kwargs_for

WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"name": "clock", "description": "The time now.", "parameters": {"type": "object", "properties": {}}}

OPENAI_ROW = {"tools": [WEATHER, {"type": "function", "function": CLOCK}], "messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    {"role": "assistant", "content": "Sunny, 21 C."}]}


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def loss_text(tok, ids, mask):
    runs, current = [], []
    for i, m in zip(ids, mask):
        if m:
            current.append(i)
        elif current:
            runs.append(tok.decode(current))
            current = []
    return runs + ([tok.decode(current)] if current else [])


@pytest.fixture(scope="module")
def tok(qwen3_model_dir):
    return AutoTokenizer.from_pretrained(qwen3_model_dir, local_files_only=True)


def test_openai_tools_render_as_apply_chat_template_with_tools_and_only_assistant_turns_train(tok, tmp_path):
    [conv] = read_conversations(_write(tmp_path / "tools.jsonl", [OPENAI_ROW]))
    assert conv["tools"] == OPENAI_ROW["tools"]
    ids, mask, full = encode_conversation(tok, conv["messages"], 4096, template_kwargs_for(conv))
    reference = tok.apply_chat_template(OPENAI_ROW["messages"], tools=OPENAI_ROW["tools"], tokenize=False)
    assert tok.decode(ids) == reference and full == len(ids)
    assert '<tools>\n{"type": "function", "function": {"name": "weather"' in reference
    assert reference.index("<tools>") < reference.index("Weather in Paris?")  # in the system prompt
    runs = loss_text(tok, ids, mask)
    assert runs == ['<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
                    "<think>\n\n</think>\n\nSunny, 21 C.<|im_end|>"]
    assert not any("sunny, 21 C" in r or "<tools>" in r for r in runs)  # tool results and schemas are prompt


def test_sharegpt_tools_string_and_function_call_turns_read_as_the_openai_row(tok, tmp_path):
    """LLaMA-Factory's ShareGPT form: `tools` a JSON string of bare schemas, `function_call` and
    `observation` turns. It renders exactly as the OpenAI row does."""
    row = {"system": "Be brief.", "tools": json.dumps([WEATHER["function"], CLOCK]), "conversations": [
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "function_call", "value": json.dumps({"name": "weather", "arguments": {"city": "Paris"}})},
        {"from": "observation", "value": "sunny, 21 C"},
        {"from": "gpt", "value": "Sunny, 21 C."}]}
    [conv] = read_conversations(_write(tmp_path / "sharegpt.jsonl", [row]))
    assert conv["tools"] == OPENAI_ROW["tools"]
    assert conv["messages"][2] == {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]}
    ids, mask, _ = encode_conversation(tok, conv["messages"], 4096, template_kwargs_for(conv))
    assert tok.decode(ids) == tok.apply_chat_template(OPENAI_ROW["messages"], tools=OPENAI_ROW["tools"],
                                                      tokenize=False)
    assert loss_text(tok, ids, mask)[0].startswith("<tool_call>\n")


def test_hermes_sharegpt_with_a_tools_field_and_tool_turns(tok, tmp_path):
    """Hermes function-calling rows: the calls are text in `gpt` turns, results `tool` turns, the
    schemas a `tools` JSON string; the results are never trained on."""
    call = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    row = {"tools": json.dumps([WEATHER]), "conversations": [
        {"from": "human", "value": "Weather in Paris?"}, {"from": "gpt", "value": call},
        {"from": "tool", "value": "sunny"}, {"from": "gpt", "value": "Sunny."}]}
    [conv] = read_conversations(_write(tmp_path / "hermes.jsonl", [row]))
    ids, mask, _ = encode_conversation(tok, conv["messages"], 4096, template_kwargs_for(conv))
    assert tok.decode(ids) == tok.apply_chat_template(conv["messages"], tools=[WEATHER], tokenize=False)
    runs = loss_text(tok, ids, mask)
    assert runs[0] == call + "<|im_end|>" and not any("sunny" in r for r in runs)


def test_a_row_without_tools_renders_as_before(tok, tmp_path):
    row = {"messages": OPENAI_ROW["messages"][:2] + [{"role": "assistant", "content": "Sunny."}]}
    [conv] = read_conversations(_write(tmp_path / "plain.jsonl", [row]))
    assert "tools" not in conv and template_kwargs_for(conv, {"enable_thinking": False}) == {"enable_thinking": False}
    ids, _, _ = encode_conversation(tok, conv["messages"], 4096, template_kwargs_for(conv))
    assert "<tools>" not in tok.decode(ids)


@pytest.mark.parametrize("tools, words", [
    ("[{", "'tools' is a string but not JSON"),
    ({"name": "weather"}, "'tools' must be a list of function schemas, got dict"),
    (["weather"], "tools[0] must be an object"),
    ([{"type": "function", "function": {"description": "no name"}}], "tools[0] needs a function 'name'"),
])
def test_bad_tools_are_one_error_naming_file_and_line(tmp_path, tools, words):
    path = _write(tmp_path / "bad.jsonl", [{**OPENAI_ROW, "tools": tools}])
    with pytest.raises(DataError) as err:
        read_conversations(path)
    assert str(err.value).startswith(f"{path}:1: ") and words in str(err.value) and "\n" not in str(err.value)


def test_training_evaluation_and_data_report_render_the_rows_tools(qwen3_model_dir, tmp_path, capsys):
    """One run on tool rows: the held-out prompts τ is measured on hold the schemas (their token
    count is that of apply_chat_template(..., tools=...)'s prompt), and data-report counts the rows."""
    from trainer.__main__ import main
    from trainer.entry import train
    from trainer.run.config import parse_config

    data = _write(tmp_path / "chat.jsonl", [OPENAI_ROW] * 4)
    config = (f"model: {{target: {{path: {qwen3_model_dir}}}, drafter_layers: 1, block_size: 4, dtype: fp32}}\n"
              f"data: {{train_path: {data}, max_length: 512, token_budget: 1024, bucket_edges: [512],"
              f" num_anchors: 2, pad_multiple: 16}}\n"
              f"optim: {{total_steps: 1}}\nrun: {{threads: 1}}\neval: {{samples: 2, max_new_tokens: 2, turns: last}}\n")
    assert train(parse_config(config), tmp_path / "run") == 0
    events = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    (evaluation,) = [e for e in events if e["event"] == "eval"]
    tok = AutoTokenizer.from_pretrained(qwen3_model_dir, local_files_only=True)
    prompt = tok.apply_chat_template(OPENAI_ROW["messages"][:4], tools=OPENAI_ROW["tools"], tokenize=False,
                                     add_generation_prompt=True)
    assert evaluation["prompt_tokens"] == 2 * len(tok(prompt, add_special_tokens=False)["input_ids"])
    (tmp_path / "c.yaml").write_text(config)
    assert main(["data-report", "--config", str(tmp_path / "c.yaml")]) == 0
    assert "with tools (schemas rendered by the chat template): 4 of 4" in capsys.readouterr().out


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_data_report_counts_tools_as_rendered_only_when_the_template_renders_them(
        family, qwen3_model_dir, llama3_model_dir, tmp_path, capsys):
    """data-report counted every row with tools as "rendered by the chat template", also under a
    template that ignores `tools` (Llama 3's) (issue 55): the text with and without them is compared."""
    from trainer.__main__ import main

    model = qwen3_model_dir if family == "qwen3" else llama3_model_dir
    plain = {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]}
    data = _write(tmp_path / "chat.jsonl", [OPENAI_ROW] * 3 + [plain])
    (tmp_path / "c.yaml").write_text(
        f"model: {{target: {{path: {model}}}, drafter_layers: 1, block_size: 4, dtype: fp32}}\n"
        f"data: {{train_path: {data}, max_length: 512, token_budget: 1024, bucket_edges: [512]}}\n")
    assert main(["data-report", "--config", str(tmp_path / "c.yaml")]) == 0
    out = capsys.readouterr().out
    tok = AutoTokenizer.from_pretrained(model, local_files_only=True)
    renders = (tok.apply_chat_template(OPENAI_ROW["messages"], tools=OPENAI_ROW["tools"], tokenize=False)
               != tok.apply_chat_template(OPENAI_ROW["messages"], tokenize=False))
    assert renders == (family == "qwen3")  # the premise: Llama 3's template has no tools block
    if renders:
        assert "with tools (schemas rendered by the chat template): 3 of 4" in out and "ignores" not in out
    else:
        assert "schemas rendered" not in out
        assert "with tools the chat template ignores (its text is the same without them): 3 of 4" in out
