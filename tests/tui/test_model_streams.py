import json
import threading

from dflash_ops.runs import RetryPolicy, RunInfo
from dflash_ops.tui.model import RunHistory, bar, downsample, fmt_age, fmt_tau, sparkline
from dflash_ops.tui.remote import run_row_from_info
from dflash_ops.tui.source import GpuSample
from dflash_ops.tui.streams import LineSink, follow_forever


def _step(step, **extra):
    return json.dumps({"event": "step", "time": 0.0, "step": step, **extra})


def test_history_builds_series_gpus_and_checkpoints():
    history = RunHistory()
    history.feed([
        json.dumps({"event": "warmup", "time": 0, "step": 0, "shapes": [[4, 128]], "seconds": 2.0}),
        _step(1, loss=3.0, tokens_per_s=100.0, recompiles=0,
              gpus=[{"index": 0, "role": "target", "busy": 0.9, "mem_gb": 30},
                    {"index": 5, "role": "drafter", "busy": 12, "mem_gb": 8}]),
        "not json",
        _step(2, loss=2.5, tokens_per_s=120.0, recompiles=1),
        json.dumps({"event": "checkpoint", "time": 0, "step": 2, "path": "checkpoints/step_2",
                    "seconds": 1.0, "request": "abc"}),
        json.dumps({"event": "eval", "time": 0, "step": 2, "tau": 3.2, "acc": 0.6, "samples": 8}),
    ])
    assert history.tau_lookup is None
    history.feed([json.dumps({"event": "eval", "time": 0, "step": 4, "tau": 3.3, "tau_lookup": 2.2, "tau_ratio": 1.5})])
    assert (history.tau, history.tau_lookup, history.tau_ratio) == (3.3, 2.2, 1.5)
    history.tau = 3.2
    assert list(history.loss_steps) == [1, 2] and list(history.loss) == [3.0, 2.5]
    assert list(history.tps) == [100.0, 120.0]
    assert history.gpus[0].role == "target" and list(history.gpus[0].history) == [90.0]
    assert history.gpus[5].role == "drafter" and history.gpus[5].busy == 12
    assert history.recompiles == 1 and history.tau == 3.2 and history.bad_lines == 1
    assert history.checkpoints[0].path == "checkpoints/step_2" and history.checkpoints[0].request == "abc"
    assert history.warmup == {"shapes": [[4, 128]], "seconds": 2.0}


def test_host_samples_fill_gaps_but_do_not_override_the_trainer():
    history = RunHistory()
    history.feed([_step(1, gpus=[{"index": 0, "role": "target", "busy": 0.5, "mem_gb": 30}])])
    history.apply_host_samples(
        [GpuSample(0, 99.0, 31.0, 80.0), GpuSample(1, 40.0, 2.0, 80.0), GpuSample(7, 1.0, 0.0, 80.0)],
        held=(0, 1),
    )
    assert history.gpus[0].busy == 50.0 and history.gpus[0].mem_total_gb == 80.0
    assert history.gpus[1].busy == 40.0 and history.gpus[1].role == "?"
    assert 7 not in history.gpus  # not held by this run


def test_tau_is_shown_beside_the_prompt_lookup_ratio():
    info = RunInfo.from_json({"run_id": "r", "state": "running", "effective_state": "running", "tau": 3.0,
                              "tau_lookup": 2.0, "tau_ratio": 1.5})
    row = run_row_from_info("host200", info)
    assert (row.tau, row.tau_lookup, row.tau_ratio) == (3.0, 2.0, 1.5)
    assert fmt_tau(row.tau, row.tau_ratio) == "3 1.50x" and fmt_tau(2.85, None) == "2.85"


def test_text_renderers():
    assert bar(50, 10) == "█████░░░░░" and bar(None, 3) == "···"
    assert sparkline([0, 100], 4) == "  ▁█"
    assert [fmt_age(s) for s in (None, 5, 125, 7300, 90000)] == ["-", "5s", "2m05s", "2h01m", "1d01h"]
    xs, ys = downsample(range(1000), range(1000), points=10)
    assert len(xs) <= 10 and xs[-1] == 999 and xs == ys


def test_line_sink_is_bounded_and_counts_drops():
    sink = LineSink(maxlen=3)
    sink.add(["a", "b"])
    sink.add(["c", "d", "e"])
    assert sink.drain() == (["c", "d", "e"], 2)
    assert sink.drain() == ([], 0)


def test_retry_policy_doubles_to_a_cap():
    policy = RetryPolicy(backoff=0.5, max_backoff=2.0)
    assert [policy.delay(n) for n in range(4)] == [0.5, 1.0, 2.0, 2.0]


class FlakySource:
    """Serves lines 0..total-1 from an in-memory 'file'; the first `drops` follows break after 3 lines."""

    def __init__(self, total: int, drops: int) -> None:
        self.lines = [f"line {i}" for i in range(total)]
        self.drops = drops
        self.starts: list = []

    # no on_link: a source written to the protocol before it, raising on every drop (still served)
    def follow(self, target, run_id, name, on_lines, stop, start=None, tail_lines=200):
        self.starts.append(start)
        index = 0 if start is None else start  # offsets are line numbers here
        sent = 0
        while index < len(self.lines):
            on_lines([self.lines[index]], index + 1)
            index += 1
            sent += 1
            if self.drops and sent == 3:
                self.drops -= 1
                raise ConnectionResetError("link dropped")
        stop.wait()


def test_follow_forever_reconnects_at_the_offset_and_reports_the_drop():
    source = FlakySource(total=10, drops=2)
    sink, stop, states = LineSink(100), threading.Event(), []
    thread = threading.Thread(
        target=follow_forever,
        args=(source, "t", "r", "train.log", sink, stop, states.append, 50, RetryPolicy(backoff=0.01, max_backoff=0.02)),
    )
    thread.start()
    for _ in range(2000):  # a hang guard, not a time bound
        if sink.received >= 10:
            break
        stop.wait(0.01)
    stop.set()
    thread.join()
    assert sink.drain()[0] == source.lines
    assert source.starts == [None, 3, 6]
    assert [s.connected for s in states] == [True, False, True, False, True]
    assert "ConnectionResetError: link dropped" in states[1].describe()


def test_a_queued_run_shows_its_place_in_line_and_what_it_waits_for():
    info = RunInfo.from_json({"run_id": "q", "state": "queued", "effective_state": "queued", "position": 2,
                              "gpus": [0], "waits_for": ["a (pid 7) holds GPU 0", "b is queued before it for GPU 0"],
                              "reason": "waits for a (pid 7) holds GPU 0"})
    row = run_row_from_info("host200", info)
    assert row.state == "queued #2" and row.error is None
    assert row.waits_for == "a (pid 7) holds GPU 0; b is queued before it for GPU 0"
