"""A full disk under a live run: status/metrics/log writes and periodic checkpoints fail, training goes on."""

from __future__ import annotations

import errno
import json
import os
import subprocess

import pytest

from tests.conftest import unavailable
from tests.trainer.test_run import config, events, status
from trainer.entry import train
from trainer.run import checkpoint as ckpt
from trainer.run import rundir


def test_failing_status_writes_and_checkpoint_do_not_kill_the_run(tmp_path, monkeypatch):
    real_write = rundir.write_atomic
    real_fill = ckpt.CheckpointManager._fill
    calls = {"status": 0, "fill": 0}

    def full_for_a_while(path, data):
        calls["status"] += 1
        if 3 <= calls["status"] <= 8:  # ENOSPC for a stretch of the run, then space again
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_write(path, data)

    def first_checkpoint_fails(self, tmp, *args, **kwargs):
        calls["fill"] += 1
        (tmp / "partial.bin").write_bytes(b"x" * 1000)
        if calls["fill"] == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fill(self, tmp, *args, **kwargs)

    monkeypatch.setattr(rundir, "write_atomic", full_for_a_while)
    monkeypatch.setattr(ckpt.CheckpointManager, "_fill", first_checkpoint_fails)
    run = tmp_path / "run"
    assert train(config(steps=6, every=3, fit=0), run) == 0
    final = status(run)
    assert final["state"] == "done" and final["step"] == 6
    assert final["write_failures"]["status"] == 6
    assert "No space left" in final["last_write_error"]["message"]
    assert [e["step"] for e in events(run, "step")] == [1, 2, 3, 4, 5, 6]  # no step lost
    assert [e["step"] for e in events(run, "checkpoint_failed")] == [3]
    assert [e["step"] for e in events(run, "checkpoint")] == [6]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_6"]  # the failed tmp was removed
    assert not [p for p in run.iterdir() if p.name.endswith(".tmp")]


@pytest.fixture
def tiny_disk(tmp_path):
    where = tmp_path / "disk"
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        unavailable(f"cannot mount a tmpfs: {done.stderr.decode().strip()}", "the full-disk test")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def test_run_dir_on_a_really_full_disk_keeps_going_and_reports_when_space_returns(tiny_disk):
    rd = rundir.RunDir(tiny_disk / "run", total_steps=10)
    filler = tiny_disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * 512):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    rd.update(step=1)  # neither raises
    rd.event("step", 1, loss=1.0)
    rd.log("a line that does not fit")
    assert json.loads((tiny_disk / "run" / "status.json").read_text())["step"] == 0  # the old, complete one
    filler.unlink()
    rd.update(step=2)
    doc = json.loads((tiny_disk / "run" / "status.json").read_text())
    assert doc["step"] == 2 and doc["write_failures"]["status"] >= 1 and doc["write_failures"]["metrics"] == 1
    assert not [p for p in (tiny_disk / "run").iterdir() if p.name.endswith(".tmp")]
    rd.close()
