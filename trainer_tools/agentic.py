"""Whole agent trajectories for `python -m trainer_tools.regen --agentic` (docs/agent-regen.md).

The target acts on its own from a trace's system and user turns. After each user turn it answers;
each tool call it makes is answered and it goes on, until it answers without a call (then the
next user turn, if the trace has one), a turn limit (`max_turns` assistant turns), or a token
limit (a request whose prompt and answer reach `max_context_tokens`). An answer cut at
max_tokens is an answer (counted as truncated): the next user turn follows, as without --agentic.

A call is answered, in this order, by:
  1. the trace's recorded result, when the call equals the trace's next call (the first recorded
     call of this user turn's stretch not yet replayed): same function, arguments equal as
     canonical JSON (`same_call`). The cursor moves only on a match, so an extra call of the
     target's (executed) does not stop a later one from being replayed;
  2. the user's tool executor (`ToolExecutor`: the call as JSON on stdin, the result on stdout);
     a non-zero exit or a timeout is an error result the target sees ("Error: ..."), as agent
     frameworks hand errors back;
  3. nothing: the trajectory ends at that call, `"stopped": "diverged"` (no result can be made up).

A call is the server's parsed `tool_calls`, or `<tool_call>` blocks in the text (the HF engine,
a server without a tool-call parser), parsed the way vLLM's hermes parser does: the text before
the first block is the content, each block a call, and text whose blocks are not JSON calls is
an answer, not a call. Every call is kept in OpenAI's form (arguments as a JSON string), so the
training template renders it; `trainer_tools.token_check` checks that rendering against the
tokens the engine produced.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from typing import Any

ERROR_PREFIX = "Error: "  # how a failed call's result starts (what the target sees)
MAX_RESULT_BYTES = 1 << 20  # a tool's stdout beyond this is cut (and says so)
CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


class ToolExecError(ValueError):
    """A --tool-exec command that cannot be used (reported as a usage error)."""


# ---------------------------------------------------------------------------- calls


def canonical(arguments: Any) -> str:
    """Arguments as canonical JSON (keys sorted, no spaces); a string that is not JSON stays itself."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return arguments
    return json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def function_of(call: dict) -> tuple[str, Any]:
    """(name, arguments) of a call in OpenAI's form or a bare {"name", "arguments"}."""
    fn = call.get("function")
    if not isinstance(fn, dict):
        fn = call
    return str(fn.get("name", "")), fn.get("arguments", {})


def same_call(a: dict, b: dict) -> bool:
    """Same function, arguments equal as canonical JSON."""
    (name_a, args_a), (name_b, args_b) = function_of(a), function_of(b)
    return name_a == name_b and canonical(args_a) == canonical(args_b)


