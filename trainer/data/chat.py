"""Chat data as people have it, and the assistant loss mask the chat template implies.

Formats, detected per file from its first record (every line must then have that format):
  * OpenAI messages:  {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": ...}, ...]}
  * ShareGPT:         {"conversations": [{"from": "system"|"human"|"gpt"|..., "value": ...}, ...]}
  * prompt/response:  {"prompt": ..., "response": ...} (or "completion"), optional "system"
Each file is JSON Lines; anything else is one error naming file:line.

Every conversation becomes {"messages": [...], "source": "file:line"}, plus "tools" when the
record carries function schemas; extra message keys (`reasoning_content`, `tool_calls`, ...) are
kept for the template.

Tools, in any format: a record's `tools` is OpenAI's list ({"type": "function", "function":
{...}}) or a list of bare function schemas ({"name", "description", "parameters"}, LLaMA-Factory's
ShareGPT form, wrapped into OpenAI's), either as JSON or as a JSON string (ShareGPT/Hermes files
keep it a string). They reach the chat template as its `tools` variable wherever the row is
rendered (`template_kwargs_for`): training, held-out τ, data-report and regeneration, so the system
prompt holds the schemas exactly as the template writes them. A ShareGPT `function_call` turn whose
value is a call ({"name", "arguments"} or a list of them) becomes an assistant turn with
`tool_calls`; `observation` and `tool` turns are tool results (never trained on).

Per-token loss weights (the on-policy stage, trainer_tools.onpolicy; docs/objectives.md): a record
may carry `answer_tokens` (the token ids of its last assistant turn, as the template renders them)
and `loss_weights` (one float > 0 per answer token). The ids make the alignment exact: encoding
checks that the chat template renders the last assistant turn to exactly these tokens (the ids are
the first tokens of its span; a span token past them, the end-of-turn the template adds after an
answer cut at max tokens, weighs 1) and puts the weights on those tokens' loss mask; every other
trained token weighs 1, as in a row without them. A row whose ids or weights do not fit is refused
(file:line: what differs). Weights > 0 only: anchors are drawn among the tokens that carry loss, so a
zero weight would move them.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class DataError(ValueError):
    pass


ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "tool": "tool",
                  "function_call": "assistant", "observation": "tool"}
FORMATS = {"messages": "OpenAI messages", "conversations": "ShareGPT conversations",
           "prompt": "prompt/response pairs"}
KNOWN = ("expected one JSON object per line with 'messages' (OpenAI), 'conversations' (ShareGPT) "
         "or 'prompt' and 'response'")
PROMPT_KNOWN = KNOWN.replace(" and 'response'", " (a response is not needed)")


def detect_format(row: object) -> str | None:
    """'messages', 'conversations' or 'prompt' for a record, None when it is none of them."""
    if not isinstance(row, dict):
        return None
    for key in ("messages", "conversations"):
        if key in row:
            return key
    if "prompt" in row and ("response" in row or "completion" in row):
        return "prompt"
    return None


def _text(value: object, where: str, what: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"{where}: {what} must be a string, got {type(value).__name__}")
    return value


def _entries(row: dict, key: str, where: str) -> list:
    entries = row[key]
    if not isinstance(entries, list) or not entries:
        raise DataError(f"{where}: '{key}' must be a non-empty list")
    return entries


def row_tools(row: dict, where: str) -> list[dict] | None:
    """A record's function schemas in OpenAI's form (see the module docstring), None when it has none."""
    tools = row.get("tools")
    if tools is None or tools == "" or tools == []:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: 'tools' is a string but not JSON: {exc.msg}") from None
    if not isinstance(tools, list):
        raise DataError(f"{where}: 'tools' must be a list of function schemas, got {type(tools).__name__}")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise DataError(f"{where}: tools[{i}] must be an object, got {type(tool).__name__}")
        function = tool.get("function") if tool.get("type") == "function" else tool
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise DataError(f"{where}: tools[{i}] needs a function 'name' ({{\"type\": \"function\", "
                            "\"function\": {\"name\": ...}} or {\"name\": ...})")
        out.append(tool if tool.get("type") == "function" else {"type": "function", "function": tool})
    return out


def weighted_answer(conversation: dict) -> tuple[list[int], list[float]] | None:
    """A read conversation's (answer_tokens, loss_weights) (answer_weights validated them), None without."""
    if "loss_weights" not in conversation:
        return None
    return conversation["answer_tokens"], conversation["loss_weights"]


