import json
from pathlib import Path

import pytest

from trainer.entry import train
from trainer.run.config import load_config

DEMO = Path(__file__).resolve().parents[2] / "trainer" / "configs" / "tiny-cpu.yaml"


@pytest.mark.slow
def test_tiny_cpu_demo_learns_and_drafts_accepted_blocks(tmp_path):
    assert train(load_config(DEMO), tmp_path / "demo") == 0
    lines = [json.loads(x) for x in (tmp_path / "demo" / "metrics.jsonl").read_text().splitlines()]
    losses = [e["loss"] for e in lines if e["event"] == "step"]
    assert losses[-1] < losses[0] / 3
    (evaluation,) = [e for e in lines if e["event"] == "eval"]
    assert evaluation["tau"] > 2.0
    status = json.loads((tmp_path / "demo" / "status.json").read_text())
    assert status["state"] == "done" and status["tau"] == evaluation["tau"]


def test_shipped_configs_are_valid():
    for path in DEMO.parent.glob("*.yaml"):
        load_config(path)
