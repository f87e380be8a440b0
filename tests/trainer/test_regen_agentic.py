"""`python -m trainer_tools.regen --agentic`: whole trajectories of the agent fixture's target
(trainer_tools.fixtures.agent), its calls replayed from the trace, executed by the fixture's
executor, or ending the trajectory; both engines; the token check against the training template."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainer_tools import agentic, regen
from trainer_tools.fixtures import agent_tools
from trainer_tools.fixtures.agent import tool_exec_argv
from trainer_tools.fixtures.openai_server import serve

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def records(path: Path) -> dict[str, dict]:
    return {r["id"]: r for r in (json.loads(line) for line in path.read_text().splitlines() if line.strip())}


def run_cli(args: list, capsys) -> tuple[int, str, str]:
    code = regen.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def hf_args(fx: dict, out: Path, *more) -> list:
    return ["--agentic", "--engine", "hf", "--model-path", fx["model"], "--in", fx["traces"], "--out", out,
            "--max-tokens", 48, *more]


def exec_args(fx: dict) -> list:
    return ["--tool-exec", json.dumps(tool_exec_argv(fx["files"]))]


def shape(record: dict) -> list:
    """Each turn's role, text and calls (call ids left out: a server's and a parser's differ)."""
    return [(m["role"], m.get("content"), [c["function"] for c in m.get("tool_calls", [])]) for m in record["messages"]]


def test_whole_trajectories_replay_execute_and_count(agent_fixture, tmp_path, capsys):
    out = tmp_path / "regen.jsonl"
    code, stdout, err = run_cli(hf_args(agent_fixture, out, *exec_args(agent_fixture)), capsys)
    assert code == 0, err
    assert ("6 trajectories, 13 turns, 3 calls replayed, 3 executed, 0 diverged, 1 tool errors" in stdout), stdout
    got = records(out)
    assert sorted(got) == ["city-hello", "hello", "missing", "other-calc", "same-calc", "triple"]
    assert (tmp_path / "regen.rejected.jsonl").read_text() == ""  # every row's tokens are the engine's
    triple = got["triple"]
    assert triple["calls"] == {"replayed": 1, "executed": 1, "errors": 0} and "stopped" not in triple
    assert shape(triple)[1:] == [
        ("user", "Read notes/n.txt and triple it.", []),
        ("assistant", "", [{"name": "read_file", "arguments": '{"path": "notes/n.txt"}'}]),
        ("tool", "14", []),  # the trace's result (replayed)
        ("assistant", "", [{"name": "calc", "arguments": '{"expr": "14*3"}'}]),  # the trace called 3*14
        ("tool", "42", []),  # the executor's
        ("assistant", "<think>\n\n</think>\n\nTripled, it is 42.", [])]
    assert triple["messages"][3]["tool_call_id"] == triple["messages"][2]["tool_calls"][0]["id"]
    assert triple["tools"] == agent_tools.TOOLS
    missing = got["missing"]
    assert missing["messages"][3]["content"] == "Error: no such file: notes/gone.txt"  # the target sees the error
    assert missing["calls"] == {"replayed": 0, "executed": 1, "errors": 1}
    assert [m["role"] for m in got["city-hello"]["messages"]] == [
        "system", "user", "assistant", "tool", "assistant", "user", "assistant"]
    # what regen wrote trains: the trainer's reader takes it, calls and results included
    from trainer.data.chat import read_conversations

    assert len(read_conversations(out)) == 6


