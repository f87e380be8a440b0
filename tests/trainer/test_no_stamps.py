"""A model's facts travel as values (trainer.models.frozen_target.Target, the drafter's Layout), never as
private attributes stamped onto torch modules: no `obj.__dict__["_..."] = ...` and no `_dflash_...`
attribute anywhere in trainer/ or bench/ (read as Python, so a comment or a docstring does not count)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "_dflash_"


def _private_name(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) \
        and node.value.startswith("_") else None


def _on_dict(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "__dict__"


def stamps(source: str, name: str = "<source>") -> list[str]:
    """Every side door in `source`, as `name:line: what`: a module's `__dict__` indexed (or read by
    get/pop/setdefault) with a private name, an attribute named `_dflash_...`, and a string naming
    one (getattr/setattr's argument)."""
    found = []
    for node in ast.walk(ast.parse(source, name)):
        what = None
        if isinstance(node, ast.Subscript) and _on_dict(node.value) and _private_name(node.slice):
            what = f"__dict__[{_private_name(node.slice)!r}]"
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _on_dict(node.func.value)
              and node.func.attr in ("get", "pop", "setdefault") and node.args and _private_name(node.args[0])):
            what = f"__dict__.{node.func.attr}({_private_name(node.args[0])!r})"
        elif isinstance(node, ast.Attribute) and node.attr.startswith(PREFIX):
            what = f".{node.attr}"
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(PREFIX):
            what = repr(node.value)
        if what is not None:
            found.append(f"{name}:{node.lineno}: {what}")
    return found


def test_no_stamps_on_models_in_the_trainer_or_the_bench():
    files = sorted(p for d in ("trainer", "bench") for p in (ROOT / d).rglob("*.py"))
    assert len(files) > 50
    found = [s for p in files for s in stamps(p.read_text(), str(p.relative_to(ROOT)))]
    assert found == []


@pytest.mark.parametrize("planted", [
    'model.__dict__["_source"] = path',
    'plan = target.__dict__.get("_plan")',
    'module.__dict__.pop("_align", None)',
    "layer._dflash_compiled = True",
    'getattr(model, "_dflash_plan", None)',
])
def test_a_planted_stamp_is_found(planted):
    assert stamps(f"x = 1\n{planted}\n", "planted.py") == [stamps(planted, "planted.py")[0].replace(":1:", ":2:")]


@pytest.mark.parametrize("innocent", [
    'config.__dict__["vocab_size"]',  # a public name
    'layer._compiled_call_impl = None',  # torch's own attribute, not ours
    '"""docs: _dflash_ ..."""',  # a docstring that starts otherwise
    "self._forward_dflash2(x)",
])
def test_what_is_not_a_stamp(innocent):
    assert stamps(innocent) == []
