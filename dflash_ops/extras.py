"""The optional extras of the distribution, and the one line that names the one a command needs.

`pip install dflash-ops` is the operator's side alone: it drives remote containers and never
imports torch. The trainer's packages are the `trainer` extra (pyproject.toml): the embedded
simulated node links them into its containers from this python, and the tests, local trainer
runs and the fixture writers import them. A command that needs them says so in one line.
"""

from __future__ import annotations

import importlib.util
import re

from dflash_ops.errors import DflashOpsError

TRAINER_PACKAGES = ("torch", "transformers", "safetensors", "tokenizers")
TRAINER_INSTALL = "pip install 'dflash-ops[trainer]'"


class ExtraMissing(DflashOpsError):
    """A command needs packages of an extra that this python lacks."""


def installed(module: str) -> bool:
    """Can this python import `module` (without importing it)?"""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a finder that refuses it, or a broken parent package
        return False


def trainer_missing(what: str, missing: list[str] | tuple[str, ...]) -> ExtraMissing:
    """The one-line error for `what`, which needs the trainer's packages `missing` lacks."""
    return ExtraMissing(f"{what} needs the trainer's packages, and this python lacks {', '.join(missing)}: "
                        f"{TRAINER_INSTALL}")


def require_trainer(what: str, packages: tuple[str, ...] = TRAINER_PACKAGES) -> None:
    """Raise ExtraMissing unless every one of `packages` is importable here."""
    missing = [p for p in packages if not installed(p)]
    if missing:
        raise trainer_missing(what, missing)


def trainer_module(error: ImportError) -> str | None:
    """The trainer package an ImportError is about (e.g. 'torch' for 'torch.nn'), else None."""
    name = (getattr(error, "name", None) or "").split(".")[0]
    return name if name in TRAINER_PACKAGES else None


def trainer_module_in(output: str) -> str | None:
    """The trainer package a python's traceback in `output` says it could not import, else None."""
    for name in re.findall(r"No module named '([A-Za-z0-9_.]+)'", output):
        if name.split(".")[0] in TRAINER_PACKAGES:
            return name.split(".")[0]
    return None
