"""Control requests from ops (control/checkpoint, control/stop) and SIGTERM, polled at step boundaries."""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Request:
    kind: str  # "checkpoint" or "stop"
    id: str | None  # the request's id; None for SIGTERM
    reason: str  # "control" or "signal"


class ControlPoller:
    """Finds pending requests. A request file is deleted only after `done(request)`."""

    KINDS = ("stop", "checkpoint")

    def __init__(self, run_dir: str | Path):
        self.dir = Path(run_dir) / "control"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._signalled = False

    def install_sigterm(self) -> None:
        """SIGTERM becomes a stop request served at the next step boundary."""
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "_signalled", True))

    def poll(self) -> list[Request]:
        found = []
        if self._signalled:
            found.append(Request("stop", None, "signal"))
        for kind in self.KINDS:
            path = self.dir / kind
            if not path.exists():
                continue
            try:
                request_id = str(json.loads(path.read_text()).get("id"))
            except (OSError, ValueError, AttributeError):
                request_id = None
            found.append(Request(kind, request_id, "control"))
        return found

    def done(self, request: Request) -> None:
        if request.reason == "control":
            (self.dir / request.kind).unlink(missing_ok=True)
