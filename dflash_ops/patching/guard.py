"""The structural guard: does a patch apply, compile, and keep every definition where it was?

The patch is applied in memory to copies of the touched files; the release tree is never
written. A patch is refused when a hunk does not apply, a touched Python file does not
compile, a definition becomes unreachable (placed after a return/raise/continue/break), or,
unless allow_moves, an existing definition disappears or changes its qualified name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from dflash_ops.patching.definitions import Definition, definitions
from dflash_ops.patching.diff import DiffError, FilePatch, HunkFailed, apply_hunks, parse_unified_diff


@dataclass
class Problem:
    kind: str  # diff, hunk, file, syntax, moved, removed, unreachable
    file: str
    line: int | None
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        return f"{where}: {self.message}"


@dataclass
class PatchReport:
    touched: list[str] = field(default_factory=list)
    new_contents: dict[str, str | None] = field(default_factory=dict)  # None: file deleted
    problems: list[Problem] = field(default_factory=list)  # any of these refuses the patch
    notes: list[Problem] = field(default_factory=list)  # reported, not refusing

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        head = "patch OK" if self.ok else "patch REFUSED"
        lines = [f"{head}: {len(self.touched)} file(s): {', '.join(self.touched)}"]
        lines += [f"  error: {p}" for p in self.problems]
        lines += [f"  note:  {p}" for p in self.notes]
        return "\n".join(lines)

    def write_to(self, root: Path) -> None:
        """Write the new contents into a tree (e.g. a copy of the release): tmp + rename per file."""
        if not self.ok:
            raise ValueError("refusing to write a patch that failed its checks:\n" + self.summary())
        for rel, text in self.new_contents.items():
            path = Path(root, rel)
            if text is None:
                path.unlink(missing_ok=True)
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.patch-tmp")
            tmp.write_text(text, encoding="utf-8", newline="")
            if path.exists():
                os.chmod(tmp, path.stat().st_mode & 0o7777)
            os.replace(tmp, path)


def check_patch(release_root: Path | str, diff_text: str, allow_moves: bool = False) -> PatchReport:
    report = PatchReport()
    try:
        patches = parse_unified_diff(diff_text)
    except DiffError as e:
        report.problems.append(Problem("diff", "<diff>", None, str(e)))
        return report
    originals: dict[str, str | None] = {}
    for patch in patches:
        _apply_file_patch(Path(release_root), patch, originals, report)
    report.touched = list(report.new_contents)
    if report.problems:
        return report
    for rel in report.touched:
        _check_python_file(rel, originals[rel], report.new_contents[rel], allow_moves, report)
    return report


def _read_original(root: Path, rel: str, originals: dict[str, str | None], report: PatchReport) -> str | None:
    if rel not in originals:
        path = root / rel
        try:
            originals[rel] = path.read_bytes().decode("utf-8") if path.is_file() else None
        except UnicodeDecodeError:
            report.problems.append(Problem("file", rel, None, "not a UTF-8 text file"))
            originals[rel] = None
        report.new_contents[rel] = originals[rel]
    return report.new_contents[rel]


def _apply_file_patch(root: Path, patch: FilePatch, originals: dict[str, str | None], report: PatchReport) -> None:
    if patch.old_path and patch.new_path and patch.old_path != patch.new_path:
        report.problems.append(Problem("diff", patch.old_path, None,
                                       f"renames to {patch.new_path} are not supported; delete and create instead"))
        return
    rel = patch.path
    current = _read_original(root, rel, originals, report)
    if patch.old_path is None and current is not None:
        report.problems.append(Problem("file", rel, None, "the diff creates this file but it already exists"))
        return
    if patch.old_path is not None and current is None:
        report.problems.append(Problem("file", rel, None, "no such file in the release"))
        return
    crlf = _uses_crlf(current or "")
    try:
        new_text = apply_hunks((current or "").replace("\r\n", "\n") if crlf else current or "", patch.hunks)
        new_text = new_text.replace("\n", "\r\n") if crlf else new_text
    except HunkFailed as e:
        report.problems.append(Problem("hunk", rel, e.hunk.old_start, str(e)))
        return
    if patch.new_path is None:
        if new_text != "":
            report.problems.append(Problem("hunk", rel, None, "the diff deletes this file but does not remove all of it"))
            return
        report.new_contents[rel] = None
    else:
        report.new_contents[rel] = new_text


def _uses_crlf(text: str) -> bool:
    """Every line ends with CRLF: hunks apply to its lines and the result keeps CRLF."""
    return "\n" in text and text.count("\r\n") == text.count("\n")


def _check_python_file(rel: str, old: str | None, new: str | None, allow_moves: bool, report: PatchReport) -> None:
    if not rel.endswith(".py"):
        return
    old_defs = _definitions_or_note(old, rel, report)
    if new is None:
        new_defs: list[Definition] = []
    else:
        try:
            compile(new, rel, "exec", dont_inherit=True)
        except SyntaxError as e:
            report.problems.append(Problem("syntax", rel, e.lineno, f"SyntaxError: {e.msg}"))
            return
        new_defs = definitions(new, rel)
    _compare(rel, old_defs, new_defs, allow_moves, report)


def _definitions_or_note(text: str | None, rel: str, report: PatchReport) -> list[Definition]:
    if text is None:
        return []
    try:
        return definitions(text, rel)
    except SyntaxError as e:
        report.notes.append(Problem("syntax", rel, e.lineno, f"the file did not compile before the patch either: {e.msg}"))
        return []


def _compare(rel: str, old_defs: list[Definition], new_defs: list[Definition], allow_moves: bool,
             report: PatchReport) -> None:
    old_by_name = {d.qualname: d for d in old_defs}
    new_by_name = {d.qualname: d for d in new_defs}
    added = [d for d in new_defs if d.qualname not in old_by_name]
    moves_to = report.notes if allow_moves else report.problems
    for gone in (d for d in old_defs if d.qualname not in new_by_name):
        match = next((d for d in added if d.name == gone.name and d.kind == gone.kind), None)
        if match is not None:
            added.remove(match)
            moves_to.append(Problem("moved", rel, match.line,
                                    f"{gone.kind} {gone.qualname} (was line {gone.line}) → {match.qualname}"))
        else:
            moves_to.append(Problem("removed", rel, gone.line, f"{gone.kind} {gone.qualname} disappears"))
    for d in new_defs:
        if d.reachable:
            continue
        was = old_by_name.get(d.qualname)
        if was is not None and not was.reachable:
            report.notes.append(Problem("unreachable", rel, d.line, f"{d.qualname} was already unreachable"))
        else:
            report.problems.append(Problem("unreachable", rel, d.line,
                                           f"{d.kind} {d.qualname} is unreachable (after a return/raise/continue/break)"))
