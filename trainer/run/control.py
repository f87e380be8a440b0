"""Control requests from ops (control/checkpoint, control/stop) and SIGTERM, polled at step boundaries.

Before the first step there are no step boundaries: loading a target, fitting the demo's target,
tokenising and compiling can take minutes, and a stop that waited for a boundary waited that long
(issue #53: `run stop --now` during the demo's target fit timed out after 10 minutes). So while
setup is armed (`arm_setup`), a stop acts at once: SIGTERM raises SetupStop in the main thread,
and a watcher thread turns a control/stop file into the same (there is nothing trained to save).
"""

from __future__ import annotations

import json
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

SETUP_POLL_S = 0.5  # how often the watcher looks for control/stop while setup is armed


def stop_asked(run_dir: str | Path) -> bool:
    """A stop request (control/stop) or an operator's stop or signal (control/.no-restart, left by
    the runs helper) is there."""
    return any((Path(run_dir) / "control" / name).exists() for name in ("stop", ".no-restart"))


class SetupStop(BaseException):
    """A stop that came where there is no step boundary (before training began; during the final
    evaluation): the run stops in the phase it is in. A BaseException, so that no library's
    `except Exception` around a load, a compile or a decode swallows it."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason  # "signal" or "control"


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
        self._setup = threading.Event()  # set while setup is armed (no step boundary yet)
        self._file_stop = False  # the watcher found control/stop (the interrupt is its, not a signal's)

    def install_sigterm(self) -> None:
        """SIGTERM becomes a stop request served at the next step boundary, or at once (SetupStop)
        while setup is armed."""
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, *_: object) -> None:
        file_stop, self._file_stop = self._file_stop, False
        if self._setup.is_set():
            self._setup.clear()
            # Python runs a handler between any two bytecodes of the main thread, also inside a weakref
            # callback or a __del__, where a raised exception is printed and dropped ("Exception ignored",
            # seen in torch._dynamo's weak-key dictionaries). The stop is kept as well, so a dropped
            # SetupStop is served at the next step boundary (a control/stop file stays until served).
            self._signalled = self._signalled or not file_stop
            raise SetupStop("control" if file_stop else "signal")
        if not file_stop:  # the watcher's own signal, come late: control/stop is polled at the next step
            self._signalled = True

    def arm_setup(self) -> None:
        """From here until disarm_setup, a stop (SIGTERM or control/stop) raises SetupStop in the main
        thread within about SETUP_POLL_S. Call from the main thread after install_sigterm. A SIGTERM that
        came while disarmed and found no step boundary after it (the last step had run) acts here, at once."""
        if self._signalled:
            self._signalled = False
            raise SetupStop("signal")
        self._setup.set()
        threading.Thread(target=self._watch_setup, name="setup-stop-watch", daemon=True).start()

    def disarm_setup(self) -> None:
        """Training begins: stops are served at step boundaries again (with the final checkpoint)."""
        self._setup.clear()

    def _watch_setup(self) -> None:
        """control/stop while armed: a real SIGTERM to the main thread (not _thread.interrupt_main,
        which would not wake a main thread blocked in a lock or a pool's wait)."""
        while self._setup.is_set():
            if (self.dir / "stop").exists():
                self._file_stop = True
                signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGTERM)
                return
            time.sleep(SETUP_POLL_S)

    def stop_pending(self) -> bool:
        """An operator's stop reached this run (a SIGTERM, control/stop or control/.no-restart), served or not."""
        return self._signalled or stop_asked(self.dir.parent)

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
