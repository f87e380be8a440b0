"""Exact tokens: a regenerated conversation, rendered by the training template, holds at every
assistant turn exactly the tokens the engine produced there.

Training renders the conversation whole with the chat template (`trainer.data.chat.assistant_spans`)
and learns the tokens of each assistant span. What the engine produced can differ: a call the
server parsed and the template renders again with other spacing, a template at training that is
not the one the server used, a tokenization that merges differently across a turn's edge. A
drafter trained on such a row learns tokens the target did not produce, so the row is kept out
of the output (regen writes it to the rejected file with the mismatch).

Compared per assistant turn: the template's tokens of that turn's span (from the end of its
generation prompt to its end-of-turn token) against the engine's tokens, the end-of-turn token
included. A turn cut at max_tokens (finish_reason "length") has no end-of-turn token from the
engine, so only the engine's tokens are compared, against the start of the span. The context
before a turn is not compared: templates rewrite history on purpose (Qwen3 drops the reasoning of
turns before the last user turn), and that is the context training has.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass
from typing import Any

from trainer.data.chat import DataError, assistant_spans


@dataclass(frozen=True)
class Mismatch:
    turn: int  # the assistant turn (0 = first)
    message: int  # its index in the conversation's messages
    position: int  # the first differing token's position in the rendered conversation
    engine: int | None  # the engine's token there (None: the engine's turn ended before)
    template: int | None  # the template's token there (None: the template's span ended before)
    note: str = ""  # why, when the conversation could not be rendered at all

    def describe(self, tokenizer: Any) -> str:
        if self.note:
            return self.note

        def show(token: int | None) -> str:
            return "end of turn" if token is None else f"{token} {tokenizer.decode([token])!r}"

        return (f"assistant turn {self.turn} (message {self.message}): token {self.position} of the rendered "
                f"conversation is {show(self.template)} by the template, {show(self.engine)} by the engine")

    def to_json(self, tokenizer: Any) -> dict:
        return {"turn": self.turn, "message": self.message, "position": self.position, "engine": self.engine,
                "template": self.template, "text": self.describe(tokenizer)}


def first_difference(engine: list[int], template: list[int], cut: bool) -> int | None:
    """Index of the first token that differs (cut: the engine's tokens are a prefix), None when equal."""
    for i, (a, b) in enumerate(zip(engine, template)):
        if a != b:
            return i
    if len(engine) == len(template) or (cut and len(engine) <= len(template)):
        return None
    return min(len(engine), len(template))


class TokenChecker:
    """Checks conversations against the training tokenizer and template (`check`); one at a time
    (a fast tokenizer's state is not safe to share between threads)."""

    def __init__(self, tokenizer: Any, template_kwargs: dict | None = None):
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        self._lock = threading.Lock()

    def check(self, messages: list[dict], tools: list[dict] | None,
              produced: list[tuple[int, list[int], str]]) -> Mismatch | None:
        """The first mismatch, or None. produced: (message index, the engine's token ids, finish
        reason) for every assistant turn the engine produced."""
        kwargs = {**self.template_kwargs, **({"tools": tools} if tools else {})}
        with self._lock:
            try:
                text, spans = assistant_spans(self.tokenizer, messages, kwargs)
            except DataError as e:
                first = produced[0][0] if produced else 0
                return Mismatch(0, first, 0, None, None, f"the training template cannot render the conversation: {e}")
            enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, starts = enc["input_ids"], [a for a, _ in enc["offset_mapping"]]
        at = [i for i, m in enumerate(messages) if m.get("role") == "assistant" and i > 0]  # assistant_spans' order
        by_message = dict(zip(at, spans))
        for turn, (index, tokens, finish) in enumerate(produced):
            a, b = by_message[index]
            lo, hi = bisect.bisect_left(starts, a), bisect.bisect_left(starts, b)
            k = first_difference(tokens, ids[lo:hi], finish == "length")
            if k is not None:
                return Mismatch(turn, index, lo + k, tokens[k] if k < len(tokens) else None,
                                ids[lo + k] if lo + k < hi else None)
        return None
