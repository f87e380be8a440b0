"""Following a file that is truncated, replaced, removed, or has no newlines at all."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from dflash_ops import runs
from dflash_ops.runs.follow import FileTruncated, FollowCallbacks
from dflash_ops.transport.base import LineSplitter
from tests.unit.runs_double import HELPERS, LocalHelperContainer, eventually

RUNS_HELPER = str(HELPERS / "runs.py")


@pytest.fixture
def container(tmp_path):
    (tmp_path / "base" / "runs" / "r1").mkdir(parents=True)
    return LocalHelperContainer(tmp_path / "base")


def _log(container) -> Path:
    return container.base / "runs" / "r1" / "train.log"


def _follow_in_thread(container, got, truncations):
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(runs.follow_file(
        container, "r1", "train.log", FollowCallbacks(on_line=got.append, on_truncated=lambda reached, size:
                                                      truncations.append((reached, size))),
        follow=True, poll=0.01)), daemon=True)
    thread.start()
    return thread, result


def _finish(container, thread):
    (container.base / "runs" / "r1" / "status.json").write_text('{"state": "stopped", "pid": 1}')
    thread.join(60)
    assert not thread.is_alive()


@pytest.mark.parametrize("how", ["truncate", "truncate-and-regrow", "replace"])
def test_a_truncated_or_replaced_log_is_reported_and_followed_from_its_new_start(container, how):
    log = _log(container)
    log.write_bytes(b"old 1\nold 2\nold 3\n")
    got: list[bytes] = []
    truncations: list[tuple[int, int]] = []
    thread, _ = _follow_in_thread(container, got, truncations)
    eventually(lambda: len(got) == 3, "the old lines")
    if how == "truncate":
        log.write_bytes(b"")
        eventually(lambda: truncations, "the truncation to be noticed")
        with open(log, "ab") as f:
            f.write(b"new 1\n")
    elif how == "truncate-and-regrow":  # longer than before by the next poll: a size check alone misses it
        log.write_bytes(b"NEW 1 is a longer line\nnew 2\n")
    else:
        tmp = log.with_name("train.log.new")
        tmp.write_bytes(b"new 1\n")
        tmp.rename(log)
    eventually(lambda: got[-1:] in ([b"new 1\n"], [b"new 2\n"]), "the new content")
    _finish(container, thread)
    assert got[:3] == [b"old 1\n", b"old 2\n", b"old 3\n"]
    assert truncations and truncations[0][0] == 18
    if how == "truncate-and-regrow":
        assert got[3:] == [b"NEW 1 is a longer line\n", b"new 2\n"]  # nothing of the new file skipped
    else:
        assert got[3:] == [b"new 1\n"]


def test_a_resumed_follow_past_the_end_of_a_shorter_file_is_reported(container):
    _log(container).write_bytes(b"short\n")
    with pytest.raises(FileTruncated, match="truncated or replaced at byte 100 .now 6 bytes"):
        runs.follow_file(container, "r1", "train.log", lambda line: None, offset=100, follow=True, poll=0.01)


def test_helper_reports_truncation_on_stderr_with_its_exit_status(tmp_path):
    log = tmp_path / "train.log"
    log.write_bytes(b"abc\n")
    done = subprocess.run([sys.executable, RUNS_HELPER, "follow", str(log), "--offset", "50", "--follow",
                           "--until-final", str(tmp_path)], capture_output=True, timeout=60)
    assert done.returncode == 7 and done.stdout == b"#offset 50\n" and done.stderr == b"truncated 50 4\n"


def test_a_run_directory_removed_mid_follow_ends_the_follow(container):
    import shutil

    _log(container).write_bytes(b"one\n")
    got: list[bytes] = []
    thread, result = _follow_in_thread(container, got, [])
    eventually(lambda: got == [b"one\n"], "the first line")
    shutil.rmtree(container.base / "runs" / "r1")
    thread.join(60)
    assert not thread.is_alive() and result == [4]


def test_output_without_newlines_arrives_whole(container):
    data = b"x" * (5 << 20) + b"\ntail without newline"
    _log(container).write_bytes(data)
    got: list[bytes] = []
    runs.follow_file(container, "r1", "train.log", got.append)
    assert got == [b"x" * (5 << 20) + b"\n", b"tail without newline"]


def test_line_splitter_joins_a_line_from_many_chunks_once():
    lines: list[bytes] = []
    splitter = LineSplitter(lines.append)
    for _ in range(1000):
        splitter.feed(b"ab")
    splitter.feed(b"c\nd\ne")
    assert lines == [b"ab" * 1000 + b"c\n", b"d\n"]
    assert splitter.finish() == b"ab" * 1000 + b"c\nd\ne"
    assert lines[-1] == b"e"
