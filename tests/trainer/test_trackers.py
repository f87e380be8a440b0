"""Trackers beside metrics.jsonl (issue #53 item 2): TensorBoard event files in the run directory with
the same scalars; a tracker named but not installed refused before the run; one failing never stops it."""

import json
import struct
from pathlib import Path

import pytest

from tests.trainer.tiny_config import tiny_config
from trainer.__main__ import main
from trainer.entry import train
from trainer.run.config import parse_config
from trainer.train.trackers import scalars


def event_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the TFRecord event files under logdir (length, crc, Event proto, crc)."""
    from tensorboardX.proto import event_pb2

    found: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        at = 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at:at + 8])
            event = event_pb2.Event.FromString(data[at + 12:at + 12 + length])
            at += 12 + length + 4
            for v in event.summary.value:
                found.setdefault(v.tag, []).append((event.step, v.simple_value))
    return found


def test_tensorboard_gets_the_scalars_of_metrics_jsonl(tmp_path):
    run = tmp_path / "run"
    assert train(parse_config(tiny_config("optim: {total_steps: 4}\nrun: {log_every: 2, trackers: [tensorboard]}")),
                 run) == 0
    logged = event_scalars(run / "tensorboard")
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for record in (e for e in steps if e["event"] == "step"):
        for name, value in scalars(record).items():  # event files hold float32
            assert dict(logged[name])[record["step"]] == pytest.approx(value, rel=1e-6, abs=1e-6), name
    assert [s for s, _ in logged["loss"]] == [2, 4]
    assert "eval/acc" in logged


def test_mlflow_gets_the_same_scalars_in_a_file_store_of_the_run_directory(tmp_path):
    from mlflow.tracking import MlflowClient

    run = tmp_path / "run"
    assert train(parse_config(tiny_config("optim: {total_steps: 3}\nrun: {trackers: [mlflow, tensorboard]}")),
                 run) == 0
    client = MlflowClient(tracking_uri=(run / "mlruns").as_uri())
    [found] = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert found.info.run_name == "run"
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [(e["step"], e["loss"]) for e in steps if e["event"] == "step"]
    history = [(m.step, m.value) for m in client.get_metric_history(found.info.run_id, "loss")]
    assert sorted(history) == [(s, pytest.approx(v)) for s, v in losses] and len(losses) == 3
    assert "eval/tau" in found.data.metrics and "tracker_error" not in (run / "metrics.jsonl").read_text()


def test_mlflow_names_keep_the_bucket_signs_readable_and_replace_what_mlflow_refuses():
    from trainer.train.trackers import mlflow_name

    assert mlflow_name("eval/tau_by_length/<=2K/tau") == "eval/tau_by_length/le2K/tau"
    assert mlflow_name("eval/tau_by_length/>32K/tau") == "eval/tau_by_length/gt32K/tau"
    assert mlflow_name("eval/tau_by_form/a<b>=c/tau") == "eval/tau_by_form/altbgec/tau"
    # a data file's own form of prompt may hold anything: what MLflow refuses becomes _
    assert mlflow_name("eval/tau_by_form/q&a (50%)/tau") == "eval/tau_by_form/q_a _50__/tau"


def test_a_tracker_not_installed_is_refused_before_the_run(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text(tiny_config("run: {trackers: [tensorboard, wandb]}"))  # wandb: not in the dev extras
    assert main(["--config", str(config), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err == (f"config error: {config}: run.trackers names wandb, which is not installed here: "
                   "pip install wandb (or pip install 'dflash-ops[wandb]')\n")
    assert not (tmp_path / "run").exists()


def test_a_failing_tracker_is_an_event_and_the_run_goes_on(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "tensorboard").write_text("a file where the writer wants its directory")
    assert train(parse_config(tiny_config("optim: {total_steps: 2}\nrun: {trackers: [tensorboard]}")), run) == 0
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    failed = [e for e in events if e["event"] == "tracker_error"]
    assert len(failed) == 1 and failed[0]["tracker"] == "tensorboard" and failed[0]["stage"] == "open"
    assert json.loads((run / "status.json").read_text())["state"] == "done"
    assert "tracker tensorboard failed (open)" in (run / "train.log").read_text()
