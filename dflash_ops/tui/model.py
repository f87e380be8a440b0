"""What the run detail shows, built from metrics.jsonl lines; plus small text renderers.

Pure data, no Textual: the screens feed lines in and read series out, tests do the same.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from dflash_ops.runs.events import BadLine, parse_event
from dflash_ops.tui.source import GpuSample

SERIES_POINTS = 5000  # per series; older points are dropped
GPU_HISTORY = 40  # samples of busy% kept per GPU
PLOT_LIMIT = 1e15  # a plotted value is clamped to +-this: 1e308 overflowed the plot's axis arithmetic


def plottable(value: object) -> float | None:
    """A number read back from metrics.jsonl as a plot may draw it: finite, clamped to
    +-PLOT_LIMIT; None for NaN, +-Infinity or not a number (drawn as a gap; the summary shows the
    value itself). NaN, Infinity and 1e308 in metrics.jsonl ended `dflash-ops dash` (issue 55)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    number = float(value)
    if not math.isfinite(number):
        return None
    return max(-PLOT_LIMIT, min(PLOT_LIMIT, number))


def percent(value: object) -> float | None:
    """A busy share as drawn (bar, sparkline): finite, 0..100; None otherwise."""
    number = plottable(value)
    return None if number is None else max(0.0, min(100.0, number))
_SPARK = "▁▂▃▄▅▆▇█"


@dataclass
class GpuTrack:
    """One GPU: its role in the run and a short busy% history.

    The trainer's own per-step `gpus` entries win over host samples for busy% (they know
    the role and measure per step); host samples fill in memory totals, and busy% for GPUs
    the trainer does not report.
    """

    index: int
    role: str = "?"
    busy: float | None = None
    mem_gb: float | None = None
    mem_total_gb: float | None = None
    history: deque = field(default_factory=lambda: deque(maxlen=GPU_HISTORY))
    from_trainer: bool = False

    def record(self, busy: float | None) -> None:
        busy = percent(busy)  # a host sample too: what a bar or sparkline draws is 0..100
        self.busy = busy
        if busy is not None:
            self.history.append(busy)


@dataclass
class Checkpoint:
    step: int
    path: str
    seconds: float | None
    request: str | None


