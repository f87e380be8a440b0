"""RemoteSource over real Containers: the simulated node and a real sshd, a fake-trainer run.

The run is started with `dflash_ops.runs.start_run` from a release holding the fake trainer;
every test kills the runs it started (no trainer outlives its test).
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
from rich.cells import cell_len
from textual.widgets import DataTable

from dflash_ops import runs
from dflash_ops.connect import close_all, open_container
from dflash_ops.inventory import load_inventory
from dflash_ops.tui.app import DashApp
from dflash_ops.tui.detail import RunDetailScreen
from dflash_ops.tui.remote import RemoteSource
from tests.unit.runs_double import eventually, make_release

TARGET = "host200"
SLOW_RUN = "total_steps: 1000000\nstep_seconds: 0.02\n"


class Remote:
    """A RemoteSource on one inventory target, with a fake-trainer run `tiny` going."""

    def __init__(self, inventory: Path, tmp_path: Path, sshd=None) -> None:
        self.inventory = load_inventory(inventory)
        self.sshd = sshd
        self.base = Path(self.inventory.target(TARGET).base_dir)
        shutil.rmtree(self.base, ignore_errors=True)  # the sshd node outlives one test
        self.base.mkdir(parents=True)
        make_release(self.base)
        self.container = open_container(self.inventory, TARGET)
        config = tmp_path / "tiny.yaml"
        config.write_text(SLOW_RUN)
        self.run_id = runs.start_run(self.container, config, run_id="tiny")
        self.source = RemoteSource({TARGET: lambda: open_container(self.inventory, TARGET)})

    def log(self) -> bytes:
        return (self.base / "runs" / self.run_id / "train.log").read_bytes()

    def close(self) -> None:
        for info in runs.list_runs(self.container):
            if info.alive:
                runs.signal_run(self.container, info.run_id, "KILL")
        close_all()


@pytest.fixture(params=["sim", pytest.param("sshd", marks=pytest.mark.sshd)])
def remote(request, tmp_path):
    if request.param == "sim":
        remote = Remote(request.getfixturevalue("sim_inventory"), tmp_path)
    else:
        node = request.getfixturevalue("sshd_node")
        remote = Remote(node.inventory, tmp_path, sshd=node)
    yield remote
    remote.close()



class Follower:
    """source.follow in a thread, collecting (line, end_offset) pairs."""

    def __init__(self, source, run_id: str, start: int | None = None, tail_lines: int = 3) -> None:
        self.got: list[tuple[str, int]] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None

        def on_lines(lines: list[str], end: int) -> None:
            ends = end - sum(len(line) + 1 for line in lines[1:])
            for line in lines:
                self.got.append((line, ends))
                ends += len(line) + 1

        def work() -> None:
            try:
                source.follow(TARGET, run_id, "train.log", on_lines, self.stop, start=start, tail_lines=tail_lines)
            except BaseException as exc:  # noqa: BLE001 - reported by finish()
                self.error = exc

        self.thread = threading.Thread(target=work, daemon=True)
        self.thread.start()

    def finish(self) -> list[tuple[str, int]]:
        self.stop.set()
        self.thread.join(120)
        assert not self.thread.is_alive(), "follow did not return after stop"
        assert self.error is None, self.error
        return self.got


def start_of(pair: tuple[str, int]) -> int:
    line, end = pair
    return end - len(line.encode()) - 1


def assert_exact(pairs: list[tuple[str, int]], log: bytes) -> None:
    """Every line sits in the file right before its end offset, and the lines are contiguous."""
    for before, after in zip(pairs, pairs[1:]):
        assert start_of(after) == before[1]
    for line, end in pairs:
        assert log[end - len(line.encode()) - 1:end] == line.encode() + b"\n"


def test_rows_follow_request_and_gpus_through_a_real_container(remote):
    source = remote.source
    eventually(lambda: source.list_runs(TARGET)[0].step >= 5, "the run to step")
    [row] = source.list_runs(TARGET)
    assert (row.target, row.run_id, row.state, row.release) == (TARGET, "tiny", "running", "abc123")
    assert row.heartbeat is not None and row.error is None

    follower = Follower(source, remote.run_id, tail_lines=3)
    eventually(lambda: len(follower.got) >= 10, "live log lines")
    first = follower.finish()
    assert_exact(first, remote.log())
    assert start_of(first[0]) > 0  # a tail of 3, not the whole file

    resumed = Follower(source, remote.run_id, start=first[-1][1])
    eventually(lambda: len(resumed.got) >= 3, "lines after the resume offset")
    second = resumed.finish()
    assert start_of(second[0]) == first[-1][1]  # neither lost nor repeated
    assert_exact(second, remote.log())

    request_id = source.request(TARGET, remote.run_id, "checkpoint")
    path = runs.wait_for_checkpoint(remote.container, remote.run_id, request_id, timeout=120, poll=0.1)
    assert (remote.base / "runs" / remote.run_id / path).is_dir()
    assert source.gpu_samples(TARGET) is None  # no GPU on the simulated node

    (remote.base / "runs" / "idle").mkdir()  # a run whose log never comes: a quiet follow
    quiet = Follower(source, "idle")
    eventually(lambda: runs.list_runs(remote.container) and True, "one more round trip")
    assert quiet.finish() == []


class RecordingLinks(dict):
    """The detail screen's stream states, with every state it was ever given."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.history: list = []

    def __setitem__(self, key, value) -> None:
        self.history.append((key, value))
        super().__setitem__(key, value)


