"""Every layering rule the docs state is a test (issue 48), read from the sources' imports (AST), and each
checker is shown to catch a violation planted in a throw-away tree:

* the trainer (trainer/, and trainer_tools/, which playbooks ship into containers) never imports
  dflash_ops (docs/architecture.md, README's layout);
* dflash_ops imports from the trainer only the modules docs/architecture.md lists under "What the
  operator's side takes from the trainer" (read from the doc), and the doc lists none it does not import;
* the operator's side floors: the light install (`pip install dflash-ops`, no torch: README) imports
  none of the trainer extra's packages when a dflash_ops module is imported (only inside a function),
  and a dflash_ops module imports its own floor and lower ones only (the floors docs/architecture.md
  prints, read from it);
* shell quoting (shlex.quote / shlex.join) happens only in dflash_ops/render.py and dflash_ops/testing/
  ("render.py: the only place that quotes");
* what is pushed into a container as a helper (dflash_ops/helpers/*.py and the trainer's modules shipped
  beside them) imports only the standard library of python 3.8 and the files shipped beside it ("stdlib
  only": README's layout, architecture.md).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from dflash_ops import helpers
from dflash_ops.extras import TRAINER_PACKAGES
from tests.unit.test_import_graph import TRAINER_FLOORS, imports

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("dflash_ops", "trainer", "trainer_tools")
ALLOW_HEADING = "## What the operator's side takes from the trainer"
OPERATOR_FLOORS_LINE = "operator floors, lowest first"
QUOTING_HOMES = ("dflash_ops/render.py", "dflash_ops/testing/")


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Module name -> file of every .py in PACKAGES under root."""
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of PACKAGES it imports anywhere in its file (also inside functions)."""
    known = modules(root)
    return {name: imports(name, path, known) for name, path in known.items()}


def in_package(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


# -- the trainer never imports dflash_ops ---------------------------------------------------------------

def trainer_imports_of_ops(g: dict[str, set[str]]) -> list[str]:
    return [f"{m} -> {t}" for m, ts in sorted(g.items()) if in_package(m, "trainer", "trainer_tools")
            for t in sorted(ts) if in_package(t, "dflash_ops")]


# -- what dflash_ops takes from the trainer: the doc's list ---------------------------------------------

def allowed_from_trainer(doc: str) -> set[str]:
    """The modules listed (`* \\`trainer...\\``) in the doc's section under ALLOW_HEADING."""
    if ALLOW_HEADING not in doc:
        raise AssertionError(f"{DOC.name} has no section {ALLOW_HEADING!r}")
    section = doc.split(ALLOW_HEADING, 1)[1].split("\n#", 1)[0]
    return set(re.findall(r"^\* `(trainer(?:\.\w+)*)`", section, flags=re.MULTILINE))


def ops_imports_outside(g: dict[str, set[str]], allowed: set[str]) -> list[str]:
    """dflash_ops' imports of trainer modules the list lacks, and listed modules it never imports."""
    used = {t for m, ts in g.items() if in_package(m, "dflash_ops") for t in ts if in_package(t, "trainer")}
    return [f"{m} -> {t} (not in {DOC.name}'s list)" for m, ts in sorted(g.items()) if in_package(m, "dflash_ops")
            for t in sorted(ts) if in_package(t, "trainer") and t not in allowed] + \
        [f"{t} is listed but dflash_ops does not import it" for t in sorted(allowed - used)]


# -- the operator's side floors -------------------------------------------------------------------------

