"""Text from a run directory, a model or a data set, made safe to show on a terminal.

Such text is data, not ours: a chat template, a log line or an error message may hold control
characters (ESC sequences that move the cursor, recolour or retitle the terminal, a carriage
return that overwrites the line). Every place that renders it to the operator (`run status`, the
dashboard's rows, summary and log) passes it through `printable` first; JSON output is left as it
is (JSON escapes them itself).
"""

from __future__ import annotations

import re

# C0 controls but tab, DEL, and the C1 controls (0x80-0x9f: CSI and OSC have one-character forms)
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")


def _escape(match: re.Match[str]) -> str:
    return "\\x%02x" % ord(match.group(0))


def printable(text: object) -> str:
    """str(text) with every control character but tab shown as `\\xNN` (newlines too: one value,
    one line). A line of a log keeps its text; only what would act on the terminal is escaped."""
    return _CONTROL.sub(_escape, text if isinstance(text, str) else str(text))


def printable_lines(text: str) -> list[str]:
    """A multi-line text (a log tail) as printable lines."""
    return [printable(line) for line in text.rstrip("\n").splitlines()]