def template_kwargs_for(conversation: dict, template_kwargs: dict | None = None) -> dict:
    """The chat-template variables one conversation is rendered with: the data config's
    (`trainer.run.config.template_kwargs`) and the row's own `tools`."""
    kwargs = dict(template_kwargs or {})
    if conversation.get("tools"):
        kwargs["tools"] = conversation["tools"]
    return kwargs


def _sharegpt_call(value: str) -> list[dict] | None:
    """The tool calls a ShareGPT `function_call` value holds ({"name", "arguments"} or a list of
    them, as JSON), in OpenAI's form; None when it is not one (kept as text)."""
    try:
        doc = json.loads(value)
    except json.JSONDecodeError:
        return None
    calls = doc if isinstance(doc, list) else [doc]
    if not calls or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        return None
    return [{"type": "function", "function": {"name": c["name"], "arguments": c.get("arguments", {})}}
            for c in calls]


def _from_messages(row: dict, where: str) -> list[dict]:
    out = []
    for i, m in enumerate(_entries(row, "messages", where)):
        if not isinstance(m, dict) or "role" not in m:
            raise DataError(f"{where}: messages[{i}] must be an object with 'role' and 'content'")
        if m["role"] not in ROLES:
            raise DataError(f"{where}: messages[{i}] has role {m['role']!r} (known: {', '.join(ROLES)})")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise DataError(f"{where}: messages[{i}] has non-text content parts (only text is supported)")
            content = "".join(_text(p.get("text"), where, f"messages[{i}] text part") for p in content)
        elif content is None and not (m["role"] == "assistant" and m.get("tool_calls")):
            raise DataError(f"{where}: messages[{i}] has no 'content'")
        elif content is not None:
            _text(content, where, f"messages[{i}].content")
        out.append({**m, "content": content if content is not None else ""})
    return out


def _from_sharegpt(row: dict, where: str) -> list[dict]:
    turns = _entries(row, "conversations", where)
    out = []
    if isinstance(row.get("system"), str) and row["system"]:
        out.append({"role": "system", "content": row["system"]})
    for i, t in enumerate(turns):
        if not isinstance(t, dict) or "from" not in t or "value" not in t:
            raise DataError(f"{where}: conversations[{i}] must be an object with 'from' and 'value'")
        role = SHAREGPT_ROLES.get(str(t["from"]).lower())
        if role is None:
            raise DataError(f"{where}: conversations[{i}] is from {t['from']!r} "
                            f"(known: {', '.join(sorted(SHAREGPT_ROLES))})")
        value = _text(t["value"], where, f"conversations[{i}].value")
        calls = _sharegpt_call(value) if str(t["from"]).lower() == "function_call" else None
        out.append({"role": role, "content": "", "tool_calls": calls} if calls else {"role": role, "content": value})
    return out


def _from_pair(row: dict, where: str) -> list[dict]:
    response = row.get("response", row.get("completion"))
    out = []
    if row.get("system"):
        out.append({"role": "system", "content": _text(row["system"], where, "'system'")})
    out.append({"role": "user", "content": _text(row["prompt"], where, "'prompt'")})
    out.append({"role": "assistant", "content": _text(response, where, "'response'")})
    return out


CONVERTERS = {"messages": _from_messages, "conversations": _from_sharegpt, "prompt": _from_pair}


