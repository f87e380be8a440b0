"""The run detail screen (plots, GPUs, log tail), the full log, and the stop confirmation."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from typing import Callable, Protocol, cast

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.events import Key
from textual.screen import ModalScreen, Screen
from textual.widgets import Button, Footer, Input, Log, Static
from textual_plotext import PlotextPlot

from dflash_ops.printable import printable
from dflash_ops.runs.report import acceptance_text
from dflash_ops.tui.model import RunHistory, bar, downsample, fmt_age, fmt_num, sparkline
from dflash_ops.tui.source import DashSource, GpuSample, RunRow
from dflash_ops.tui.streams import LineSink, LinkState, follow_forever
from trainer.run.contract import duration_text, eta_seconds, phase_text, tau_by_length_text, tau_by_temperature_text

LOG_BUFFER = 20_000  # lines kept for filtering and the full log
LOG_VIEW = 2_000  # lines in the detail's tail
LOG_TAIL = 500  # lines fetched when a log stream starts
METRICS_TAIL = 100_000  # metrics lines fetched at start (the plots' whole history)
TICK_S = 0.1  # how often buffered lines reach the widgets
PLOT_S = 0.5  # how often plots are redrawn (when data changed)


class DashState(Protocol):
    """What a run's detail reads from the DashApp that opened it."""

    source: DashSource
    rows: dict[str, RunRow]
    host_gpus: dict[str, list[GpuSample] | None]
    clock: Callable[[], float]


