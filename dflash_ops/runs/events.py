"""metrics.jsonl events as they enter the operator's side: one parser for every reader (`metrics`,
`dash`, the playbook's `follow`, `run checkpoint --wait`).

A line is an event only when it is a JSON object of at most MAX_LINE bytes, nested at most
MAX_DEPTH levels, whose fields documented in docs/run-directory.md have their documented types
(an int `step`, a number or null `loss`, a list of objects `gpus`...). Anything else is a
BadLine that says why: readers show it as bad and go on; none of them meets a value of a type
it did not expect further down (a string loss in a plot, a number where a list is iterated).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from dflash_ops.helpers.nodefacts import loads_bounded

MAX_LINE = 1 << 20  # the trainer's longest lines (an eval's histograms) are a few KiB
MAX_DEPTH = 8  # the deepest documented field, step's gpus, nests 3 levels


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or check(value)


def _list_of(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, list) and all(check(item) for item in value)


def _gpu(value: Any) -> bool:
    return (isinstance(value, dict) and _int(value.get("index"))
            and all(_optional(_number)(value.get(k)) for k in ("busy", "mem_gb"))
            and _optional(lambda role: isinstance(role, str))(value.get("role")))


def _by_length(value: Any) -> bool:
    """An eval's tau_by_length: {bucket: {prompts: int, tau: number, tau_lookup/tau_ratio: number or null}}."""
    return isinstance(value, dict) and all(
        isinstance(b, dict) and _int(b.get("prompts")) and _number(b.get("tau"))
        and all(_optional(_number)(b.get(k)) for k in ("tau_lookup", "tau_ratio", "prompt_tokens"))
        for b in value.values())


def _by_temperature(value: Any) -> bool:
    """An eval's temperatures: {label: {tau, tau_expected, tau_lookup, tau_lookup_expected: number or null, ...}}."""
    return isinstance(value, dict) and all(
        isinstance(t, dict) and all(_optional(_number)(t.get(k)) for k in ("tau", "tau_expected", "tau_lookup", "tau_lookup_expected"))
        for t in value.values())


def _str(value: Any) -> bool:
    return isinstance(value, str)


_NUMBER_OR_NULL = _optional(_number)
_STR_OR_NULL = _optional(_str)

# field -> (check, what a reader is told it should be)
FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "event": (_str, "a string"),
    "time": (_number, "a number"),
    "step": (_int, "an integer"),
    "total_steps": (_int, "an integer"),
    "recompiles": (_int, "an integer"),
    "attempt": (_int, "an integer"),
    **{name: (_NUMBER_OR_NULL, "a number or null") for name in (
        "loss", "acc", "lr", "grad_norm", "tokens_per_s", "tokens_per_s_steady", "tokens", "pad_share",
        "tau", "tau_per_prompt", "tau_lookup", "tau_ratio", "seconds", "stall_s", "copy_s",
        "selector_loss", "selector_acc", "candidate_recall")},
    **{name: (_STR_OR_NULL, "a string or null") for name in (
        "path", "request", "reason", "message", "thread", "resumed_from", "from")},
    "gpus": (_list_of(_gpu), "a list of {index: int, role, busy, mem_gb}"),
    "shapes": (_list_of(_list_of(_int)), "a list of [batch, seq]"),
    "histogram": (_list_of(_int), "a list of integers"),
    "tau_by_length": (_by_length, "an object of {prompts: int, tau: number, tau_lookup: number or null} by bucket"),
    "acceptance": (_optional(_list_of(_number)), "a list of numbers or null"),
    "temperatures": (_by_temperature, "an object of {tau, tau_expected, tau_lookup, ...: number or null} by temperature"),
}


@dataclass(frozen=True)
class BadLine:
    """A line that is not an event; `problem` says why, `text` is its start (for showing)."""

    problem: str
    text: str

    def describe(self) -> str:
        return f"bad metrics line ({self.problem}): {self.text}"


def parse_event(line: bytes | str) -> dict[str, Any] | BadLine:
    """The event on `line` (a dict whose documented fields have their types), or a BadLine."""
    text = line.decode("utf-8", "replace") if isinstance(line, bytes) else line
    text = text.rstrip("\r\n")
    shown = text if len(text) <= 200 else text[:200] + "..."
    value, problem = loads_bounded(line, MAX_LINE, MAX_DEPTH)
    if problem is not None:
        return BadLine(problem, shown)
    if not isinstance(value, dict):
        return BadLine(f"a JSON {type(value).__name__}, not an object", shown)
    for name, (check, wanted) in FIELDS.items():
        if name in value and not check(value[name]):
            return BadLine(f"{name} is {_kind(value[name])}, not {wanted}", shown)
    if "event" not in value:
        return BadLine("no 'event' field", shown)
    return value


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (list, dict)):
        return f"a JSON {'array' if isinstance(value, list) else 'object'}"
    return f"{type(value).__name__} {value!r}"[:60]
