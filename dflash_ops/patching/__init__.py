"""Guarded patches: a unified diff is checked against a release before it becomes a new one.

See guard.check_patch. Imports of the patched tree are checked inside the container by the
stdlib helper dflash_ops/helpers/import_check.py.
"""

from dflash_ops.patching.definitions import Definition, definitions
from dflash_ops.patching.diff import DiffError, FilePatch, Hunk, apply_hunks, parse_unified_diff
from dflash_ops.patching.guard import PatchReport, Problem, check_patch

__all__ = [
    "Definition", "DiffError", "FilePatch", "Hunk", "PatchReport", "Problem", "apply_hunks",
    "check_patch", "definitions", "parse_unified_diff",
]