def test_without_an_executor_a_call_the_trace_cannot_answer_ends_the_trajectory(agent_fixture, tmp_path, capsys):
    out = tmp_path / "regen.jsonl"
    code, stdout, err = run_cli(hf_args(agent_fixture, out), capsys)
    assert code == 0, err
    assert "6 trajectories, 10 turns, 3 calls replayed, 0 executed, 3 diverged, 0 tool errors" in stdout
    kept, rejected = records(out), records(tmp_path / "regen.rejected.jsonl")
    diverged = {**kept, **rejected}
    assert {k for k, r in diverged.items() if r.get("stopped") == "diverged"} == {"other-calc", "triple", "missing"}
    triple = diverged["triple"]
    assert triple["calls"]["replayed"] == 1
    assert [m["role"] for m in triple["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert triple["messages"][-1]["tool_calls"][0]["function"]["arguments"] == '{"expr": "14*3"}'
    # Qwen3's template renders the last assistant turn after an empty think block, a call too: a
    # trajectory that ends at a call is not what the target produced there, and is kept out
    assert sorted(rejected) == ["missing", "other-calc", "triple"]
    assert all("by the template" in r["token_mismatch"]["text"] for r in rejected.values())


def test_the_server_with_parsed_tool_calls_gives_the_same_trajectories(agent_fixture, tmp_path, capsys):
    httpd, state = serve(str(agent_fixture["model"]), served_name="agent", load_in_background=False,
                         tool_call_parser="hermes")
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        out = tmp_path / "server.jsonl"
        code, stdout, err = run_cli(["--agentic", "--endpoint", url, "--model", "agent", "--in", agent_fixture["traces"],
                                     "--out", out, "--max-tokens", 48, "--check-tokens", agent_fixture["model"],
                                     "-n", 3, *exec_args(agent_fixture)], capsys)
    finally:
        httpd.shutdown()
    assert code == 0, err
    assert "6 trajectories, 13 turns, 3 calls replayed, 3 executed, 0 diverged, 1 tool errors" in stdout
    assert (tmp_path / "server.rejected.jsonl").read_text() == ""  # the server's token ids were checked
    hf_out = tmp_path / "hf.jsonl"
    assert run_cli(hf_args(agent_fixture, hf_out, *exec_args(agent_fixture)), capsys)[0] == 0
    served, local = records(out), records(hf_out)
    assert {k: shape(r) for k, r in served.items()} == {k: shape(r) for k, r in local.items()}


def test_a_planted_template_mismatch_is_caught_per_row(agent_fixture, tmp_path, capsys):
    """Training with a template that writes a call without the newline after <tool_call>: every row
    with a call is kept out, named with its first differing position; the row without calls is kept."""
    import shutil

    planted = tmp_path / "planted"
    shutil.copytree(agent_fixture["model"], planted)
    config = json.loads((planted / "tokenizer_config.json").read_text())
    newline = "{{- '<tool_call>\\n{\"name\": \"' }}"
    assert newline in config["chat_template"]
    config["chat_template"] = config["chat_template"].replace(newline, "{{- '<tool_call>{\"name\": \"' }}")
    (planted / "tokenizer_config.json").write_text(json.dumps(config))
    out = tmp_path / "regen.jsonl"
    code, stdout, err = run_cli(hf_args(agent_fixture, out, "--check-tokens", planted, *exec_args(agent_fixture)),
                                capsys)
    assert code == 0, err
    assert "5 kept out: the training template's tokens differ from the engine's" in stdout
    assert sorted(records(out)) == ["hello"]
    rejected = records(tmp_path / "regen.rejected.jsonl")
    assert sorted(rejected) == ["city-hello", "missing", "other-calc", "same-calc", "triple"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(planted, local_files_only=True)
    for r in rejected.values():
        m = r["token_mismatch"]
        assert (m["turn"], m["message"]) == (0, 2)  # the first call
        assert tok.decode([m["engine"]]) == "\n" and tok.decode([m["template"]]).startswith("{")
        text = tok.apply_chat_template(r["messages"], tools=r["tools"], tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids[m["position"]] == m["template"] and tok.decode(ids[m["position"] - 1:m["position"]]) == "<tool_call>"
    # a rerun finds every row done, the rejected ones included (the check would fail them again)
    code, stdout, _ = run_cli(hf_args(agent_fixture, out, "--check-tokens", planted, *exec_args(agent_fixture)),
                              capsys)
    assert code == 0 and "0 regenerated, 6 already done" in stdout


def test_a_rerun_resumes_whole_trajectories(agent_fixture, tmp_path, capsys):
    out = tmp_path / "regen.jsonl"
    assert run_cli(hf_args(agent_fixture, out, "--limit", 2, *exec_args(agent_fixture)), capsys)[0] == 0
    first = out.read_text()
    code, stdout, err = run_cli(hf_args(agent_fixture, out, *exec_args(agent_fixture)), capsys)
    assert code == 0, err
    assert "4 regenerated, 2 already done" in stdout
    assert out.read_text().startswith(first) and len(records(out)) == 6


def test_the_turn_limit_ends_a_trajectory(agent_fixture, tmp_path, capsys):
    out = tmp_path / "regen.jsonl"
    code, stdout, _ = run_cli(hf_args(agent_fixture, out, "--max-turns", 1, *exec_args(agent_fixture)), capsys)
    assert code == 0
    got = {**records(out), **records(tmp_path / "regen.rejected.jsonl")}
    assert got["triple"]["stopped"] == "max_turns"
    assert [m["role"] for m in got["triple"]["messages"]] == ["system", "user", "assistant", "tool"]
    assert "hello" in records(out) and "stopped" not in got["hello"]
    assert "5 stopped at the turn limit (--max-turns)" in stdout


# ---------------------------------------------------------------------------- parts


def test_calls_are_the_same_when_their_arguments_are_the_same_json():
    a = {"function": {"name": "calc", "arguments": '{"expr": "6*7", "round": 2}'}}
    assert agentic.same_call(a, {"name": "calc", "arguments": {"round": 2, "expr": "6*7"}})
    assert agentic.same_call(a, {"function": {"name": "calc", "arguments": '{"round":2,"expr":"6*7"}'}})
    assert not agentic.same_call(a, {"name": "calc", "arguments": {"expr": "7*6", "round": 2}})
    assert not agentic.same_call(a, {"name": "calc2", "arguments": {"expr": "6*7", "round": 2}})
    assert not agentic.same_call(a, {"name": "calc", "arguments": {"expr": "6*7", "round": 2.5}})


def test_text_calls_are_parsed_as_a_hermes_parser_does():
    text = 'Let me see.\n<tool_call>\n{"name": "calc", "arguments": {"expr": "1+1"}}\n</tool_call>'
    content, calls = agentic.parse_text_calls(text)
    assert content == "Let me see." and calls == [
        {"id": "call_0", "type": "function", "function": {"name": "calc", "arguments": '{"expr": "1+1"}'}}]
    broken = "<tool_call>\n{\"name\": calc}\n</tool_call>"
    assert agentic.parse_text_calls(broken) == (broken, [])  # not a call: the text is the answer
    assert agentic.parse_text_calls("no call") == ("no call", [])


def test_the_trace_results_are_matched_to_their_calls_per_user_turn():
    msgs = [{"role": "user", "content": "a"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "1", "function": {"name": "f"}},
                                                                {"id": "2", "function": {"name": "g"}}]},
            {"role": "tool", "tool_call_id": "2", "content": "G"}, {"role": "tool", "content": "F"},
            {"role": "user", "content": "b"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "3", "function": {"name": "h"}}]}]
    first, second = agentic.trace_stretches(msgs)
    assert [(r.call["id"], r.result) for r in first] == [("1", "F"), ("2", "G")]
    assert [(r.call["id"], r.result) for r in second] == [("3", None)]