class RunHistory:
    """Accumulates metrics.jsonl events for one run."""

    def __init__(self) -> None:
        self.loss_steps: deque[int] = deque(maxlen=SERIES_POINTS)
        self.loss: deque[float] = deque(maxlen=SERIES_POINTS)
        self.tps_steps: deque[int] = deque(maxlen=SERIES_POINTS)
        self.tps: deque[float] = deque(maxlen=SERIES_POINTS)
        self.gpus: dict[int, GpuTrack] = {}
        self.checkpoints: list[Checkpoint] = []
        self.warmup: dict | None = None
        self.recompiles = 0
        self.tau: float | None = None
        self.tau_lookup: float | None = None  # n-gram prompt lookup on the same prompts
        self.tau_ratio: float | None = None
        self.tau_by_length: dict | None = None  # {bucket: {prompts, tau, tau_lookup}} (trainer/run/contract.py)
        self.tau_by_temperature: dict | None = None  # {"0.7": {tau, tau_expected, tau_lookup, ...}} (the eval's temperatures)
        self.acceptance: list | None = None  # share of rounds accepting draft position k = 1.. (last eval)
        self.error: str | None = None
        self.restarts: list[dict] = []  # `restart` events of a run started with --restart
        self.bad_lines = 0  # metrics lines that are not events (runs/events.py); shown, then skipped
        self.last_bad: BadLine | None = None
        self.version = 0  # bumps on every change, so screens redraw only when needed

    def feed(self, lines: list[str]) -> None:
        for line in lines:
            event = parse_event(line)
            if isinstance(event, BadLine):
                self.bad_lines += 1
                self.last_bad = event
                continue
            self._apply(event)
        if lines:
            self.version += 1

    def _apply(self, event: dict) -> None:
        kind = event.get("event")
        step = event.get("step", 0)
        if kind == "step":
            loss, tps = plottable(event.get("loss")), plottable(event.get("tokens_per_s"))
            if loss is not None and plottable(step) is not None:
                self.loss_steps.append(step)
                self.loss.append(loss)
            if tps is not None and plottable(step) is not None:
                self.tps_steps.append(step)
                self.tps.append(tps)
            if isinstance(event.get("recompiles"), int):
                self.recompiles = event["recompiles"]
            for gpu in event.get("gpus") or ():
                self._apply_trainer_gpu(gpu)
        elif kind == "warmup":
            self.warmup = {"shapes": event.get("shapes"), "seconds": event.get("seconds")}
        elif kind == "eval":
            self.tau = event.get("tau")
            self.tau_lookup, self.tau_ratio = event.get("tau_lookup"), event.get("tau_ratio")
            self.tau_by_length = event.get("tau_by_length")
            self.tau_by_temperature = event.get("temperatures")
            self.acceptance = event.get("acceptance")
        elif kind == "checkpoint":
            checkpoint = Checkpoint(step, str(event.get("path")), event.get("seconds"), event.get("request"))
            self.checkpoints.append(checkpoint)
        elif kind == "error":
            self.error = event.get("message")
        elif kind == "restart":
            self.restarts.append(event)
            self.error = None  # the crash it recovered from is history (the restart line says it)

    def _apply_trainer_gpu(self, gpu: dict) -> None:
        try:
            index = int(gpu["index"])
        except (KeyError, TypeError, ValueError):
            return
        track = self.gpus.setdefault(index, GpuTrack(index))
        track.from_trainer = True
        track.role = str(gpu.get("role") or track.role)
        track.mem_gb = gpu.get("mem_gb", track.mem_gb)
        busy = plottable(gpu.get("busy"))
        if busy is not None:
            # the trainer may report a 0..1 fraction or a percentage
            track.record(percent(busy * 100 if busy <= 1 else busy))

    def apply_host_samples(self, samples: list[GpuSample] | None, held: tuple[int, ...] = ()) -> None:
        """Merge host-side samples; `held` limits them to the run's GPUs when known."""
        for sample in samples or ():
            if held and sample.index not in held:
                continue
            track = self.gpus.setdefault(sample.index, GpuTrack(sample.index))
            track.mem_total_gb = sample.mem_total_gb
            if not track.from_trainer:
                track.mem_gb = sample.mem_gb
                track.record(sample.busy)
        if samples:
            self.version += 1


def bar(share: float | None, width: int = 20) -> str:
    shown = percent(share)
    if shown is None:
        return "·" * width
    filled = round(shown / 100 * width)
    return "█" * filled + "░" * (width - filled)


def sparkline(values: Sequence[float], width: int = GPU_HISTORY) -> str:
    values = list(values)[-width:]
    chars = [_SPARK[min(len(_SPARK) - 1, int((percent(v) or 0.0) / 100 * len(_SPARK)))] for v in values]
    return "".join(chars).rjust(width)


def fmt_age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


def fmt_num(value: float | None, digits: int = 3) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "-"  # None, or a value of the wrong type read back from a run directory
    if not math.isfinite(value):
        return str(value)  # nan, inf, -inf: said, not drawn
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"


def fmt_tau(tau: float | None, ratio: float | None) -> str:
    """τ, and beside it how many times n-gram prompt lookup's τ on the same prompts it is."""
    return fmt_num(tau, 3) + ("" if ratio is None else f" {ratio:.2f}x")


def downsample(xs: Sequence[float], ys: Sequence[float], points: int = 400) -> tuple[list, list]:
    """Every k-th point (always keeping the last), so a plot stays cheap to draw."""
    xs, ys = list(xs), list(ys)
    if len(xs) <= points:
        return xs, ys
    k = -(-len(xs) // points)
    keep = list(range(len(xs) - 1, -1, -k))[::-1]
    return [xs[i] for i in keep], [ys[i] for i in keep]
