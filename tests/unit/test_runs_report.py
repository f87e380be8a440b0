"""The human lines of `metrics` and `run status`."""

import pytest

from dflash_ops.runs import RunInfo, latest_run
from dflash_ops.runs.report import STATUS_COLUMNS, metric_line, status_detail, status_row


def test_step_event_is_one_compact_line():
    line = metric_line({"event": "step", "time": 1.0, "step": 40, "loss": 2.34567, "acc": 0.4123, "lr": 0.003,
                        "grad_norm": 1.234, "tokens_per_s": 23932.0}, total_steps=300)
    assert line == "step 40/300  loss 2.3457  acc 0.412  lr 3.00e-03  gnorm 1.23  23.9k tok/s"


def test_other_events():
    assert metric_line({"event": "eval", "step": 300, "tau": 6.59375, "acc": 0.957, "samples": 16}) == \
        "eval at step 300: acceptance length tau 6.594  acc 0.957  samples 16"
    assert metric_line({"event": "eval", "step": 300, "tau": 4.5, "tau_lookup": 3.0, "tau_ratio": 1.5, "acc": 0.9,
                        "samples": 16}) == \
        "eval at step 300: acceptance length tau 4.500  n-gram lookup 3.000 (1.50x)  acc 0.900  samples 16"
    assert metric_line({"event": "start", "step": 202, "total_steps": 3000, "resumed_from": "checkpoints/step_202"}) == \
        "start at step 202 of 3000 (resumed from checkpoints/step_202)"
    assert metric_line({"event": "stop", "step": 9, "reason": "signal"}) == "stop at step 9: signal"
    assert metric_line({"event": "future", "step": 1, "x": 2}) == 'future at step 1: {"x": 2}'


def test_status_row_and_failed_detail():
    info = RunInfo.from_json({"run_id": "r1", "state": "running", "effective_state": "failed", "step": 5,
                              "total_steps": 10, "loss": 0.5, "tau": 3.456, "tokens_per_s": 800.0, "release": "abc",
                              "reason": "process died without saying so", "log_tail": "a\nb\n", "checkpoints": [4]})
    assert status_row(info) == ("r1", "failed", "-", "5/10", "0.5000", "3.46", "800", "-", "-", "abc")
    assert status_detail(info) == ["reason: process died without saying so", "checkpoints: step_4", "log tail:",
                                   "  a", "  b"]


def test_per_position_acceptance_in_the_eval_line_and_run_status():
    event = {"event": "eval", "step": 300, "tau": 2.5, "acceptance": [0.9, 0.5, 0.1], "acc": 0.9, "samples": 16}
    assert metric_line(event) == \
        "eval at step 300: acceptance length tau 2.500  by position 0.90 0.50 0.10  acc 0.900  samples 16"
    info = RunInfo.from_json({"run_id": "r1", "state": "running", "effective_state": "running", "tau": 2.5,
                              "acceptance": [0.9, 0.5, 0.1], "checkpoints": []})
    assert status_detail(info)[0] == "accepted by draft position (last eval, tau 2.50): 0.90 0.50 0.10"
    # status.json without it (an older trainer), or of another type: no line
    for status in ({}, {"acceptance": "high"}, {"acceptance": [0.5, "x"]}):
        other = RunInfo.from_json({"run_id": "r1", "effective_state": "running", "checkpoints": [], **status})
        assert not any(line.startswith("accepted by") for line in status_detail(other))


def test_latest_run_prefers_launch_time():
    runs = [RunInfo(run_id="b", launched=1.0), RunInfo(run_id="a", launched=2.0), RunInfo(run_id="c")]
    assert latest_run(runs).run_id == "a" and latest_run([]) is None


def test_a_live_run_shows_its_phase_tokens_and_eta():
    info = RunInfo.from_json({"run_id": "r2", "state": "running", "effective_state": "running", "alive": True,
                              "step": 50, "total_steps": 200, "tokens_per_s": 900.0, "tokens_per_s_recent": 1000.0,
                              "tokens_done": 1_000_000, "tokens_total": 4_000_000,
                              "phase": {"name": "training", "done": None, "total": None, "since": 1.0}})
    row = dict(zip(STATUS_COLUMNS, status_row(info)))
    assert row["phase"] == "training" and row["eta"] == "50m"  # 3M tokens to go at 1,000 tok/s
    assert "tokens: 1.0M done, 3.0M to go (25%), eta 50m at 1.0k tok/s (recent)" in status_detail(info)
    fitting = RunInfo.from_json({"run_id": "r3", "effective_state": "starting", "alive": True,
                                 "phase": {"name": "fitting the target", "done": 12, "total": 200, "since": 1.0}})
    assert dict(zip(STATUS_COLUMNS, status_row(fitting)))["phase"] == "fitting the target 12/200"
    assert "phase: fitting the target 12/200" in status_detail(fitting)


