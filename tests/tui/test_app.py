"""Pilot tests: the dashboard driven against run directories a writer keeps updating."""

import contextlib
import json
import sys

import pytest

from dflash_ops.container import Container
from dflash_ops.errors import ConnectionLost, Unreachable
from dflash_ops.inventory import Node, Target
from dflash_ops.transport.local import LocalTransport
from dflash_ops.tui.app import DashApp
from dflash_ops.tui.detail import ConfirmScreen, RunDetailScreen
from dflash_ops.tui.remote import LocalDirSource, RemoteSource

pytestmark = pytest.mark.anyio


@contextlib.asynccontextmanager
async def dashboard(run, wait_for, source=None):
    """The app over `run`'s base directory as target `sim`, driven by a pilot, once the run is in its table.
    The table's poll every 0.5 s (the app's default: 2): each poll runs the runs helper, a process, and at
    0.05 s they ran back to back, a core for as long as a test's dashboard was open; what a test waits
    for is bounded by wait_for, never by the poll's period."""
    app = DashApp(source or LocalDirSource({"sim": run.dir.parents[1]}, gpus=False), poll_s=0.5)
    async with app.run_test(size=(140, 45)) as pilot:
        await wait_for(pilot, lambda: f"sim/{run.run_id}" in app.rows, "the run in the table")
        yield app, pilot


async def test_table_fills_and_detail_plots_grow_while_the_run_writes(live_run, wait_for):
    async with dashboard(live_run, wait_for) as (app, pilot):
        await pilot.press("enter")
        assert isinstance(app.screen, RunDetailScreen)
        detail = app.screen
        await wait_for(pilot, lambda: len(detail.history.loss) >= 3, "loss points")
        first = len(detail.history.loss)
        await wait_for(pilot, lambda: len(detail.history.loss) >= first + 5, "the loss plot to grow")
        assert {t.role for t in detail.history.gpus.values()} == {"target", "drafter"}
        await wait_for(pilot, lambda: detail.lines_shown > 0, "log lines shown")
        assert app.rows["sim/live-run"].step > 0


async def test_checkpoint_key_drops_a_request_the_run_serves(live_run, wait_for):
    async with dashboard(live_run, wait_for) as (app, pilot):
        await pilot.press("enter")
        detail = app.screen
        await pilot.press("c")
        await wait_for(pilot, lambda: detail.history.checkpoints, "a checkpoint event")
        served = detail.history.checkpoints[-1]
        assert served.request and (live_run.dir / served.path / "manifest.json").exists()


async def test_checkpoint_and_confirmed_stop_write_control_files(static_run, wait_for):
    control = static_run.dir / "control"
    async with dashboard(static_run, wait_for) as (app, pilot):
        await pilot.press("c")
        await wait_for(pilot, lambda: (control / "checkpoint").exists(), "control/checkpoint")
        assert set(json.loads((control / "checkpoint").read_text())) == {"id", "time"}
        await pilot.press("s")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("n")
        await pilot.pause()
        assert not isinstance(app.screen, ConfirmScreen)
        await pilot.press("s", "y")
        await wait_for(pilot, lambda: (control / "stop").exists(), "control/stop")
    # the requests; control/.no-restart (the stop recorded first, for a supervisor) is no request
    assert sorted(p.name for p in control.iterdir() if not p.name.startswith(".")) == ["checkpoint", "stop"]
    assert (control / ".no-restart").exists()


async def test_filter_shows_only_matching_log_lines(static_run, wait_for):
    static_run.log("needle here", "hay", "another NEEDLE")
    async with dashboard(static_run, wait_for) as (app, pilot):
        await pilot.press("enter")
        detail = app.screen
        await wait_for(pilot, lambda: "hay" in detail.lines, "the log tail")
        await pilot.press("slash", *"needle", "enter")
        log = detail.query_one("#log")
        assert list(log.lines) == ["needle here", "another NEEDLE"]
        await pilot.press("l")
        full = app.screen.query_one("#full-log")
        assert list(full.lines) == ["needle here", "another NEEDLE"]


class CutLink(LocalTransport):
    """The local transport with a switch, as a dropped ssh link: while `down`, a command cannot
    start (Unreachable) and one running loses its connection at its next line (ConnectionLost)."""

    down = False

    def run(self, command, *, on_line=None, **kwargs):
        if self.down:
            raise Unreachable("node 'local': cannot connect (the test cut the link)")

        def guarded(line):
            if self.down:
                raise ConnectionLost("ssh link lost")
            on_line(line)

        return super().run(command, on_line=None if on_line is None else guarded, **kwargs)


