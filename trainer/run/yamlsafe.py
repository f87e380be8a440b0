"""YAML read with bounds: the one rule for every YAML reader of the project (the trainer's config
and, through dflash_ops/yamlfile.py, the operator's inventory, playbooks and trainer configs).

PyYAML builds an alias as a reference to its anchor's node, so a few hundred bytes of nested
aliases ("billion laughs") compose instantly but expand to 10^9 nodes for whoever walks the tree
or constructs it into plain values; a recursive alias (`&a [*a]`) makes the tree a cycle; a deep
nest (`[[[[...`) ends PyYAML's recursive composer with a RecursionError. `BoundedLoader` counts
while it composes: the nodes that aliases add (their anchor's expanded size, computed once per
node), the nesting depth and the text's size, and stops at the first one over its limit with the
line that crossed it. Stdlib + PyYAML only (dflash_ops imports it; it imports nothing of ours).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

MAX_BYTES = 4 * 1024 * 1024     # a config, playbook or inventory is a few KiB
MAX_DEPTH = 64                  # nesting levels (mappings and lists)
MAX_ALIAS_NODES = 10_000        # nodes that all aliases of a document together may add


class YAMLBoundError(yaml.MarkedYAMLError):
    """The document is over one of the bounds; `problem` says which, `problem_mark` where.
    A MarkedYAMLError, so a reader that reports YAML errors with their line reports this one too."""

    def __init__(self, problem: str, mark: yaml.Mark | None = None) -> None:
        super().__init__(problem=problem, problem_mark=mark)


class BoundedLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a document over MAX_BYTES, nested deeper than MAX_DEPTH, with a
    recursive alias, or whose aliases add more than MAX_ALIAS_NODES nodes. Subclass it (with its
    own constructors) rather than SafeLoader to keep the bounds."""

    max_bytes = MAX_BYTES
    max_depth = MAX_DEPTH
    max_alias_nodes = MAX_ALIAS_NODES

    def __init__(self, stream: Any) -> None:
        if isinstance(stream, (str, bytes)) and len(stream) > self.max_bytes:
            raise YAMLBoundError(f"{len(stream)} bytes of YAML, more than the {self.max_bytes} this reader takes")
        super().__init__(stream)
        self._depth = 0
        self._open: set[str] = set()      # anchors whose node is being composed
        self._sizes: dict[int, int] = {}  # id(node) -> nodes it expands to (the nodes live as long as the document)
        self._alias_nodes = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            if event.anchor in self._open:
                raise YAMLBoundError(f"alias *{event.anchor} is inside the node it names (a recursive alias)",
                                     event.start_mark)
            node = super().compose_node(parent, index)
            self._alias_nodes += self._sizes[id(node)]
            if self._alias_nodes > self.max_alias_nodes:
                raise YAMLBoundError(f"aliases expand to more than {self.max_alias_nodes} nodes"
                                     f" (at *{event.anchor}); write the values out or use fewer aliases",
                                     event.start_mark)
            return node
        if self._depth >= self.max_depth:
            raise YAMLBoundError(f"nested deeper than {self.max_depth} levels", event.start_mark)
        anchor = event.anchor
        if anchor is not None:
            self._open.add(anchor)
        self._depth += 1
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
            if anchor is not None:
                self._open.discard(anchor)
        self._sizes[id(node)] = 1 + sum(self._sizes[id(child)] for child in _children(node))
        return node


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def compose(text: str, name: str = "<yaml>", loader_class: type[BoundedLoader] = BoundedLoader) -> yaml.Node | None:
    """The single document of `text` as a node graph (None when empty), within the bounds.
    Raises yaml.YAMLError (YAMLBoundError for a bound) like yaml.compose."""
    loader = loader_class(text)
    loader.name = name
    try:
        return loader.get_single_node()
    finally:
        loader.dispose()


def safe_load(text: str, name: str = "<yaml>") -> Any:
    """yaml.safe_load within the bounds."""
    loader = BoundedLoader(text)
    loader.name = name
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def read_text(path: Path, max_bytes: int = MAX_BYTES) -> str:
    """The file's text, refusing one over `max_bytes` without reading it whole. OSError and
    UnicodeDecodeError as Path.read_text; YAMLBoundError when it is too big."""
    with open(path, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise YAMLBoundError(f"more than {max_bytes} bytes of YAML, more than this reader takes")
    return data.decode("utf-8")


# ---------------------------------------------------------------- writing

YAML11_Y_N = ("y", "Y", "n", "N")  # YAML 1.1 booleans that PyYAML's own resolver leaves strings


class QuotingDumper(yaml.SafeDumper):
    """safe_dump's Dumper, with y / Y / n / N resolving as booleans too: a string the YAML 1.1 spec
    reads as a boolean is written quoted. PyYAML quotes yes/no/on/off/true/false (its resolver reads
    them as booleans) but left `y` and `n` plain, which a YAML 1.1 reader of another tool (Go's
    yaml.v2, for one) reads back as true / false (#55 item 8)."""


QuotingDumper.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:y|Y|n|N)$"), list("yYnN"))


def dump(doc: Any, sort_keys: bool = False) -> str:
    """The one way the project writes YAML (a trainer config, a playbook's `set:`, a run
    directory's config.yaml, a test harness's inventory): safe_dump, every string a YAML 1.1
    reader would read as something else written quoted, so it reads back as itself."""
    return yaml.dump(doc, Dumper=QuotingDumper, sort_keys=sort_keys)


def reads_back_as_itself(text: str) -> bool:
    """Would a YAML 1.1 reader read `text`, written plain, as this same string? (The inventory's
    round-trip writer quotes it when not.)"""
    if text in YAML11_Y_N:
        return False
    try:
        plain = yaml.safe_load(text)
    except yaml.YAMLError:
        return False
    return isinstance(plain, str) and plain == text
