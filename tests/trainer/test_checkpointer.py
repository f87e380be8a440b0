"""Asynchronous checkpoints (trainer.train.checkpointer): written in the background while training
goes on, one write at a time, crash-safe, and `run checkpoint --wait`'s event only once on disk."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import trainer
from tests.trainer.test_run import config, events, status
from trainer.entry import train
from trainer.run import checkpoint as ckpt
from trainer.train.checkpointer import Checkpointer


def tiny_state():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()  # the optimizer holds moments now
    return model, opt, sched


def snapshot(cp, step, model, opt, sched):
    return cp.snapshot(step, model.state_dict(), {"x": 1}, {"optimizer": opt.state_dict(),
                                                            "scheduler": sched.state_dict()},
                       {"data": {}}, optimizers=(opt,))


def poll_until(condition, what, deadline_s=120.0):
    """Wait for another thread or process to reach a point (the deadline only ends a hung test)."""
    end = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < end, f"never happened: {what}"
        time.sleep(0.01)


KILLED_WRITER = """
import sys, time
from pathlib import Path
import torch
from trainer.run import checkpoint as ckpt
from trainer.train.checkpointer import Checkpointer

run = Path(sys.argv[1])
torch.manual_seed(0)
model = torch.nn.Linear(3, 2)
opt = torch.optim.AdamW(model.parameters())
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
model(torch.ones(1, 3)).sum().backward()
opt.step()
cp = Checkpointer(ckpt.CheckpointManager(run, keep=3), lambda *a: None, lambda *a: None)

def snap(step):
    cp.snapshot(step, model.state_dict(), {"x": 1}, {"optimizer": opt.state_dict(), "scheduler": sched.state_dict()},
                {"data": {}}, optimizers=(opt,))

snap(1)
cp.wait()
torch.save(model.state_dict(), run / "weights_at_step_1.pt")
real = ckpt._write_torch

def hangs(path, obj):
    real(path, obj)
    if path.name == ckpt.OPTIM_FILE:  # half of step_2 is on disk: the parent kills us here
        (run / "midway").write_text("")
        time.sleep(600)

ckpt._write_torch = hangs
with torch.no_grad():
    model.weight.add_(1.0)
