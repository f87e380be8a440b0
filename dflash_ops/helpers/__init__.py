"""Versioned helper scripts that run inside containers (stdlib only, python3.8+).

A helper named `inspect-source` is the file `inspect_source.py` ('-' maps to '_'). Container.helper()
installs it once per content hash as BASE/helpers/<hash>/<file> and runs it there as a script.

A shared module (SHARED: as_package.py, how a helper run as a script imports the others; nodefacts.py, the node-side facts; runqueue.py, the run queue on disk;
notify.py, run events and their delivery; venvs.py, the venvs' layout on disk; run_*.py, the parts of the runs helper that runs.py
dispatches to; destination.py, the replace rule, and
contract.py, the run directory's contract, whose one copies live in the trainer,
trainer/run/destination.py and trainer/run/contract.py, as the trainer never imports dflash_ops) is not a helper: it travels with each helper that imports it, the way Ansible ships
`module_utils` with a module. BASE/helpers/<hash>/ then holds the helper and the shared module
beside it, and <hash> covers both (bundle()), so a change to a shared module is a new version of
every helper that imports it, and of no other.

Helpers and shared modules import each other one way, `from . import nodefacts` (as_package.py: in a
container a helper's directory is made its package first). The operator's side imports helpers as
modules too, for what is named once for both sides: nodefacts (FINAL_STATES, parse_gpus), the
helpers' exit statuses (runs.py, import_check.py), and tree.py, whose staging and swap rules `fetch`
applies on the operator's machine as `push` does in the container (dflash_ops/transfer.py). They
import only the stdlib, so that works anywhere; here `from . import contract` (and destination) is
the trainer's own module (__getattr__ below).
"""

from __future__ import annotations

import hashlib
import importlib.util
import threading
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

HELPERS_DIR = Path(__file__).resolve().parent
# modules shipped beside the helpers that import them (never run), and where they live outside HELPERS_DIR
SHARED_ELSEWHERE = {"destination": ("trainer.run", "destination.py"), "contract": ("trainer.run", "contract.py")}
# the runs helper's parts (runs.py is their dispatcher): shipped beside it, never run on their own
RUN_PARTS = ("run_protocol", "run_describe", "run_follow", "run_start", "run_supervise", "run_events", "run_queue")
SHARED = ("as_package", "nodefacts", "runqueue", "notify", "venvs", *RUN_PARTS, *SHARED_ELSEWHERE)


def __getattr__(name: str) -> Any:
    """`from . import contract` in a helper imported here (or run in place): the trainer's module of
    that name (SHARED_ELSEWHERE), its one copy; in a container the copy shipped beside the helper."""
    if name == "contract":
        from trainer.run import contract

        return contract
    if name == "destination":
        from trainer.run import destination

        return destination
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def shared_path(module: str) -> Path:
    """The source file of a shared module."""
    if module not in SHARED_ELSEWHERE:
        return HELPERS_DIR / f"{module}.py"
    package, filename = SHARED_ELSEWHERE[module]
    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.submodule_search_locations, f"{package} is installed with dflash_ops"
    return Path(list(spec.submodule_search_locations)[0]) / filename


def source_of(filename: str) -> Path:
    """Where a bundle's file is read from: a helper here, or a shared module (shared_path)."""
    stem = filename.removesuffix(".py")
    return shared_path(stem) if stem in SHARED else HELPERS_DIR / filename


@dataclass(frozen=True)
class Bundle:
    """What one helper version is: its files (shared modules first, the helper last) and the hash
    that names BASE/helpers/<digest>/."""

    files: tuple[tuple[str, bytes], ...]  # (file name, content)
    digest: str

    @property
    def script(self) -> str:
        """The helper's own file (the one that is run)."""
        return self.files[-1][0]

    def rel(self, filename: str | None = None) -> str:
        """`helpers/<digest>/<file>` relative to BASE: one of its files, by default the helper
        itself (the file that is run)."""
        return f"helpers/{self.digest}/{filename or self.script}"


def helper_source(name: str) -> Path | None:
    """The helper's file, or None when `name` names no helper."""
    path = HELPERS_DIR / (name.replace("-", "_") + ".py")
    if path.stem in SHARED or path.name == "__init__.py" or not path.is_file():
        return None
    return path


def helper_names() -> list[str]:
    """Every helper, by file stem."""
    return sorted(p.stem for p in HELPERS_DIR.glob("*.py") if helper_source(p.stem) is not None)


def bundle(name: str) -> Bundle:
    """The helper `name` with the shared modules it imports (read now; cached while unchanged)."""
    source = helper_source(name)
    if source is None:
        raise ValueError(f"no helper {name!r} in {HELPERS_DIR}")
    stamps = tuple((p.name, p.stat().st_mtime_ns, p.stat().st_size)
                   for p in [source, *map(shared_path, SHARED)])
    return _bundle(source, stamps)


@lru_cache(maxsize=64)
def _bundle(source: Path, _stamps: tuple[tuple[str, int, int], ...]) -> Bundle:
    content = source.read_bytes()
    files: list[tuple[str, bytes]] = []
    for module in _shared_imports(content):
        files.append((f"{module}.py", source_of(f"{module}.py").read_bytes()))
    files.append((source.name, content))
    digest = hashlib.sha256()
    for filename, data in files:
        digest.update(b"%s\0%d\0" % (filename.encode(), len(data)))
        digest.update(data)
    return Bundle(tuple(files), digest.hexdigest()[:16])


# ast.parse from several threads at once (a deploy to many targets) trips CPython 3.11's
# "AST constructor recursion depth mismatch" (gh-106905, fixed in 3.11.8/3.12): one parse at a time.
_PARSE_LOCK = threading.Lock()


def _shared_imports(content: bytes) -> list[str]:
    """The shared modules a helper imports (`from . import m`, `from .m import ...`, `import m`),
    with the ones those import in turn, each once, a module before what imports it."""
    import ast

    found: list[str] = []
    seen: set[str] = set()

    def visit(code: bytes) -> None:
        with _PARSE_LOCK:
            tree = ast.parse(code)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module] if node.module else [alias.name for alias in node.names]
            else:
                continue
            for module in names:
                if module in SHARED and module not in seen:
                    seen.add(module)
                    visit(shared_path(module).read_bytes())
                    found.append(module)

    visit(content)
    return found