def jsonl_records(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(line number, record) for every non-blank line of a JSON Lines file; DataError naming file:line."""
    try:
        f = open(path, encoding="utf-8")
    except OSError as exc:
        raise DataError(f"{path}: cannot read: {exc.strerror or exc}") from None
    with f:
        lineno = 0
        try:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    hint = " (a JSON array? write one object per line)" if line.lstrip()[:1] == "[" else ""
                    raise DataError(f"{path}:{lineno}: not JSON: {exc.msg}{hint}") from None
                yield lineno, row
        except UnicodeDecodeError:
            raise DataError(f"{path}:{lineno + 1}: not UTF-8 text") from None


def read_conversations(path: str | Path) -> list[dict]:
    """All conversations of one JSONL file, in any of the supported formats (one per file)."""
    rows, fmt = [], None
    for lineno, row in jsonl_records(path):
        where = f"{path}:{lineno}"
        kind = detect_format(row)
        if kind is None:
            if isinstance(row, list):
                raise DataError(f"{where}: a JSON array (a .json file?); {KNOWN} (JSON Lines)")
            keys = f" (keys: {', '.join(sorted(row)[:6])})" if isinstance(row, dict) else ""
            raise DataError(f"{where}: unknown record{keys}; {KNOWN}")
        if fmt is None:
            fmt = kind
        elif kind != fmt:
            raise DataError(f"{where}: a {FORMATS[kind]} record in a file of {FORMATS[fmt]} (line 1 format)")
        messages = CONVERTERS[kind](row, where)
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{where}: the conversation has no assistant turn to train on")
        tools = row_tools(row, where)
        weighted = answer_weights(row, where)
        form = row.get("form") if isinstance(row, dict) else None  # how the prompt is put: τ is reported per form
        rows.append({"messages": messages, "source": where, **({"tools": tools} if tools else {}),
                     **({"answer_tokens": weighted[0], "loss_weights": weighted[1]} if weighted else {}),
                     **({"form": form} if isinstance(form, str) else {})})
    return rows


def answer_weights(row: dict, where: str) -> tuple[list[int], list[float]] | None:
    """A record's (answer_tokens, loss_weights) (see the module docstring), None when it has neither."""
    tokens, weights = row.get("answer_tokens"), row.get("loss_weights")
    if tokens is None and weights is None:
        return None
    if tokens is None or weights is None:
        given, needed = ("answer_tokens", "loss_weights") if weights is None else ("loss_weights", "answer_tokens")
        raise DataError(f"{where}: '{given}' needs '{needed}' beside it (one weight per answer token id)")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, int) and not isinstance(t, bool)
                                                              and t >= 0 for t in tokens):
        raise DataError(f"{where}: 'answer_tokens' must be a non-empty list of token ids")
    if not isinstance(weights, list) or len(weights) != len(tokens):
        count = len(weights) if isinstance(weights, list) else type(weights).__name__
        raise DataError(f"{where}: 'loss_weights' must hold one weight per answer token: {len(tokens)} tokens, "
                        f"got {count}")
    for i, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 < w < float("inf"):
            raise DataError(f"{where}: loss_weights[{i}] is {w!r}; a weight is a finite number > 0")
    return tokens, [float(w) for w in weights]


def prompt_messages(row: object, where: str) -> list[dict]:
    """A record's turns for regeneration: any supported format, or a `prompt` without a response."""
    if isinstance(row, dict) and "prompt" in row and detect_format(row) is None:
        row = {**row, "response": ""}
    kind = detect_format(row)
    if kind is None or not isinstance(row, dict):  # a known format is a JSON object
        raise DataError(f"{where}: unknown record; {PROMPT_KNOWN}")
    return CONVERTERS[kind](row, where)