def _executed(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements of a module body that run when it is imported: not function bodies, not
    `if TYPE_CHECKING:` blocks; class bodies, other ifs, try and with blocks do run."""
    out: list[ast.stmt] = []
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        out.append(node)
        if isinstance(node, ast.If):
            test = ast.unparse(node.test)
            out += _executed(node.orelse) if test in ("TYPE_CHECKING", "typing.TYPE_CHECKING") else \
                _executed(node.body) + _executed(node.orelse)
        elif isinstance(node, (ast.ClassDef, ast.With)):
            out += _executed(node.body)
        elif isinstance(node, ast.Try):
            out += _executed(node.body) + _executed(node.orelse) + _executed(node.finalbody)
            for handler in node.handlers:
                out += _executed(handler.body)
    return out


def import_time_imports(name: str, path: Path, known: dict[str, Path]) -> tuple[set[str], set[str]]:
    """(modules of PACKAGES, other top-level packages) that importing `name` imports itself."""
    executed: list[ast.AST] = [s for s in _executed(ast.parse(path.read_text(), str(path)).body)
                               if isinstance(s, (ast.Import, ast.ImportFrom))]
    others = set()
    for node in executed:
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        others.update(n.split(".")[0] for n in names if n and n.split(".")[0] not in PACKAGES)
    return imports(name, path, known, executed), others


def heavy_at_import(root: Path = ROOT) -> list[str]:
    """dflash_ops modules (not the container-side helpers) whose import reaches an import of a trainer
    extra package at import time, with the module that imports it."""
    known = modules(root)
    direct = {m: import_time_imports(m, p, known) for m, p in known.items()}
    found = []
    for start in sorted(m for m in known if in_package(m, "dflash_ops") and not in_package(m, "dflash_ops.helpers")):
        seen, todo = set(), [start]
        while todo:
            m = todo.pop()
            if m in seen:
                continue
            seen.add(m)
            parts = m.split(".")
            todo += [".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in known]  # parents
            ours, others = direct[m]
            todo += sorted(ours)
            for package in sorted(others & set(TRAINER_PACKAGES)):
                found.append(f"{start} imports {package} when imported (in {m})")
    return found


def operator_floors(doc: str) -> list[list[str]]:
    """The doc's operator floors, lowest first: the line after OPERATOR_FLOORS_LINE, `<` between
    floors, `,` between the modules or packages of one floor (names under dflash_ops)."""
    lines = doc.splitlines()
    at = next((i for i, line in enumerate(lines) if OPERATOR_FLOORS_LINE in line), None)
    if at is None:
        raise AssertionError(f"{DOC.name} prints no {OPERATOR_FLOORS_LINE!r}")
    text = ""
    for line in lines[at + 1:]:  # its continuation lines are indented by three spaces or more
        if not line.startswith("   ") or not line.strip():
            break
        text += " " + line.strip()
    return [[f"dflash_ops.{n.strip()}" for n in floor.split(",") if n.strip()] for floor in text.split("<")]


def operator_floor_violations(g: dict[str, set[str]], floors: list[list[str]]) -> list[str]:
    """dflash_ops modules on no floor, and imports of a higher floor (a floor's own members import each
    other freely: the doc draws them side by side)."""
    def floor_of(module: str) -> int | None:
        best = None
        for level, names in enumerate(floors):
            for n in names:
                if in_package(module, n) and (best is None or len(n) > len(best[1])):
                    best = (level, n)
        return None if best is None else best[0]

    found = []
    for m, ts in sorted(g.items()):
        if not in_package(m, "dflash_ops") or m == "dflash_ops":
            continue
        here = floor_of(m)
        if here is None:
            found.append(f"{m} is on no floor (add it to {DOC.name}'s {OPERATOR_FLOORS_LINE!r})")
            continue
        for t in sorted(ts):
            there = floor_of(t) if in_package(t, "dflash_ops") and t != "dflash_ops" else None
            if there is not None and there > here:
                found.append(f"{m} -> {t} (floor {here} imports floor {there})")
    return found


# -- shell quoting lives in render.py ----------------------------------------------------------------------

def quoting_outside_render(root: Path = ROOT) -> list[str]:
    """file:line of each shlex.quote / shlex.join (also `from shlex import quote`, pipes.quote) outside
    QUOTING_HOMES."""
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel.startswith(QUOTING_HOMES):
                continue
            for node in ast.walk(ast.parse(path.read_text(), rel)):
                if isinstance(node, ast.Attribute) and node.attr in ("quote", "join") and \
                        isinstance(node.value, ast.Name) and node.value.id in ("shlex", "pipes") and \
                        not (node.value.id == "pipes" and node.attr == "join"):
                    found.append(f"{rel}:{node.lineno}: {node.value.id}.{node.attr}")
                elif isinstance(node, ast.ImportFrom) and node.module in ("shlex", "pipes") and \
                        {a.name for a in node.names} & {"quote", "join", "*"}:
                    found.append(f"{rel}:{node.lineno}: from {node.module} import "
                                 f"{', '.join(a.name for a in node.names)}")
    return found


# -- a helper takes only the standard library and what is shipped beside it -------------------------------

NEWER_THAN_38 = {"graphlib", "zoneinfo", "tomllib"}  # standard modules a container's python 3.8 lacks
# what a helper probes for inside a function, working on without it
PROBES = {"torch": "doctor.py: the venv's torch, its answer when broken",
          "pynvml": "gpu_sample.py: NVML first, else nvidia-smi"}


def shipped_files() -> dict[str, Path]:
    """What a container may receive as a helper or beside one: file name -> source."""
    found = {p.name: p for p in sorted(helpers.HELPERS_DIR.glob("*.py")) if p.name != "__init__.py"}
    return {**found, **{f"{m}.py": helpers.shared_path(m) for m in helpers.SHARED_ELSEWHERE}}


def helper_imports_outside_stdlib(files: dict[str, Path]) -> list[str]:
    """file:line of each import, also inside a function, of neither a python 3.8 standard module nor
    a file of `files` (imported as `from . import m`, `from .m import x`, or `import m` beside it);
    a PROBES module only inside a function."""
    siblings = {name.removesuffix(".py") for name in files}
    found: list[tuple[str, int, str]] = []
    for name, path in sorted(files.items()):
        tree = ast.parse(path.read_text(), name)
        at_import = {id(node) for node in _executed(tree.body)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                wanted = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level:
                wanted = [node.module.split(".")[0]] if node.module else [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                wanted = [(node.module or "").split(".")[0]]
            else:
                continue
            for module in wanted:
                standard = module in sys.stdlib_module_names and module not in NEWER_THAN_38
                probe = module in PROBES and id(node) not in at_import
                if not (standard or module in siblings or probe):
                    found.append((name, node.lineno, module))
    return [f"{name}:{line}: {module}" for name, line, module in sorted(found)]


# -- the rules on this repository -------------------------------------------------------------------------

def test_the_trainer_never_imports_dflash_ops():
    assert trainer_imports_of_ops(graph()) == []


def test_dflash_ops_takes_from_the_trainer_only_what_the_architecture_doc_lists():
    assert ops_imports_outside(graph(), allowed_from_trainer(DOC.read_text())) == []


def test_importing_any_operator_module_imports_none_of_the_trainer_extra():
    assert heavy_at_import() == []


def test_the_operator_side_imports_only_its_own_and_lower_floors():
    assert operator_floor_violations(graph(), operator_floors(DOC.read_text())) == []


def test_the_trainer_floors_the_doc_prints_are_the_ones_checked():
    line = DOC.read_text().split(" floors, lowest first (tests/unit/test_import_graph.py):\n", 1)[1].splitlines()[0]
    printed = [tuple(n.strip() for n in floor.split(",")) for floor in line.split("<")]
    assert printed == [tuple(f.removeprefix("trainer.") for f in floor) for floor in TRAINER_FLOORS]


def test_only_render_and_the_test_harness_quote_for_a_shell():
    assert quoting_outside_render() == []


def test_what_is_pushed_as_a_helper_takes_only_the_standard_library_and_its_siblings():
    files = shipped_files()
    assert {"runs.py", "nodefacts.py", "as_package.py", "contract.py", "destination.py"} <= set(files)
    assert helper_imports_outside_stdlib(files) == []


# -- each checker catches a planted violation --------------------------------------------------------------

def plant(root: Path, files: dict[str, str]) -> Path:
    for package in PACKAGES:
        (root / package).mkdir(parents=True, exist_ok=True)
        (root / package / "__init__.py").touch()
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A small clean tree: the operator side reads the trainer's contract, the trainer reads its own."""
    return plant(tmp_path, {
        "dflash_ops/render.py": "import shlex\n\ndef line(argv):\n    return shlex.join(argv)\n",
        "dflash_ops/testing/sshd.py": "from shlex import quote\n",
        "dflash_ops/container.py": "from dflash_ops.render import line\nfrom trainer.run.contract import X\n\n"
                                   "def plan():\n    import torch  # only when asked\n",
        "trainer/run/contract.py": "X = 1\n",
        "trainer/models/drafter.py": "import torch\nfrom trainer.run.contract import X\n",
        "trainer_tools/regen.py": "from trainer.run import contract\n",
    })


FLOORS_DOC = f"""text
 {OPERATOR_FLOORS_LINE}:
   render, testing
   < container
 other text
"""
ALLOW_DOC = f"{ALLOW_HEADING}\n\n* `trainer.run.contract` - the run directory's contract\n\n## next\n* `trainer.x`\n"


def test_the_checkers_pass_the_clean_tree(tree):
    g = graph(tree)
    assert trainer_imports_of_ops(g) == []
    assert allowed_from_trainer(ALLOW_DOC) == {"trainer.run.contract"}
    assert ops_imports_outside(g, {"trainer.run.contract"}) == []
    assert heavy_at_import(tree) == []
    assert operator_floors(FLOORS_DOC) == [["dflash_ops.render", "dflash_ops.testing"], ["dflash_ops.container"]]
    assert operator_floor_violations(g, [["dflash_ops.render", "dflash_ops.testing"], ["dflash_ops.container"]]) == []
    assert quoting_outside_render(tree) == []


def test_a_trainer_module_importing_dflash_ops_is_caught(tree):
    plant(tree, {"trainer_tools/regen.py": "def f():\n    from dflash_ops.render import line\n"})
    assert trainer_imports_of_ops(graph(tree)) == ["trainer_tools.regen -> dflash_ops.render"]


def test_an_unlisted_trainer_module_and_a_stale_entry_are_caught(tree):
    plant(tree, {"trainer/run/config.py": "", "dflash_ops/doctor.py": "def f():\n    from trainer.run import config\n"})
    assert ops_imports_outside(graph(tree), {"trainer.run.contract", "trainer.run.rundir"}) == [
        f"dflash_ops.doctor -> trainer.run.config (not in {DOC.name}'s list)",
        "trainer.run.rundir is listed but dflash_ops does not import it"]


def test_an_import_time_torch_is_caught_also_through_the_trainer(tree):
    plant(tree, {"dflash_ops/runs.py": "try:\n    import transformers\nexcept ImportError:\n    pass\n",
                 "dflash_ops/tui.py": "from trainer.models import drafter\n",
                 "dflash_ops/typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n"})
    assert heavy_at_import(tree) == ["dflash_ops.runs imports transformers when imported (in dflash_ops.runs)",
                                     "dflash_ops.tui imports torch when imported (in trainer.models.drafter)"]


def test_an_upward_import_and_a_module_on_no_floor_are_caught(tree):
    plant(tree, {"dflash_ops/render.py": "from dflash_ops.container import plan\n", "dflash_ops/stray.py": ""})
    floors = [["dflash_ops.render", "dflash_ops.testing"], ["dflash_ops.container"]]
    assert operator_floor_violations(graph(tree), floors) == [
        "dflash_ops.render -> dflash_ops.container (floor 0 imports floor 1)",
        f"dflash_ops.stray is on no floor (add it to {DOC.name}'s {OPERATOR_FLOORS_LINE!r})"]


def test_a_helper_importing_beyond_the_stdlib_is_caught(tmp_path):
    files = plant(tmp_path, {"h/runs.py": "import json\nfrom . import nodefacts\n\ndef f():\n    import yaml\n"
                                          "    import torch  # a probe\nimport pynvml\n",
                             "h/nodefacts.py": "from .contract import X\nimport tomllib\nfrom trainer.run import contract\n",
                             "h/contract.py": "from __future__ import annotations\nimport os.path\n"})
    assert helper_imports_outside_stdlib({p.name: p for p in sorted((files / "h").glob("*.py"))}) == [
        "nodefacts.py:2: tomllib", "nodefacts.py:3: trainer", "runs.py:5: yaml", "runs.py:7: pynvml"]


def test_quoting_outside_render_is_caught(tree):
    plant(tree, {"dflash_ops/deploy.py": "import shlex\ncmd = shlex.quote('a b')\n",
                 "trainer/launch.py": "from shlex import join as j\n", "dflash_ops/split.py": "import shlex\nshlex.split('a')\n"})
    assert quoting_outside_render(tree) == ["dflash_ops/deploy.py:2: shlex.quote", "trainer/launch.py:1: from shlex import join"]
