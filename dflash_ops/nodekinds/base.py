"""The base of node kinds (dflash_ops/nodekinds/__init__.py is the registry): a Proxmox node reached by `pct`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from pydantic import BaseModel, ConfigDict

from dflash_ops.transport.base import Transport


class KindKeys(BaseModel):
    """A kind's own inventory keys (pydantic, strict, like the inventory's other schemas)."""

    model_config = ConfigDict(extra="forbid", strict=True)


# fail(key, message): an InventoryError at the line of `key` (or of the node), for the caller to raise.
Fail = Callable[[str, str], Exception]


@dataclass(frozen=True)
class NodeKind:
    """A Proxmox node reached by `pct` (or a plain host when `pct` is empty): nothing to start."""

    pct: tuple[str, ...]  # the argv prefix that runs pct on the node; () when it has none (`pct: none`)

    def target_defaults(self, ctid: int) -> dict[str, str]:
        """Defaults for a target's `base_dir` and `python` (none: the inventory names them)."""
        return {}

    def start(self, ctid: int, hostname: str, transport: Transport) -> None:
        """First use of a target in this process (open_container): nothing for a real node."""

    def backend(self, ctid: int) -> str:
        """What runs the target's container, for `dflash-ops hosts` ("" when it is the node's own business)."""
        return ""

    def backend_reason(self, ctid: int) -> str:
        """Why `backend` is what it is, in a few words ("" when there is nothing to say)."""
        return ""

    def identity(self) -> str:
        """What tells two nodes of this kind apart besides address/port/user (doctor's verdict key)."""
        return ""

    # What provision asks of a node (dflash_ops/provision/): where its files are, its tools, its templates.

    def node_path(self, path: str) -> str:
        """Where the node's file `path` is (`/etc/pve/lxc/500.conf`, `/proc/driver/nvidia/version`)."""
        return path

    def node_tool(self, argv: list[str]) -> list[str]:
        """The argv that runs the node's tool argv[0] (`pveversion`)."""
        return argv

    def container_root(self, ctid: int) -> str:
        """Where the container's `/` is, as its own processes see it ("/": it has its own root)."""
        return "/"

    def create_options(self, ctid: int) -> list[str]:
        """Options this kind's `pct create` needs besides provision's own."""
        return []

    def no_gpus_hint(self, node: str) -> str:
        """What gives a node without the NVIDIA module GPUs ("": the admin installs the driver)."""
        return ""

    def limit_cap(self, name: str) -> str:
        """Why an `lxc.prlimit.NAME` the config asks for cannot reach the container ("" when nothing here caps it)."""
        return ""

    def default_template(self) -> str | None:
        """The OS template `pct create` uses when provision is given none (None: it must be given)."""
        return None


class KindFactory:
    """Makes a node kind from the node's own inventory keys."""

    keys: ClassVar[type[KindKeys] | None] = None

    @classmethod
    def from_inventory(cls, keys: dict[str, Any], transport: str, fail: Fail) -> NodeKind:
        raise NotImplementedError