def parse_text_calls(text: str) -> tuple[str, list[dict]]:
    """(content, calls) of a text that may hold `<tool_call>` blocks (see the module docstring);
    calls in OpenAI's form with ids call_0, call_1, ...; no calls when a block is not a JSON call."""
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls = []
    for i, block in enumerate(CALL_BLOCK.findall(text[start:])):
        try:
            doc = json.loads(block)
        except ValueError:
            return text, []
        if not isinstance(doc, dict) or not isinstance(doc.get("name"), str):
            return text, []
        args = doc.get("arguments", {})
        calls.append({"id": f"call_{i}", "type": "function", "function": {
            "name": doc["name"], "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}})
    if not calls:
        return text, []
    content = text[:start]
    return (content[:-1] if content.endswith("\n") else content), calls


# ---------------------------------------------------------------------------- the trace


@dataclass
class Recorded:
    call: dict
    result: str | None  # None: the trace has no result for it


def trace_stretches(messages: list[dict]) -> list[list[Recorded]]:
    """The trace's calls and their results, one list per user turn (the calls made after it).
    A result is matched to its call by tool_call_id, else by order among the turn's results."""
    stretches: list[list[Recorded]] = []
    for m in messages:
        if m.get("role") == "user":
            stretches.append([])
        elif not stretches:
            continue
        elif m.get("role") == "assistant":
            for c in m.get("tool_calls") or []:
                if isinstance(c, dict):
                    stretches[-1].append(Recorded(c, None))
        elif m.get("role") == "tool":
            waiting = [r for r in stretches[-1] if r.result is None]
            by_id = [r for r in waiting if m.get("tool_call_id") and r.call.get("id") == m.get("tool_call_id")]
            target = by_id[0] if by_id else (waiting[0] if waiting else None)
            if target is not None:
                target.result = str(m.get("content") or "")
    return stretches


# ---------------------------------------------------------------------------- the executor


def parse_tool_exec(text: str) -> list[str]:
    """--tool-exec's argv: a JSON array of strings, or a command line split by POSIX shell-word
    rules (shlex.split: quotes and backslashes, no expansion); run without a shell either way."""
    text = text.strip()
    if text.startswith("["):
        try:
            argv = json.loads(text)
        except ValueError as e:
            raise ToolExecError(f"--tool-exec: not a JSON array: {e}") from None
        if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
            raise ToolExecError("--tool-exec: the JSON array must hold strings only")
    else:
        try:
            argv = shlex.split(text)
        except ValueError as e:
            raise ToolExecError(f"--tool-exec: {e}") from None
    if not argv or not argv[0]:
        raise ToolExecError("--tool-exec: empty command")
    if shutil.which(argv[0]) is None:
        raise ToolExecError(f"--tool-exec: {argv[0]}: command not found")
    return argv


@dataclass(frozen=True)
class ToolExecutor:
    """Runs one call per process: `argv` gets {"id", "name", "arguments"} as JSON on stdin; its
    stdout is the result. The process runs in its own session, killed with its children at
    `timeout` seconds."""

    argv: list[str]
    timeout: float = 30.0

    def run(self, call: dict) -> tuple[str, bool]:
        """(result, failed): a non-zero exit or a timeout gives an error result."""
        name, args = function_of(call)
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass  # handed over as the text the target wrote
        payload = json.dumps({"id": call.get("id"), "name": name, "arguments": args}, ensure_ascii=False)
        try:
            proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True)
        except OSError as e:
            return f"{ERROR_PREFIX}the tool executor could not start: {e.strerror or e}", True
        try:
            out, err = proc.communicate(payload.encode(), timeout=self.timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return f"{ERROR_PREFIX}the tool gave no result within {self.timeout:g}s", True
        finally:
            if proc.poll() is None:  # an exception (Ctrl-C) while waiting: stop what we started
                _kill_group(proc)
        if proc.returncode != 0:
            lines = [line for line in err.decode("utf-8", "replace").splitlines() if line.strip()]
            why = lines[-1].strip() if lines else f"the tool exited with status {proc.returncode}"
            return ERROR_PREFIX + why, True
        text = out[:MAX_RESULT_BYTES].decode("utf-8", "replace")
        if len(out) > MAX_RESULT_BYTES:
            text += f"\n[cut: the result had {len(out)} bytes]"
        return text, False


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.communicate()


# ---------------------------------------------------------------------------- one trajectory


@dataclass(frozen=True, kw_only=True)
class Agent:
    """How trajectories are carried on: the executor (None: a call the trace cannot answer ends
    the trajectory) and the limits."""

    executor: ToolExecutor | None = None
    max_turns: int = 16
    max_context_tokens: int = 32768


@dataclass
class Turn:
    """What the engine produced for one assistant message (for the token check)."""

    message: int  # its index in the record's messages
    token_ids: list[int] | None
    finish_reason: str


@dataclass
class Trajectory:
    record: dict
    turns: list[Turn] = field(default_factory=list)
    replayed: int = 0
    executed: int = 0
    errors: int = 0
    completion_tokens: int = 0
    retries: int = 0
    truncated: bool = False


def assistant_message(content: str, calls: list[dict], reasoning: str | None) -> dict:
    m: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        m["reasoning_content"] = reasoning
    if calls:
        m["tool_calls"] = calls
    return m


def run_trajectory(engine: Any, prompt: Any, model: str, agent: Agent) -> Trajectory:
    """The target's whole trajectory from `prompt` (a regen Prompt: its kept system and user
    turns, the full `trace`, its tools); see the module docstring."""
    stretches = trace_stretches(prompt.trace)
    history: list[dict] = []
    t = Trajectory(record={})
    finish_reasons: list[str] = []
    stopped = None
    stretch = -1
    for m in prompt.messages:
        history.append(m)
        if m["role"] != "user":
            continue
        stretch += 1
        recorded = stretches[stretch] if stretch < len(stretches) else []
        cursor = 0
        while stopped is None:
            if len(t.turns) >= agent.max_turns:
                stopped = "max_turns"
                break
            c = engine.complete(list(history), prompt.tools)
            t.completion_tokens += c.completion_tokens
            t.retries += c.retries
            finish_reasons.append(c.finish_reason)
            if c.tool_calls:
                content, calls = c.content, c.tool_calls
            else:  # ids unique in the trajectory, as a server's are
                content, calls = parse_text_calls(c.content)
                calls = [{**call, "id": f"call_{len(t.turns)}_{i}"} for i, call in enumerate(calls)]
            history.append(assistant_message(content, calls, c.reasoning_content))
            t.turns.append(Turn(len(history) - 1, c.token_ids, c.finish_reason))
            t.truncated |= c.finish_reason == "length"
            if not calls or c.finish_reason == "length":  # an answer cut short is an answer, as in regenerate_one
                break
            results = []
            for i, call in enumerate(calls):
                call_id = str(call.get("id") or f"call_{len(t.turns)}_{i}")
                name, _ = function_of(call)
                if cursor < len(recorded) and recorded[cursor].result is not None \
                        and same_call(call, recorded[cursor].call):
                    content, t.replayed, cursor = recorded[cursor].result or "", t.replayed + 1, cursor + 1
                elif agent.executor is not None:
                    content, failed = agent.executor.run(call)
                    t.executed += 1
                    t.errors += failed
                else:
                    stopped = "diverged"
                    break
                results.append({"role": "tool", "tool_call_id": call_id, "name": name, "content": content})
            if stopped is not None:
                break  # the turn's call is kept, unanswered; results of its other calls are not
            history.extend(results)
            if c.prompt_tokens + c.completion_tokens >= agent.max_context_tokens:
                stopped = "token_limit"
        if stopped is not None:
            break
    t.record = {"id": prompt.id, "messages": history, **({"tools": prompt.tools} if prompt.tools else {}),
                "finish_reasons": finish_reasons, "model": model,
                "calls": {"replayed": t.replayed, "executed": t.executed, "errors": t.errors},
                **({"stopped": stopped} if stopped else {})}
    return t
