"""The last doctor verdict of each target, kept on the operator's machine for `hosts`.

One small JSON file per target under $XDG_STATE_HOME/dflash-ops/doctor (default
~/.local/state/...), named by a hash of what identifies the container (node address, port,
user, ctid, base_dir), so two inventories naming one container share it. Written atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.run.contract import write_atomic

if TYPE_CHECKING:
    from dflash_ops.doctor.checks import Report
    from dflash_ops.inventory import Target


def state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(base) / "dflash-ops" / "doctor"


def _key(target: Target) -> str:
    node = target.node
    identity = [node.transport, node.address or node.kind.identity(), str(node.port or ""), node.user or "",
                str(target.ctid), target.base_dir]
    return hashlib.sha256("\0".join(identity).encode()).hexdigest()[:20]


def record_verdict(target: Target, report: Report) -> None:
    doc = {"target": target.name, "time": report.time, "verdict": report.verdict, "fast": report.fast,
           "failed": [c.name for c in report.checks if c.status == "fail"],
           "warned": [c.name for c in report.checks if c.status == "warn"]}
    try:
        state_dir().mkdir(parents=True, exist_ok=True)
        write_atomic(state_dir() / f"{_key(target)}.json", json.dumps(doc, sort_keys=True).encode())
    except OSError:
        pass  # a verdict that cannot be remembered is still printed


def last_verdict(target: Target) -> dict | None:
    try:
        return json.loads((state_dir() / f"{_key(target)}.json").read_text())
    except (OSError, ValueError):
        return None


def describe(doc: dict | None, now: float | None = None) -> str:
    """`ok 5m ago`, `fail: /dev/shm, disk at base_dir 2h ago`, or `never`."""
    if not doc:
        return "never"
    age = max(0.0, (now or time.time()) - doc.get("time", 0))
    when = f"{age:.0f}s" if age < 120 else f"{age / 60:.0f}m" if age < 7200 else f"{age / 3600:.0f}h" \
        if age < 172800 else f"{age / 86400:.0f}d"
    label = doc.get("verdict", "?")
    if doc.get("failed"):
        label += ": " + ", ".join(doc["failed"])
    elif doc.get("warned"):
        label += " (! " + ", ".join(doc["warned"]) + ")"
    return f"{label} {when} ago" + (" (fast)" if doc.get("fast") else "")