class DroppingSource(RemoteSource):
    """The dashboard's own source over `base` on a link that can be cut (`down`): what rides
    out the drop is RemoteSource's follow_file reconnect, as over SSH."""

    def __init__(self, base) -> None:
        self.link = CutLink()
        node = Node(name="local", transport="local", pct=())
        target = Target(name="sim", node=node, ctid=0, base_dir=str(base), python=sys.executable)
        super().__init__({"sim": lambda: Container(target, self.link, helpers_in_place=True)}, gpus=False)

    @property
    def down(self) -> bool:
        return self.link.down

    @down.setter
    def down(self, value: bool) -> None:
        self.link.down = value


def test_remote_source_rides_out_a_cut_link_and_reports_it(live_run):
    """RemoteSource.follow itself reconnects (follow_file's RetryPolicy) instead of raising on a
    drop: on_link hears 'disconnected ... (retry in Ns)' then live, and the offsets stay exact."""
    import threading

    from tests.unit.runs_double import eventually

    source = DroppingSource(live_run.dir.parents[1])
    got: list[tuple[str, int]] = []
    links: list = []
    stop = threading.Event()
    errors: list[BaseException] = []

    def follow() -> None:
        try:
            source.follow("sim", live_run.run_id, "train.log", lambda lines, end: got.extend((l, end) for l in lines),
                          stop, start=0, on_link=links.append)
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    try:
        eventually(lambda: len(got) > 5, "log lines")
        source.down = True
        eventually(lambda: any(not link.connected for link in links) or errors, "the drop reported")
        source.down = False
        seen = len(got)
        eventually(lambda: len(got) > seen + 5 or errors, "lines flowing again")
    finally:
        stop.set()
        thread.join(60)
    assert not errors and not thread.is_alive()
    drop = next(i for i, link in enumerate(links) if not link.connected)
    assert "disconnected: " in links[drop].describe() and "(retry in " in links[drop].describe()
    assert any(link.connected for link in links[drop:])  # recovered, said so
    log = (live_run.dir / "train.log").read_bytes()
    assert b"".join(line.encode() + b"\n" for line, _end in got) == log[:got[-1][1]]  # none lost or repeated


async def test_dropped_link_shows_disconnected_and_recovers_without_losing_lines(tmp_path, live_run, wait_for):
    source = DroppingSource(tmp_path)
    async with dashboard(live_run, wait_for, source) as (app, pilot):
        await pilot.press("enter")
        detail = app.screen
        await wait_for(pilot, lambda: len(detail.lines) > 5, "log lines")
        source.down = True
        await wait_for(pilot, lambda: not detail.links["train.log"].connected, "log stream marked down")
        await wait_for(pilot, lambda: not app.links["sim"].connected, "target marked down")
        await wait_for(pilot, lambda: "disconnected" in str(detail.query_one("#summary").render()), "shown")
        source.down = False
        await wait_for(pilot, lambda: app.links["sim"].connected, "target back")
        seen = len(detail.lines)
        await wait_for(pilot, lambda: len(detail.lines) > seen + 4, "log lines flowing again")
        assert detail.links["train.log"].connected
        lines = [line for line in detail.lines if line.startswith("step ")]
        assert len(lines) == len(set(lines))  # nothing repeated
        steps = sorted({int(line.split()[1]) for line in lines})
        assert steps == list(range(steps[0], steps[-1] + 1))  # nothing lost


async def test_s_then_enter_does_not_stop_the_run(static_run, wait_for):
    """The confirm dialog's default focus is Cancel: a reflexive Enter is the safe answer."""
    control = static_run.dir / "control"
    async with dashboard(static_run, wait_for) as (app, pilot):
        await pilot.press("s")
        assert isinstance(app.screen, ConfirmScreen)
        assert app.screen.focused is not None and app.screen.focused.id == "no"
        await pilot.press("enter")
        await pilot.pause()
        assert not isinstance(app.screen, ConfirmScreen)
    assert not (control / "stop").exists()


async def test_a_restart_and_its_reason_show_in_the_detail(static_run, wait_for):
    """A run started with --restart: the supervisor's `restart` event (metrics.jsonl) and
    restarts.json reach the dashboard's detail summary, with the step, reason and checkpoint."""
    restart = {"attempt": 1, "n": 1, "time": 1.0, "reason": "killed by SIGKILL", "exit_code": -9, "step": 27,
               "from": "checkpoints/step_20"}
    with open(static_run.dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps(dict(restart, event="restart", max=3)) + "\n")
    (static_run.dir / "restarts.json").write_text(json.dumps({"policy": "on-failure:3", "max": 3,
                                                              "restarts": [restart]}))
    async with dashboard(static_run, wait_for) as (app, pilot):
        assert app.rows["sim/tiny-run"].restarts == 1
        await pilot.press("enter")
        detail = app.screen
        summary = detail.query_one("#summary")
        # the row's count (restarts.json) can show before the detail has read the event (metrics.jsonl): wait for both
        shown = "restarts: 1 (last at step 27: killed by SIGKILL; from checkpoints/step_20)"
        await wait_for(pilot, lambda: shown in str(summary.render()), "the restart and its reason in the summary")


