"""The prompts a held-out conversation gives for τ: at its last assistant turn, or at every one.

A chat conversation is judged where its last answer starts. An agent conversation answers many
times, after each tool result, and the drafter meets each of those contexts when it is served
(a call right after the user's request, an answer after a long tool output, a tenth call deep
into the trajectory): judged only at one turn, it is judged on one of them. `turn_prompts` gives
every assistant turn's context, each with the turn's index, so that τ can be reported per turn
index (trainer.generate.evaluate: tau_by_turn) and per prompt length.

Modes (eval.turns): "last" (the last assistant turn: what chat evaluation always did), "every"
(each assistant turn that follows another turn), "auto" (every turn for a conversation holding tool
results, the last for one that does not).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

TurnMode = Literal["auto", "last", "every"]
TURN_MODES = ("auto", "last", "every")


@dataclass(frozen=True)
class TurnPrompt:
    conversation: int  # the conversation's index in the list given
    turn: int  # the assistant turn's index among the conversation's assistant turns (0 = the first)
    messages: list[dict]  # the turns before it: rendered with the generation prompt, the context τ is judged in


def has_tool_results(conversation: dict) -> bool:
    return any(m.get("role") == "tool" for m in conversation["messages"])


def turn_prompts(conversations: list[dict], mode: TurnMode = "last") -> list[TurnPrompt]:
    """Each conversation's prompts under `mode` (see the module docstring), in order. An assistant
    turn that opens the conversation has no prompt; a conversation without an assistant turn gives
    none."""
    if mode not in TURN_MODES:
        raise ValueError(f"turns must be one of {', '.join(TURN_MODES)}, got {mode!r}")
    out: list[TurnPrompt] = []
    for c, conv in enumerate(conversations):
        messages = conv["messages"]
        at = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        every = mode == "every" or (mode == "auto" and has_tool_results(conv))
        chosen = list(enumerate(at)) if every else list(enumerate(at))[-1:]
        out.extend(TurnPrompt(c, turn, messages[:i]) for turn, i in chosen if i > 0)
    return out
