"""`DashApp`: a runs table across targets; selecting a run opens its detail.

All calls to the `DashSource` happen in plain daemon threads (one poller per target, two
followers per open run); they post messages or fill bounded buffers, and the UI applies them
on its own timers, so a slow or dead host never blocks a keypress.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.message import Message
from textual.widgets import DataTable, Footer, Static

from dflash_ops.runs.follow import RetryPolicy
from dflash_ops.runs.info import FINAL_STATES
from dflash_ops.tui.detail import ConfirmScreen, RunDetailScreen
from dflash_ops.tui.model import fmt_age, fmt_num, fmt_tau
from dflash_ops.tui.source import DashSource, GpuSample, LinkState, RequestKind, RunRow, describe_error
from trainer.run.contract import duration_text, eta_seconds, phase_text

COLUMNS = ("target", "run", "state", "phase", "step", "loss", "acc", "tau", "tok/s", "eta", "heartbeat", "release")
STATE_STYLE = {"running": "green", "warmup": "yellow", "starting": "yellow", "checkpointing": "cyan",
               "done": "bold green", "stopped": "dim", "failed": "bold red", "restarting": "bold yellow",
               "queued": "magenta"}
POLL_RETRY = RetryPolicy(max_backoff=30.0)  # a target's poller: list_runs again after 0.5, 1, 2 ... 30 s


class TargetUpdate(Message):
    """A poller's news about one target: rows and GPU samples, or the link failure."""

    def __init__(self, target: str, link: LinkState, rows: list[RunRow] | None = None,
                 gpus: list[GpuSample] | None = None) -> None:
        super().__init__()
        self.target, self.link, self.rows, self.gpus = target, link, rows, gpus


def group_order(rows: dict[str, RunRow]) -> list[str]:
    """Row keys in poll order, except that the members of a run across hosts (same run id, a
    world size) sit together at the first member's place, by rank: one run, a row per node."""
    out: list[str] = []
    placed: set[str] = set()
    for key, row in rows.items():
        if key in placed:
            continue
        if row.world:
            group = [k for k, r in rows.items() if r.world and r.run_id == row.run_id]
            group.sort(key=lambda k: (rows[k].rank is None, rows[k].rank or 0, k))
        else:
            group = [key]
        out += group
        placed.update(group)
    return out


