"""The tree of class and function definitions of a module, with reachability.

Qualified names are dotted by nesting, whatever the parent is: a method is `Class.method`, a
function defined inside a function is `func.inner` (not Python's `func.<locals>.inner`), so a
method that a patch pushed into a function body shows up as `func.method`.

A definition is unreachable when it follows a `return`, `raise`, `continue` or `break` in the
same block, or sits inside an unreachable definition. Python compiles such code silently.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

TERMINATORS = (ast.Return, ast.Raise, ast.Continue, ast.Break)
DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


@dataclass(frozen=True)
class Definition:
    qualname: str
    kind: str  # "class" or "def"
    line: int
    reachable: bool

    @property
    def name(self) -> str:
        return self.qualname.rsplit(".", 1)[-1]


def definitions(source: str, filename: str = "<patch>") -> list[Definition]:
    """All definitions in source order; raises SyntaxError for code that does not parse."""
    found: list[Definition] = []
    _walk_block(ast.parse(source, filename).body, "", True, found)
    return found


def _walk_block(body: list[ast.stmt], prefix: str, reachable: bool, found: list[Definition]) -> None:
    for stmt in body:
        if isinstance(stmt, DEFINITIONS):
            qualname = prefix + stmt.name
            kind = "class" if isinstance(stmt, ast.ClassDef) else "def"
            found.append(Definition(qualname, kind, stmt.lineno, reachable))
            _walk_block(stmt.body, qualname + ".", reachable, found)
        else:
            for block in _child_blocks(stmt):
                _walk_block(block, prefix, reachable, found)
        if isinstance(stmt, TERMINATORS):
            reachable = False


def _child_blocks(stmt: ast.stmt) -> list[list[ast.stmt]]:
    """Statement lists nested in a compound statement (if/for/while/with/try/match)."""
    lists = [getattr(stmt, name, None) for name in ("body", "orelse", "finalbody")]
    blocks = [b for b in lists if isinstance(b, list) and b and isinstance(b[0], ast.stmt)]
    return blocks + [h.body for h in getattr(stmt, "handlers", [])] + [c.body for c in getattr(stmt, "cases", [])]
