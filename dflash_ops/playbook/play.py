"""YAML playbooks: named, ordered steps with variables, validated whole before any step runs.

    name: deploy
    vars: {keep: 5}
    steps:
      - name: push code
        deploy: {keep: "${keep}"}
      - exec: ["${release_python}", "--version"]

`${var}` is substituted only inside values (never keys), from `vars:` (overridden by
`--var k=v`; a var may use the built-ins and the vars above it), the built-ins (target, base_dir, current, python) and what earlier steps
provide (see steps.py, run_steps.py). A value that is exactly "${x}" keeps x's type. `$${` is a
literal `${`. There are no shell strings: `exec` takes an argv list.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import yaml

from dflash_ops.errors import DflashOpsError
from dflash_ops.playbook.registry import STEP_TYPES, StepContext, StepType
from dflash_ops.yamlfile import read_yaml_node, suggest

if TYPE_CHECKING:
    from dflash_ops.container import ContainerAPI

TOP_KEYS = ("name", "description", "vars", "steps")
BUILTIN_VARS = ("target", "base_dir", "current", "python")
_VAR = re.compile(r"\$\$|\$\{([^}]*)\}|\$\{")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class PlaybookError(DflashOpsError):
    """The playbook is invalid; the message lists every problem as file:line: message."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


@dataclass
class Step:
    index: int
    name: str
    type: StepType
    params: dict[str, Any]
    line: int


@dataclass
class Playbook:
    path: Path
    name: str
    variables: dict[str, Any]
    steps: list[Step]


@dataclass
class PlayResult:
    target: str
    steps_done: int = 0
    error: str | None = None
    variables: dict[str, Any] = field(default_factory=dict)
    results: list[dict] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


class _Checker:
    def __init__(self, path: Path, loader: yaml.SafeLoader):
        self.path = path
        self.loader = loader
        self.problems: list[str] = []

    def problem(self, node: yaml.Node, message: str) -> None:
        self.problems.append(f"{self.path}:{node.start_mark.line + 1}: {message}")

    def value(self, node: yaml.Node) -> Any:
        return self.loader.construct_object(node, deep=True)

    def mapping(self, node: yaml.Node, what: str) -> list[tuple[str, yaml.Node, yaml.Node]] | None:
        if not isinstance(node, yaml.MappingNode):
            self.problem(node, f"{what} must be a mapping")
            return None
        pairs, seen = [], set()
        for key_node, value_node in node.value:
            key = str(self.value(key_node))
            if key in seen:
                self.problem(key_node, f"{what}: duplicate key {key!r}")
            seen.add(key)
            pairs.append((key, key_node, value_node))
        return pairs

    def var_refs(self, node: yaml.Node, defined: set[str]) -> None:
        """Report every undefined or malformed `${...}` in the scalars under `node`."""
        if isinstance(node, yaml.ScalarNode):
            if node.tag != "tag:yaml.org,2002:str":
                return
            for m in _VAR.finditer(node.value):
                if m.group(0) == "$$":
                    continue
                name = m.group(1)
                if name is None:
                    self.problem(node, f"unterminated '${{' in {node.value!r}")
                elif not _NAME.match(name):
                    self.problem(node, f"bad variable reference '${{{name}}}'")
                elif name not in defined:
                    self.problem(node, f"undefined variable {name!r}{suggest(name, defined)}")
        elif isinstance(node, yaml.SequenceNode):
            for item in node.value:
                self.var_refs(item, defined)
        elif isinstance(node, yaml.MappingNode):
            for _key, item in node.value:
                self.var_refs(item, defined)


def load_playbook(path: str | Path, overrides: dict[str, str] | None = None) -> Playbook:
    """Parse and validate the whole playbook; raises PlaybookError listing every problem."""
    path = Path(path)
    loader, root = read_yaml_node(path, "playbook", lambda message: PlaybookError([message]))
    if root is None:
        raise PlaybookError([f"{path}:1: empty playbook: expected 'steps'"])
    check = _Checker(path, loader)
    top = check.mapping(root, "playbook")
    if top is None:
        raise PlaybookError(check.problems)
    sections = {}
    for key, key_node, value_node in top:
        if key not in TOP_KEYS:
            check.problem(key_node, f"unknown top-level key {key!r}{suggest(key, TOP_KEYS)}")
        sections[key] = value_node
    if "steps" not in sections:
        check.problem(root, "missing required key 'steps'")
    variables = _variables(check, sections.get("vars"), overrides or {})
    steps = _steps(check, sections.get("steps"), set(variables) | set(BUILTIN_VARS))
    if check.problems:
        raise PlaybookError(check.problems)
    name = check.value(sections["name"]) if "name" in sections else path.stem
    return Playbook(path=path, name=str(name), variables=variables, steps=steps)


