"""The inventory: which nodes exist, how to reach them, and which containers (targets) they hold.

Schema (YAML)::

    nodes:
      pve1: {transport: ssh, address: 10.1.2.6, port: 22, user: root,
             identity_file: ~/.ssh/id_ed25519, known_hosts: ~/.ssh/known_hosts, pct: pct}
    targets:
      host200: {node: pve1, ctid: 200, base_dir: /opt/dflash, python: python3, gpus: [0, 1]}

`pct: none` says the node has no Proxmox: its targets are the node itself (a plain GPU box,
or the container you are in), commands run there directly and `ctid` may be left out.

`pct: simulated` (local nodes only) selects the bundled `pct` stand-in (dflash_ops/simnode),
run by this very interpreter, with its state under `sim_root`. On local nodes `~` in
`base_dir` and `sim_root` is expanded for the user running dflash-ops, so the default
inventory works for root and non-root users alike.

Every error names file:line and says what is wrong in one line.
"""

from __future__ import annotations

import difflib
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dflash_ops.errors import InventoryError

ENV_VAR = "DFLASH_OPS_INVENTORY"
SIMULATED = "simulated"
NO_PCT = "none"
DEFAULT_SIM_ROOT = "~/.local/state/dflash-ops/sim"
_SIM_PCT_SCRIPT = Path(__file__).resolve().parent / "simnode" / "pct.py"


@dataclass(frozen=True)
class Node:
    name: str
    transport: str  # "ssh" or "local"
    pct: tuple[str, ...]  # the argv prefix that runs pct on the node; () when it has none (`pct: none`)
    address: str | None = None
    port: int | None = None
    user: str | None = None
    identity_file: str | None = None
    known_hosts: str | None = None
    strict_host_key_checking: bool = True
    connect_timeout: float = 10.0
    keepalive: int = 15
    sim_root: str | None = None  # local nodes running the stand-in: its state directory
    # simulated nodes: containers created (like an admin's `pct create`) on first use
    sim_containers: tuple[int, ...] = ()


@dataclass(frozen=True)
class Target:
    name: str
    node: Node
    ctid: int
    base_dir: str
    python: str = "python3"
    gpus: tuple[int, ...] = ()
    extra_paths: tuple[str, ...] = ()  # deployed beside trainer/, relative to the project root
    venv: "tuple[tuple[str, Any], ...] | bool | None" = None  # venv: mapping (as items), or False for none
    keep_releases: int | None = None
    address: str | None = None  # the container's own address for runs across hosts (else asked from it)

    @property
    def venv_config(self) -> "dict[str, Any] | bool | None":
        return dict(self.venv) if isinstance(self.venv, tuple) else self.venv


@dataclass
class Inventory:
    path: Path
    nodes: dict[str, Node] = field(default_factory=dict)
    targets: dict[str, Target] = field(default_factory=dict)

    def target(self, name: str) -> Target:
        try:
            return self.targets[name]
        except KeyError:
            raise InventoryError(
                f"{self.path}: no target {name!r}{_suggest(name, self.targets)}"
                f" (targets: {', '.join(sorted(self.targets)) or 'none'})"
            ) from None


def default_inventory_path() -> Path:
    """$DFLASH_OPS_INVENTORY, else the repository's inventory/hosts.yaml, else the packaged copy."""
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env).expanduser()
    package_dir = Path(__file__).resolve().parent
    repo_file = package_dir.parent / "inventory" / "hosts.yaml"
    if repo_file.is_file():
        return repo_file
    return package_dir / "data" / "hosts.yaml"


def load_inventory(path: str | os.PathLike | None = None) -> Inventory:
    path = Path(path).expanduser() if path else default_inventory_path()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise InventoryError(f"{path}: cannot read inventory: {e.strerror or e}") from None
    try:
        loader = _MarkedLoader(text)
        loader.name = str(path)
        try:
            data = loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark else "?"
        raise InventoryError(f"{path}:{line}: invalid YAML: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise InventoryError(f"{path}: invalid YAML: {e}") from None
    return _Parser(path).inventory(data)


class _Mapping(dict):
    """A YAML mapping that remembers the line of itself and of each key."""

    line = 0
    key_lines: dict


class _MarkedLoader(yaml.SafeLoader):
    pass


def _construct_marked_mapping(loader: _MarkedLoader, node: yaml.MappingNode):
    data = _Mapping()
    data.line = node.start_mark.line + 1
    data.key_lines = {}
    yield data
    loader.flatten_mapping(node)
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        if key in data:
            raise InventoryError(f"{loader.name}:{line}: duplicate key {key!r}")
        data[key] = loader.construct_object(value_node, deep=True)
        data.key_lines[key] = line


_MarkedLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_marked_mapping)

