"""`provision --write-inventory`: add the target to the inventory file, keeping its comments and order.

ruamel.yaml's round-trip mode loads the file into objects that remember its comments, key order and
flow style, and writes back only what changed; PyYAML (the inventory's reader) drops comments, so a
rewrite through it would lose the admin's notes.

The inventory is the user's file: it is edited in place under a lock, from what it holds under that
lock, and only after the inventory as it would be written loads (dflash_ops/userfile.py says why).
The text functions (`with_target`, `with_gpus`) compute the new text; a dry run parses it without
writing anything, and every message names the user's file.

ruamel writes YAML 1.2, where `on`, `yes` and `off` are plain strings; the inventory's reader
(PyYAML) reads YAML 1.1, where they are booleans. So every string written is quoted when a YAML 1.1
reader would not read it back as that string (a target named `on`, a node named `123`).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from dflash_ops.errors import InventoryError
from dflash_ops.userfile import edit_in_place
from trainer.run.yamlsafe import reads_back_as_itself


def _yaml() -> Any:
    from ruamel.yaml import YAML

    yaml = YAML()  # round-trip
    yaml.preserve_quotes = True
    yaml.width = 1 << 16  # never fold a long line the admin wrote on one
    return yaml


def _load(yaml: Any, text: str, path: Path) -> Any:
    from ruamel.yaml.error import YAMLError

    try:
        return yaml.load(text)
    except YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise InventoryError(f"{path}{line}: not YAML the inventory can be written back to ({e.__class__.__name__})") from None


def _dump(yaml: Any, doc: Any) -> str:
    out = io.StringIO()
    yaml.dump(doc, out)
    return out.getvalue()


def _scalar(text: str) -> Any:
    """`text` as written: quoted where a YAML 1.1 reader would read it as something else."""
    from ruamel.yaml.scalarstring import DoubleQuotedScalarString

    return text if reads_back_as_itself(text) else DoubleQuotedScalarString(text)


def _flow(items: tuple[int, ...]) -> Any:
    from ruamel.yaml.comments import CommentedSeq

    seq = CommentedSeq(list(items))
    seq.fa.set_flow_style()
    return seq


def with_gpus(text: str, path: Path, name: str, gpus: tuple[int, ...]) -> str | None:
    """The inventory text with target `name` given a `gpus:` list, or None when it has one already."""
    yaml = _yaml()
    doc = _load(yaml, text, path)
    entry = ((doc or {}).get("targets") or {}).get(name) if isinstance(doc, dict) else None
    if not isinstance(entry, dict) or "gpus" in entry:
        return None
    entry["gpus"] = _flow(gpus)
    return _dump(yaml, doc)


def with_target(text: str, path: Path, name: str, node: str, ctid: int, gpus: tuple[int, ...] = (),
                base_dir: str | None = None) -> str | None:
    """The inventory text with target `name` (node, ctid, gpus, and base_dir where the node's kind
    gives none) appended under `targets:`, or None when a target of that name is there already."""
    from ruamel.yaml.comments import CommentedMap

    yaml = _yaml()
    doc = _load(yaml, text, path)
    if doc is None:
        doc = CommentedMap()
    if not isinstance(doc, dict):
        raise InventoryError(f"{path}:1: an inventory is a mapping with nodes: and targets:")
    targets = doc.get("targets")
    if targets is None:
        targets = doc["targets"] = CommentedMap()
    if not isinstance(targets, dict):
        raise InventoryError(f"{path}: targets: is not a mapping")
    if name in targets:
        return None
    entry = CommentedMap([("node", _scalar(node)), ("ctid", ctid)])
    if base_dir:
        entry["base_dir"] = _scalar(base_dir)
    if gpus:
        entry["gpus"] = _flow(gpus)
    entry.fa.set_flow_style()
    targets[_scalar(name)] = entry
    return _dump(yaml, doc)


def check(path: Path, name: str) -> Any:
    """A check for edit_in_place: the new text loads as an inventory (named as the user's file) and
    holds target `name`; anything wrong is the inventory's own one-line error, and nothing is written."""
    from dflash_ops.inventory import load_inventory

    def run(text: str) -> None:
        inv = load_inventory(path, text=text)
        inv.target(name)

    return run


def set_gpus(path: Path, name: str, gpus: tuple[int, ...]) -> bool:
    """Give target `name` a `gpus:` list when it has none (provision --gpus all resolved it); False if it had one."""
    return edit_in_place(path, lambda text: with_gpus(text, path, name, gpus), check(path, name), InventoryError)


def add_target(path: Path, name: str, node: str, ctid: int, gpus: tuple[int, ...] = (),
               base_dir: str | None = None) -> bool:
    """Append target `name` under `targets:` (with_target); False when it is there already."""
    return edit_in_place(path, lambda text: with_target(text, path, name, node, ctid, gpus, base_dir),
                         check(path, name), InventoryError)
