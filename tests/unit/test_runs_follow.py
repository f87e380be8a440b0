"""Following by byte offset: the helper's framing and follow_file's resume after drops."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from dflash_ops import runs
from dflash_ops.errors import TransportError, Unreachable
from dflash_ops.runs import ConnectionLost, RunNotFound
from dflash_ops.runs.follow import NO_RETRY, FollowCallbacks, RetryPolicy
from dflash_ops.runs.helper import EXIT_TIME_UP
from tests.unit.runs_double import HELPERS, Drop, LocalHelperContainer, eventually, make_release

RUNS_HELPER = str(HELPERS / "runs.py")
FAST = RetryPolicy(backoff=0)  # retried at once


@pytest.fixture
def container(tmp_path):
    base = tmp_path / "base"
    (base / "runs" / "r1").mkdir(parents=True)
    return LocalHelperContainer(base)


def log_path(container) -> Path:
    return container.base / "runs" / "r1" / "train.log"


def helper_follow(*args: str) -> bytes:
    return subprocess.run([sys.executable, RUNS_HELPER, "follow", *args], capture_output=True, check=True).stdout


def numbered(n: int, start: int = 0) -> bytes:
    return b"".join(b"line %d %s\n" % (i, b"x" * (i % 7)) for i in range(start, start + n))


def test_header_and_raw_bytes_from_offset(tmp_path):
    f = tmp_path / "log"
    f.write_bytes(b"alpha\nbeta\ngamma\n")
    assert helper_follow(str(f), "--offset", "6") == b"#offset 6\nbeta\ngamma\n"
    assert helper_follow(str(f), "--offset", "0", "--tail-lines", "2") == b"#offset 6\nbeta\ngamma\n"
    assert helper_follow(str(f), "--offset", "0", "--tail-lines", "9") == b"#offset 0\nalpha\nbeta\ngamma\n"
    assert helper_follow(str(f), "--offset", "0", "--tail-lines", "0") == b"#offset 17\n"


def test_tail_counts_complete_lines_only(tmp_path):
    f = tmp_path / "log"
    f.write_bytes(b"a\nb\nc\npartial")
    # the unfinished line is not one of the last 2 lines, but it is sent last as a fragment
    assert helper_follow(str(f), "--offset", "0", "--tail-lines", "2") == b"#offset 2\nb\nc\npartial"


def test_tail_across_read_blocks(tmp_path):
    f = tmp_path / "log"
    data = numbered(30000)
    f.write_bytes(data)
    lines = data.splitlines(keepends=True)
    start = len(data) - sum(len(l) for l in lines[-12345:])
    out = helper_follow(str(f), "--offset", "0", "--tail-lines", "12345")
    assert out == b"#offset %d\n" % start + data[start:]


def test_follow_file_tail_and_returned_offset(container):
    data = numbered(50)
    log_path(container).write_bytes(data)
    got: list[bytes] = []
    end = runs.follow_file(container, "r1", "train.log", got.append, tail_lines=5)
    assert got == data.splitlines(keepends=True)[-5:]
    assert end == len(data)
    log_path(container).write_bytes(data + b"more\n")
    got.clear()
    assert runs.follow_file(container, "r1", "train.log", got.append, offset=end) == len(data) + 5
    assert got == [b"more\n"]


@pytest.mark.parametrize("mid_line", [False, True])
def test_drops_lose_and_repeat_nothing(container, mid_line):
    data = numbered(2000)
    log_path(container).write_bytes(data)
    container.drops = [Drop(0, mid_line), Drop(1, mid_line), Drop(137, mid_line), Drop(1, mid_line), Drop(901, mid_line)]
    got: list[bytes] = []
    end = runs.follow_file(container, "r1", "train.log", got.append, tail_lines=1500, retry=FAST)
    assert b"".join(got) == data[len(data) - len(b"".join(data.splitlines(keepends=True)[-1500:])):]
    assert len(got) == 1500 and end == len(data)
    assert container.drops == []
    offsets = [c[c.index("--offset") + 1] for c in container.calls]
    assert offsets[:2] == ["0", "0"]  # no header received yet: ask for the tail again
    assert len(set(offsets)) == 4


def test_no_reconnect_raises(container):
    log_path(container).write_bytes(numbered(10))
    container.drops = [Drop(3)]
    with pytest.raises(ConnectionLost):
        runs.follow_file(container, "r1", "train.log", lambda line: None, retry=NO_RETRY)


def test_unreachable_node_is_retried_with_backoff_from_the_same_offset(container):
    """The sshd listener gone (connection refused) or a partition (connect timed out) is retried
    with exponential backoff, resuming at the exact offset: `logs -f` exited at once before."""
    data = numbered(40)
    log_path(container).write_bytes(data)
    container.drops = [Drop(11)]  # the header and 10 lines
    container.refusals = [Unreachable("refused"), Unreachable("timed out"), ConnectionLost("reset"), Unreachable("x")]
    retries: list[tuple[str, float]] = []
    got: list[bytes] = []
    resumed: list[int] = []
    callbacks = FollowCallbacks(on_line=got.append, on_retry=lambda error, delay: retries.append((str(error), delay)),
                                on_resumed=resumed.append)
    end = runs.follow_file(container, "r1", "train.log", callbacks, retry=RetryPolicy(backoff=0.001, max_backoff=0.004))
    assert b"".join(got) == data and end == len(data)
    assert [e for e, _d in retries][:4] == ["refused", "timed out", "reset", "x"]
    assert [d for _e, d in retries] == [0.001, 0.002, 0.004, 0.004, 0.001]  # progress resets the backoff
    ten_lines = str(len(b"".join(data.splitlines(keepends=True)[:10])))
    assert [c[c.index("--offset") + 1] for c in container.calls] == ["0"] * 5 + [ten_lines]
    assert resumed == [0, int(ten_lines)]  # the helper answered again after each failure, from there


def test_unreachable_for_longer_than_give_up_after_raises(container):
    log_path(container).write_bytes(numbered(5))
    container.refusals = [Unreachable("down")] * 50
    with pytest.raises(Unreachable):
        runs.follow_file(container, "r1", "train.log", lambda line: None,
                         retry=RetryPolicy(backoff=0.01, give_up_after=0.05))
    assert 2 <= len(container.calls) < 50


def test_a_refused_host_key_is_not_retried(container):
    log_path(container).write_bytes(numbered(5))
    container.refusals = [TransportError("host key does not match known_hosts")]
    with pytest.raises(TransportError, match="host key"):
        runs.follow_file(container, "r1", "train.log", lambda line: None, retry=FAST)
    assert len(container.calls) == 1


def test_missing_file_without_follow_is_not_found(container):
    with pytest.raises(RunNotFound, match="no such file"):
        runs.follow_file(container, "r1", "metrics.jsonl", lambda line: None)


def test_follow_live_run_to_the_end_through_drops(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    make_release(base)
    c = LocalHelperContainer(base)
    config = tmp_path / "c.yaml"
    config.write_text("total_steps: 300\nlog_lines: 5\nstep_seconds: 0.002\n")
    run_id = runs.start_run(c, config, run_id="live")
    c.drops = [Drop(40, True), Drop(200), Drop(3, True)]
    got: list[bytes] = []
    end = runs.follow_file(c, run_id, "train.log", got.append, follow=True, poll=0.01, retry=FAST)
    final = (base / "runs" / run_id / "train.log").read_bytes()
    assert b"".join(got) == final and end == len(final)
    assert got[-1] == b"done\n"
    metrics: list[bytes] = []
    runs.follow_file(c, run_id, "metrics.jsonl", metrics.append, follow=True, poll=0.01)
    assert len(metrics) == 303  # start, 300 steps, checkpoint, stop


def test_follow_waits_for_the_file_and_stops_when_run_is_over(container):
    run_dir = container.base / "runs" / "r1"
    (run_dir / "status.json").write_text('{"state": "stopped", "pid": 1}')
    got: list[bytes] = []
    assert runs.follow_file(container, "r1", "metrics.jsonl", got.append, follow=True, poll=0.01) == 0
    assert got == []


def test_unterminated_last_line_is_handed_on_only_at_a_normal_end(container):
    log_path(container).write_bytes(b"one\ntwo\nthr")
    got: list[bytes] = []
    assert runs.follow_file(container, "r1", "train.log", got.append) == 8
    assert got == [b"one\n", b"two\n", b"thr"]


# ---------------------------------------------------------------- cancelling a follow (stop)


def test_helper_max_seconds_ends_a_live_follow_after_its_last_complete_line(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()  # no status.json: the run is not over
    log = run_dir / "train.log"
    log.write_bytes(b"a\nb\nhalf")
    done = subprocess.run(
        [sys.executable, RUNS_HELPER, "follow", str(log), "--offset", "0", "--follow", "--poll", "0.01",
         "--until-final", str(run_dir), "--max-seconds", "0.2"],
        capture_output=True,
    )
    assert done.returncode == EXIT_TIME_UP
    assert done.stdout == b"#offset 0\na\nb\n"  # the fragment waits for the next call


def test_helper_max_seconds_while_waiting_for_the_file(tmp_path):
    done = subprocess.run(
        [sys.executable, RUNS_HELPER, "follow", str(tmp_path / "train.log"), "--offset", "7", "--follow",
         "--poll", "0.01", "--until-final", str(tmp_path), "--max-seconds", "0.1"],
        capture_output=True,
    )
    assert (done.returncode, done.stdout) == (EXIT_TIME_UP, b"#offset 7\n")


def test_stop_ends_a_quiet_follow_and_reissues_keep_exact_offsets(container):
    first = numbered(30)
    log_path(container).write_bytes(first)
    got: list[bytes] = []
    starts: list[int] = []
    stop = threading.Event()
    result: list[int] = []
    follower = threading.Thread(target=lambda: result.append(runs.follow_file(
        container, "r1", "train.log", FollowCallbacks(on_line=got.append, on_start=starts.append), tail_lines=10,
        follow=True, poll=0.01, stop=stop, stop_check_s=0.1)))
    follower.start()
    try:
        eventually(lambda: len(got) == 10, "the tail")
        eventually(lambda: len(container.calls) >= 3, "the follow to be asked again")
        with open(log_path(container), "ab") as f:
            f.write(numbered(5, start=30) + b"unfinished")
        eventually(lambda: len(got) == 15, "the appended lines")
        eventually(lambda: len(container.calls) >= 6, "more re-issued follows")
    finally:
        stop.set()
        follower.join(60)
    assert not follower.is_alive()
    tail_start = len(first) - len(b"".join(first.splitlines(keepends=True)[-10:]))
    assert starts == [tail_start]
    assert b"".join(got) == first[tail_start:] + numbered(5, start=30)
    assert result == [len(first) + len(numbered(5, start=30))]
    offsets = [int(c[c.index("--offset") + 1]) for c in container.calls]
    assert offsets[0] == 0 and set(offsets[1:]) <= {len(first), result[0]}
    assert all("--max-seconds" in c and c.count("--tail-lines") == (i == 0) for i, c in enumerate(container.calls))


def test_stop_delivers_nothing_more_and_returns_the_delivered_offset(container):
    data = numbered(100)
    log_path(container).write_bytes(data)
    stop = threading.Event()
    got: list[bytes] = []

    def take(line: bytes) -> None:
        got.append(line)
        if len(got) == 7:
            stop.set()

    end = runs.follow_file(container, "r1", "train.log", take, stop=stop)
    assert got == data.splitlines(keepends=True)[:7]
    assert end == len(b"".join(got))


def test_stop_already_set_returns_the_start_offset(container):
    log_path(container).write_bytes(numbered(3))
    stop = threading.Event()
    stop.set()
    assert runs.follow_file(container, "r1", "train.log", lambda line: None, offset=6, follow=True, stop=stop) == 6
    assert container.calls == []
