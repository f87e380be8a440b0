"""The inventory: which nodes exist, how to reach them, and which containers (targets) they hold.

Schema (YAML)::

    nodes:
      pve1: {transport: ssh, address: 10.1.2.6, port: 22, user: root,
             identity_file: ~/.ssh/id_ed25519, known_hosts: ~/.ssh/known_hosts, pct: pct}
    targets:
      host200: {node: pve1, ctid: 200, base_dir: /opt/dflash, python: python3, gpus: [0, 1]}

`pct: none` says the node has no Proxmox: its targets are the node itself (a plain GPU box,
or the container you are in), commands run there directly and `ctid` may be left out.

`pct: simulated` (local nodes only) is the bundled simulated Proxmox node. What a node is (its
`pct:` value) is its kind (dflash_ops/nodekinds/), which owns its own keys (the simulated node's
`sim_root`, `sim_containers`, `sim_backend`), its pct command, and defaults for its targets'
`base_dir` and `python`; this module only asks it. On local nodes `~` in `base_dir` is expanded
for the user running dflash-ops, so the default inventory works for root and non-root users alike.

`notify:` (on a node, for all its targets, or on a target, added to its node's) names who hears
about every state change of a run started there (docs/run-lifecycle.md, "Events")::

    notify:
      webhooks: [https://hooks.example.com/T0/B0/XXXX, env:SLACK_WEBHOOK]   # POSTed from the container
      commands: [[/usr/local/bin/page-me, --quiet]]     # run in the container, the event on stdin
      local: [[notify-send, dflash-ops]]                 # run on the operator's side by the followers
      checkpoints: true                                  # also an event per checkpoint written (default: no)

A webhook `env:NAME` is read from the operator's environment when the run starts, so the secret
need not be in the inventory; URLs are shown redacted (scheme and host) everywhere.

Every error names file:line and says what is wrong in one line.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dflash_ops import nodekinds
from dflash_ops.errors import InventoryError
from dflash_ops.helpers.notify import URL_RE as WEBHOOK_RE
from dflash_ops.helpers.notify import redact_url
from dflash_ops.nodekinds.base import NodeKind
from dflash_ops.yamlfile import read_yaml_node, suggest
from trainer.run.yamlsafe import BoundedLoader

ENV_VAR = "DFLASH_OPS_INVENTORY"


@dataclass(frozen=True)
class Notify:
    """Who hears about a run's state changes: webhooks and commands in the container (sent by its
    supervisor, the queue worker), local commands on the operator's side (run by the followers)."""

    webhooks: tuple[str, ...] = ()  # URLs, or env:NAME (resolved when a run starts: resolved_webhooks)
    commands: tuple[tuple[str, ...], ...] = ()
    local: tuple[tuple[str, ...], ...] = ()
    checkpoints: bool = False  # also the optional `checkpoint` event, one per checkpoint written

    def __add__(self, other: "Notify | None") -> "Notify":
        if other is None:
            return self
        return Notify(self.webhooks + other.webhooks, self.commands + other.commands, self.local + other.local,
                      self.checkpoints or other.checkpoints)

    def __bool__(self) -> bool:
        return bool(self.webhooks or self.commands or self.local)


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
    kind: NodeKind = None  # type: ignore[assignment]  # what the node is (dflash_ops/nodekinds/); default: pct's
    notify: Notify | None = None  # for every target of the node

    def __post_init__(self) -> None:
        if self.kind is None:
            object.__setattr__(self, "kind", NodeKind(self.pct))


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
    notify: Notify | None = None  # added to the node's
    user: str | None = None  # a non-root user of the container the runs are meant for: doctor checks its GPU access

    @property
    def notify_all(self) -> Notify:
        """The node's notify: and the target's, together."""
        return (self.node.notify or Notify()) + self.notify

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
                f"{self.path}: no target {name!r}{suggest(name, self.targets)}"
                f" (targets: {', '.join(sorted(self.targets)) or 'none'}){self._new_target_hint(name)}"
            ) from None

    def _new_target_hint(self, name: str) -> str:
        """How a target that is not there gets made (a provision --dry-run adds none): the command,
        with the node when the inventory has one node of pct's, else NODE, and a ctid to choose."""
        pct_nodes = [n for n, node in self.nodes.items() if node.pct]
        if not pct_nodes or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
            return ""
        node = pct_nodes[0] if len(pct_nodes) == 1 else "NODE"
        return (f"; to create it: dflash-ops provision {name} --write-inventory --node {node} --ctid N"
                f"{'' if self.path == user_inventory_path() or self.path == packaged_inventory_path() else f' --inventory {self.path}'}")


