"""The reference loop against the run-directory contract: resume, control, SIGTERM, crash-safe saves."""

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
from tests.trainer.test_phases import sigterm_once
from trainer.entry import train
from trainer.run import checkpoint as ckpt
from trainer.run.config import parse_config

CONFIG = """
model:
  target:
    tiny: {{layers: 2, hidden: 32, heads: 4, kv_heads: 2, head_dim: 8, intermediate: 64, fit_steps: {fit}}}
  drafter_layers: 1
  block_size: 4
  num_target_layers: 2
  dtype: fp32
data:
  synthetic: {{n_train: 64, n_eval: 2, min_len: 6, max_len: 20}}
  max_length: 64
  num_anchors: 8
  token_budget: 256
  bucket_edges: [32, 64]
  pad_multiple: 16
optim:
  total_steps: {steps}
  micro_batches: 2
run:
  log_every: 1
  checkpoint_every: {every}
  keep_checkpoints: {keep}
  threads: 1
eval:
  samples: 2
  max_new_tokens: 8
pipeline:
  kind: {kind}
"""


def config(steps=6, every=3, keep=5, fit=3, kind="reference"):
    return parse_config(CONFIG.format(steps=steps, every=every, keep=keep, fit=fit, kind=kind))


def events(run_dir, kind):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == kind]


def status(run_dir):
    return json.loads((Path(run_dir) / "status.json").read_text())


@pytest.mark.parametrize("kind", ["reference", "threaded"])
def test_resume_gives_the_same_next_losses_as_an_uninterrupted_run(tmp_path, kind):
    run = tmp_path / "run"
    assert train(config(kind=kind), run) == 0
    straight = {e["step"]: e["loss"] for e in events(run, "step")}
    assert status(run)["state"] == "done" and status(run)["last_checkpoint"] == "checkpoints/step_6"
    assert "tokenized 64 training and 2 held-out conversations in " in (run / "train.log").read_text()  # start-up is not silent
    assert [e["step"] for e in events(run, "checkpoint")] == [3, 6]
    assert all(e["stall_s"] >= 0 and e["request"] is None for e in events(run, "checkpoint"))
    assert events(run, "stop")[-1]["reason"] == "done"
    assert train(config(kind=kind), run, resume="3") == 0
    resumed = {e["step"]: e["loss"] for e in events(run, "step")[len(straight):]}
    assert sorted(resumed) == [4, 5, 6]
    assert all(resumed[s] == straight[s] for s in resumed)
    assert events(run, "start")[-1]["resumed_from"] == "checkpoints/step_3"
    manifest = ckpt.verify(run / "checkpoints" / "step_6")
    assert manifest["step"] == 6 and "drafter.safetensors" in manifest["files"]


def request(run, kind, rid):
    (run / "control" / f".{kind}.{rid}.tmp").write_text(json.dumps({"id": rid, "time": time.time()}))
    os.rename(run / "control" / f".{kind}.{rid}.tmp", run / "control" / kind)


def test_control_checkpoint_and_stop_are_honoured(tmp_path):
    """A checkpoint asked for before the start is served at the first step boundary; a stop asked for
    while training, at the next one (a stop before training stops at once: tests/trainer/test_phases.py)."""
    run = tmp_path / "run"
    (run / "control").mkdir(parents=True)
    request(run, "checkpoint", "c-1")

    def stop_once_training() -> None:
        while not ((run / "status.json").exists() and status(run)["step"] >= 1):
            time.sleep(0.01)
        request(run, "stop", "s-1")

    threading.Thread(target=stop_once_training, daemon=True).start()
    assert train(config(steps=100000, every=0, fit=0), run) == 0
    assert status(run)["state"] == "stopped"
    assert [e["request"] for e in events(run, "checkpoint")] == ["c-1", "s-1"]
    assert events(run, "stop")[-1]["reason"] == "control"
    assert not (run / "control" / "stop").exists() and not (run / "control" / "checkpoint").exists()
    assert train(config(steps=status(run)["step"] + 2, every=0, fit=0), run, resume="latest") == 0  # the stop was consumed
    assert status(run)["state"] == "done"