class RunDetailScreen(Screen):
    AUTO_FOCUS = "#log"
    CSS = """
    #summary { height: auto; padding: 0 1; }
    #plots { height: 12; }
    #gpus { height: auto; padding: 0 1; }
    #filter { display: none; }
    #filter.shown { display: block; }
    #log { height: 1fr; border-top: solid $primary; }
    """
    BINDINGS = [Binding("escape", "app.pop_screen", "Back"), Binding("l", "full_log", "Full log"),
                Binding("slash", "filter", "Filter")]

    def __init__(self, target: str, run_id: str) -> None:
        super().__init__()
        self.target, self.run_id = target, run_id
        self.history = RunHistory()
        self.lines: deque[str] = deque(maxlen=LOG_BUFFER)
        self.filter_text = ""
        self.log_sink = LineSink(LOG_BUFFER)
        self.metrics_sink = LineSink(METRICS_TAIL)
        self.links = {"train.log": LinkState(False), "metrics.jsonl": LinkState(False)}
        self.dropped = 0
        self.updates = 0  # ticks that moved data to widgets (bench figure)
        self.lines_shown = 0
        self._plotted_version = -1
        self._stop = threading.Event()
        self._full_log: Log | None = None
        self._samples_applied: list[GpuSample] | None = None

    def compose(self) -> ComposeResult:
        yield Static(id="summary")
        with Horizontal(id="plots"):
            yield PlotextPlot(id="loss-plot")
            yield PlotextPlot(id="tps-plot")
        yield Static(id="gpus")
        yield Input(placeholder="filter the log (Enter keeps it, Esc clears)", id="filter")
        yield Log(id="log", max_lines=LOG_VIEW)
        yield Footer()

    @property
    def dash(self) -> DashState:
        return cast(DashState, self.app)

    def on_mount(self) -> None:
        streams = (("train.log", self.log_sink, LOG_TAIL), ("metrics.jsonl", self.metrics_sink, METRICS_TAIL))
        for name, sink, tail in streams:
            threading.Thread(target=follow_forever, name=f"dash-follow-{name}", daemon=True,
                             args=(self.dash.source, self.target, self.run_id, name, sink, self._stop,
                                   lambda link, name=name: self.links.__setitem__(name, link), tail)).start()
        # Anchored, the tail stays at its end when the panes above change height (the summary is
        # empty at the first write), until the user scrolls up; Log's own auto-scroll does not.
        self.query_one("#log", Log).anchor()
        self.set_interval(TICK_S, self.tick)
        self.set_interval(PLOT_S, self.replot)
        self.set_interval(1.0, self.render_summary)
        self.render_summary()
        self.replot()

    def on_unmount(self) -> None:
        self._stop.set()

    # -- data to widgets -----------------------------------------------------------------
    def tick(self) -> None:
        metrics, _ = self.metrics_sink.drain()
        lines, dropped = self.log_sink.drain()
        lines = [printable(line) for line in lines]  # train.log is data: no ESC sequence reaches the terminal
        samples = self.dash.host_gpus.get(self.target)
        if samples is not self._samples_applied:  # a new poll result, not the same one again
            self._samples_applied = samples
            row = self._row()
            self.history.apply_host_samples(samples, row.gpus if row else ())
        self.history.feed(metrics)
        self.dropped += dropped
        if lines:
            self.lines.extend(lines)
            shown = self._matching(lines)
            if shown:
                self.query_one("#log", Log).write_lines(shown)
                if self._full_log is not None:
                    self._full_log.write_lines(shown)
            self.lines_shown += len(shown)
        if lines or metrics:
            self.updates += 1
            self.render_summary()

    def _row(self) -> RunRow | None:
        return self.dash.rows.get(f"{self.target}/{self.run_id}")

    def _matching(self, lines: Iterable[str]) -> list[str]:
        if not self.filter_text:
            return list(lines)
        needle = self.filter_text.lower()
        return [line for line in lines if needle in line.lower()]

    def render_summary(self) -> None:
        row = self._row()
        h = self.history
        text = Text()
        text.append(f"{self.target}/{self.run_id}", style="bold")
        if row is None:
            text.append("  (not listed yet)")
        else:
            age = None if row.heartbeat is None else self.dash.clock() - row.heartbeat
            total = f"/{row.total_steps}" if row.total_steps else ""
            text.append("  state ")
            text.append(row.state, style="bold")
            if phase_text(row.phase):
                text.append(f"  phase {phase_text(row.phase)}")
            eta = eta_seconds({**row.status, "state": row.state})
            text.append(
                ("" if eta is None else f"  eta {duration_text(eta)}")
                + f"  step {row.step}{total}  loss {fmt_num(row.loss, 4)}  acc {fmt_num(row.acc)}"
                f"  tau {fmt_num(h.tau)}"
                + ("" if h.tau_lookup is None else f" (n-gram lookup {fmt_num(h.tau_lookup)}, {fmt_num(h.tau_ratio)}x)")
                + f"  tok/s {fmt_num(row.tokens_per_s, 4)}"
                + ("" if row.tokens_per_s_steady is None else f" (steady {fmt_num(row.tokens_per_s_steady, 4)})")
                + ("" if row.pad_share is None else f"  pad {row.pad_share:.1%}")
                + f"  heartbeat {fmt_age(age)}  release {row.release or '-'}"
            )
        accepted = acceptance_text(h.acceptance if h.acceptance is not None else row.acceptance if row else None)
        if accepted:
            text.append(f"\naccepted by draft position (last eval): {accepted}")
        warm = "not seen"
        if h.warmup is not None:
            shapes = h.warmup.get("shapes") or []
            warm = f"{len(shapes)} shapes in {fmt_num(h.warmup.get('seconds'))}s"
        recompiles = max(h.recompiles, row.recompiles if row else 0)
        by_length = tau_by_length_text(h.tau_by_length)
        if by_length:
            text.append(f"\ntau by prompt length: {by_length}")
        by_temperature = tau_by_temperature_text(h.tau_by_temperature or (row.status.get("tau_by_temperature") if row else None))
        if by_temperature:
            text.append(f"\ntau by temperature: {by_temperature}")
        text.append(f"\nwarm-up: {warm}   recompiles: ")
        text.append(str(recompiles), style="bold red" if recompiles else "")
        ckpts = ", ".join(c.path.rsplit("/", 1)[-1] for c in h.checkpoints[-4:]) or "none"
        text.append(f"   checkpoints: {ckpts}")
        if h.restarts or (row and row.restarts):
            last = h.restarts[-1] if h.restarts else {}
            text.append(f"\nrestarts: {max(len(h.restarts), row.restarts if row else 0)}", style="bold yellow")
            if last:
                text.append(f" (last at step {last.get('step')}: {last.get('reason')}; from "
                            f"{last.get('from') or 'the start'})")
        text.append("\nstreams: ")
        for i, (name, link) in enumerate(self.links.items()):
            text.append(("" if i == 0 else ", ") + f"{name} {link.describe()}",
                        style="" if link.connected else "bold red")
        if self.dropped:
            text.append(f"   skipped {self.dropped} log lines (too fast to show)", style="yellow")
        if self.filter_text:
            text.append(f"   filter: {self.filter_text!r}", style="cyan")
        if h.last_bad is not None:
            text.append(f"\nmetrics: {h.bad_lines} bad line{'s' if h.bad_lines > 1 else ''} skipped, the last: "
                        f"{h.last_bad.problem}", style="yellow")
        if row is not None and row.waits_for:
            text.append(f"\nwaits for: {row.waits_for}", style="magenta")
        error = (row.error if row else None) or h.error
        if error:
            text.append(f"\nerror: {error}", style="bold red")
        self.query_one("#summary", Static).update(text)
        self.render_gpus()

    def render_gpus(self) -> None:
        tracks = [self.history.gpus[i] for i in sorted(self.history.gpus)]
        if not tracks:
            note = "GPUs: none reported (CPU run or no GPU on target)"
            self.query_one("#gpus", Static).update(Text(note, style="dim"))
            return
        text = Text()
        for i, track in enumerate(tracks):
            mem = fmt_num(track.mem_gb) + (f"/{fmt_num(track.mem_total_gb)}" if track.mem_total_gb else "")
            busy = "  -" if track.busy is None else f"{track.busy:3.0f}"
            text.append(("\n" if i else "") + f"GPU{track.index:<2} {track.role:<8} ")
            text.append(bar(track.busy, 16), style="green" if (track.busy or 0) >= 50 else "yellow")
            text.append(f" {busy}%  ")
            text.append(sparkline(track.history, 30), style="cyan")
            text.append(f"  mem {mem} GB")
        self.query_one("#gpus", Static).update(text)

    def replot(self) -> None:
        h = self.history
        if h.version == self._plotted_version:
            return
        self._plotted_version = h.version
        for widget_id, title, xs, ys in (("#loss-plot", "loss", h.loss_steps, h.loss),
                                         ("#tps-plot", "tokens/s", h.tps_steps, h.tps)):
            widget = self.query_one(widget_id, PlotextPlot)
            plt = widget.plt
            plt.clear_data()
            plt.title(title)
            shown_x, shown_y = downsample(xs, ys)
            if shown_x:
                plt.plot(shown_x, shown_y, marker="braille")
            widget.refresh()

    # -- actions ---------------------------------------------------------------------------
    def action_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.add_class("shown")
        box.focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        self.filter_text = event.value
        log = self.query_one("#log", Log)
        log.clear()
        log.write_lines(self._matching(list(self.lines)[-LOG_VIEW * 10:])[-LOG_VIEW:])

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.query_one("#log", Log).focus()

    def on_key(self, event: Key) -> None:
        box = self.query_one("#filter", Input)
        if event.key == "escape" and box.has_focus:
            event.stop()
            box.value = ""
            box.remove_class("shown")
            self.query_one("#log", Log).focus()

    def action_full_log(self) -> None:
        self.app.push_screen(FullLogScreen(self))


