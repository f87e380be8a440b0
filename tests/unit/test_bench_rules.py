"""The lab (bench/) obeys the product's rules (issue #48 item 4): it imports no private name of the
product or of itself, each script's `main` is a short skin over functions that have tests, it is
type-checked, and the product names no benchmark script (no hooks kept for one).

Each rule is a function over source text, so that a planted violation shows the test can fail."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
OURS = ("trainer", "trainer_tools", "dflash_ops", "bench")  # whose private names are private
MAIN_LINES = 80


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _ours(module: str) -> bool:
    return module.split(".")[0] in OURS


def private_uses(source: str) -> list[str]:
    """Where `source` reaches a private name of our packages: `from ours import _name`, an import of
    a private module (`ours._mod`), or `alias._name` on a name bound to one of our modules."""
    found, bound = [], set()
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or _ours(node.module or "")):
            module = node.module or ""
            if any(_private(part) for part in module.split(".")):
                found.append(f"{node.lineno}: from {module} import")
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{node.lineno}: from {module} import {alias.name}")
                bound.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _ours(alias.name):
                    if any(_private(part) for part in alias.name.split(".")):
                        found.append(f"{node.lineno}: import {alias.name}")
                    bound.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in bound:
                found.append(f"{node.lineno}: {root.id}...{node.attr}")
    return found


def long_mains(source: str, most: int = MAIN_LINES) -> list[str]:
    """A script (it has `if __name__ == "__main__"`) whose top-level `main` is missing or longer than `most` lines."""
    tree = ast.parse(source)
    if "__main__" not in source:
        return []
    mains = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == "main"]
    if not mains:
        return ["no top-level main()"]
    lines = mains[0].end_lineno - mains[0].lineno + 1
    return [f"main is {lines} lines (at most {most})"] if lines > most else []


BENCH_SCRIPT = re.compile(r"\bbench/(?!RESULTS\.md)[\w./-]+|\b(?:from|import) bench\b")


def names_bench(source: str) -> list[str]:
    """Lines of product code that name a benchmark script or import bench (a result cited from
    bench/RESULTS.md is evidence, not a hook)."""
    return [f"{n}: {line.strip()}" for n, line in enumerate(source.splitlines(), 1) if BENCH_SCRIPT.search(line)]


def bench_sources() -> list[Path]:
    return sorted(BENCH.glob("*.py"))


def test_the_rules_catch_a_planted_violation():
    planted = ("from trainer.run.contract import _secret\nfrom bench import _common\nimport dflash_ops.runs.follow as f\n"
               "x = f._Stream\nimport trainer\ny = trainer.models._private_thing\nfrom .quality import fmt, _f\n"
               "from dflash_ops.runs._impl import thing\nz = torch._dynamo\n")
    assert private_uses(planted) == ["1: from trainer.run.contract import _secret", "2: from bench import _common",
                                     "7: from quality import _f", "8: from dflash_ops.runs._impl import",
                                     "4: f..._Stream", "6: trainer..._private_thing"]
    assert private_uses("import os\nos._exit(0)\nfrom trainer.run import contract\ncontract.__name__\n") == []
    script = "def main():\n" + "    pass\n" * MAIN_LINES + "\nif __name__ == '__main__':\n    main()\n"
    assert long_mains(script) == [f"main is {MAIN_LINES + 1} lines (at most {MAIN_LINES})"]
    assert long_mains("if __name__ == '__main__':\n    print(1)\n") == ["no top-level main()"]
    assert long_mains("def main():\n    pass\n") == []  # a module, not a script
    assert names_bench("x = 1  # bench/pipeline.py turns it off\nfrom bench import quality\n") == [
        "1: x = 1  # bench/pipeline.py turns it off", "2: from bench import quality"]
    assert names_bench("# measured: bench/RESULTS.md, issue #35\n") == []


def test_bench_imports_no_private_name():
    found = {p.name: private_uses(p.read_text()) for p in bench_sources()}
    assert {name: f for name, f in found.items() if f} == {}


def test_every_bench_script_main_is_at_most_80_lines():
    found = {p.name: long_mains(p.read_text()) for p in bench_sources()}
    assert {name: f for name, f in found.items() if f} == {}


def test_product_code_names_no_benchmark_script():
    found = {}
    for package in ("trainer", "dflash_ops", "trainer_tools"):
        for path in sorted((ROOT / package).rglob("*.py")):
            hits = names_bench(path.read_text())
            if hits:
                found[str(path.relative_to(ROOT))] = hits
    assert found == {}


def test_bench_is_a_type_checked_package():
    assert (BENCH / "__init__.py").exists()
    files = re.search(r"^\[tool\.mypy\]\nfiles = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M)
    assert files is not None and '"bench"' in files[1].split(", ")