@pytest.mark.anyio
async def test_dashboard_shows_the_remote_run_live(remote, wait_for):
    app = DashApp(remote.source, poll_s=0.1)
    async with app.run_test(size=(140, 45)) as pilot:
        key = f"{TARGET}/tiny"
        await wait_for(pilot, lambda: key in app.rows and app.rows[key].state == "running", "the run in the table")
        assert app.links[TARGET].connected
        await pilot.press("enter")
        detail = app.screen
        assert isinstance(detail, RunDetailScreen)
        await wait_for(pilot, lambda: detail.lines_shown >= 5, "log lines in the detail")
        await wait_for(pilot, lambda: len(detail.history.loss) >= 5, "loss points")
        step = app.rows[key].step
        await wait_for(pilot, lambda: app.rows[key].step > step, "the step to move in the table")
        await pilot.press("escape")
        await pilot.pause(0.2)
        table = app.query_one("#runs", DataTable)
        for column in table.columns.values():  # cells that grew since the row was added fit whole
            assert column.content_width >= cell_len(str(table.get_cell(key, column.key)))


@pytest.mark.anyio
@pytest.mark.sshd
async def test_dropped_ssh_connection_shows_disconnected_and_recovers(tmp_path, sshd_node, wait_for):
    remote = Remote(sshd_node.inventory, tmp_path, sshd=sshd_node)
    try:
        app = DashApp(remote.source, poll_s=0.1)
        async with app.run_test(size=(140, 45)) as pilot:
            await wait_for(pilot, lambda: f"{TARGET}/tiny" in app.rows, "the run in the table")
            await pilot.press("enter")
            detail = app.screen
            detail.links = RecordingLinks(detail.links)
            await wait_for(pilot, lambda: len(detail.lines) >= 5, "log lines")
            assert sshd_node.kill_sessions() >= 1
            history = detail.links.history
            await wait_for(pilot, lambda: any(name == "train.log" and not link.connected for name, link in history),
                           "the log stream marked disconnected")
            drop = next(i for i, (name, link) in enumerate(history) if name == "train.log" and not link.connected)
            assert "disconnected: ConnectionLost" in history[drop][1].describe()
            await wait_for(pilot, lambda: any(name == "train.log" and link.connected for name, link in history[drop:]),
                           "the log stream back")
            seen = len(detail.lines)
            await wait_for(pilot, lambda: len(detail.lines) > seen + 5, "log lines flowing again")
            lines = [line for line in detail.lines if line.startswith("step ")]
            steps = [int(line.split()[1]) for line in lines]
            assert steps == list(range(steps[0], steps[0] + len(steps)))  # nothing lost, nothing repeated
    finally:
        remote.close()