def _variables(check: _Checker, node: yaml.Node | None, overrides: dict[str, str]) -> dict[str, Any]:
    variables: dict[str, Any] = {}
    for key, key_node, value_node in (check.mapping(node, "vars") or []) if node is not None else []:
        if not _NAME.match(key):
            check.problem(key_node, f"vars: bad variable name {key!r}")
        elif key in BUILTIN_VARS:
            check.problem(key_node, f"vars: {key!r} is a built-in variable")
        elif not isinstance(value_node, yaml.ScalarNode):
            check.problem(value_node, f"vars: {key!r} must be a scalar (string, number, true/false)")
        else:
            check.var_refs(value_node, set(variables) | set(BUILTIN_VARS))
            variables[key] = check.value(value_node)
    for key, raw in overrides.items():
        if key not in variables:
            check.problems.append(f"--var {key}: not a variable of {check.path}{suggest(key, variables)}"
                                  f" (vars: {', '.join(sorted(variables)) or 'none'})")
            continue
        value, problem = typed_override(raw, variables[key])
        if problem:
            check.problems.append(f"--var {key}={raw}: {problem}")
        else:
            variables[key] = value
    return variables


_DECIMAL = re.compile(r"[-+]?[0-9]+")
_BOOLS = {"true": True, "false": False}


def typed_override(raw: str, default: Any) -> tuple[Any, str | None]:
    """A `--var` value as the type its playbook declares by its default: a string stays the
    string given (`010`, `no`, `x # y` are not re-read as YAML), a number default takes a decimal
    number, a true/false default takes true or false. Returns (value, problem)."""
    if isinstance(default, bool):
        if raw.lower() in _BOOLS:
            return _BOOLS[raw.lower()], None
        return None, "not true or false (the playbook's default is a boolean)"
    if isinstance(default, (int, float)):
        text = raw.strip()
        if _DECIMAL.fullmatch(text):
            return int(text, 10), None
        try:
            number = float(text)
        except ValueError:
            number = math.nan
        if not math.isfinite(number):
            return None, "not a number (the playbook's default is a number)"
        return number, None
    return raw, None


def _steps(check: _Checker, node: yaml.Node | None, defined: set[str]) -> list[Step]:
    if node is None:
        return []
    if not isinstance(node, yaml.SequenceNode) or not node.value:
        check.problem(node, "steps must be a non-empty list")
        return []
    steps = []
    for index, step_node in enumerate(node.value, start=1):
        step = _step(check, index, step_node, defined)
        if step is not None:
            steps.append(step)
            defined |= set(step.type.provides)
    return steps


def _step(check: _Checker, index: int, node: yaml.Node, defined: set[str]) -> Step | None:
    pairs = check.mapping(node, f"step {index}")
    if pairs is None:
        return None
    name, kinds, unknown = None, [], False
    for key, key_node, value_node in pairs:
        if key == "name":
            name = str(check.value(value_node))
        elif key in STEP_TYPES:
            kinds.append((key, value_node))
        else:
            unknown = True
            check.problem(key_node, f"step {index}: unknown step type {key!r}{suggest(key, [*STEP_TYPES, 'name'])}"
                                    f" (step types: {', '.join(sorted(STEP_TYPES))})")
    if len(kinds) != 1:
        if not kinds and not unknown:
            check.problem(node, f"step {index}: no step type (one of: {', '.join(sorted(STEP_TYPES))})")
        elif len(kinds) > 1:
            check.problem(node, f"step {index}: more than one step type: {', '.join(k for k, _ in kinds)}")
        return None
    kind, params_node = kinds[0]
    step_type = STEP_TYPES[kind]
    label = f"step {index} ({kind})"
    if not isinstance(params_node, yaml.MappingNode):
        if step_type.shorthand is None:
            check.problem(params_node, f"{label}: parameters must be a mapping")
            return None
        param_nodes = {step_type.shorthand: (params_node, params_node)}
    else:
        param_nodes = {key: (key_node, value_node) for key, key_node, value_node in check.mapping(params_node, label) or []}
    params = {}
    for key, (key_node, value_node) in param_nodes.items():
        if key not in step_type.params:
            check.problem(key_node, f"{label}: unknown parameter {key!r}{suggest(key, step_type.params)}"
                                    f" (parameters: {', '.join(step_type.params) or 'none'})")
            continue
        check.var_refs(value_node, defined)
        value = check.value(value_node)
        expected = step_type.types.get(key)
        if expected and not _is_whole_ref(value) and not isinstance(value, expected):
            check.problem(value_node, f"{label}: {key} must be {_type_name(expected)}, got {type(value).__name__}"
                          + (" (exec takes an argv list, not a shell string)" if kind == "exec" else ""))
        params[key] = value
    for key in step_type.required:
        if key not in param_nodes:
            check.problem(params_node, f"{label}: missing required parameter {key!r}")
    return Step(index=index, name=name or kind, type=step_type, params=params, line=node.start_mark.line + 1)


