"""The dashboard's sources: `RemoteSource` (the DashSource over `dflash_ops.runs`) for inventory
targets, and `LocalDirSource`, the same code over run directories on this machine.

One Container per target (opened lazily by a factory, so an unreachable node fails inside a
worker thread, where the dashboard shows it, not at start-up). A local directory is a container
too (no pct, the local transport, the helpers run in place), so the dashboard reads every run
directory through the one reader, the runs helper.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Callable

from dflash_ops import runs
from dflash_ops.container import Container, ContainerAPI
from dflash_ops.inventory import Node, Target
from dflash_ops.printable import printable
from dflash_ops.runs.info import RunInfo
from dflash_ops.runs.local_notify import LocalNotifier
from dflash_ops.transport.local import LocalTransport
from dflash_ops.tui.source import (
    GpuSample,
    LinkState,
    LogName,
    OnLines,
    OnLink,
    RequestKind,
    RunRow,
    gpu_samples_from_json,
    group_fields,
)

DASH_RETRY = runs.RetryPolicy(give_up_after=math.inf)  # a dashboard keeps trying while it is open


def run_row_from_info(target: str, info: RunInfo) -> RunRow:
    """A RunRow from `dflash_ops.runs.RunInfo` (its effective state: dead runs show failed); the
    contract's status fields pass through as they are."""
    error = info.reason or ((info.error or {}).get("message") if isinstance(info.error, dict) else None)
    error = printable(error) if error is not None else None  # text from the run directory: escaped
    release = printable(info.release) if info.release is not None else None
    if info.effective_state == "queued":  # not an error: its place in line and what it waits for
        return RunRow(target=target, run_id=info.run_id, state=f"queued #{info.position}", gpus=tuple(info.gpus or ()),
                      release=release, waits_for=printable("; ".join(info.waits_for) or "nothing: starting"))
    return RunRow(target=target, run_id=info.run_id, state=info.effective_state, step=info.step or 0,
                  release=release, recompiles=info.recompiles or 0, gpus=tuple(info.gpus or ()), error=error,
                  restarts=len(info.restarts), status=dict(info.status), **group_fields(info.raw))


class RemoteSource:
    """openers: {target: a function opening its container}; gpus=False: no GPU panel;
    poll_s: how often a quiet followed file is looked at again; retry: how a followed file
    rides out a dropped link (default: retried for as long as the dashboard is open)."""

    def __init__(self, openers: Mapping[str, Callable[[], ContainerAPI]], gpus: bool = True,
                 poll_s: float = 0.2, notifiers: Mapping[str, LocalNotifier] | None = None,
                 retry: runs.RetryPolicy = DASH_RETRY) -> None:
        self._retry = retry
        self._openers = dict(openers)
        self._notifiers = dict(notifiers or {})  # the inventory's notify: local: commands, by target
        self._containers: dict[str, ContainerAPI] = {}
        self._lock = threading.Lock()
        self._gpus = gpus
        self._poll_s = poll_s

    def _container(self, target: str) -> ContainerAPI:
        with self._lock:
            if target not in self._containers:
                self._containers[target] = self._openers[target]()
            return self._containers[target]

    def targets(self) -> list[str]:
        return list(self._openers)

    def list_runs(self, target: str) -> list[RunRow]:
        infos = runs.list_runs(self._container(target))
        notifier = self._notifiers.get(target)
        if notifier is not None:  # the dashboard is a follower: it runs the local notify commands
            for info in infos:
                notifier.see(info)
        return [run_row_from_info(target, info) for info in infos]

    def follow(self, target: str, run_id: str, name: LogName, on_lines: OnLines, stop: threading.Event,
               start: int | None = None, tail_lines: int = 200, on_link: OnLink | None = None) -> None:
        """One cancellable `follow_file`: the tail (start=None) or byte `start`, then live lines.

        A dropped link is retried by follow_file (`retry`: for as long as the dashboard is open,
        by default) from the exact offset reached; `on_link` hears of each drop (disconnected ...
        retry in Ns) and of each recovery. Returns when `stop` is set or the run is over.
        """
        position = start or 0  # on_start sets it first when following the tail

        def on_start(offset: int) -> None:
            nonlocal position
            position = offset

        def on_line(line: bytes) -> None:
            nonlocal position
            if not line.endswith(b"\n"):
                return  # a final fragment; it is re-read whole next time
            position += len(line)
            on_lines([line[:-1].decode("utf-8", "replace")], position)

        def on_truncated(reached: int, size: int) -> None:
            nonlocal position
            position = 0
            on_lines([f"[dflash-ops: {name} was truncated or replaced at byte {reached} (now {size} bytes); "
                      "what was written before that and not yet shown is lost; following from its start]"], 0)

        def on_retry(error: Exception, delay: float) -> None:
            if on_link is not None:
                on_link(LinkState.lost(error, delay))

        def on_resumed(offset: int) -> None:
            if on_link is not None:
                on_link(LinkState(True))

        callbacks = runs.FollowCallbacks(on_line=on_line, on_start=on_start, on_truncated=on_truncated,
                                         on_retry=on_retry, on_resumed=on_resumed)
        runs.follow_file(self._container(target), run_id, name, callbacks, offset=start or 0,
                         tail_lines=tail_lines if start is None else None, follow=True, retry=self._retry,
                         stop=stop, poll=self._poll_s)

    def request(self, target: str, run_id: str, kind: RequestKind) -> str:
        return runs.request(self._container(target), run_id, kind)

    def gpu_samples(self, target: str) -> list[GpuSample] | None:
        if not self._gpus:
            return None
        return gpu_samples_from_json(self._container(target).helper_json("gpu_sample", []))


def local_dir_container(name: str, base_dir: str | Path) -> Container:
    """base_dir on this machine as a container (base_dir/runs/<run-id>/): no pct, the local
    transport, this python; its helpers run from the package, nothing is installed there."""
    node = Node(name="local", transport="local", pct=())
    target = Target(name=name, node=node, ctid=0, base_dir=str(Path(base_dir).absolute()), python=sys.executable)
    return Container(target, LocalTransport(), helpers_in_place=True)


class LocalDirSource(RemoteSource):
    """Runs under `{target: base_dir}` on this filesystem, read exactly as a remote target's are."""

    def __init__(self, bases: Mapping[str, str | Path], gpus: bool = True, poll_s: float = 0.2) -> None:
        super().__init__({name: partial(local_dir_container, name, base) for name, base in bases.items()},
                         gpus=gpus, poll_s=poll_s)
