"""A loss that goes NaN or inf ends the run `failed`, saying so, before it is trained on further or
checkpointed (it used to train on NaN to the end, write NaN checkpoints and end `done` with rc 0)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.trainer.tiny_config import tiny_config
from trainer.entry import train
from trainer.run.config import parse_config

# An lr of 1e30 makes the first update overflow the drafter's weights: the loss of step 2 is NaN.
DIVERGES = "optim: {lr: 1.0e+30, total_steps: 6, micro_batches: 1}\nrun: {checkpoint_every: 2, log_every: %d}\n" \
           "pipeline: {kind: %s}"


def _events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("kind", ["reference", "threaded"])
def test_a_nan_loss_fails_the_run_with_the_reason(tmp_path, kind):
    run = tmp_path / "run"
    assert train(parse_config(tiny_config(DIVERGES % (1, kind))), run) == 1
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "failed"
    message = status["error"]["message"]
    assert "the loss is nan at step 2" in message and "optim.lr" in message and "\n" not in message
    events = _events(run)
    assert [e["step"] for e in events if e["event"] == "step"] == [1]  # no NaN record, no step trained after it
    assert not [e for e in events if e["event"] == "stop"]
    assert not (run / "checkpoints" / "step_6").exists()  # no final checkpoint of NaN weights
    assert not [e for e in events if e["event"] == "checkpoint"]
    assert "FAILED" in (run / "train.log").read_text()


def test_a_checkpoint_of_nan_weights_is_not_written_even_between_logged_steps(tmp_path):
    """log_every 6: the NaN of step 2 is in no record yet when the step-2 checkpoint is taken."""
    run = tmp_path / "run"
    assert train(parse_config(tiny_config(DIVERGES % (6, "reference"))), run) == 1
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "failed"
    assert "holds NaN/inf at step 2: checkpoint not written" in status["error"]["message"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == []
    assert not [e for e in _events(run) if e["event"] in ("checkpoint", "stop")]
