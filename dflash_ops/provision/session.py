"""One provision pass's runner: runs node commands (or, dry, only prints them) and counts the changes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dflash_ops import render
from dflash_ops.provision.node import ProvisionError
from dflash_ops.render import Rendered

if TYPE_CHECKING:
    from dflash_ops.container import Container


@dataclass
class Outcome:
    changes: list[str] = field(default_factory=list)
    commands: list[Rendered] = field(default_factory=list)
    diff: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    gpus: tuple[int, ...] = ()


Confirm = Callable[[str], bool]
Say = Callable[[str], None]


class _Session:
    """Runs (or, dry, only prints) node commands; reads always run, and are printed too."""

    def __init__(self, container: Container, dry_run: bool, say: Say):
        self.container, self.dry_run, self.say = container, dry_run, say
        self.outcome = Outcome()

    def show(self, what: str, rendered: Rendered) -> None:
        self.outcome.commands.append(rendered)
        if not self.dry_run:
            return
        self.say(f"# {what}")
        if rendered.argv == rendered.pct_argv:  # a node command: no container layer
            self.say(f"node argv: {list(rendered.argv)!r}")
            self.say(f"node command (sent over SSH): {rendered.command}")
            return
        for label, value in rendered.layers():
            self.say(f"{label}: {value}")

    def read(self, what: str, argv: list[str]) -> str:
        rendered = node_rendered(argv)
        self.show(what + " (read)", rendered)
        result = self.container.transport.run(rendered.command, timeout=120)
        if not result.ok:
            raise ProvisionError(f"{what}: {_said(result.stderr, result.exit_code)}")
        return result.stdout

    def quiet(self, rendered: Rendered) -> None:
        """A step of a change that changes nothing by itself (a directory made for a copy)."""
        self.show("(part of the next step)", rendered)
        if not self.dry_run:
            self.container.transport.run(rendered.command, timeout=120)

    def change(self, what: str, rendered: Rendered, stdin: bytes | None = None, timeout: float = 600,
               count: bool = True) -> None:
        self.show(what, rendered)
        if count:
            self.outcome.changes.append(what)
        if self.dry_run:
            return
        self.say(f"provision: {what}")
        result = self.container.transport.run(rendered.command, stdin=stdin, timeout=timeout)
        if not result.ok:
            raise ProvisionError(f"{what} failed: {_said(result.stderr or result.stdout, result.exit_code)}")


def node_rendered(argv: list[str]) -> Rendered:
    """A node-level command, shown with the layers exec --print-command shows (no container layer)."""
    return Rendered(argv=tuple(argv), pct_argv=tuple(argv), command=render.node_command(argv))


def _said(text: str, code: int) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else f"exit {code}"


