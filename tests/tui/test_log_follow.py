"""The detail's log tail keeps following the end when the panes above it change height."""

import pytest
from textual.widgets import Log

from dflash_ops.tui.app import DashApp
from dflash_ops.tui.detail import RunDetailScreen
from dflash_ops.tui.remote import LocalDirSource

pytestmark = pytest.mark.anyio


async def test_log_stays_at_its_end_when_the_summary_grows_until_the_user_scrolls_up(static_run, wait_for):
    app = DashApp(LocalDirSource({"sim": static_run.dir.parents[1]}, gpus=False), poll_s=0.5)  # why 0.5: test_app.dashboard
    async with app.run_test(size=(140, 45)) as pilot:
        await wait_for(pilot, lambda: "sim/tiny-run" in app.rows, "the run")
        await pilot.press("enter")
        screen = app.screen
        assert isinstance(screen, RunDetailScreen)
        log = screen.query_one("#log", Log)
        last = (static_run.dir / "train.log").read_text().splitlines()[-1]
        await wait_for(pilot, lambda: screen.lines and screen.lines[-1] == last, "the whole log tail")
        await wait_for(pilot, lambda: log.max_scroll_y > 0 and log.is_vertical_scroll_end, "the log at its end")

        screen.history.error = "one\ntwo\nthree\nfour"  # the summary grows by four lines, the log shrinks
        screen.render_summary()
        await pilot.pause()
        await wait_for(pilot, lambda: log.is_vertical_scroll_end, "the log back at its end")

        log.scroll_home(animate=False)  # the user reads back: new lines must not pull the view down
        await pilot.pause()
        log.write_lines(["a new line"])
        await pilot.pause()
        assert log.scroll_y == 0
