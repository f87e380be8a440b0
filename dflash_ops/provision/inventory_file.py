"""`provision --write-inventory`: add the target to the inventory file, keeping its comments and order.

ruamel.yaml's round-trip mode loads the file into objects that remember its comments, key order and
flow style, and writes back only what changed; PyYAML (the inventory's reader) drops comments, so a
rewrite through it would lose the admin's notes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash_ops.errors import InventoryError


def _load(path: Path) -> tuple[Any, Any]:
    from ruamel.yaml import YAML
    from ruamel.yaml.error import YAMLError

    yaml = YAML()  # round-trip
    yaml.preserve_quotes = True
    yaml.width = 1 << 16  # never fold a long line the admin wrote on one
    try:
        return yaml, yaml.load(path.read_text())
    except YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise InventoryError(f"{path}{line}: not YAML the inventory can be written back to ({e.__class__.__name__})") from None


def _dump(yaml: Any, doc: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.dflash-ops.tmp")
    with tmp.open("w") as f:
        yaml.dump(doc, f)
    tmp.replace(path)


def _flow(items: tuple[int, ...]) -> Any:
    from ruamel.yaml.comments import CommentedSeq

    seq = CommentedSeq(list(items))
    seq.fa.set_flow_style()
    return seq


def set_gpus(path: Path, name: str, gpus: tuple[int, ...]) -> bool:
    """Give target `name` a `gpus:` list when it has none (provision --gpus all resolved it); False if it had one."""
    yaml, doc = _load(path)
    entry = ((doc or {}).get("targets") or {}).get(name)
    if not isinstance(entry, dict) or "gpus" in entry:
        return False
    entry["gpus"] = _flow(gpus)
    _dump(yaml, doc, path)
    return True


def add_target(path: Path, name: str, node: str, ctid: int, gpus: tuple[int, ...] = ()) -> bool:
    """Append target `name` (node, ctid, gpus) under `targets:`; False when it is there already."""
    from ruamel.yaml.comments import CommentedMap

    yaml, doc = _load(path)
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
        return False
    entry = CommentedMap([("node", node), ("ctid", ctid)])
    if gpus:
        entry["gpus"] = _flow(gpus)
    entry.fa.set_flow_style()
    targets[name] = entry
    _dump(yaml, doc, path)
    return True