_NODE_KEYS = {
    "transport", "address", "port", "user", "identity_file", "known_hosts",
    "strict_host_key_checking", "pct", "connect_timeout", "keepalive", "sim_root", "sim_containers",
}
_TARGET_KEYS = {"node", "ctid", "base_dir", "python", "gpus", "extra_paths", "venv", "keep_releases", "address"}
_VENV_KEYS = {"requirements", "system_site_packages", "wheelhouse", "uv", "index"}


def _suggest(word: str, choices) -> str:
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


class _Parser:
    def __init__(self, path: Path):
        self.path = path

    def fail(self, line: int, message: str) -> InventoryError:
        return InventoryError(f"{self.path}:{line}: {message}")

    def mapping(self, value: Any, line: int, what: str) -> _Mapping:
        if not isinstance(value, _Mapping):
            raise self.fail(line, f"{what} must be a mapping, got {type(value).__name__}")
        value.line = line  # report a missing key at the line naming the entry
        return value

    def check_keys(self, m: _Mapping, allowed: set[str], required: set[str], what: str) -> None:
        for key in m:
            if key not in allowed:
                raise self.fail(m.key_lines[key], f"{what}: unknown key {key!r}{_suggest(key, allowed)}")
        for key in sorted(required):
            if key not in m:
                raise self.fail(m.line, f"{what}: missing required key {key!r}")

    def inventory(self, data: Any) -> Inventory:
        if data is None:
            raise self.fail(1, "empty inventory: expected 'nodes' and 'targets'")
        top = self.mapping(data, 1, "inventory")
        self.check_keys(top, {"nodes", "targets"}, {"nodes", "targets"}, "inventory")
        inv = Inventory(path=self.path)
        nodes = self.mapping(top["nodes"], top.key_lines["nodes"], "'nodes'")
        for name, body in nodes.items():
            inv.nodes[str(name)] = self.node(str(name), body, nodes.key_lines[name])
        targets = self.mapping(top["targets"], top.key_lines["targets"], "'targets'")
        for name, body in targets.items():
            inv.targets[str(name)] = self.target(str(name), body, targets.key_lines[name], inv.nodes)
        return inv

    def node(self, name: str, body: Any, line: int) -> Node:
        what = f"node {name!r}"
        m = self.mapping(body, line, what)
        self.check_keys(m, _NODE_KEYS, {"transport"}, what)
        at = lambda key: m.key_lines.get(key, m.line)  # noqa: E731
        transport = m["transport"]
        if transport not in ("ssh", "local"):
            raise self.fail(at("transport"), f"{what}: transport must be 'ssh' or 'local', got {transport!r}")
        if transport == "ssh" and "address" not in m:
            raise self.fail(m.line, f"{what}: missing required key 'address' (ssh nodes)")
        for key in ("sim_root", "sim_containers"):
            if key in m and m.get("pct") != SIMULATED:
                raise self.fail(at(key), f"{what}: '{key}' only applies to nodes with pct: simulated")
        sim_containers = m.get("sim_containers", [])
        if not isinstance(sim_containers, list) or not all(
                isinstance(c, int) and not isinstance(c, bool) and 100 <= c <= 999_999_999 for c in sim_containers):
            raise self.fail(at("sim_containers"), f"{what}: sim_containers must be a list of ctids, got {sim_containers!r}")
        if "port" in m and (not isinstance(m["port"], int) or isinstance(m["port"], bool)
                            or not 1 <= m["port"] <= 65535):
            raise self.fail(at("port"), f"{what}: port must be an integer from 1 to 65535, got {m['port']!r}")
        if "keepalive" in m and (not isinstance(m["keepalive"], int) or isinstance(m["keepalive"], bool)
                                 or m["keepalive"] < 0):
            raise self.fail(at("keepalive"), f"{what}: keepalive must be a non-negative integer, got {m['keepalive']!r}")
        timeout = m.get("connect_timeout", 10.0)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise self.fail(at("connect_timeout"), f"{what}: connect_timeout must be a number of seconds > 0, got {timeout!r}")
        strict = m.get("strict_host_key_checking", True)
        if not isinstance(strict, bool):
            raise self.fail(at("strict_host_key_checking"), f"{what}: strict_host_key_checking must be true or false")
        for key in ("address", "user", "identity_file", "known_hosts", "sim_root"):
            if key in m and not isinstance(m[key], str):
                raise self.fail(at(key), f"{what}: {key} must be a string, got {m[key]!r}")
        sim_root = None
        pct: tuple[str, ...]
        raw_pct = m.get("pct", "pct")
        if raw_pct == SIMULATED:
            if transport != "local":
                raise self.fail(at("pct"), f"{what}: pct 'simulated' needs transport 'local'")
            sim_root = os.path.expanduser(m.get("sim_root", DEFAULT_SIM_ROOT))
            if not os.path.isabs(sim_root):
                raise self.fail(at("sim_root"), f"{what}: sim_root must be an absolute path, got {sim_root!r}")
            pct = (sys.executable, str(_SIM_PCT_SCRIPT), "--state-root", sim_root)
        elif raw_pct == NO_PCT:
            pct = ()
        elif isinstance(raw_pct, str) and raw_pct.strip():
            pct = tuple(shlex.split(raw_pct))
        elif isinstance(raw_pct, list) and raw_pct and all(isinstance(p, str) and p for p in raw_pct):
            pct = tuple(raw_pct)
        else:
            raise self.fail(at("pct"), f"{what}: pct must be a command (string or list of strings), got {raw_pct!r}")
        return Node(
            name=name,
            transport=transport,
            pct=pct,
            address=m.get("address"),
            port=m.get("port"),
            user=m.get("user"),
            identity_file=m.get("identity_file"),
            known_hosts=m.get("known_hosts"),
            strict_host_key_checking=strict,
            connect_timeout=float(m.get("connect_timeout", 10.0)),
            keepalive=int(m.get("keepalive", 15)),
            sim_root=sim_root,
            sim_containers=tuple(sim_containers),
        )

    def target(self, name: str, body: Any, line: int, nodes: dict[str, Node]) -> Target:
        what = f"target {name!r}"
        m = self.mapping(body, line, what)
        self.check_keys(m, _TARGET_KEYS, {"node", "base_dir"}, what)
        at = lambda key: m.key_lines.get(key, m.line)  # noqa: E731
        node_name = str(m["node"])
        if node_name not in nodes:
            raise self.fail(at("node"), f"{what}: unknown node {node_name!r}{_suggest(node_name, nodes)}")
        node = nodes[node_name]
        if "ctid" not in m and node.pct:
            raise self.fail(m.line, f"{what}: missing required key 'ctid'")
        ctid = m.get("ctid", 100)
        if isinstance(ctid, str) and ctid.isdigit():
            ctid = int(ctid)
        if not isinstance(ctid, int) or isinstance(ctid, bool) or not 100 <= ctid <= 999_999_999:
            raise self.fail(at("ctid"), f"{what}: ctid must be an integer from 100 to 999999999, got {m['ctid']!r}")
        base_dir = m["base_dir"]
        if not isinstance(base_dir, str) or not base_dir:
            raise self.fail(at("base_dir"), f"{what}: base_dir must be a path string")
        if node.transport == "local":
            base_dir = os.path.expanduser(base_dir)
        if not base_dir.startswith("/"):
            raise self.fail(at("base_dir"), f"{what}: base_dir must be an absolute path, got {base_dir!r}")
        python = m.get("python", "python3")
        if not isinstance(python, str) or not python:
            raise self.fail(at("python"), f"{what}: python must be a command name or path")
        if node.transport == "local":
            python = os.path.expanduser(python)
        gpus = m.get("gpus", [])
        if not isinstance(gpus, list) or not all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in gpus):
            raise self.fail(at("gpus"), f"{what}: gpus must be a list of GPU indices, got {gpus!r}")
        if len(set(gpus)) != len(gpus):
            raise self.fail(at("gpus"), f"{what}: gpus names a GPU twice: {gpus!r}")
        extra_paths = m.get("extra_paths", [])
        if not isinstance(extra_paths, list) or not all(isinstance(p, str) and p for p in extra_paths):
            raise self.fail(at("extra_paths"), f"{what}: extra_paths must be a list of paths, got {extra_paths!r}")
        keep = m.get("keep_releases")
        if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
            raise self.fail(at("keep_releases"), f"{what}: keep_releases must be a whole number >= 1, got {keep!r}")
        address = m.get("address")
        if address is not None and (not isinstance(address, str) or not address or any(c.isspace() for c in address)):
            raise self.fail(at("address"), f"{what}: address must be the container's IP address or host name, got {address!r}")
        return Target(name=name, node=node, ctid=ctid, base_dir=base_dir.rstrip("/") or "/", python=python,
                      gpus=tuple(gpus), extra_paths=tuple(extra_paths), venv=self.venv(m, at, what),
                      keep_releases=keep, address=address)

    def venv(self, m: _Mapping, at, what: str) -> "tuple[tuple[str, Any], ...] | bool | None":
        if "venv" not in m or m["venv"] is None:
            return None
        if m["venv"] is False:
            return False
        v = self.mapping(m["venv"], at("venv"), f"{what}: venv")
        self.check_keys(v, _VENV_KEYS, set(), f"{what}: venv")
        if not all(isinstance(v.get(k, True), bool) for k in ("system_site_packages", "index")):
            raise self.fail(at("venv"), f"{what}: venv: system_site_packages and index must be true or false")
        if v.get("uv", "auto") not in ("auto", "always", "never"):
            raise self.fail(v.key_lines["uv"], f"{what}: venv: uv must be auto, always or never, got {v['uv']!r}")
        return tuple(sorted(dict(v).items()))
