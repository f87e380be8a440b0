import json
import os
import shutil
import threading

import pytest

from dflash_ops.helpers import gpu_sample
from dflash_ops.runs import RunNotFound
from dflash_ops.tui.remote import LocalDirSource
from dflash_ops.tui.source import gpu_samples_from_json


def _follow_once(source, run, start, tail, stop_after):
    got, ends = [], []
    stop = threading.Event()

    def on_lines(lines, end):
        got.extend(lines)
        ends.append(end)
        if len(got) >= stop_after:
            stop.set()

    source.follow("t", run, "train.log", on_lines, stop, start=start, tail_lines=tail)
    return got, ends[-1]


def test_follow_resumes_at_the_offset_without_losing_or_repeating(tmp_path):
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    (run / "train.log").write_text("one\ntwo\nthr")
    source = LocalDirSource({"t": tmp_path}, gpus=False, poll_s=0.01)
    first, end = _follow_once(source, "r", None, 10, 2)
    assert first == ["one", "two"]
    with open(run / "train.log", "a") as handle:
        handle.write("ee\nfour\n")
    second, _ = _follow_once(source, "r", end, 10, 2)
    assert second == ["three", "four"]


def test_request_creates_the_control_file_atomically(tmp_path):
    (tmp_path / "runs" / "r").mkdir(parents=True)
    source = LocalDirSource({"t": tmp_path}, gpus=False)
    request_id = source.request("t", "r", "checkpoint")
    control = tmp_path / "runs" / "r" / "control"
    assert json.loads((control / "checkpoint").read_text())["id"] == request_id
    assert os.listdir(control) == ["checkpoint"]
    with pytest.raises(ValueError):
        source.request("t", "r", "reboot")
    with pytest.raises(RunNotFound):
        source.request("t", "missing", "stop")


def test_list_runs_reads_status_release_and_flags_dead_processes(tmp_path, static_run):
    source = LocalDirSource({"t": tmp_path}, gpus=False)
    (tmp_path / "runs" / "no-status-yet").mkdir()
    rows = {row.run_id: row for row in source.list_runs("t")}
    assert rows["tiny-run"].state == "running"
    assert rows["tiny-run"].step == 30 and rows["tiny-run"].release == "dev"
    # what `dflash-ops run list` says of it too (the same reader: the runs helper)
    assert (rows["no-status-yet"].state, rows["no-status-yet"].error) == ("failed", "no status.json and no live process")
    assert rows["tiny-run"].tau is None  # no evaluation yet
    status = json.loads((static_run.dir / "status.json").read_text())
    (static_run.dir / "status.json").write_text(json.dumps({**status, "tau": 3.25}))
    assert {row.run_id: row for row in source.list_runs("t")}["tiny-run"].tau == 3.25
    status["pid_start"] = status["pid_start"] + 1  # a reused pid: not our trainer
    (static_run.dir / "status.json").write_text(json.dumps(status))
    dead = {row.run_id: row for row in source.list_runs("t")}["tiny-run"]
    assert dead.state == "failed" and "died" in dead.error


def test_gpu_sample_parses_smi_and_reports_no_gpu():
    rows = gpu_sample.parse_smi_csv("0, 87, 40960, 81920\n1, [N/A], 1024, 81920\n")
    assert rows[0] == {"index": 0, "busy": 87.0, "mem_gb": 40.0, "mem_total_gb": 80.0}
    assert rows[1]["busy"] is None
    samples = gpu_samples_from_json({"gpus": rows})
    assert [s.index for s in samples] == [0, 1]
    if shutil.which("nvidia-smi") is not None:
        pytest.skip("this machine has a GPU")
    none = gpu_sample.sample()
    assert none["gpus"] is None and "nvidia-smi" in none["reason"]
    assert gpu_samples_from_json(none) is None