def _is_whole_ref(value: Any) -> bool:
    return isinstance(value, str) and re.fullmatch(r"\$\{[A-Za-z_][A-Za-z0-9_]*\}", value) is not None


def _type_name(expected: type | tuple[type, ...]) -> str:
    types = expected if isinstance(expected, tuple) else (expected,)
    names = {list: "a list", dict: "a mapping", int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    return " or ".join(names.get(t, t.__name__) for t in types)


def substitute(value: Any, variables: dict[str, Any]) -> Any:
    """Replace `${name}` in every string under `value` (lists and mapping values, not keys)."""
    if isinstance(value, str):
        if _is_whole_ref(value):
            return variables[value[2:-1]]

        def one(m: re.Match) -> str:
            if m.group(0) == "$$":
                return "$"
            return str(variables[m.group(1)])

        return _VAR.sub(one, value)
    if isinstance(value, list):
        return [substitute(v, variables) for v in value]
    if isinstance(value, dict):
        return {k: substitute(v, variables) for k, v in value.items()}
    return value


def run_playbook(playbook: Playbook, container: ContainerAPI, *, say: Callable[[str], None] = print,
                 contexts: list[StepContext] | None = None,
                 open_target: Callable[[str], Any] | None = None) -> PlayResult:
    """Run every step on one target, in order; stops at the first failing step. What the steps
    registered as cleanups (a serving engine to stop) runs at the end, also after a failure or
    Ctrl-C. `contexts` collects each target's StepContext for clean_up_interrupted().
    `open_target` opens other targets by name (a `start` step over several targets needs it)."""
    started = time.monotonic()
    base = container.base_dir
    variables: dict[str, Any] = {"target": container.target.name, "base_dir": base, "current": f"{base}/current",
                                 "python": container.target.python}
    for name, value in playbook.variables.items():  # a var may use the built-ins and the vars above it
        variables[name] = substitute(value, variables)
    ctx = StepContext(container=container, target=container.target.name, variables=variables,
                      playbook_dir=playbook.path.resolve().parent, say=say, open_target=open_target)
    result = PlayResult(target=ctx.target, variables=variables, results=ctx.results)
    if contexts is not None:
        contexts.append(ctx)
    try:
        for step in playbook.steps:
            say(f"[{step.index}/{len(playbook.steps)}] {step.name}")
            try:
                params = substitute(step.params, variables)
                provided = step.type.run(ctx, params) or {}
            except KeyError as e:
                result.error = f"{playbook.path}:{step.line}: step {step.index} ({step.name}): variable {e} is not set yet"
                break
            except Exception as e:  # noqa: BLE001 - reported with the step's file:line
                result.error = f"{playbook.path}:{step.line}: step {step.index} ({step.name}) failed: {e}"
                break
            variables.update(provided)
            result.steps_done += 1
    finally:
        _clean_up(ctx, result, playbook.path)
    result.seconds = round(time.monotonic() - started, 3)
    return result


def clean_up_interrupted(contexts: list[StepContext], path: Path) -> None:
    """After Ctrl-C: the cleanups still pending on every target. Only the target playing in the
    interrupted (main) thread unwinds by itself; the others' threads never get to theirs."""
    for ctx in contexts:
        _clean_up(ctx, PlayResult(target=ctx.target), path)


def _clean_up(ctx: StepContext, result: PlayResult, path: Path) -> None:
    """Run the steps' cleanups, newest first; a failing one is reported and the others still run."""
    while True:
        try:
            label, cleanup = ctx.cleanups.pop()  # atomic: a target's own thread may be popping too
        except IndexError:
            return
        ctx.say(f"[cleanup] {label}")
        try:
            cleanup()
        except Exception as e:  # noqa: BLE001 - every cleanup gets its turn
            message = f"{path}: cleanup ({label}) failed: {e}"
            ctx.say(message)
            result.error = result.error or message