def file_format(path: str | Path) -> str:
    """The detected format's name for a file (for reports)."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                return FORMATS.get(detect_format(json.loads(line)) or "", "unknown")
    return "empty"


# ---------------------------------------------------------------------------- loss mask

SENTINEL = "\u2063dflash-end-of-content\u2063"  # invisible separator: never in real data, survives `trim`


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def assistant_spans(tokenizer: Any, messages: list[dict], template_kwargs: dict | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character span of each assistant turn in it.

    A turn's span is what the model generates at that point: from the end of the generation
    prompt (render(messages[:i], add_generation_prompt=True), matched against the full text,
    so a think block the prompt pre-fills, e.g. Qwen3 with enable_thinking=False, stays
    prompt) to the end of its end-of-turn text (`<|im_end|>`, `<|eot_id|>`; the template's
    newline after it is not generated, so not trained). The end is found by rendering the
    conversation with a sentinel appended to this turn's content: whatever follows the
    sentinel follows the turn in the real text, so templates that rewrite turns (Qwen3 drops
    the reasoning of earlier turns, Llama 3 trims) need no model-specific rule. A first
    message from the assistant has no prompt and is not trained.
    """
    kwargs = dict(template_kwargs or {})

    def render(msgs: list[dict], gen: bool = False) -> str:
        try:
            return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen, **kwargs)
        except Exception as exc:  # noqa: BLE001 - whatever the template raises (jinja2's errors, TypeError, ...)
            raise DataError(template_failure(tokenizer, exc)) from None

    text = render(messages)
    spans: list[tuple[int, int]] = []
    for i, m in enumerate(messages):
        if m.get("role") != "assistant" or i == 0:
            continue
        start = _common_prefix(text, render(messages[:i], True))
        previous = spans[-1][1] if spans else 0
        try:
            spans.append(_turn_span(render, messages, i, _marked_content(m), text, start, previous))
        except DataError:
            if not m.get("tool_calls"):
                raise
            # An empty content beside tool calls (OpenAI's `content: null`): templates render an
            # empty content differently from a marked one (Qwen3 adds a newline before
            # <tool_call>), so mark the end of the last call's name instead, which they print as is.
            spans.append(_turn_span(render, messages, i, _marked_tool_call(m), text, start, previous))
    return text, spans


def template_source(tokenizer: Any) -> str:
    """Where the tokenizer's chat template is written: its model directory's chat_template.jinja
    or tokenizer_config.json (a worker's tokenizer, loaded from a temporary copy, is given the
    directory it was read from as its name_or_path: trainer.data.encoding)."""
    directory = Path(str(getattr(tokenizer, "name_or_path", "") or ""))
    if str(directory) not in ("", ".") and directory.is_dir():
        if (directory / "chat_template.jinja").is_file():
            return str(directory / "chat_template.jinja")
        if (directory / "tokenizer_config.json").is_file():
            return f"{directory / 'tokenizer_config.json'} chat_template"
    return "the chat template"


def _template_line(exc: BaseException) -> int | None:
    """The template line an error was raised at: a syntax error's own, else the last frame jinja2
    maps to the template (filename "<template>") in the traceback."""
    line = getattr(exc, "lineno", None)
    if isinstance(line, int):
        return line
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def template_failure(tokenizer: Any, exc: BaseException) -> str:
    """One line: where in the chat template rendering failed, and what it said."""
    source, line = template_source(tokenizer), _template_line(exc)
    where = source if line is None else (f"{source}:{line}" if source.endswith(".jinja") else f"{source} line {line}")
    message = " ".join(str(exc).split()) or "(no message)"
    return f"{where}: the chat template failed: {type(exc).__name__}: {message}"


def _marked_content(m: dict) -> dict:
    return {**m, "content": (m.get("content") or "") + SENTINEL}


def _marked_tool_call(m: dict) -> dict:
    calls = [dict(c) if isinstance(c, dict) else c for c in m["tool_calls"]]
    last = calls[-1]
    if isinstance(last, dict) and isinstance(last.get("function"), dict):
        last["function"] = {**last["function"], "name": str(last["function"].get("name", "")) + SENTINEL}
    elif isinstance(last, dict):
        last["name"] = str(last.get("name", "")) + SENTINEL
    return {**m, "tool_calls": calls}


