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


def _mount_tmpfs(where, size: str) -> None:
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        unavailable(f"cannot mount a tmpfs: {done.stderr.decode().strip()}", "the full-disk test")


@pytest.fixture
def small_disks(tmp_path):
    mounted = []

    def mount(where, size):
        _mount_tmpfs(where, size)
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _state(n: int = 20000):
    import torch

    return ({"w": torch.ones(n)}, {"hidden": 8}, {"optimizer": {"m": torch.ones(n)}, "scheduler": {}}, {"data": 1})


@pytest.mark.parametrize("size, library", [("32k", "SafetensorError"), ("96k", "RuntimeError")])
def test_a_full_disk_in_any_library_s_writer_is_an_oserror_and_leaves_no_partial(small_disks, tmp_path, size,
                                                                                   library):
    """The real libraries on a real full file system (no patched-in exception): safetensors (the
    80 kB weights do not fit in 32 kB) raises SafetensorError, torch.save (the optimizer file, after
    the weights fit in 96 kB) RuntimeError without an errno; both are a full disk for the run."""
    run = tmp_path / "run"
    small_disks(run / "checkpoints", size)
    manager = ckpt.CheckpointManager(run, keep=2)
    with pytest.raises(OSError) as err:
        manager.save(3, *_state())
    assert err.value.errno == errno.ENOSPC and "No space left on device" in str(err.value)
    # named as the user knows it: checkpoints/step_3, not the .tmp-step_3-PID it was built in (#55 item 8)
    assert str(run / "checkpoints" / "step_3") in str(err.value) and ".tmp-" not in str(err.value)
    assert type(err.value.__cause__).__name__ == library
    assert list((run / "checkpoints").iterdir()) == []  # the partial .tmp-step_3-PID is gone


def test_a_run_whose_checkpoints_do_not_fit_says_so_and_leaves_no_partial(small_disks, tmp_path):
    """Each checkpoint (~170 kB) needs more than the 128 kB disk: the periodic ones are reported and
    training goes on (it used to die at the first, on SafetensorError / RuntimeError); the final one
    fails the run with the reason."""
    run = tmp_path / "run"
    small_disks(run / "checkpoints", "128k")
    assert train(config(steps=6, every=2, fit=0), run) == 1
    final = status(run)
    assert final["state"] == "failed" and final["step"] == 6
    assert "No space left on device" in final["error"]["message"] and ".tmp-" not in final["error"]["message"]
    assert [e["step"] for e in events(run, "step")] == [1, 2, 3, 4, 5, 6]  # no step lost
    failed = events(run, "checkpoint_failed")
    assert all(".tmp-" not in e["message"] and f"step_{e['step']}" in e["message"] for e in failed)
    assert [e["step"] for e in failed] == [2, 4, 6] and all("No space left" in e["message"] for e in failed)
    assert list((run / "checkpoints").iterdir()) == []
    assert "training goes on, the next checkpoint tries again" in (run / "train.log").read_text()


def test_an_export_onto_a_full_disk_is_one_line_and_leaves_nothing(small_disks, tmp_path, capsys):
    """`python -m trainer export` onto a disk too small for the draft: SafetensorError was a traceback."""
    from trainer.__main__ import main

    run = tmp_path / "run"
    assert train(config(steps=1, every=0, fit=0), run) == 0
    disk = small_disks(tmp_path / "disk", "16k")
    assert main(["export", "--checkpoint", str(run / "checkpoints" / "step_1"), "--out", str(disk / "draft")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("export: [Errno 28] No space left on device") and err.count("\n") == 1
    assert f"{disk / 'draft'} (" in err and ".tmp-" not in err  # the --out given, not the build beside it
    assert list(disk.iterdir()) == []  # neither the draft nor its .draft.tmp-PID


def test_synth_and_an_atomic_write_onto_a_full_disk_name_the_users_file(small_disks, tmp_path, capsys):
    """`python -m trainer synth` onto a full disk ended in a traceback; an atomic write's error named
    its temporary copy (`.NAME.PID.tmp`) or no file at all: one line naming the file asked for, and
    no temporary copy left (#55 item 8)."""
    from trainer.__main__ import main
    from trainer.run.contract import write_atomic

    disk = small_disks(tmp_path / "disk", "16k")
    assert main(["synth", "--out", str(disk / "syn.jsonl"), "--n", "2000"]) == 1
    err = capsys.readouterr().err
    assert err == f"synth: [Errno 28] No space left on device: '{disk / 'syn.jsonl'}'\n"
    with pytest.raises(OSError) as e:
        write_atomic(disk / "status.json", b"x" * 40000)
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(disk / "status.json")
    assert list(disk.iterdir()) == []
