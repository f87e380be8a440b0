"""The inventory's `notify: local:` commands, run on the operator's side by the followers
(`dflash-ops logs -f`, `metrics -f`, the dashboard) when they see a run change state.

The container sends its own events (helpers/notify.py: webhooks and commands there, from its
supervisor and queue worker) whether anyone follows or not; these local commands run only while
someone follows, for a desktop notification or a page from the operator's machine. They get the
same event document (notify.make_event) on stdin and DFLASH_EVENT, DFLASH_RUN_ID, DFLASH_TARGET,
DFLASH_EVENT_ID in their environment. A follower that first sees a run says nothing about it: only
a change it watched happen is an event. Each command runs in a thread of its own, so a slow one
never holds up a follower; a failure is reported through on_error and never retried.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from dflash_ops.helpers import notify
from dflash_ops.runs.info import RunInfo

# effective_state -> the event a change into it is (None: no event of its own)
EVENT_OF = {"queued": "queued", "starting": "started", "warmup": "started", "running": "started",
            "checkpointing": "started", "restarting": None, "stopped": "stopped", "failed": "failed",
            "broken": "failed", "done": "done"}


class LocalNotifier:
    """Runs `commands` for the state changes of the runs of one target that see() is shown."""

    def __init__(self, target: str, commands: Sequence[Sequence[str]], on_error: Callable[[str], None]) -> None:
        self.target = target
        self.commands = [list(c) for c in commands]
        self.on_error = on_error
        self._seen: dict[str, tuple[str | None, int]] = {}  # run id -> (event, restarts)
        self._lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    def see(self, info: RunInfo) -> list[dict]:
        """Look at a run's status now; returns the events it made (and starts their commands)."""
        event = EVENT_OF.get(info.effective_state)
        restarts = len(info.restarts)
        with self._lock:
            before = self._seen.get(info.run_id)
            self._seen[info.run_id] = (event or (before[0] if before else None), restarts)
        if before is None:
            return []
        made = []
        if restarts > before[1]:
            last = info.restarts[-1] if info.restarts else {}
            made.append(self._event(info, "restart", last.get("reason"), last.get("step")))
        if event is not None and event != before[0]:
            made.append(self._event(info, event, info.reason, info.step))
        for doc in made:
            for argv in self.commands:
                thread = threading.Thread(target=self._run, args=(argv, doc), daemon=True,
                                          name=f"notify-local-{info.run_id}")
                self.threads.append(thread)
                thread.start()
        return made

    def _event(self, info: RunInfo, state: str, reason: str | None, step: object) -> dict:
        return notify.make_event(info.run_id, self.target, state, step=step, reason=reason,
                                 log_tail=info.log_tail if state == "failed" else None)

    def _run(self, argv: list[str], event: dict) -> None:
        try:
            notify.run_command(argv, event)
        except notify.Failed as e:
            self.on_error(f"notify: local command for the {event['state']} event of {event['run_id']}: {e}")

    def wait(self, timeout: float = notify.COMMAND_TIMEOUT_S) -> None:
        """Let the commands started so far finish (a follower that exits waits for them)."""
        for thread in list(self.threads):
            thread.join(timeout)
