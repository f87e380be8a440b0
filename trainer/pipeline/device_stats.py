"""Sync-free measurement on the device: metric sums, busy fraction, peak memory.

Nothing here calls `.item()` or synchronises in the steady state. Values accumulate on the
device; snapshots are copied non-blocking on a side stream into pinned host memory and read only
once their CUDA event has completed (`event.query()`), so the training stream never waits for
the host.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Iterator

import torch


def is_cuda(device: torch.device) -> bool:
    return torch.device(device).type == "cuda"


class MetricAccumulator:
    """Per-replica running sums of named scalars, kept on the device.

    `add(vector)` adds a device tensor of len(names) values (one kernel, no sync).
    `snapshot(steps)` launches an async copy of the sums to pinned memory and resets them;
    `completed()` returns the windows whose copy has landed, as dicts, without blocking.
    """

    def __init__(self, names: list[str], device: torch.device, ring: int = 4) -> None:
        self.names = list(names)
        self.device = torch.device(device)
        self.sums = torch.zeros(len(names), dtype=torch.float64, device=self.device)
        self._cuda = is_cuda(self.device)
        self._side = torch.cuda.Stream(self.device) if self._cuda else None
        self._slots = [
            torch.zeros(len(names), dtype=torch.float64, pin_memory=self._cuda) for _ in range(ring)
        ]
        self._free = deque(range(ring))
        self._pending: deque = deque()  # (slot, event, steps, host_time)
        self._ready: list[dict] = []
        self._lock = threading.Lock()
        self._ref = None  # timing event every snapshot's GPU time is measured from
        if self._cuda:
            self._ref = torch.cuda.Event(enable_timing=True)
            self._ref.record(self._side)

    def add(self, vector: torch.Tensor) -> None:
        self.sums.add_(vector.to(torch.float64))

    def snapshot(self, steps: int) -> None:
        """Called by the owning thread at a window boundary (its current stream is the producer)."""
        with self._lock:
            if not self._free:
                self._wait_oldest()
            slot = self._free.popleft()
            host = self._slots[slot]
            side = self._side
            event: torch.cuda.Event | None
            if side is not None:  # CUDA
                producer = torch.cuda.current_stream(self.device)
                side.wait_stream(producer)
                with torch.cuda.stream(side):
                    host.copy_(self.sums, non_blocking=True)
                    self.sums.zero_()
                    event = torch.cuda.Event(enable_timing=True)
                    event.record(side)
                producer.wait_stream(side)
            else:
                host.copy_(self.sums)
                self.sums.zero_()
                event = None
            self._pending.append((slot, event, steps, time.time()))

    def _wait_oldest(self) -> None:
        """Move the oldest window to host values, freeing its slot (the host is `ring` windows ahead)."""
        slot, event, steps, when = self._pending.popleft()
        if event is not None:
            event.synchronize()
        self._ready.append(self._values(slot, steps, when, event))
        self._free.append(slot)

    def _values(self, slot: int, steps: int, when: float, event: torch.cuda.Event | None = None) -> dict:
        """A window's sums; `gpu_time` (CUDA): seconds on the device's own clock from the
        accumulator's creation to the snapshot, so windows are timed by the GPU, not by when the
        host (which runs ahead) happened to call snapshot()."""
        values = dict(zip(self.names, self._slots[slot].tolist()))
        values["step"] = steps
        values["time"] = when
        if event is not None and self._ref is not None:  # CUDA: both are events
            values["gpu_time"] = self._ref.elapsed_time(event) / 1000.0
        return values

    def completed(self) -> list[dict]:
        with self._lock:
            out, self._ready = self._ready, []
            while self._pending and (self._pending[0][1] is None or self._pending[0][1].query()):
                slot, event, steps, when = self._pending.popleft()
                out.append(self._values(slot, steps, when, event))
                self._free.append(slot)
        return out

    def drain(self) -> list[dict]:
        """Wait for every pending window (end of run only)."""
        with self._lock:
            for _, event, _, _ in self._pending:
                if event is not None:
                    event.synchronize()
        return self.completed()


class BusyMeter:
    """Fraction of time a device is running our work, from intervals marked by its workers.

    On CUDA an interval is a pair of timing events on the worker's stream, placed in GPU time
    relative to one reference event per device; intervals of all workers sharing the device are
    merged (union), so two threads on one GPU are not double counted. On CPU the intervals are
    host wall-clock time. Read with `busy_fraction()`, which only looks at completed events.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._cuda = is_cuda(self.device)
        self._lock = threading.Lock()
        self._open: list = []  # (start, end) events not yet known to be complete
        self._done: list[tuple[float, float]] = []  # closed intervals, ms
        self._cut = 0.0
        self._ref = None
        self._t0 = time.perf_counter()
        if self._cuda:
            self._ref = torch.cuda.Event(enable_timing=True)
            self._ref.record(torch.cuda.current_stream(self.device))

    def _now_ms(self) -> float:
        return (time.perf_counter() - self._t0) * 1000.0

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        if self._cuda:
            stream = torch.cuda.current_stream(self.device)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            yield
            end.record(stream)
            with self._lock:
                self._open.append((start, end))
        else:
            start_ms = self._now_ms()
            yield
            with self._lock:
                self._done.append((start_ms, self._now_ms()))

    def _collect(self) -> None:
        ref = self._ref
        assert ref is not None, "only on CUDA, where the reference event exists"
        still_open = []
        for start, end in self._open:
            if end.query():
                self._done.append((ref.elapsed_time(start), ref.elapsed_time(end)))
            else:
                still_open.append((start, end))
        self._open = still_open

    def busy_fraction(self) -> float | None:
        """Busy share of the span since the last call, up to the latest completed interval end.

        On CPU the span ends now. None when nothing completed in the span."""
        with self._lock:
            if self._cuda:
                self._collect()
            if not self._done:
                return None
            intervals = sorted(self._done)
            self._done = []
            end_of_span = self._now_ms() if not self._cuda else max(e for _, e in intervals)
            start_of_span = self._cut if self._cut else intervals[0][0]
            self._cut = end_of_span
        if end_of_span <= start_of_span:
            return None
        busy, merged = 0.0, None  # merged: the union interval being built (start, end)
        for s, e in intervals:
            s, e = max(s, start_of_span), min(e, end_of_span)
            if e <= s:
                continue
            if merged is None or s > merged[1]:
                if merged is not None:
                    busy += merged[1] - merged[0]
                merged = (s, e)
            else:
                merged = (merged[0], max(merged[1], e))
        if merged is not None:
            busy += merged[1] - merged[0]
        return min(1.0, busy / (end_of_span - start_of_span))


def peak_memory_gb(device: torch.device) -> float | None:
    if not is_cuda(device):
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30
