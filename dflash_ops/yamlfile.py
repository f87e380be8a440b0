"""The operator side's YAML files (inventory, playbooks): one reader with file:line errors and one
"did you mean" suggester. The bounds (size, depth, aliases) are the trainer's
`trainer/run/yamlsafe.py`, the one rule for every YAML reader of the project."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from pathlib import Path

import yaml

from trainer.run.yamlsafe import BoundedLoader, YAMLBoundError, compose, read_text

ErrorFactory = Callable[[str], Exception]


def suggest(word: object, choices: Iterable[object]) -> str:
    """' (did you mean 'x'?)' for the closest choice, or ''."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def read_yaml_node(path: Path, what: str, error: ErrorFactory,
                   loader_class: type[BoundedLoader] = BoundedLoader,
                   text: str | None = None) -> tuple[yaml.SafeLoader, yaml.Node | None]:
    """The file's single document as a node (None when empty) and the loader to construct values
    with (their marks give lines). Unreadable files, invalid YAML and YAML over the bounds (size,
    nesting, alias expansion) raise error("FILE[:LINE]: ..."). `text`: what the file would hold
    (an edit checked before it is written), read instead of the file and named as it."""
    try:
        if text is None:
            text = read_text(path)
    except OSError as e:
        raise error(f"{path}: cannot read {what}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise error(f"{path}: cannot read {what}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except yaml.MarkedYAMLError as e:  # over the size bound
        raise error(f"{path}: cannot read {what}: {e.problem}") from None
    try:
        loader = loader_class(text)
        loader.name = str(path)
        return loader, loader.get_single_node()
    except yaml.MarkedYAMLError as e:
        raise error(_located(path, e)) from None
    except yaml.YAMLError as e:
        raise error(f"{path}: invalid YAML: {e}") from None


def check_bounds(path: Path, what: str, error: ErrorFactory) -> None:
    """Raise error("FILE[:LINE]: ...") when the file is over the YAML bounds (size, nesting, alias
    expansion); anything else wrong with it is left to the reader that owns its schema (the
    trainer's config loader reports its own YAML errors)."""
    try:
        compose(read_text(path), str(path))
    except YAMLBoundError as e:
        raise error(_located(path, e)) from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return


def _located(path: Path, e: yaml.MarkedYAMLError) -> str:
    mark = e.problem_mark or e.context_mark
    where = f":{mark.line + 1}" if mark else ""
    return f"{path}{where}: invalid YAML: {e.problem or e.context}"
