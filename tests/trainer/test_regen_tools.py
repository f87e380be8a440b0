"""Regenerating agentic traces: a row's tools go with every request and are rendered by the
template (as `apply_chat_template(..., tools=...)` does); the trace's tool calls and tool results
are kept while the target rewrites the text turns; `--agentic` ends at the target's first tool
call and says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from trainer.data.chat import encode_conversation, read_conversations, template_kwargs_for
from trainer_tools import regen
from trainer_tools.fixtures.openai_server import serve

WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}
TRACE = {"id": "t", "tools": [WEATHER], "messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"}, CALL, RESULT,
    {"role": "assistant", "content": "the trace's own answer"},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "the trace's own goodbye"}]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from trainer_tools.fixtures.hub_model import write_hub_model

    return write_hub_model(tmp_path_factory.mktemp("regen-tools") / "tiny-target", "qwen3")


@pytest.fixture(scope="module")
def server(model_dir):
    httpd, state = serve(str(model_dir), served_name="tiny", load_in_background=False)
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_the_request_carries_the_tools_the_template_renders(server, model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    messages = TRACE["messages"][:4]
    engine = regen.OpenAIEngine([server], "tiny", regen.Sampling(max_tokens=3))
    with_tools = engine.complete(messages, [WEATHER])
    without = engine.complete(messages)
    rendered = tok.apply_chat_template(messages, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    assert with_tools.prompt_tokens == len(tok(rendered, add_special_tokens=False)["input_ids"])
    assert without.prompt_tokens < with_tools.prompt_tokens


def test_a_trace_keeps_its_tool_calls_and_results_and_the_target_rewrites_its_text(server, model_dir, tmp_path,
                                                                                    capsys):
    out = tmp_path / "regen.jsonl"
    code = regen.main(["--endpoint", server, "--model", "tiny", "--in", str(_write(tmp_path / "in.jsonl", [TRACE])),
                       "--out", str(out), "--max-tokens", "4"])
    stdout = capsys.readouterr().out
    assert code == 0 and "1 regenerated" in stdout and "tool call" not in stdout
    [record] = _records(out)
    got = record["messages"]
    assert [m["role"] for m in got] == [m["role"] for m in TRACE["messages"]]
    assert got[:4] == [TRACE["messages"][0], TRACE["messages"][1], {**CALL, "content": ""}, RESULT]
    assert got[5] == TRACE["messages"][5]
    assert "the trace's own" not in got[4]["content"] + got[6]["content"]  # the target's answers
    assert len(record["finish_reasons"]) == 2 and record["tools"] == [WEATHER] and "stopped" not in record
    # what regen wrote trains with its schemas rendered by the template, the calls learned, results not
    [conv] = read_conversations(out)
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    ids, mask, _ = encode_conversation(tok, conv["messages"], 4096, template_kwargs_for(conv))
    assert tok.decode(ids) == tok.apply_chat_template(got, tools=[WEATHER], tokenize=False)
    trained = tok.decode([i for i, m in zip(ids, mask) if m])
    assert '<tool_call>\n{"name": "weather"' in trained and "sunny, 21 C" not in trained


def test_agentic_keeps_only_system_and_user_turns(model_dir, tmp_path, capsys):
    out = tmp_path / "agentic.jsonl"
    code = regen.main(["--engine", "hf", "--model-path", str(model_dir), "--agentic", "--max-tokens", "4",
                       "--in", str(_write(tmp_path / "in.jsonl", [TRACE])), "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    # the random model's answers need not re-tokenize to its own tokens: then the row is kept out
    [record] = _records(out) + _records(tmp_path / "agentic.rejected.jsonl")
    assert [m["role"] for m in record["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert record["messages"][3] == {"role": "user", "content": "Thanks!"}


class Scripted:
    """An engine answering from a script (what the target would say), recording each request."""

    def __init__(self, answers: list[regen.Completion]) -> None:
        self.answers = answers
        self.requests: list[tuple[list[dict], list[dict] | None]] = []

    def complete(self, messages: list[dict], tools: list[dict] | None = None) -> regen.Completion:
        self.requests.append((messages, tools))
        return self.answers[len(self.requests) - 1]

    def close(self) -> None:
        pass


def test_agentic_ends_at_the_targets_first_tool_call_and_says_so(tmp_path):
    call = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    row = {"id": "t", "tools": [WEATHER], "messages": [
        {"role": "user", "content": "Hello"}, {"role": "assistant", "content": "old"},
        {"role": "user", "content": "Weather in Paris?"}, CALL, RESULT, {"role": "assistant", "content": "old"},
        {"role": "user", "content": "Thanks!"}]}
    prompts, _ = regen.read_prompts(_write(tmp_path / "in.jsonl", [row]), agentic=True)
    engine = Scripted([regen.Completion("Hi.", "stop"), regen.Completion(call, "stop")])
    output = regen.Output(tmp_path / "out.jsonl")
    try:
        summary = regen.regenerate(prompts, engine, output, model="m")
    finally:
        output.close()
    [record] = _records(tmp_path / "out.jsonl")
    assert record["stopped"] == "tool_call" and summary.tool_stops == 1
    assert "1 stopped at the target's first tool call" in summary.line()
    assert record["messages"] == [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi."},
                                  {"role": "user", "content": "Weather in Paris?"},
                                  {"role": "assistant", "content": call}]
    assert [tools for _, tools in engine.requests] == [[WEATHER], [WEATHER]]
    # a server's parsed calls (content null) are a tool call too, kept in OpenAI's form
    reply = {"choices": [{"finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None, "tool_calls": CALL["tool_calls"]}}]}
    parsed = regen._completion(reply, 0, 1000)
    assert parsed.calls_tool and parsed.content == "" and parsed.tool_calls == CALL["tool_calls"]


def test_the_trace_mode_also_stops_where_the_target_calls_a_tool_the_trace_has_no_result_for(tmp_path):
    prompts, _ = regen.read_prompts(_write(tmp_path / "in.jsonl", [TRACE]))
    assert [m["role"] for m in prompts[0].messages] == ["system", "user", "assistant", "tool", "user"]
    parsed = regen.Completion("", "stop", tool_calls=CALL["tool_calls"])
    engine = Scripted([parsed])
    record = regen.regenerate_one(engine, prompts[0], "m").record
    assert record["stopped"] == "tool_call"
    assert record["messages"][-1] == {"role": "assistant", "content": "", "tool_calls": CALL["tool_calls"]}
    assert engine.requests[0][0][-1] == RESULT  # asked after the trace's tool result, which it kept