def _turn_span(render: Any, messages: list[dict], i: int, marked: dict, text: str, start: int,
               previous: int) -> tuple[int, int]:
    """(start, end) of assistant turn i: whatever follows the sentinel in `marked` follows the
    turn's content in the real text (see assistant_spans)."""
    whole = render(messages[:i] + [marked] + messages[i + 1:])
    alone = render(messages[:i] + [marked])
    if whole.count(SENTINEL) != 1 or alone.count(SENTINEL) != 1:
        raise DataError(f"cannot locate assistant turn {i}: the chat template does not render its content")
    after = whole[whole.index(SENTINEL) + len(SENTINEL):]
    tail = alone[alone.index(SENTINEL) + len(SENTINEL):]
    if not text.endswith(after):
        raise DataError(f"cannot locate assistant turn {i}: the chat template renders it differently "
                        "depending on its content")
    content_end = len(text) - len(after)
    end = content_end + len(tail[: _common_prefix(tail, after)].rstrip())
    if not previous <= start <= content_end:
        raise DataError(f"cannot locate assistant turn {i}: its generation prompt is not where the "
                        "conversation renders it")
    return start, end


def encode_conversation(tokenizer: Any, messages: list[dict], max_length: int,
                        template_kwargs: dict | None = None,
                        weighted: tuple[list[int], list[float]] | None = None) -> tuple[list[int], list[float], int]:
    """Token ids and a 0/1 loss mask that is 1 on the assistant turns' tokens (see assistant_spans),
    both cut at max_length, and the untruncated token count. Tokens map to spans through their
    character offsets. weighted: the row's (answer_tokens, loss_weights) (answer_weights): the mask
    is then floats, those weights on the last assistant turn's first tokens, which must be exactly
    answer_tokens (DataError naming the first token that differs)."""
    text, spans = assistant_spans(tokenizer, messages, template_kwargs)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    every = [start for start, _ in enc["offset_mapping"]]
    starts = every[:max_length]
    mask: list[float]
    if all(x <= y for x, y in zip(starts, starts[1:])):  # the usual case: offsets increase
        mask = [0] * len(starts)
        for a, b in spans:  # tokens whose first character lies in an assistant span
            lo, hi = bisect.bisect_left(starts, a), bisect.bisect_left(starts, b)
            mask[lo:hi] = [1] * (hi - lo)
    else:
        mask = [int(any(a <= start < b for a, b in spans)) for start in starts]
    if weighted is not None:
        mask = _weighted_mask(tokenizer, ids, every, spans, mask, weighted)
    return ids[:max_length], mask, len(ids)


def _weighted_mask(tokenizer: Any, ids: list[int], starts: list[int], spans: list[tuple[int, int]],
                   mask: list[float], weighted: tuple[list[int], list[float]]) -> list[float]:
    """`mask` as floats with the answer's weights on the last assistant span's first tokens (see
    encode_conversation); ids and starts are the whole conversation's (before the max_length cut)."""
    tokens, weights = weighted
    if not spans:
        raise DataError("'loss_weights' weigh the last assistant turn, and the conversation has none after a prompt")
    a, b = spans[-1]
    lo = next((i for i, s in enumerate(starts) if s >= a), len(starts))
    hi = next((i for i in range(lo, len(starts)) if starts[i] >= b), len(starts))
    span = ids[lo:hi]
    for k, token in enumerate(tokens):
        if k >= len(span) or span[k] != token:
            rendered = "the turn's end" if k >= len(span) else f"{span[k]} {tokenizer.decode([span[k]])!r}"
            raise DataError(f"answer_tokens[{k}] is {token} {tokenizer.decode([token])!r}, the chat template renders "
                            f"the last assistant turn to {rendered} there: the weights would not fall on the "
                            "tokens trained")
    out = [float(m) for m in mask]
    for k, w in enumerate(weights[: max(0, len(out) - lo)]):  # cut at max_length as the mask is
        out[lo + k] = w
    return out


def trained_tokens(mask: list[float]) -> int:
    """Tokens that carry loss in a conversation's mask (0/1, or weights > 0)."""
    return len(mask) - mask.count(0)


def tokenize_conversation(tokenizer: Any, messages: list[dict], max_length: int,
                          template_kwargs: dict | None = None) -> tuple[list[int], list[float]]:
    ids, mask, _ = encode_conversation(tokenizer, messages, max_length, template_kwargs)
    return ids, mask
