"""Import modules from a code tree and report failures as JSON (python3.8+, stdlib only).

  import_check.py [--static] ROOT MODULE...

Runs in the container's venv against a patched tree before it becomes a release. With
--static (what `patch --check` uses) no code of ROOT runs: each module is compiled and every
module-level import is resolved without importing it (modules of ROOT by their files and
the names they define, others by `importlib.util.find_spec` of their top-level package). Prints one
JSON document {"ok": bool, "root": ROOT, "results": [{"module", "ok", "error", "file",
"line", "traceback"}]}; exit status 0 when every module imports, else one of the EXIT_* below.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import sys
import traceback
from collections.abc import Callable, Iterator

EXIT_IMPORT_FAILED = 1  # the JSON document says which modules failed (dflash_ops/patching/rollout.py)
EXIT_BAD_INPUT = 2  # no JSON: the usage line on stderr


def import_one(name: str) -> dict:
    try:
        importlib.import_module(name)
    except BaseException as e:  # noqa: BLE001 - a module may call sys.exit or raise anything at import
        frames = traceback.extract_tb(e.__traceback__)
        where = frames[-1] if frames else None
        result = {
            "module": name, "ok": False, "error": "%s: %s" % (type(e).__name__, e),
            "file": where.filename if where else None, "line": where.lineno if where else None,
            "traceback": "".join(traceback.format_exception(type(e), e, e.__traceback__)[-12:]),
        }
        if isinstance(e, SyntaxError):
            result["file"], result["line"] = e.filename, e.lineno
        return result
    return {"module": name, "ok": True, "error": None, "file": None, "line": None, "traceback": None}


def module_file(root: str, name: str) -> str | None:
    """The file of module `name` inside root, or None."""
    base = os.path.join(root, *name.split("."))
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(path):
            return path
    if os.path.isdir(base):
        return base  # a namespace package
    return None


def module_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements that run at import time (not inside functions or classes)."""
    for node in body:
        yield node
        for field in ("body", "orelse", "finalbody", "handlers"):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                yield from module_level(getattr(node, field, None) or [])


def defined_names(tree: ast.Module) -> set[str] | None:
    """Names a module defines at import time; None when it cannot be known statically."""
    names = set()
    for node in module_level(tree.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    return None
                names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For, ast.With)):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            if isinstance(node, ast.With):
                targets = [item.optional_vars for item in node.items]
            for target in targets:
                for leaf in ast.walk(target) if target is not None else ():
                    if isinstance(leaf, ast.Name):
                        names.add(leaf.id)
    if "__getattr__" in names:
        return None
    return names


class StaticError(Exception):
    def __init__(self, message: str, line: int) -> None:
        Exception.__init__(self, message)
        self.line = line


def resolve(root: str, package: str, node: ast.Import | ast.ImportFrom,
            parse: Callable[[str], ast.Module]) -> None:
    """Raise StaticError when an import statement would fail to find what it names."""
    if isinstance(node, ast.Import):
        wanted: list[tuple[str, str | None]] = [(alias.name, None) for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = package.split(".") if package else []
            if node.level - 1 > len(parts):
                raise StaticError("ImportError: attempted relative import beyond top-level package", node.lineno)
            parts = parts[:len(parts) - (node.level - 1)]
            base = ".".join(parts + ([base] if base else []))
        wanted = [(base, alias.name) for alias in node.names]
    for module, name in wanted:
        top = module.split(".")[0]
        if module_file(root, top) is None:
            if importlib.util.find_spec(top) is None:
                raise StaticError("ModuleNotFoundError: No module named %r" % top, node.lineno)
            continue
        path = module_file(root, module)
        if path is None:
            raise StaticError("ModuleNotFoundError: No module named %r" % module, node.lineno)
        if name is None or name == "*" or module_file(root, module + "." + name) is not None:
            continue
        if os.path.isfile(path):
            names = defined_names(parse(path))
            if names is not None and name not in names:
                raise StaticError("ImportError: cannot import name %r from %r" % (name, module), node.lineno)


def check_static(root: str, name: str) -> dict:
    """import_one's result for `name`, found by reading files only."""
    path = module_file(root, name)
    result = {"module": name, "ok": True, "error": None, "file": None, "line": None, "traceback": None}
    if path is None or not os.path.isfile(path):
        return dict(result, ok=False, error="ModuleNotFoundError: No module named %r" % name)

    def parse(file: str) -> ast.Module:
        with open(file, "rb") as f:
            return ast.parse(f.read(), file)

    try:
        tree = parse(path)
        compile(tree, path, "exec")
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        for node in module_level(tree.body):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                try:
                    resolve(root, package, node, parse)
                except StaticError as e:
                    return dict(result, ok=False, error=str(e), file=path, line=e.line)
    except SyntaxError as e:
        return dict(result, ok=False, error="SyntaxError: %s" % e.msg, file=e.filename, line=e.lineno)
    return result


def main(argv: list[str]) -> int:
    static = argv[:1] == ["--static"]
    argv = argv[1:] if static else argv
    if len(argv) < 2 or not os.path.isdir(argv[0]):
        sys.stderr.write("usage: import_check.py [--static] ROOT MODULE... (ROOT must be a directory)\n")
        return EXIT_BAD_INPUT
    root = os.path.abspath(argv[0])
    if static:
        results = [check_static(root, name) for name in argv[1:]]
    else:
        sys.path.insert(0, root)
        sys.dont_write_bytecode = True  # never leave __pycache__ in a release tree
        results = [import_one(name) for name in argv[1:]]
    ok = all(r["ok"] for r in results)
    sys.stdout.write(json.dumps({"ok": ok, "root": root, "results": results}, sort_keys=True) + "\n")
    sys.stdout.flush()
    return 0 if ok else EXIT_IMPORT_FAILED


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