def test_keeps_only_the_last_k_checkpoints(tmp_path):
    run = tmp_path / "run"
    assert train(config(steps=4, every=1, keep=2, fit=0), run) == 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_3", "step_4"]


def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    manager = ckpt.CheckpointManager(tmp_path, keep=3)

    def optim():
        return {"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}

    manager.save(1, model.state_dict(), {"x": 1}, optim(), {"data": {}})
    before = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    real_write = ckpt._write_torch

    def dies_after_config(path, obj):
        if path.name == ckpt.OPTIM_FILE:
            raise KeyboardInterrupt("killed while saving")
        real_write(path, obj)

    monkeypatch.setattr(ckpt, "_write_torch", dies_after_config)
    with pytest.raises(KeyboardInterrupt):
        manager.save(2, model.state_dict(), {"x": 1}, optim(), {"data": {}})
    leftovers = [p.name for p in (tmp_path / "checkpoints").iterdir()]
    assert any(n.startswith(".tmp-step_2-") for n in leftovers) and "step_2" not in leftovers
    latest = manager.resolve("latest")
    assert latest.name == "step_1"
    assert torch.equal(ckpt.load(latest)["model"]["weight"], before)


def test_sigterm_checkpoints_and_stops(tmp_path):
    """`run stop`'s SIGTERM at step 2 or later of a run of 100,000 steps, served by train() in the test's
    process (test_phases.sigterm_once)."""
    run = tmp_path / "run"
    with sigterm_once(run, lambda now: now.get("step", 0) >= 2):
        assert train(parse_config(CONFIG.format(steps=100000, every=0, keep=2, fit=0, kind="reference")), run) == 0
    st = status(run)
    assert st["state"] == "stopped" and st["last_checkpoint"] == f"checkpoints/step_{st['step']}"
    assert events(run, "stop")[-1]["reason"] == "signal"
    assert "step 1/100000" in (run / "train.log").read_text()


KILLED_MID_SAVE = """
import os, signal, sys, torch
from trainer.run import checkpoint as ckpt

def killed(path, obj):  # SIGKILL while the optimizer file is written: the weights are already in the tmp dir
    os.kill(os.getpid(), signal.SIGKILL)

ckpt._write_torch = killed
ckpt.CheckpointManager(sys.argv[1], keep=3).save(3, {"w": torch.ones(1000)}, {}, {"optimizer": {}}, {})
"""


def test_a_start_removes_the_temp_dirs_of_killed_checkpoint_writes_and_nothing_else(tmp_path):
    run = tmp_path / "run"
    root = Path(trainer.__file__).resolve().parents[1]
    killed = subprocess.run([sys.executable, "-c", KILLED_MID_SAVE, str(run)], cwd=root)
    assert killed.returncode == -signal.SIGKILL
    checkpoints = run / "checkpoints"
    [leftover] = [p for p in checkpoints.iterdir()]
    assert leftover.name.startswith(".tmp-step_3-") and leftover.name.rsplit("-", 1)[1].isdigit()
    assert (leftover / ckpt.MODEL_FILE).stat().st_size > 4000
    (checkpoints / f".trash-step_1-{leftover.name.rsplit('-', 1)[1]}").mkdir()  # a discard killed midway
    (checkpoints / f".tmp-step_2-{os.getpid()}").mkdir()  # this process's pid: no save of this process began
    live = subprocess.Popen(["sleep", "60"])
    try:
        time.sleep(0.05)
        (checkpoints / f".tmp-step_4-{live.pid}").mkdir()  # a live writer's (written after it started)
        kept = [f".tmp-step_4-{live.pid}", ".tmp-notes", ".tmp-step_x-1", "mine.txt"]
        (checkpoints / ".tmp-notes").mkdir()
        (checkpoints / ".tmp-step_x-1").mkdir()
        (checkpoints / "mine.txt").write_text("the user's")
        assert train(config(steps=2, every=0, fit=0), run) == 0
        assert sorted(p.name for p in checkpoints.iterdir()) == sorted([*kept, "step_2"])
    finally:
        live.kill()
        live.wait()
    log = (run / "train.log").read_text()
    assert f"removed checkpoints/{leftover.name}: a checkpoint write its process did not finish" in log
