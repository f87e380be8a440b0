"""The simulated Proxmox node as a node kind (`pct: simulated`): its inventory keys and start-up.

    nodes:
      sim: {transport: local, pct: simulated, sim_root: ~/.local/state/dflash-ops/sim,
            sim_containers: [200, 300], sim_backend: auto}

`sim_root`: the stand-in's state; `sim_containers`: the CTs created on first use, as an admin's
`pct create` would have (any other ctid is refused, as on a node); `sim_backend`: what a new
container is, `lxc` (a real LXC container: dflash_ops/simnode/rootfs.py), `directory` (a
directory with its own python) or `auto` (lxc where this machine allows, else directory; the
environment variable DFLASH_OPS_SIM_BACKEND overrides auto). A container keeps the backend it
was created with. Targets of the node get their `base_dir` and `python` from it by default.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field

from dflash_ops.errors import TransportError
from dflash_ops.extras import require_trainer
from dflash_ops.nodekinds.base import Fail, KindFactory, KindKeys, NodeKind
from dflash_ops.render import node_command
from dflash_ops.simnode import containers as simct
from dflash_ops.simnode.pct import PctError
from dflash_ops.transport.base import Transport

DEFAULT_SIM_ROOT = "~/.local/state/dflash-ops/sim"
_create_lock = threading.Lock()


class SimulatedKeys(KindKeys):
    sim_root: str | None = None
    sim_containers: list[Annotated[int, Field(ge=100, le=999_999_999)]] = []
    sim_backend: Literal["auto", "lxc", "directory"] = "auto"


@dataclass(frozen=True)
class SimulatedNode(NodeKind):
    root: str = ""
    containers: tuple[int, ...] = ()
    backend_choice: str = "auto"

    def backend(self, ctid: int) -> str:
        return simct.recorded_backend(self.root, ctid) or simct.pick_backend(self.backend_choice)

    def backend_reason(self, ctid: int) -> str:
        return simct.backend_reason(self.root, ctid, self.backend_choice)

    def target_defaults(self, ctid: int) -> dict[str, str]:
        return simct.target_defaults(self.root, ctid, self.backend(ctid))

    def start(self, ctid: int, hostname: str, transport: Transport) -> None:
        """First use of a listed container: `pct create` it (running), as an admin would have. One
        created before is mended and started: the venv whose packages it uses may be gone
        (simct.mend_packages), and after this machine restarts an LXC container is stopped (a
        node's `onboot`)."""
        if ctid not in self.containers:
            return
        with _create_lock:
            if simct.is_created(self.root, ctid):
                self._bring_up(ctid, transport)
                return
            require_trainer(f"simulated CT {ctid} (its python links them from this one)")
            argv = simct.create_argv(self.pct, ctid, hostname=hostname, backend=simct.pick_backend(self.backend_choice),
                                     network=True)
            result = transport.run(node_command(argv))
            if not simct.is_created(self.root, ctid):
                raise TransportError(f"creating simulated CT {ctid} failed: {result.stderr.strip()[-500:]}")

    def _bring_up(self, ctid: int, transport: Transport) -> None:
        try:
            mended = simct.mend_packages(self.root, ctid)
        except PctError as exc:
            raise TransportError(f"simulated CT {ctid}: {str(exc).strip()}") from None
        for line in mended:
            print(f"simulated node: {line}", file=sys.stderr)
        if simct.is_running(self.root, ctid):
            return
        result = transport.run(node_command([*self.pct, "start", str(ctid)]))
        if not simct.is_running(self.root, ctid):
            raise TransportError(f"starting simulated CT {ctid} failed: {result.stderr.strip()[-500:]}")
        print(f"simulated node: CT {ctid} was stopped (this machine restarted, or `pct stop`): started",
              file=sys.stderr)

    def identity(self) -> str:
        return self.root

    def node_path(self, path: str) -> str:
        """The stand-in's state root holds the node's files: configs and locks where pct.py keeps
        them, the rest (dev/nvidia*, proc/driver/nvidia/version) under ROOT/node (simnode/gpus.py)."""
        for prefix, where in (("/etc/pve/lxc/", "lxc"), ("/run/lock/lxc/", "lock")):
            if path.startswith(prefix):
                return os.path.join(self.root, where, path[len(prefix):])
        return os.path.join(self.root, "node", path.lstrip("/"))

    def node_tool(self, argv: list[str]) -> list[str]:
        """pveversion and systemctl are the stand-in's (pveversion_main.py, systemctl_main.py);
        dpkg-query is this machine's, reading the node's status database (simnode/aptrepo.py)."""
        if argv[:1] in (["pveversion"], ["systemctl"]):
            script = os.path.join(os.path.dirname(simct.PCT_SCRIPT), f"{argv[0]}_main.py")
            return [sys.executable, "-I", "-S", script, "--state-root", self.root, *argv[1:]]
        if argv[:1] == ["dpkg-query"]:
            return [argv[0], f"--admindir={os.path.dirname(self.node_path('/var/lib/dpkg/status'))}", *argv[1:]]
        return argv

    def container_root(self, ctid: int) -> str:
        """A directory container's `/` is this machine's: its own files are under ROOT/ct/CTID."""
        if self.backend(ctid) == "lxc":
            return "/"
        return os.path.join(self.root, "ct", str(ctid))

    def create_options(self, ctid: int) -> list[str]:
        backend = simct.pick_backend(self.backend_choice)
        options = ["--sim-backend", backend]
        if backend == "lxc":
            from dflash_ops.simnode import rootfs

            options += ["--sim-rootfs", str(rootfs.path())]
        return options

    def no_gpus_hint(self, node: str) -> str:
        return f"the simulated node has no GPUs until it is given fixture ones: dflash-ops sim-gpus {node}"

    def limit_cap(self, name: str) -> str:
        """The stand-in gives an LXC container at most this machine's own hard limit (pct.py
        _prlimit_here): this machine may be a container itself, whose limit even root cannot pass."""
        import resource

        which = getattr(resource, f"RLIMIT_{name.upper()}", None)
        if which is None:
            return ""
        hard = resource.getrlimit(which)[1]
        if hard == resource.RLIM_INFINITY:
            return ""
        return (f"this machine's own hard {name} limit is {hard} bytes and the simulated node cannot give a "
                f"container more (a node's root can); nothing to fix here" if name == "memlock" else
                f"this machine's own hard {name} limit is {hard} and the simulated node cannot give a container more")

    def default_template(self) -> str | None:
        return simct.SIM_TEMPLATE


class SimulatedFactory(KindFactory):
    keys = SimulatedKeys

    @classmethod
    def from_inventory(cls, keys: dict[str, Any], transport: str, fail: Fail) -> NodeKind:
        spec = SimulatedKeys.model_validate(keys)
        if transport != "local":
            raise fail("pct", "pct 'simulated' needs transport 'local'")
        root = os.path.expanduser(spec.sim_root or DEFAULT_SIM_ROOT)
        if not os.path.isabs(root):
            raise fail("sim_root", f"sim_root must be an absolute path, got {root!r}")
        return SimulatedNode(pct=tuple(simct.stand_in_argv(root)), root=root,
                             containers=tuple(spec.sim_containers), backend_choice=spec.sim_backend)
