"""The operator side's YAML files (inventory, playbooks): one reader with file:line errors and one
"did you mean" suggester. (The trainer, which never imports dflash_ops, keeps its own copy.)"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from pathlib import Path

import yaml

ErrorFactory = Callable[[str], Exception]


def suggest(word: object, choices: Iterable[object]) -> str:
    """' (did you mean 'x'?)' for the closest choice, or ''."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def read_yaml_node(path: Path, what: str, error: ErrorFactory,
                   loader_class: type[yaml.SafeLoader] = yaml.SafeLoader) -> tuple[yaml.SafeLoader, yaml.Node | None]:
    """The file's single document as a node (None when empty) and the loader to construct values
    with (their marks give lines). Unreadable files and invalid YAML raise error("FILE[:LINE]: ...")."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise error(f"{path}: cannot read {what}: {e.strerror or e}") from None
    loader = loader_class(text)
    loader.name = str(path)
    try:
        return loader, loader.get_single_node()
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        raise error(f"{path}:{mark.line + 1 if mark else '?'}: invalid YAML: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise error(f"{path}: invalid YAML: {e}") from None
