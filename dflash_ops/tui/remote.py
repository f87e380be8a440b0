"""`RemoteSource`: the DashSource over `dflash_ops.runs` for inventory targets.

One Container per target (opened lazily by a factory, so an unreachable node fails inside a
worker thread, where the dashboard shows it, not at start-up).
"""

from __future__ import annotations

import threading
from typing import Callable

from dflash_ops.tui.source import GpuSample, OnLines, RunRow, gpu_samples_from_json, group_fields


def run_row_from_info(target: str, info) -> RunRow:
    """A RunRow from `dflash_ops.runs.RunInfo` (its effective state: dead runs show failed)."""
    error = info.reason or ((info.error or {}).get("message") if isinstance(info.error, dict) else None)
    return RunRow(
        target=target,
        run_id=info.run_id,
        state=info.effective_state,
        step=info.step or 0,
        total_steps=info.total_steps,
        loss=info.loss,
        acc=info.acc,
        tau=info.tau,
        tokens_per_s=info.tokens_per_s,
        tokens_per_s_steady=info.tokens_per_s_steady,
        pad_share=info.pad_share,
        heartbeat=info.heartbeat,
        release=info.release,
        recompiles=info.recompiles or 0,
        last_checkpoint=info.last_checkpoint,
        gpus=tuple(info.gpus or ()),
        error=error,
        **group_fields(info.raw),
    )


class RemoteSource:
    def __init__(self, openers: dict[str, Callable[[], object]]) -> None:
        self._openers = openers
        self._containers: dict[str, object] = {}
        self._lock = threading.Lock()

    def _container(self, target: str):
        with self._lock:
            if target not in self._containers:
                self._containers[target] = self._openers[target]()
            return self._containers[target]

    def targets(self) -> list[str]:
        return list(self._openers)

    def list_runs(self, target: str) -> list[RunRow]:
        from dflash_ops import runs

        return [run_row_from_info(target, info) for info in runs.list_runs(self._container(target))]

    def follow(self, target, run_id, name, on_lines: OnLines, stop, start=None, tail_lines=200) -> None:
        """One cancellable `follow_file`: the tail (start=None) or byte `start`, then live lines.

        `reconnect=False`: a drop raises, and the dashboard's own loop shows it and resumes
        at the last offset handed to `on_lines`. Returns when `stop` is set or the run is over.
        """
        from dflash_ops.runs import follow_file

        position = start

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

        follow_file(
            self._container(target), run_id, name, on_line,
            offset=start or 0, tail_lines=tail_lines if start is None else None,
            follow=True, reconnect=False, stop=stop, on_start=on_start, on_truncated=on_truncated,
        )

    def request(self, target: str, run_id: str, kind: str) -> str:
        from dflash_ops import runs

        return runs.request(self._container(target), run_id, kind)

    def gpu_samples(self, target: str) -> list[GpuSample] | None:
        return gpu_samples_from_json(self._container(target).helper_json("gpu_sample", []))
