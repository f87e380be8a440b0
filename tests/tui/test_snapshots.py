"""Two pictures of the dashboard, frozen: a static run, a fixed clock (heartbeat age 5s)."""

from textual.widgets import DataTable

from dflash_ops.tui.app import DashApp
from dflash_ops.tui.demo import SimulatedRun
from dflash_ops.tui.detail import RunDetailScreen
from dflash_ops.tui.remote import LocalDirSource

SIZE = (140, 45)


def _app(tmp_path, frozen_clock):
    # polled every 0.05 s, not test_app's 0.5: the table's column widths are drawn on a later refresh than the one
    # that sizes them, and the polls' refreshes are what brings that one before the picture (at 0.5 s, one run of
    # the whole suite took the picture with the old widths)
    return DashApp(LocalDirSource({"sim": tmp_path}, gpus=False), clock=frozen_clock, poll_s=0.05)


def test_runs_table(snap_compare, tmp_path, static_run, frozen_clock, wait_for):
    done = SimulatedRun(tmp_path, "finished-run", total_steps=5, clock=frozen_clock)
    done.begin()
    while done.advance():
        pass

    async def loaded(pilot):
        await wait_for(pilot, lambda: len(pilot.app.rows) == 2, "both runs")
        table = pilot.app.query_one("#runs", DataTable)  # columns are sized when the table is next idle
        await wait_for(pilot, lambda: table.columns["run"].content_width >= len("finished-run"), "sized columns")
        await pilot.pause()

    assert snap_compare(_app(tmp_path, frozen_clock), terminal_size=SIZE, run_before=loaded)


def test_run_detail(snap_compare, tmp_path, static_run, frozen_clock, wait_for):
    async def detail_loaded(pilot):
        await wait_for(pilot, lambda: "sim/tiny-run" in pilot.app.rows, "the run")
        await pilot.press("enter")
        screen = pilot.app.screen
        assert isinstance(screen, RunDetailScreen)
        last = (static_run.dir / "train.log").read_text().splitlines()[-1]  # the log arrives in chunks
        await wait_for(pilot, lambda: len(screen.history.loss) == 30 and screen.lines and screen.lines[-1] == last,
                       "history and the whole log tail")
        await wait_for(pilot, lambda: screen._plotted_version == screen.history.version, "plots")
        screen.render_summary()
        await pilot.pause()
        log = screen.query_one("#log")  # anchored: it reaches its end once the layout settles
        await wait_for(pilot, lambda: log.scroll_y == log.max_scroll_y, "the log view at its end")

    assert snap_compare(_app(tmp_path, frozen_clock), terminal_size=SIZE, run_before=detail_loaded)
