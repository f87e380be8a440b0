"""Dashboard under log load: headless app on a run's detail screen, idle vs 10,000 lines/s.

Prints, for an idle baseline and for the loaded phase measured in the same run:
frames/s (screen updates the compositor produced), UI updates/s (ticks that moved data to
widgets), lines displayed/s, lines written/s, lines skipped, and event-loop lag (how late a
20 ms timer fires: mean / p99 / max) - the number a user feels as key latency.

    PYTHONPATH=$PWD python bench/dash_load.py [--rate 10000] [--seconds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import threading
import time

from dflash_ops.tui.app import DashApp
from dflash_ops.tui.demo import SimulatedRun
from dflash_ops.tui.detail import RunDetailScreen
from dflash_ops.tui.remote import LocalDirSource

PROBE_S = 0.02


def write_log(sim: SimulatedRun, rate: int, stop: threading.Event, written: list[int]) -> None:
    """Append `rate` lines a second in 10 ms batches, paced against the clock."""
    start = time.perf_counter()
    total = 0
    while not stop.is_set():
        due = int((time.perf_counter() - start) * rate)
        if due > total:
            batch = due - total
            sim.log(*(f"{time.time():.6f} worker 3 step {total + i} loss 0.1234 queue depth 7 some padding text"
                      for i in range(batch)))
            total += batch
            written[0] = total
        stop.wait(0.01)


async def measure(pilot, app, screen, seconds: float, written: list[int]) -> dict:
    lags: list[float] = []
    last = [time.perf_counter()]

    def probe() -> None:
        now = time.perf_counter()
        lags.append(max(0.0, now - last[0] - PROBE_S))
        last[0] = now

    frames0, updates0, shown0, dropped0, written0 = app.frames, screen.updates, screen.lines_shown, screen.dropped, written[0]
    timer = app.set_interval(PROBE_S, probe)
    start = time.perf_counter()
    await pilot.pause(seconds)
    elapsed = time.perf_counter() - start
    timer.stop()
    lags.sort()
    return {
        "frames/s": (app.frames - frames0) / elapsed,
        "updates/s": (screen.updates - updates0) / elapsed,
        "lines shown/s": (screen.lines_shown - shown0) / elapsed,
        "lines written/s": (written[0] - written0) / elapsed,
        "lines skipped": screen.dropped - dropped0,
        "lag mean ms": 1000 * statistics.fmean(lags) if lags else float("nan"),
        "lag p99 ms": 1000 * lags[int(0.99 * (len(lags) - 1))] if lags else float("nan"),
        "lag max ms": 1000 * lags[-1] if lags else float("nan"),
    }


async def type_filter(pilot) -> float:
    """Seconds the pilot needs to type a log filter and clear it (it waits for each key's effect)."""
    start = time.perf_counter()
    await pilot.press("slash", "q", "u", "e", "u", "e", "escape")
    return time.perf_counter() - start


class CountingDashApp(DashApp):
    """Counts compositor updates handed to the (headless) driver: the frames a terminal would get."""

    frames = 0

    def _display(self, screen, renderable) -> None:
        if renderable is not None:
            self.frames += 1
        super()._display(screen, renderable)


async def main(rate: int, seconds: float) -> None:
    base = tempfile.mkdtemp(prefix="dash-bench-")
    sim = SimulatedRun(base, "bench", total_steps=1_000_000)
    sim.begin()
    stop, log_stop, written = threading.Event(), threading.Event(), [0]

    def steps() -> None:
        while not stop.wait(0.2):
            sim.advance()

    threading.Thread(target=steps, daemon=True).start()
    app = CountingDashApp(LocalDirSource({"bench": base}, gpus=False), poll_s=1.0)
    async with app.run_test(size=(160, 50)) as pilot:
        while "bench/bench" not in app.rows:
            await pilot.pause(0.05)
        await pilot.press("enter")
        screen = app.screen
        assert isinstance(screen, RunDetailScreen)
        await pilot.pause(1.0)
        idle = await measure(pilot, app, screen, seconds, written)
        idle_keys_s = await type_filter(pilot)
        writer = threading.Thread(target=write_log, args=(sim, rate, log_stop, written), daemon=True)
        writer.start()
        loaded = await measure(pilot, app, screen, seconds, written)
        loaded_keys_s = await type_filter(pilot)
        log_stop.set()
        writer.join()
    stop.set()
    print(f"dashboard under load: {rate} lines/s target, {seconds:g} s per phase, 160x50 headless")
    print(f"{'':18}{'idle':>12}{'loaded':>12}{'ratio':>9}")
    for key in idle:
        a, b = idle[key], loaded[key]
        ratio = f"{b / a:8.2f}x" if a else "       -"
        print(f"{key:18}{a:12.1f}{b:12.1f}{ratio}")
    print(f"7 key presses (/ queue Esc) answered in {1000 * idle_keys_s:.0f} ms idle, "
          f"{1000 * loaded_keys_s:.0f} ms loaded ({loaded_keys_s / idle_keys_s:.2f}x)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()
    asyncio.run(main(args.rate, args.seconds))