def user_inventory_path() -> Path:
    """The user's own inventory: $XDG_CONFIG_HOME/dflash-ops/hosts.yaml (~/.config/... by default).

    It lives outside the repository, so a command that adds a target (provision --write-inventory)
    never edits a tracked file; it is seeded from the packaged default the first time one does."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "dflash-ops" / "hosts.yaml"


def packaged_inventory_path() -> Path:
    """The default shipped with dflash-ops: the repository's inventory/hosts.yaml, else the packaged copy."""
    package_dir = Path(__file__).resolve().parent
    repo_file = package_dir.parent / "inventory" / "hosts.yaml"
    if repo_file.is_file():
        return repo_file
    return package_dir / "data" / "hosts.yaml"


def default_inventory_path() -> Path:
    """$DFLASH_OPS_INVENTORY, else the user's inventory (user_inventory_path) once it exists, else
    the packaged default (the embedded simulated node)."""
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env).expanduser()
    user = user_inventory_path()
    return user if user.exists() or user.is_symlink() else packaged_inventory_path()


def writable_inventory_path(path: str | os.PathLike | None = None) -> tuple[Path, bool]:
    """The inventory file a command that adds to it edits, and whether it was seeded just now.

    A file named by --inventory or $DFLASH_OPS_INVENTORY is edited where it is. Otherwise it is the
    user's (user_inventory_path), created from the packaged default when it does not exist yet
    (O_EXCL: of two commands seeding at once, one copies and both then edit the same file)."""
    if path:
        return Path(path).expanduser(), False
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env).expanduser(), False
    user = user_inventory_path()
    if user.exists() or user.is_symlink():
        return user, False
    text = packaged_inventory_path().read_bytes()
    try:
        user.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(user, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return user, False
    except OSError as e:
        raise InventoryError(f"{user}: cannot create the user's inventory: {e.strerror or e}") from None
    with os.fdopen(fd, "wb") as f:
        f.write(text)
    return user, True


def load_inventory(path: str | os.PathLike | None = None, text: str | None = None) -> Inventory:
    """The inventory in `path` (default: default_inventory_path()); `text`: parse this instead of
    the file's content, errors still naming `path` (what an edit would write, checked before it is)."""
    path = Path(path).expanduser() if path else default_inventory_path()
    loader, root = read_yaml_node(path, "inventory", InventoryError, _MarkedLoader, text=text)
    try:
        data = None if root is None else loader.construct_document(root)
    finally:
        loader.dispose()
    return _Parser(path).inventory(data)


ENV_REF_RE = re.compile(r"^env:[A-Za-z_][A-Za-z0-9_]*$")


def resolved_webhooks(notify: Notify, extra: Iterable[str] = ()) -> list[str]:
    """The webhook URLs of notify (env:NAME read from the environment now) and `extra` (run start
    --notify URL), each once; an unset variable or a bad URL is an InventoryError (URL redacted)."""
    urls: list[str] = []
    for ref in [*notify.webhooks, *extra]:
        url = os.environ.get(ref[4:], "") if ENV_REF_RE.match(ref) else ref
        if not url:
            raise InventoryError(f"notify: webhook {ref}: the environment variable {ref[4:]} is not set")
        if not WEBHOOK_RE.match(url):
            raise InventoryError(f"notify: webhook {redact_url(url)!r} is not an http:// or https:// URL")
        if url not in urls:
            urls.append(url)
    return urls


class _Mapping(dict):
    """A YAML mapping that remembers the line of itself and of each key."""

    line = 0
    key_lines: dict


class _MarkedLoader(BoundedLoader):
    pass


def _construct_marked_mapping(loader: _MarkedLoader, node: yaml.MappingNode) -> Iterator[_Mapping]:
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


# The schema's types and ranges (pydantic, strict: no "22" for 22, no true for 1); what depends on
# other keys (ssh needs an address, pct: simulated needs a local node, ...) is checked in _Parser.
class _Schema(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


Ctid = Annotated[int, Field(ge=100, le=999_999_999)]
Path_ = Annotated[str, Field(min_length=1)]


class _InventorySpec(_Schema):
    nodes: dict
    targets: dict


class _NodeSpec(_Schema):
    transport: Literal["ssh", "local"]
    address: str | None = None
    port: Annotated[int, Field(ge=1, le=65535)] | None = None
    user: str | None = None
    identity_file: str | None = None
    known_hosts: str | None = None
    strict_host_key_checking: bool = True
    pct: Any = "pct"  # a command (string or list of strings), or a kind's name (nodekinds.KINDS)
    connect_timeout: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 10.0
    keepalive: Annotated[int, Field(ge=0)] = 15
    notify: Any = None  # a mapping (_NotifySpec)


class _TargetSpec(_Schema):
    node: str
    ctid: Annotated[Ctid, Field(strict=False)] | None = None  # "200" is a ctid too
    base_dir: Path_ | None = None  # required unless the node's kind has a default
    python: Path_ | None = None  # default: the node kind's, else python3
    gpus: list[Annotated[int, Field(ge=0)]] = []
    extra_paths: list[Path_] = []
    venv: Any = None  # a mapping (VenvConfig), false (no venv) or null (the default)
    keep_releases: Annotated[int, Field(ge=1)] | None = None
    address: str | None = None  # the container's own address, for runs across hosts
    notify: Any = None  # a mapping (_NotifySpec)
    user: Annotated[str, Field(pattern=r"^[a-z_][a-z0-9_-]*$")] | None = None  # a non-root user in the CT


Argv = Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]


class _NotifySpec(_Schema):
    webhooks: list[str] = []
    commands: list[Argv] = []
    local: list[Argv] = []
    checkpoints: bool = False


UvMode = Literal["auto", "always", "never"]


class VenvConfig(_Schema):
    """A `venv:` mapping (an inventory target's, a playbook deploy step's): the one schema of it.
    dflash_ops.deploy.venv_spec.VenvSpec.from_config builds the deploy's venv from it."""

    requirements: str | None = None
    system_site_packages: bool = True
    wheelhouse: str | None = None
    uv: UvMode = "auto"
    index: bool = True


def schema_problem(spec: type[BaseModel], error: ValidationError, known: Iterable[str] = ()) -> tuple[str, str, str]:
    """The first problem of a failed `spec.model_validate` (unknown keys first), as (its key, its
    kind: pydantic's error type, a one-line message: `key: problem, got VALUE`)."""
    first = min(error.errors(), key=lambda err: err["type"] != "extra_forbidden")
    key = str(first["loc"][0]) if first["loc"] else ""
    if first["type"] == "extra_forbidden":
        message = f"unknown key {key!r}{suggest(key, [*spec.model_fields, *known])}"
    elif first["type"] == "missing":
        message = f"missing required key {key!r}"
    else:
        field = key + "".join(f"[{part}]" for part in first["loc"][1:])
        message = f"{field} {first['msg'].replace('Input should be', 'must be')}, got {first['input']!r}"
    return key, first["type"], message


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

    def validate(self, spec: type[BaseModel], m: _Mapping, what: str, keys: dict | None = None,
                 known: Iterable[str] = ()) -> Any:
        """m (or its `keys`) checked against spec; the first problem as `FILE:LINE: what: key: problem, got VALUE`.

        `known`: other names a misspelt key is compared with (the node kinds' keys)."""
        try:
            return spec.model_validate(dict(m) if keys is None else keys)
        except ValidationError as e:
            key, kind, message = schema_problem(spec, e, known)
            line = m.line if kind == "missing" else m.key_lines.get(key, m.line)
            raise self.fail(line, f"{what}: {message}") from None

    def inventory(self, data: Any) -> Inventory:
        if data is None:
            raise self.fail(1, "empty inventory: expected 'nodes' and 'targets'")
        top = self.mapping(data, 1, "inventory")
        self.validate(_InventorySpec, top, "inventory")
        inv = Inventory(path=self.path)
        nodes: _Mapping = top["nodes"]  # the schema made these mappings
        for name, body in nodes.items():
            inv.nodes[str(name)] = self.node(str(name), body, nodes.key_lines[name])
        targets: _Mapping = top["targets"]
        for name, body in targets.items():
            inv.targets[str(name)] = self.target(str(name), body, targets.key_lines[name], inv.nodes)
        return inv

    def node(self, name: str, body: Any, line: int) -> Node:
        what = f"node {name!r}"
        m = self.mapping(body, line, what)
        own = nodekinds.keys_of(m.get("pct", "pct"))  # imports only the kind this node names
        own_keys = set(own.model_fields) if own is not None else set()
        # every kind (each one imported) only when a key is neither the node's nor its kind's: whose is it?
        stray = any(k not in _NodeSpec.model_fields and k not in own_keys for k in m)
        kinds = nodekinds.kind_keys() if stray else {}
        kind_keys = {k for keys in kinds.values() for k in keys.model_fields} | own_keys
        spec: _NodeSpec = self.validate(_NodeSpec, m, what, {k: v for k, v in m.items() if k not in kind_keys},
                                        kind_keys)
        at: Callable[[str], int] = lambda key: m.key_lines.get(key, m.line)  # noqa: E731
        if spec.transport == "ssh" and spec.address is None:
            raise self.fail(m.line, f"{what}: missing required key 'address' (ssh nodes)")
        for key in m:
            if key in kind_keys and (own is None or key not in own.model_fields):
                owner = next(n for n, keys in kinds.items() if key in keys.model_fields)
                raise self.fail(at(key), f"{what}: '{key}' only applies to nodes with pct: {owner}")
        keys = {k: v for k, v in m.items() if own is not None and k in own.model_fields}
        if own is not None:
            self.validate(own, m, what, keys)
        kind = nodekinds.build(spec.pct, keys, spec.transport,
                               lambda key, message: self.fail(at(key), f"{what}: {message}"))
        return Node(name=name, pct=kind.pct, kind=kind, notify=self.notify(m, at, what),
                    **spec.model_dump(exclude={"pct", "notify"}))

    def target(self, name: str, body: Any, line: int, nodes: dict[str, Node]) -> Target:
        what = f"target {name!r}"
        m = self.mapping(body, line, what)
        spec: _TargetSpec = self.validate(_TargetSpec, m, what)
        at: Callable[[str], int] = lambda key: m.key_lines.get(key, m.line)  # noqa: E731
        if spec.node not in nodes:
            raise self.fail(at("node"), f"{what}: unknown node {spec.node!r}{suggest(spec.node, nodes)}")
        node = nodes[spec.node]
        if spec.ctid is None and node.pct:
            raise self.fail(m.line, f"{what}: missing required key 'ctid'")
        defaults = node.kind.target_defaults(100 if spec.ctid is None else spec.ctid)
        base_dir = spec.base_dir or defaults.get("base_dir")
        if base_dir is None:
            raise self.fail(m.line, f"{what}: missing required key 'base_dir'")
        base_dir = os.path.expanduser(base_dir) if node.transport == "local" else base_dir
        if not base_dir.startswith("/"):
            raise self.fail(at("base_dir"), f"{what}: base_dir must be an absolute path, got {base_dir!r}")
        python = spec.python or defaults.get("python") or "python3"
        python = os.path.expanduser(python) if node.transport == "local" else python
        if len(set(spec.gpus)) != len(spec.gpus):
            raise self.fail(at("gpus"), f"{what}: gpus names a GPU twice: {spec.gpus!r}")
        if spec.address is not None and (not spec.address or any(c.isspace() for c in spec.address)):
            raise self.fail(at("address"), f"{what}: address must be the container's IP address or host name, "
                            f"got {spec.address!r}")
        return Target(name=name, node=node, ctid=100 if spec.ctid is None else spec.ctid,
                      base_dir=base_dir.rstrip("/") or "/", python=python, gpus=tuple(spec.gpus),
                      extra_paths=tuple(spec.extra_paths), venv=self.venv(m, at, what),
                      keep_releases=spec.keep_releases, address=spec.address, notify=self.notify(m, at, what),
                      user=spec.user)

    def notify(self, m: _Mapping, at: Callable[[str], int], what: str) -> Notify | None:
        if m.get("notify") is None:
            return None
        v = self.mapping(m["notify"], at("notify"), f"{what}: notify")
        spec: _NotifySpec = self.validate(_NotifySpec, v, f"{what}: notify")
        for i, url in enumerate(spec.webhooks):
            if not (WEBHOOK_RE.match(url) or ENV_REF_RE.match(url)):
                raise self.fail(v.key_lines.get("webhooks", v.line),
                                f"{what}: notify: webhooks[{i}] must be an http(s):// URL or env:NAME, got "
                                f"{redact_url(url)!r}")
        return Notify(tuple(spec.webhooks), tuple(map(tuple, spec.commands)), tuple(map(tuple, spec.local)),
                      spec.checkpoints)

    def venv(self, m: _Mapping, at: Callable[[str], int], what: str) -> "tuple[tuple[str, Any], ...] | bool | None":
        if m.get("venv") is None:
            return None
        if m["venv"] is False:
            return False
        v = self.mapping(m["venv"], at("venv"), f"{what}: venv")
        self.validate(VenvConfig, v, f"{what}: venv")
        return tuple(sorted(dict(v).items()))
