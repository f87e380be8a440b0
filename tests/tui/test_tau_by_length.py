"""The dashboard's detail shows τ per prompt-length bucket from the run's last eval event."""

import json

import pytest

from tests.tui.test_app import dashboard

pytestmark = pytest.mark.anyio


async def test_the_detail_summary_shows_tau_by_prompt_length(static_run, wait_for):
    by_length = {"<=2K": {"prompts": 12, "tau": 3.5, "tau_lookup": 1.75}, ">32K": {"prompts": 1, "tau": 1.0}}
    with open(static_run.dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"event": "eval", "step": 30, "time": 1.0, "tau": 3.3, "tau_by_length": by_length}) + "\n")
    async with dashboard(static_run, wait_for) as (app, pilot):
        await pilot.press("enter")
        summary = app.screen.query_one("#summary")
        await wait_for(pilot, lambda: "tau by prompt length" in str(summary.render()), "the buckets in the summary")
        assert "tau by prompt length: <=2K 3.50 (lookup 1.75, 12 prompts); >32K 1.00 (1 prompt)" in str(summary.render())