def test_a_queued_run_expects_to_start_when_the_runs_it_waits_for_end():
    from dflash_ops.runs.lifecycle import expected_starts

    live = RunInfo.from_json({"run_id": "a", "effective_state": "running", "alive": True, "tokens_done": 100,
                              "tokens_total": 1100, "tokens_per_s_recent": 10.0})
    fresh = RunInfo.from_json({"run_id": "b", "effective_state": "warmup", "alive": True})
    q1 = RunInfo.from_json({"run_id": "q1", "effective_state": "queued", "position": 1,
                            "waits_for": ["a (pid 7) holds GPU 0"]})
    q2 = RunInfo.from_json({"run_id": "q2", "effective_state": "queued", "position": 2,
                            "waits_for": ["a (pid 7) holds GPU 0", "q1 is queued before it for GPU 0"]})
    q3 = RunInfo.from_json({"run_id": "q3", "effective_state": "queued", "position": 3,
                            "waits_for": ["b (pid 8) holds GPU 1"]})
    q4 = RunInfo.from_json({"run_id": "q4", "effective_state": "queued", "position": 4, "waits_for": []})
    assert expected_starts([live, fresh, q1, q2, q3, q4]) == {"q1": 100.0, "q2": None, "q3": None, "q4": 0.0}


def test_run_stop_says_what_it_waits_for():
    from dflash_ops.runs.lifecycle import waiting_for

    fitting = RunInfo.from_json({"run_id": "r", "effective_state": "starting", "alive": True, "pid": 7,
                                 "phase": {"name": "fitting the target", "done": 31, "total": 200}})
    assert waiting_for(fitting) == "state starting, phase fitting the target 31/200"
    training = RunInfo.from_json({"run_id": "r", "effective_state": "checkpointing", "alive": True, "pid": 7,
                                  "step": 40, "phase": {"name": "checkpointing"}})
    assert waiting_for(training) == "state checkpointing, phase checkpointing, step 40"
    exiting = RunInfo.from_json({"run_id": "r", "state": "stopped", "effective_state": "stopped", "alive": True,
                                 "pid": 7})
    assert waiting_for(exiting) == "stopped; waiting for pid 7 to exit"


def test_the_dashboards_row_shows_a_run_directorys_text_escaped():
    """The dashboard's row (its error and waits-for text) drew a chat template's OSC title
    sequence raw, retitling the operator's terminal (issue 55)."""
    from dflash_ops.runs.info import RunInfo
    from dflash_ops.tui.remote import run_row_from_info

    evil = "template \x1b]0;pwned\x07\x9b2J\rend"
    info = RunInfo.from_json({"run_id": "r", "effective_state": "failed", "state": "failed", "alive": False,
                              "has_status": True, "error": {"message": evil}, "release": "abc\x1b[5m"})
    row = run_row_from_info("t", info)
    assert row.error == "template \\x1b]0;pwned\\x07\\x9b2J\\x0dend" and row.release == "abc\\x1b[5m"


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), 1e308, -1e308])
def test_run_status_and_metrics_show_odd_numbers_short(value):
    """The other readers of the numbers the dashboard now clamps (issue 55): `run status`'s row and
    `metrics`' lines printed 1e308 as 313 characters; nan and inf are said as such."""
    from dflash_ops.runs.report import metric_line, status_row

    info = RunInfo.from_json({"run_id": "r", "effective_state": "running", "state": "running", "alive": True,
                              "step": 3, "loss": value, "tau": value, "tokens_per_s": value})
    row = status_row(info)
    assert all(len(cell) <= 24 for cell in row), row
    line = metric_line({"event": "step", "step": 3, "loss": value, "acc": value, "lr": value, "grad_norm": value,
                        "tokens_per_s": value})
    assert len(line) < 120 and ("nan" in line or "inf" in line or "e+308" in line), line