def test_the_executor_hands_back_results_errors_and_timeouts(tmp_path):
    files = tmp_path / "files"
    (files / "notes").mkdir(parents=True)
    (files / "notes" / "a.txt").write_text("hello")
    (tmp_path / "secret").write_text("no")
    run = agentic.ToolExecutor([sys.executable, "-m", "trainer_tools.fixtures.agent_tools", "--root", str(files)]).run
    assert run({"name": "calc", "arguments": '{"expr": "2**10 - (3 // 2)"}'}) == ("1023", False)
    assert run({"function": {"name": "read_file", "arguments": {"path": "notes/a.txt"}}}) == ("hello", False)
    assert run({"name": "read_file", "arguments": {"path": "../secret"}}) == (
        "Error: ../secret: outside the files this tool may read", True)
    assert run({"name": "calc", "arguments": {"expr": "__import__('os')"}})[1]
    assert run({"name": "calc", "arguments": {"expr": "1/0"}}) == ("Error: division by zero", True)
    assert run({"name": "rm", "arguments": {}}) == ("Error: unknown tool 'rm' (known: calc, read_file)", True)
    pidfile = tmp_path / "child.pid"
    script = f"import os,time; open({str(pidfile)!r},'w').write(str(os.getpid())); time.sleep(60)"
    slow = agentic.ToolExecutor([sys.executable, "-c", script], timeout=2)
    assert slow.run({"name": "x", "arguments": {}}) == ("Error: the tool gave no result within 2s", True)
    pid = int(pidfile.read_text())
    assert subprocess.run(["ps", "-p", str(pid), "-o", "stat="], capture_output=True, text=True).stdout.strip() \
        in ("", "Z")  # killed, not left behind
    silent = agentic.ToolExecutor([sys.executable, "-c", "import sys; sys.exit(3)"])
    assert silent.run({"name": "x"}) == ("Error: the tool exited with status 3", True)


@pytest.mark.parametrize("args, message", [
    (["--tool-exec", "python3 x.py"], "--tool-exec answers the target's own calls: it needs --agentic"),
    (["--agentic", "--tool-exec", "[\"python3\", 1]"], "--tool-exec: the JSON array must hold strings only"),
    (["--agentic", "--tool-exec", "no-such-command-52 --x"], "--tool-exec: no-such-command-52: command not found"),
    (["--agentic", "--tool-exec", "python3 'unclosed"], "--tool-exec: No closing quotation"),
    (["--agentic", "--max-turns", "0"], "--max-turns and --max-context-tokens must be at least 1"),
])
def test_bad_agentic_arguments_are_one_line(tmp_path, capsys, args, message):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    code, _, err = run_cli(["--endpoint", "http://127.0.0.1:9", "--model", "m", "--in", prompts,
                            "--out", tmp_path / "o.jsonl", *args], capsys)
    assert code == regen.EXIT_USAGE
    assert err.strip() == f"regen: {message}"


def test_turns_whose_tokens_the_engine_did_not_give_are_counted_as_unchecked(agent_fixture):
    """A server that ignores return_token_ids (or an older vLLM) leaves turns unchecked: counted and
    said in the summary, never passed as checked."""
    from transformers import AutoTokenizer

    from trainer_tools.token_check import TokenChecker

    checker = TokenChecker(AutoTokenizer.from_pretrained(agent_fixture["model"], local_files_only=True))
    record = {"id": "x", "messages": [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi"}],
              "finish_reasons": ["stop"]}
    done = regen.checked(regen.Regenerated(record, regen.Completion("", "stop"), [(1, None, "stop")]), checker)
    assert done.unchecked == 1 and "token_mismatch" not in done.record
    s = regen.Summary(unchecked=1)
    assert "1 turns not token-checked (the engine gave no token ids)" in s.line()
    wrong = regen.checked(regen.Regenerated(record, regen.Completion("", "stop"), [(1, [5, 6], "stop")]), checker)
    assert wrong.unchecked == 0 and wrong.record["token_mismatch"]["turn"] == 0
