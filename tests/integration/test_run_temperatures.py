"""A tiny run with eval.temperatures [0, 1.0] on the simulated node (the REAL trainer, slow): `run status`
shows τ at both temperatures, sampled and expected, beside lookup's; the eval event carries both."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import write_sim_inventory
from tests.integration.test_runs_real_trainer import REPO, cli

pytestmark = [pytest.mark.slow]


def test_a_run_reports_tau_at_each_eval_temperature_in_run_status(tmp_path: Path):
    config = yaml.safe_load((REPO / "trainer" / "configs" / "tiny-cpu.yaml").read_text())
    config["model"]["target"]["tiny"]["fit_steps"] = 0
    config["data"]["synthetic"].update(n_train=64, n_eval=4)
    config["optim"]["total_steps"] = 2
    config["run"].update(checkpoint_every=1000, log_every=1)
    config["eval"].update(samples=2, max_new_tokens=8, temperatures=[0, 1.0])
    path = tmp_path / "tiny-temperatures.yaml"
    path.write_text(yaml.safe_dump(config))
    inventory = write_sim_inventory(tmp_path / "simnode")
    cli(inventory, "deploy", "host200")
    run_id = cli(inventory, "run", "start", "host200", "--config", str(path)).stdout.strip()
    while (status := json.loads(cli(inventory, "run", "status", "host200", run_id, "--json").stdout)) \
            ["effective_state"] not in ("done", "failed", "stopped"):
        time.sleep(0.5)
    assert status["effective_state"] == "done", status
    both = status["tau_by_temperature"]
    assert list(both) == ["0", "1"] and both["0"]["tau"] == both["0"]["tau_expected"] == status["tau"]
    assert all(t["tau"] >= 1 and t["tau_expected"] >= 1 and t["tau_lookup"] >= 1 for t in both.values())
    shown = cli(inventory, "run", "status", "host200", run_id).stdout
    assert "tau by temperature: T=0 " in shown and "; T=1 " in shown and "expected" in shown, shown
    metrics = tmp_path / "simnode" / "ct200" / "opt" / "dflash" / "runs" / run_id / "metrics.jsonl"
    (event,) = [e for e in map(json.loads, metrics.read_text().splitlines()) if e["event"] == "eval"]
    assert event["temperatures"]["1"]["temperature"] == 1.0 and event["temperatures"]["0"]["sampling"] == "T=0"