class DashApp(App):
    TITLE = "dflash-ops dash"
    CSS = """
    #targets { height: auto; padding: 0 1; background: $boost; }
    #runs { height: 1fr; }
    """
    BINDINGS = [Binding("c", "checkpoint", "Checkpoint"), Binding("s", "stop_run", "Stop"), Binding("q", "quit", "Quit")]

    def __init__(self, source: DashSource, targets: list[str] | None = None, clock: Callable[[], float] = time.time,
                 poll_s: float = 2.0) -> None:
        super().__init__()
        self.source = source
        self.target_names = list(targets) if targets else source.targets()
        self.clock = clock
        self.poll_s = poll_s
        self.rows: dict[str, RunRow] = {}  # key "target/run" -> row
        self.links: dict[str, LinkState] = {t: LinkState(False) for t in self.target_names}
        self.host_gpus: dict[str, list[GpuSample] | None] = {}
        self._stop = threading.Event()

    # -- layout ------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        # Kept as attributes: App.query_one searches the active screen, which is the run
        # detail while one is open, and pollers keep updating the runs table underneath.
        self._targets = Static(id="targets")
        self._table: DataTable = DataTable(id="runs", cursor_type="row", zebra_stripes=True)
        yield self._targets
        yield self._table
        yield Footer()

    def on_mount(self) -> None:
        table = self._table
        for name in COLUMNS:
            table.add_column(name, key=name)
        self._render_targets()
        for target in self.target_names:
            threading.Thread(target=self._poll_target, args=(target,), name=f"dash-poll-{target}",
                             daemon=True).start()
        self.set_interval(1.0, self._render_rows)  # heartbeat ages move with the clock

    def on_unmount(self) -> None:
        self._stop.set()

    # -- pollers (threads) ---------------------------------------------------------------
    def _poll_target(self, target: str) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                rows = self.source.list_runs(target)
            except Exception as exc:  # noqa: BLE001 - shown on the target, then retried
                delay = POLL_RETRY.delay(failures)
                failures += 1
                self.post_message(TargetUpdate(target, LinkState.lost(exc, delay)))
                self._stop.wait(delay)
                continue
            failures = 0
            try:
                gpus = self.source.gpu_samples(target)
            except Exception:  # noqa: BLE001 - GPU sampling is best effort; runs still show
                gpus = None
            self.post_message(TargetUpdate(target, LinkState(True), rows, gpus))
            self._stop.wait(self.poll_s)

    def on_target_update(self, message: TargetUpdate) -> None:
        self.links[message.target] = message.link
        if message.rows is not None:
            prefix = f"{message.target}/"
            for key in [k for k in self.rows if k.startswith(prefix)]:
                del self.rows[key]
            for row in message.rows:
                self.rows[prefix + row.run_id] = row
            self.host_gpus[message.target] = message.gpus
        self._render_targets()
        self._render_rows()

    # -- rendering -----------------------------------------------------------------------
    def _render_targets(self) -> None:
        parts = []
        for target in self.target_names:
            link = self.links[target]
            runs = sum(1 for k in self.rows if k.startswith(f"{target}/"))
            mark, style = ("●", "green") if link.connected else ("✖", "red") if link.error else ("○", "yellow")
            parts.append(Text(f"{mark} {target}: {link.describe()}, {runs} run{'s' if runs != 1 else ''}", style=style))
        self._targets.update(Text("   ").join(parts))

    def _cells(self, row: RunRow) -> tuple:
        stale = not self.links.get(row.target, LinkState(False)).connected
        age = None if row.heartbeat is None else self.clock() - row.heartbeat
        state = Text(row.state + ("?" if stale else ""), style=STATE_STYLE.get(row.state.split(" #")[0], ""))
        total = f"/{row.total_steps}" if row.total_steps else ""
        member = f" rank {row.rank if row.rank is not None else '?'}/{row.world}" if row.world else ""
        eta = eta_seconds({**row.status, "state": row.state}) if not stale else None
        return (Text(row.target + member, style="red" if stale else ""), row.run_id, state, phase_text(row.phase) or "-",
                f"{row.step}{total}", fmt_num(row.loss, 4), fmt_num(row.acc, 3), fmt_tau(row.tau, row.tau_ratio),
                fmt_num(row.tokens_per_s, 4), duration_text(eta),
                fmt_age(age) if row.state not in FINAL_STATES else "-", row.release or "-")

    def _render_rows(self) -> None:
        table = self._table
        wanted = group_order(self.rows)
        if [key.value for key in table.rows] != wanted:
            selected = self.selected_key()
            table.clear()
            for key in wanted:
                table.add_row(*self._cells(self.rows[key]), key=key)
            if selected in wanted:
                table.move_cursor(row=wanted.index(selected))
            return
        for key in wanted:
            for column, value in zip(COLUMNS, self._cells(self.rows[key])):
                table.update_cell(key, column, value, update_width=True)  # "0/300" grows to "75/300"

    # -- selection and actions -------------------------------------------------------------
    def selected_key(self) -> str | None:
        table = self._table
        if not table.row_count:
            return None
        return table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value

    def current_run(self) -> tuple[str, str] | None:
        """The run the keys act on: the open detail's, else the highlighted row's."""
        if isinstance(self.screen, RunDetailScreen):
            return self.screen.target, self.screen.run_id
        key = self.selected_key()
        if key is None:
            return None
        row = self.rows[key]
        return row.target, row.run_id

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        row = self.rows.get(event.row_key.value or "")
        if row is not None:
            self.push_screen(RunDetailScreen(row.target, row.run_id))

    def action_checkpoint(self) -> None:
        run = self.current_run()
        if run is not None:
            self.send_request(*run, "checkpoint")

    def action_stop_run(self) -> None:
        run = self.current_run()
        if run is None:
            return
        target, run_id = run

        def confirmed(ok: bool | None) -> None:
            if ok:
                self.send_request(target, run_id, "stop")

        self.push_screen(ConfirmScreen(f"Stop run {run_id} on {target}?\n(a final checkpoint is written first)"), confirmed)

    def send_request(self, target: str, run_id: str, kind: RequestKind) -> None:
        def work() -> None:
            try:
                request_id = self.source.request(target, run_id, kind)
            except Exception as exc:  # noqa: BLE001 - reported to the user, nothing to retry
                self.notify(f"{kind} {target}/{run_id} failed: {describe_error(exc)}", severity="error")
            else:
                self.notify(f"{kind} requested for {target}/{run_id} (id {request_id})")  # notify is thread-safe

        threading.Thread(target=work, name=f"dash-request-{kind}", daemon=True).start()


def run_dash(source: DashSource, targets: list[str] | None = None) -> int:
    """The library entry point: run the dashboard in this terminal until `q`. Returns the app's
    exit status: 0 after `q`, 1 when an error ended it (Textual printed its traceback)."""
    app = DashApp(source, targets=targets)
    app.run()
    return app.return_code or 0