class FullLogScreen(Screen):
    """Every buffered line of the run's log (filtered like the tail), still following."""

    BINDINGS = [Binding("escape", "app.pop_screen", "Back")]

    def __init__(self, detail: RunDetailScreen) -> None:
        super().__init__()
        self.detail = detail

    def compose(self) -> ComposeResult:
        yield Static(f"{self.detail.target}/{self.detail.run_id} train.log "
                     f"(last {LOG_BUFFER} lines{', filtered' if self.detail.filter_text else ''})")
        yield Log(id="full-log", max_lines=LOG_BUFFER)
        yield Footer()

    def on_mount(self) -> None:
        log = self.query_one("#full-log", Log)
        log.write_lines(self.detail._matching(self.detail.lines))
        log.focus()
        self.detail._full_log = log

    def on_unmount(self) -> None:
        self.detail._full_log = None


class ConfirmScreen(ModalScreen[bool]):
    """Yes/No before something that cannot be undone. Cancel has the focus: a reflexive Enter
    (after `s`) must be the safe answer; stopping takes `y` or a deliberate Tab to Yes."""

    AUTO_FOCUS = "#no"
    CSS = """
    ConfirmScreen { align: center middle; }
    #dialog { width: 60; height: auto; border: thick $error; padding: 1 2; background: $surface; }
    #buttons { height: auto; margin-top: 1; }
    """
    BINDINGS = [Binding("y", "dismiss(True)", "Yes"), Binding("n", "dismiss(False)", "No"),
                Binding("escape", "dismiss(False)", "Cancel")]

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Static(self.question)
            with Horizontal(id="buttons"):
                yield Button("Yes, stop (y)", id="yes", variant="error")
                yield Button("Cancel (n)", id="no")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")
