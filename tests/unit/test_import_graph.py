"""No import cycles in dflash_ops/ or trainer/, counting every import (also those inside functions).

A lazy import inside a function hides a cycle from Python but not from a reader: both modules
still need each other. The graph has an edge A -> B for each `import B` / `from B import x` in A
(`from B import m` with B.m a module is an edge to B.m); a package's parent is not an edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("dflash_ops", "trainer", "trainer_tools")


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path], nodes: list[ast.AST] | None = None) -> set[str]:
    """The known modules that `name` (file `path`) imports; nodes: only these statements of it."""
    is_package = path.name == "__init__.py"
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))) if nodes is None else nodes:
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.add(sub if sub in known else base)
    return {t for t in targets if t in known and t != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_graph_sees_the_imports_it_must():
    graph = import_graph()
    assert "trainer.train.loop" in graph["trainer.pipeline.threaded"]
    assert "dflash_ops.render" in graph["dflash_ops.container"]
    assert "trainer.run.stopping" in graph["trainer.pipeline.stages"]  # relative import


def test_a_cycle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    assert cycles(import_graph()) == []


# The trainer's floors, lowest first: a module may import its own folder and any lower floor,
# never a higher one or another folder of its own floor. `run/` is the ground every role stands on
# (config, run directory, control, checkpoint format, stopping, family, the replace rule, the
# contract); trainer_tools/ stands above the whole trainer. docs/architecture.md draws this.
TRAINER_FLOORS: tuple[tuple[str, ...], ...] = (
    ("trainer.run",),
    ("trainer.models", "trainer.data"),
    ("trainer.generate", "trainer.distributed"),
    ("trainer.train",),
    ("trainer.pipeline",),
    ("trainer.entry",),
    ("trainer.__main__",),
    ("trainer_tools",),
)


def floor_of(module: str) -> tuple[int, str] | None:
    for level, folders in enumerate(TRAINER_FLOORS):
        for folder in folders:
            if module == folder or module.startswith(folder + "."):
                return level, folder
    return None


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, targets in sorted(graph.items()):
        here = floor_of(module)
        if here is None:
            continue
        for target in sorted(targets):
            there = floor_of(target)
            if there is None or there[1] == here[1]:
                continue
            if there[0] >= here[0]:
                found.append(f"{module} -> {target}")
    return found


def test_the_layer_rule_catches_an_upward_import():
    graph = {
        "trainer.run.config": {"trainer.models.family"},
        "trainer.models.drafter": {"trainer.data.chat", "trainer.run.config"},
        "trainer.pipeline.threaded": {"trainer.train.loop"},
    }
    assert layer_violations(graph) == ["trainer.models.drafter -> trainer.data.chat", "trainer.run.config -> trainer.models.family"]


def test_every_module_has_a_floor():
    trainer_modules = [m for m in import_graph() if m.startswith(("trainer.", "trainer_tools"))]
    assert [m for m in trainer_modules if floor_of(m) is None] == []


def test_the_trainer_imports_only_downwards():
    assert layer_violations(import_graph()) == []