snap(2)  # returns at once: the writer thread writes it
(run / "training-goes-on").write_text("")
time.sleep(600)
"""


def test_a_write_killed_midway_leaves_the_previous_checkpoint_loadable(tmp_path):
    script = tmp_path / "writer.py"
    script.write_text(KILLED_WRITER)
    env = {**os.environ, "PYTHONPATH": str(Path(trainer.__file__).resolve().parent.parent)}
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        poll_until(lambda: (tmp_path / "midway").exists() or proc.poll() is not None, "the write to reach midway")
        assert proc.poll() is None, proc.stdout.read().decode()
        assert (tmp_path / "training-goes-on").exists()  # snapshot() returned while step_2 was being written
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    names = [p.name for p in (tmp_path / "checkpoints").iterdir()]
    assert "step_2" not in names and any(n.startswith(".tmp-step_2-") for n in names)
    manager = ckpt.CheckpointManager(tmp_path, keep=3)
    latest = manager.resolve("latest")
    assert latest.name == "step_1"
    state = ckpt.load(latest)  # verifies every file against the manifest
    assert torch.equal(state["model"]["weight"], torch.load(tmp_path / "weights_at_step_1.pt", weights_only=True)["weight"])
    assert state["optim"]["optimizer"]["state"][0]["exp_avg"].shape == (2, 3)


def test_one_write_in_flight_a_second_snapshot_waits_and_the_first_keeps_its_state(tmp_path, monkeypatch):
    model, opt, sched = tiny_state()
    written = []
    cp = Checkpointer(ckpt.CheckpointManager(tmp_path, keep=3), lambda job, path, s: written.append(job.step),
                      lambda job, exc: None)
    gate, held = threading.Event(), threading.Event()
    real = ckpt._write_torch

    def held_write(path, obj):
        if path.name == ckpt.OPTIM_FILE and not gate.is_set():
            held.set()
            gate.wait()
        real(path, obj)

    monkeypatch.setattr(ckpt, "_write_torch", held_write)
    with torch.no_grad():
        model.weight.fill_(1.0)
    first = snapshot(cp, 1, model, opt, sched)
    held.wait()
    with torch.no_grad():
        model.weight.fill_(2.0)
    second = threading.Thread(target=snapshot, args=(cp, 2, model, opt, sched))
    second.start()
    poll_until(lambda: cp.waiting == 1, "the second snapshot to wait for the first write")
    assert torch.equal(first.model["weight"], torch.ones(2, 3))  # its staging was not overwritten
    assert written == []
    gate.set()
    second.join()
    cp.wait()
    cp.close()
    assert written == [1, 2]
    manager = ckpt.CheckpointManager(tmp_path, keep=3)
    assert torch.equal(ckpt.load(manager.path(1))["model"]["weight"], torch.ones(2, 3))
    assert torch.equal(ckpt.load(manager.path(2))["model"]["weight"], torch.full((2, 3), 2.0))


@pytest.mark.parametrize("kind", ["reference", "threaded"])
def test_checkpoint_wait_sees_its_event_only_once_written_and_training_goes_on_meanwhile(tmp_path, monkeypatch,
                                                                                          kind):
    """`run checkpoint --wait` returns on the `checkpoint` event carrying its request id: that event
    (and the request's removal) must come after the checkpoint is complete, while the steps after
    the snapshot are trained during the write."""
    run = tmp_path / "run"
    (run / "control").mkdir(parents=True)
    (run / "control" / "checkpoint").write_text(json.dumps({"id": "c-1", "time": 0}))
    seen = {}
    real = ckpt._write_torch

    def slow_write(path, obj):
        if path.name == ckpt.OPTIM_FILE and not seen:
            first = events(run, "checkpoint") == [] and (run / "control" / "checkpoint").exists()
            poll_until(lambda: any(e["step"] >= 4 for e in events(run, "step")), "training to go on during the write")
            seen["before_write"] = first and (run / "control" / "checkpoint").exists() and not events(run, "checkpoint")
            seen["complete"] = ckpt.CheckpointManager(run, keep=5).steps()
        real(path, obj)

    monkeypatch.setattr(ckpt, "_write_torch", slow_write)
    assert train(config(steps=6, every=0, fit=0, kind=kind), run) == 0
    assert seen["before_write"] and seen["complete"] == []  # no event, request pending, nothing complete
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    served = [i for i, e in enumerate(lines) if e["event"] == "checkpoint" and e["request"] == "c-1"]
    assert len(served) == 1
    event = lines[served[0]]
    snapped = event["step"]
    later_steps = [e["step"] for e in lines[:served[0]] if e["event"] == "step" and e["step"] > snapped]
    assert later_steps and max(later_steps) >= 4  # trained while it was written
    assert ckpt.verify(run / event["path"])["step"] == snapped
    assert event["stall_s"] >= 0 and event["seconds"] > 0
    assert not (run / "control" / "checkpoint").exists()
    assert status(run)["state"] == "done"


def test_a_failed_requested_checkpoint_fails_the_run(tmp_path, monkeypatch):
    """Only a periodic checkpoint may fail and be retried later (tests/trainer/test_full_disk.py);
    one that was asked for fails the run, with the reason in status.json."""
    run = tmp_path / "run"
    (run / "control").mkdir(parents=True)
    (run / "control" / "checkpoint").write_text(json.dumps({"id": "c-9", "time": 0}))

    def broken(path, obj):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(ckpt, "_write_torch", broken)
    assert train(config(steps=4, every=0, fit=0, kind="threaded"), run) == 1
    assert status(run)["state"] == "failed" and "Input/output error" in status(run)["error"]["message"]
    assert [e["request"] for e in events(run, "checkpoint_failed")] == ["c-9"]


@pytest.mark.parametrize("fused", [False, True])
def test_buffers_reserved_before_the_first_step_are_the_ones_its_snapshots_use(tmp_path, fused):
    """The warm-up reserves the staging before AdamW has any state (optimizer_state_like guesses
    it); a snapshot after real steps must find every buffer there, allocating nothing."""
    from trainer.train.checkpointer import optimizer_state_like

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), fused=fused)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    cp = Checkpointer(ckpt.CheckpointManager(tmp_path, keep=3), lambda *a: None, lambda *a: None)
    cp.reserve({"model": model.state_dict(), "optim": {"optimizer": optimizer_state_like(opt),
                                                       "scheduler": sched.state_dict()}})
    cp.wait()
    reserved = {key: buf.data_ptr() for key, buf in cp._staging.items()}
    assert any("exp_avg_sq" in key for key in reserved)
    for _ in range(2):
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
    job = snapshot(cp, 2, model, opt, sched)
    cp.wait()
    assert {key: buf.data_ptr() for key, buf in cp._staging.items()} == reserved
    assert torch.equal(job.optim["optimizer"]["state"][0]["exp_avg"], opt.state[model.weight]["exp_avg"])
    cp.close()


def test_a_reader_lists_a_run_s_complete_checkpoints_oldest_first_and_creates_nothing(tmp_path):
    run = tmp_path / "run"
    assert ckpt.complete_checkpoints(run) == [] and not run.exists()
    manager = ckpt.CheckpointManager(run, keep=5)
    for step in (10, 2):
        manager.save(step, {"w": torch.full((2,), float(step))}, {"x": 1}, {}, {})
    (run / "checkpoints" / ".tmp-step_20-1").mkdir()  # a write in progress
    (run / "checkpoints" / "step_30").mkdir()  # never completed: no manifest
    found = ckpt.complete_checkpoints(run)
    assert found == [run / "checkpoints" / "step_2", run / "checkpoints" / "step_10"]
    assert [ckpt.step_of(p) for p in found] == [2, 10]
    assert ckpt.load_weights(found[-1])["model"]["w"].tolist() == [10.0, 10.0]
    with pytest.raises(ckpt.CheckpointError, match="not a checkpoint directory"):
        ckpt.step_of(run / "checkpoints" / ".tmp-step_20-1")
