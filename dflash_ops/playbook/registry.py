"""The registry of playbook step types.

A step type is a name (the step's key in YAML), the parameters it takes, the variables it
provides to later steps, and a function `run(ctx, params) -> dict | None` (the returned dict
becomes variables). Adding a step type is one `register_step(StepType(...))` call in a module
that `dflash_ops/playbook/__init__.py` imports (steps.py, run_steps.py, transfer_steps.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from dflash_ops.errors import DflashOpsError

if TYPE_CHECKING:
    from dflash_ops.container import ContainerAPI


class StepFailed(DflashOpsError):
    """A playbook step could not do its job."""


@dataclass
class StepContext:
    """What a running step sees: its target's container and the variables so far."""

    container: ContainerAPI
    target: str
    variables: dict[str, Any]
    playbook_dir: Path
    say: Callable[[str], None] = print
    results: list[dict] = field(default_factory=list)
    cleanups: list[tuple[str, Callable[[], None]]] = field(default_factory=list)  # run when the playbook ends
    open_target: Callable[[str], Any] | None = None  # another target's container (runs across hosts)

    def local_path(self, path: str) -> Path:
        """A local path of a step: relative ones are relative to the playbook's directory."""
        return Path(os.path.normpath(path if Path(path).is_absolute() else self.playbook_dir / path))


StepRun = Callable[[StepContext, dict], "dict | None"]


@dataclass(frozen=True)
class StepType:
    name: str
    run: StepRun
    required: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    provides: tuple[str, ...] = ()
    types: dict[str, type | tuple[type, ...]] = field(default_factory=dict)
    shorthand: str | None = None  # `exec: [a, b]` means `exec: {argv: [a, b]}`
    help: str = ""

    @property
    def params(self) -> tuple[str, ...]:
        return self.required + self.optional


STEP_TYPES: dict[str, StepType] = {}


NUMBER = (int, float)  # the `types` entry for a number parameter


def register_step(step_type: StepType) -> None:
    if step_type.name in STEP_TYPES:
        raise ValueError(f"step type {step_type.name!r} is already registered")
    STEP_TYPES[step_type.name] = step_type
