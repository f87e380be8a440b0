"""Unified diffs: parse them strictly and apply them to text, hunk by hunk.

Paths are relative to the release root; `a/` and `b/` prefixes (git style) are dropped.
`/dev/null` on the old side creates a file, on the new side deletes it. A hunk applies where
its context and removed lines match exactly, at the stated line or the nearest offset after
the previous hunk (like `patch` without fuzz).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath

HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
# git's extended header lines (git-diff(1) "generated diff formats") that change more than text:
# a patch made only of text hunks would drop them, so they are refused by name.
GIT_UNSUPPORTED = (
    ("old mode ", "a mode change"), ("new mode ", "a mode change"),
    ("rename from ", "a rename"), ("rename to ", "a rename"),
    ("copy from ", "a copy"), ("copy to ", "a copy"),
    ("Binary files ", "a binary change"), ("GIT binary patch", "a binary change"),
)
REGULAR_FILE_MODE = "100644"
DEV_NULL = "/dev/null"
# Names the release machinery gives a meaning to: a patched file there would overwrite the
# release manifest or (under `.helpers/`) be installed into BASE/helpers, outside the release.
RESERVED_TOP_NAMES = {".dflash-release.json", ".dflash-delta.json", ".helpers"}


class DiffError(ValueError):
    """The diff text itself is malformed (with the diff's line number)."""


@dataclass
class Hunk:
    old_start: int
    old_len: int
    new_start: int
    new_len: int
    header: str
    diff_line: int
    lines: list[tuple[str, str]] = field(default_factory=list)  # (" "|"-"|"+", text without "\n")
    old_missing_newline: bool = False
    new_missing_newline: bool = False

    @property
    def old_lines(self) -> list[str]:
        return [text for tag, text in self.lines if tag != "+"]

    @property
    def new_lines(self) -> list[str]:
        return [text for tag, text in self.lines if tag != "-"]


@dataclass
class FilePatch:
    old_path: str | None  # None: the file is created
    new_path: str | None  # None: the file is deleted
    hunks: list[Hunk] = field(default_factory=list)

    @property
    def path(self) -> str:
        return self.new_path or self.old_path  # type: ignore[return-value]


class HunkFailed(Exception):
    def __init__(self, hunk_index: int, hunk: Hunk, detail: str) -> None:
        super().__init__(f"hunk #{hunk_index} ({hunk.header}) does not apply: {detail}")
        self.hunk = hunk


def _clean_path(raw: str, prefix: str, diff_line: int) -> str | None:
    path = raw.split("\t", 1)[0].strip()
    if path == DEV_NULL:
        return None
    if path.startswith(prefix):
        path = path[len(prefix):]
    p = PurePosixPath(path)
    if not path or p.is_absolute() or ".." in p.parts:
        raise DiffError(f"diff line {diff_line}: path {raw.strip()!r} must be relative to the release root")
    if p.parts[0] in RESERVED_TOP_NAMES:
        raise DiffError(f"diff line {diff_line}: path {raw.strip()!r} is reserved for the release machinery")
    return str(p)


def diff_lines(text: str) -> list[str]:
    """Lines split at "\n" only (a form feed or U+2028 is content, not a line break); a CR
    before the "\n" is dropped so a diff saved with CRLF endings reads the same."""
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def parse_unified_diff(text: str) -> list[FilePatch]:
    lines = diff_lines(text)
    patches: list[FilePatch] = []
    i = 0
    git_header: int | None = None  # diff line of the `diff --git` whose header is being read
    git_header_patches = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("diff --git "):
            _refuse_empty_git_change(lines, git_header, git_header_patches)
            git_header, git_header_patches = i + 1, 0
            i += 1
            continue
        if git_header is not None:
            _refuse_git_extension(line, i + 1)
        if not line.startswith("--- "):
            i += 1  # `index` lines and prose are not needed
            continue
        git_header_patches += 1
        if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
            raise DiffError(f"diff line {i + 1}: '---' header without a following '+++' line")
        patch = FilePatch(_clean_path(line[4:], "a/", i + 1), _clean_path(lines[i + 1][4:], "b/", i + 2))
        if patch.old_path is None and patch.new_path is None:
            raise DiffError(f"diff line {i + 1}: both sides are /dev/null")
        i += 2
        while i < len(lines) and lines[i].startswith("@@"):
            hunk, i = _parse_hunk(lines, i)
            patch.hunks.append(hunk)
        if not patch.hunks:
            raise DiffError(f"diff line {i}: no hunks for {patch.path}")
        patches.append(patch)
        git_header = None  # one file per `diff --git` section: what follows is prose or the next one
    _refuse_empty_git_change(lines, git_header, git_header_patches)
    if not patches:
        raise DiffError("no file changes found (expected '--- a/PATH' / '+++ b/PATH' / '@@' lines)")
    return patches


def _refuse_git_extension(line: str, diff_line: int) -> None:
    for prefix, what in GIT_UNSUPPORTED:
        if line.startswith(prefix):
            raise DiffError(f"diff line {diff_line}: {what} ({line.strip()!r}) is not supported: "
                            "a patch changes the text of files only; make that change locally and deploy")
    for prefix in ("new file mode ", "deleted file mode "):
        if line.startswith(prefix) and line[len(prefix):].strip() != REGULAR_FILE_MODE:
            raise DiffError(f"diff line {diff_line}: file mode {line[len(prefix):].strip()} ({line.strip()!r}) "
                            f"is not supported: a patch creates regular files ({REGULAR_FILE_MODE}) only")


def _refuse_empty_git_change(lines: list[str], git_header: int | None, patches: int) -> None:
    """A `diff --git` section without '---'/'+++' changes something that is not text."""
    if git_header is not None and patches == 0:
        raise DiffError(f"diff line {git_header}: {lines[git_header - 1].strip()!r} has no text hunks "
                        "(an empty file, a mode-only or binary change): not supported by patch")


def _parse_hunk(lines: list[str], i: int) -> tuple[Hunk, int]:
    m = HUNK_RE.match(lines[i])
    if not m:
        raise DiffError(f"diff line {i + 1}: bad hunk header {lines[i]!r}")
    old_start, old_len, new_start, new_len = (int(g) if g is not None else 1 for g in m.groups())
    hunk = Hunk(old_start, old_len, new_start, new_len, lines[i].split(" @@")[0] + " @@", i + 1)
    i += 1
    old_seen = new_seen = 0
    while old_seen < old_len or new_seen < new_len:
        if i >= len(lines):
            raise DiffError(f"diff line {hunk.diff_line}: hunk {hunk.header} ends early (file truncated?)")
        line = lines[i]
        tag, body = (line[:1], line[1:]) if line else (" ", "")  # an empty line is empty context
        if tag not in " -+":
            raise DiffError(f"diff line {i + 1}: hunk {hunk.header} expects more lines, got {line!r}")
        if tag != "+":
            old_seen += 1
        if tag != "-":
            new_seen += 1
        hunk.lines.append((tag, body))
        i += 1
        while i < len(lines) and lines[i].startswith("\\"):
            if tag != "+":
                hunk.old_missing_newline = True
            if tag != "-":
                hunk.new_missing_newline = True
            i += 1
    if old_seen != old_len or new_seen != new_len:
        raise DiffError(f"diff line {hunk.diff_line}: hunk {hunk.header} line counts do not match its body")
    return hunk, i


def apply_hunks(original: str, hunks: list[Hunk]) -> str:
    """Apply hunks to a file's text; raises HunkFailed naming the first hunk that does not fit."""
    source = original.split("\n")
    ends_with_newline = original.endswith("\n") or original == ""
    if ends_with_newline:
        source.pop()
    result: list[str] = []
    cursor = 0
    delta = 0
    for index, hunk in enumerate(hunks, 1):
        old = hunk.old_lines
        stated = hunk.old_start - 1 if hunk.old_len else hunk.old_start
        wanted = stated + delta
        at = _find(source, old, wanted, cursor)
        if at is None:
            raise HunkFailed(index, hunk, _mismatch(source, old, max(wanted, cursor)))
        result += source[cursor:at]
        result += hunk.new_lines
        cursor = at + len(old)
        delta = at - stated
        if hunk.new_missing_newline and cursor == len(source):
            ends_with_newline = False
        elif hunk.old_missing_newline and cursor == len(source):
            ends_with_newline = True
    result += source[cursor:]
    text = "\n".join(result)
    return text + "\n" if ends_with_newline and result else text


def _find(source: list[str], old: list[str], wanted: int, floor: int) -> int | None:
    """The matching position nearest `wanted` (the lower one on a tie), not before `floor`.

    Searched outward from `wanted`, so a hunk at its stated line costs its own length, not
    the file's (a 6,000-hunk patch sorted every position of the file for every hunk)."""
    last = len(source) - len(old)
    if last < floor:
        return None
    wanted = min(max(wanted, floor), last)
    for distance in range(0, max(wanted - floor, last - wanted) + 1):
        for at in (wanted - distance, wanted + distance) if distance else (wanted,):
            if floor <= at <= last and source[at:at + len(old)] == old:
                return at
    return None


def _mismatch(source: list[str], old: list[str], at: int) -> str:
    for k, expected in enumerate(old):
        line_no = at + k + 1
        actual = source[at + k] if at + k < len(source) else None
        if actual != expected:
            found = "end of file" if actual is None else repr(actual)
            return f"at line {line_no} expected {expected!r}, found {found}"
    return f"context not found near line {at + 1}"
