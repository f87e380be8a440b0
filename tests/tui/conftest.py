"""Shared pieces for the dashboard tests: simulated runs and a bounded wait on the pilot."""

from __future__ import annotations

import threading

import pytest

from dflash_ops.tui.demo import SimulatedRun

FROZEN = 1_800_000_000.0


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def _wait_for(pilot, predicate, what: str, pauses: int = 1200) -> None:
    """Let the app run until `predicate()` holds; fail (not hang) after `pauses` pauses."""
    for _ in range(pauses):
        if predicate():
            return
        await pilot.pause(0.05)
    raise AssertionError(f"gave up waiting for: {what}")


@pytest.fixture
def wait_for():
    return _wait_for


class FrozenClock:
    def __init__(self, now: float = FROZEN) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def frozen_clock():
    return FrozenClock()


@pytest.fixture
def static_run(tmp_path):
    """A run that has done 30 steps and then sits still (files no longer change)."""
    sim = SimulatedRun(tmp_path, "tiny-run", total_steps=100, clock=FrozenClock(FROZEN - 5))
    sim.begin()
    for _ in range(30):
        sim.advance()
    return sim


@pytest.fixture
def live_run(tmp_path):
    """A run that a writer thread steps every 20 ms until the test ends."""
    sim = SimulatedRun(tmp_path, "live-run", total_steps=100_000)
    sim.begin()
    stop = threading.Event()

    def write() -> None:
        while not stop.wait(0.02):
            sim.advance()

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    yield sim
    stop.set()
    thread.join()
