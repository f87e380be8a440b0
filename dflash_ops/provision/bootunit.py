"""The node's boot unit: the NVIDIA device nodes exist before pve-guests starts the containers.

The kernel module makes no device files by itself: /dev/nvidia0..N and /dev/nvidiactl appear when
something runs nvidia-smi (or nvidia-persistenced), /dev/nvidia-uvm and -uvm-tools when nvidia-uvm is
loaded (nvidia-modprobe -u), often only on first CUDA use. After a node reboot or a kernel update
`pct start` of a GPU container then fails with `Device /dev/nvidia-uvm does not exist` (pve-container
checks every devN path), and onboot containers stay down. Users fix it with a unit of their own
(wolf#361, jammsen#7/#11); `provision --boot-unit` installs this one, with consent, and doctor names
it when it is missing. The unit file is ours (written to a temporary file, renamed); systemd enables it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dflash_ops.doctor.node import UNIT, UNIT_PATH, UNIT_TEXT
from dflash_ops.provision.node import ProvisionError
from dflash_ops.provision.session import Confirm, node_rendered

if TYPE_CHECKING:
    from dflash_ops.inventory import Target
    from dflash_ops.provision.session import _Session

_WRITE = 'mkdir -p "${1%/*}" && cat > "$1.tmp" && mv "$1.tmp" "$1"'
_READ = 'cat "$1" 2>/dev/null; exit 0'


def ensure(s: _Session, target: Target, yes: bool, confirm: Confirm, required: bool = True) -> None:
    """Install and enable the unit on the target's node when it is missing, another text, or not
    enabled; a change to the node only after a yes (--yes), shown by --dry-run. A no stops
    provision when the unit was asked for (`required`), else it is left out with a note."""
    kind = target.node.kind
    body = s.read(f"{UNIT} on the node", ["sh", "-c", _READ, "sh", kind.node_path(UNIT_PATH)])
    argv = kind.node_tool(["systemctl", "is-enabled", UNIT])
    state = (s.read(f"whether {UNIT} is enabled", ["sh", "-c", '"$@" 2>/dev/null; exit 0', "sh", *argv]).split()
             or ["not-found"])[0]
    if body == UNIT_TEXT and state == "enabled":
        return
    node = target.node.name
    if not (s.dry_run or yes or confirm(f"node {node}: install {UNIT_PATH} (creates the NVIDIA device nodes at "
                                        "boot, before pve-guests) and enable it?")):
        if not required:
            s.outcome.notes.append(f"node {node}: {UNIT} not installed (you said no)")
            return
        raise ProvisionError(f"node {node}: {UNIT} not installed, nothing changed: rerun with --yes to install it")
    if body != UNIT_TEXT:
        s.change(f"node {node}: write {UNIT_PATH}" + (" (it was another text)" if body else ""),
                 node_rendered(["sh", "-c", _WRITE, "sh", kind.node_path(UNIT_PATH)]), stdin=UNIT_TEXT.encode())
        s.change(f"node {node}: systemctl daemon-reload", node_rendered(kind.node_tool(["systemctl", "daemon-reload"])),
                 count=False)
    s.change(f"node {node}: systemctl enable {UNIT}", node_rendered(kind.node_tool(["systemctl", "enable", UNIT])))