async def test_per_position_acceptance_shows_in_the_detail(static_run, wait_for):
    """An evaluation's per-position acceptance (metrics.jsonl `eval`) reaches the detail's summary."""
    with open(static_run.dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"event": "eval", "step": 30, "time": 1.0, "tau": 2.6, "acceptance": [0.95, 0.6, 0.05],
                            "acc": 0.8, "samples": 4}) + "\n")
    async with dashboard(static_run, wait_for) as (app, pilot):
        await pilot.press("enter")
        summary = app.screen.query_one("#summary")
        await wait_for(pilot, lambda: "accepted by draft position" in str(summary.render()), "acceptance in the summary")
        assert "accepted by draft position (last eval): 0.95 0.60 0.05" in str(summary.render())


BAD_METRICS_LINES = [
    '{"event": "step", "step": 31, "time": 1.0, "gpus": 5}',                      # iterated
    '{"event": "step", "step": "thirty-one", "time": 1.0, "loss": 1.0}',          # plotted as x
    '{"event": "eval", "step": 31, "time": 1.0, "tau": "high"}',                  # formatted as a number
    '{"event": "warmup", "step": 0, "time": 1.0, "shapes": 7}',                   # len() of it
    '[1, 2]',                                                                      # not an object
    "[" * 100_000 + "]" * 100_000,                                                 # json.loads: RecursionError
]


async def test_bad_metrics_lines_show_as_bad_and_the_dashboard_goes_on(static_run, wait_for):
    """Odd lines in metrics.jsonl (a field of an unexpected type, a deep nest) are counted and named
    in the detail's summary; the lines after them still reach the plots (one ended the app). One
    dashboard reads them all: a line that ended it, or one not counted as bad, fails here as alone."""
    with open(static_run.dir / "metrics.jsonl", "a") as f:
        for bad in BAD_METRICS_LINES:
            f.write(bad + "\n")
        f.write(json.dumps({"event": "step", "step": 31, "time": 1.0, "loss": 0.125, "tokens_per_s": 10.0}) + "\n")
    async with dashboard(static_run, wait_for) as (app, pilot):
        await pilot.press("enter")
        detail = app.screen
        await wait_for(pilot, lambda: detail.history.loss and detail.history.loss[-1] == 0.125, "the good line after them")
        summary = detail.query_one("#summary")
        said = f"metrics: {len(BAD_METRICS_LINES)} bad lines skipped"
        await wait_for(pilot, lambda: said in str(summary.render()), "the bad lines named")
        await pilot.pause(0.6)  # a replot and a summary after them
        assert detail.history.bad_lines == len(BAD_METRICS_LINES) and app.return_code is None


ODD_VALUES = ["NaN", "Infinity", "-Infinity", "1e308", "-1e308"]


async def test_odd_numbers_in_metrics_are_said_and_never_end_the_dashboard(static_run, wait_for):
    """NaN, +-Infinity or 1e308 in metrics.jsonl (a loss that diverged, a broken counter) ended
    `dflash-ops dash` (the plot's axis and the GPU sparkline overflowed; issue 55): the value is a
    gap in the plot, clamped when finite, a GPU's busy share 0..100, and the lines after it plot.
    One dashboard reads every odd value: one that ends it, or is kept unclamped, fails here as alone."""
    with open(static_run.dir / "metrics.jsonl", "a") as f:
        for value in ODD_VALUES:
            f.write('{"event": "step", "step": 31, "time": 1.0, "loss": %s, "tokens_per_s": %s, '
                    '"gpus": [{"index": 0, "busy": %s, "mem_gb": %s}]}\n' % (value, value, value, value))
            f.write('{"event": "step", "step": %s, "time": 1.0, "loss": 0.5}\n' % value)
        f.write(json.dumps({"event": "step", "step": 32, "time": 1.0, "loss": 0.125, "tokens_per_s": 10.0}) + "\n")
    async with dashboard(static_run, wait_for) as (app, pilot):
        await pilot.press("enter")
        detail = app.screen
        await wait_for(pilot, lambda: detail.history.loss and detail.history.loss[-1] == 0.125, "the good line after it")
        await pilot.pause(1.2)  # a replot, a GPU panel and a summary after it
        assert app.return_code is None
        h = detail.history
        assert all(abs(v) <= 1e15 for v in [*h.loss, *h.tps]) and all(0 <= b <= 100 for t in h.gpus.values()
                                                                       for b in t.history)
