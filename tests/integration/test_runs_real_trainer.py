"""End to end with the REAL trainer on a shortened tiny CPU config (slow): the train playbook, a restart after
SIGKILL, a stop during the target fit. The README's user path (deploy, run start, checkpoint, stop, resume,
follow, pull, patch, rollback) is tests/integration/test_readme_tour.py, which runs the README's own lines."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from dflash_ops.cli import app
from tests.conftest import write_sim_inventory
from tests.trainer.test_phases import stopped_during_the_fit

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.lxc_tier]


def short_config(tmp_path: Path, total_steps: int) -> Path:
    config = yaml.safe_load((REPO / "trainer" / "configs" / "tiny-cpu.yaml").read_text())
    config["model"]["target"]["tiny"]["fit_steps"] = 20
    config["optim"]["total_steps"] = total_steps
    config["run"]["checkpoint_every"] = 1000
    config["eval"].update(samples=4, max_new_tokens=16)
    path = tmp_path / f"tiny-{total_steps}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def cli(inventory: Path, *args: str, code: int = 0):
    result = CliRunner().invoke(app, [*args, "--inventory", str(inventory)])
    assert result.exit_code == code, (result.stdout, result.stderr, result.exception)
    return result


def test_train_playbook_reports_final_loss_and_tau(tmp_path):
    inventory = write_sim_inventory(tmp_path / "simnode")
    config = short_config(tmp_path, 20)
    result = cli(inventory, "play", str(REPO / "playbooks" / "train.yaml"), "host200", "--var", f"config={config}")
    report = re.search(r"done at step 20, final loss (\d+\.\d+), acceptance length tau (\d+\.\d+)", result.stdout)
    assert report, result.stdout
    assert float(report.group(2)) >= 1.0
    assert "train: 4/4 steps OK" in result.stdout


def test_sigkill_mid_run_with_restart_ends_with_the_losses_of_an_uninterrupted_run(tmp_path):
    """`run start --restart on-failure`: the real trainer SIGKILLed mid-run is resumed from its last
    checkpoint by the node-side supervisor and finishes with the same per-step losses as a run
    that was never interrupted (the same config trained by train() in this process: the same code
    on the same CPU, one trainer process and its ~5 CPU-seconds of imports fewer than a second run on
    the node). The run evaluates at eval.temperatures [0, 1.0]: `run status` shows τ at both, sampled
    and expected, beside lookup's, and the eval event carries both.

    The kill must land while the trainer still trains: it is sent once step 4 is in metrics.jsonl
    (read here, not through `run status`, whose helper process costs a poll ~0.5 s) and the run has 20
    steps more to go (~3 s even on an idle CPU; 10 steps in all let one CI run finish before the kill)."""
    from trainer.entry import train
    from trainer.run.config import load_config

    inventory = write_sim_inventory(tmp_path / "simnode")
    base = tmp_path / "simnode" / "ct200" / "opt" / "dflash"
    cli(inventory, "deploy", "host200")
    total = 24
    doc = yaml.safe_load(short_config(tmp_path, total).read_text())
    doc["run"].update(checkpoint_every=3, log_every=1)
    doc["eval"].update(samples=2, max_new_tokens=8, temperatures=[0, 1.0])
    path = tmp_path / "every4.yaml"
    path.write_text(yaml.safe_dump(doc))

    def losses(run_dir: Path) -> dict[int, float]:
        found = {}
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            event = json.loads(line)
            if event["event"] == "step":
                found[event["step"]] = event["loss"]  # a replayed step overwrites the killed attempt's
        return found

    def last_step(run_dir: Path) -> int:
        """The last step in metrics.jsonl while it is written: no file yet, or a line half-written, is 0 steps."""
        try:
            return max(losses(run_dir), default=0)
        except (FileNotFoundError, json.JSONDecodeError):
            return 0

    def status(run_id: str) -> dict:
        return json.loads(cli(inventory, "run", "status", "host200", run_id, "--json").stdout)

    assert train(load_config(path), tmp_path / "straight") == 0
    run_id = cli(inventory, "run", "start", "host200", "--config", str(path), "--name", "killed",
                 "--restart", "on-failure:1").stdout.strip()
    run_dir = base / "runs" / run_id
    while not (run_dir / "checkpoints" / "step_3").is_dir() or last_step(run_dir) < 4:
        time.sleep(0.05)
    # killed from inside the container: launch.json's pid is the container's (an LXC container's is not this machine's)
    trainer = json.loads((run_dir / "launch.json").read_text())["pid"]
    killed = CliRunner().invoke(app, ["exec", "--inventory", str(inventory), "host200", "--", "kill", "-KILL", str(trainer)])
    assert killed.exit_code == 0, killed.stderr
    cli(inventory, "logs", "host200", run_id, "-f")  # follows across the restart to the end
    deadline = time.monotonic() + 300
    while (done := status(run_id))["effective_state"] not in ("done", "failed"):
        assert time.monotonic() < deadline, done
        time.sleep(0.5)
    assert done["effective_state"] == "done" and done["step"] == total, done
    assert [r["reason"] for r in done["restarts"]] == ["killed by SIGKILL"]
    assert losses(run_dir) == losses(tmp_path / "straight")
    assert sorted(losses(run_dir)) == list(range(1, total + 1))

    both = done["tau_by_temperature"]
    assert list(both) == ["0", "1"] and both["0"]["tau"] == both["0"]["tau_expected"] == done["tau"]
    assert all(t["tau"] >= 1 and t["tau_expected"] >= 1 and t["tau_lookup"] >= 1 for t in both.values()), both
    shown = cli(inventory, "run", "status", "host200", run_id).stdout
    assert "tau by temperature: T=0 " in shown and "; T=1 " in shown and "expected" in shown, shown
    (event,) = [e for e in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
                if e["event"] == "eval"]
    assert event["temperatures"]["1"]["temperature"] == 1.0 and event["temperatures"]["0"]["sampling"] == "T=0"


def test_run_stop_now_during_the_target_fit_stops_the_run_in_that_phase(tmp_path):
    """Issue #53: the demo's first seconds name their phase, and `run stop --now` during the target fit
    stops the run (it printed nothing for 10 minutes, then timed out). The 30 s are the command's own
    --timeout: the stop either lands in them or the command fails. The trainer's side of that SIGTERM
    (what its run directory then says) is asserted here too: tests/trainer/test_phases.py stops a fit
    with the control file only (one trainer process fewer)."""
    inventory = write_sim_inventory(tmp_path / "simnode")
    cli(inventory, "deploy", "host200")
    config = yaml.safe_load(short_config(tmp_path, 300).read_text())
    config["model"]["target"]["tiny"]["fit_steps"] = 1000000
    path = tmp_path / "fit-forever.yaml"
    path.write_text(yaml.safe_dump(config))
    run_id = cli(inventory, "run", "start", "host200", "--config", str(path)).stdout.strip()
    while True:
        doc = json.loads(cli(inventory, "run", "status", "host200", run_id, "--json").stdout)
        assert doc["effective_state"] not in ("failed", "done", "stopped"), doc
        if (doc.get("phase") or {}).get("name") == "fitting the target":
            break
        time.sleep(0.5)
    shown = cli(inventory, "run", "status", "host200", run_id).stdout
    assert "phase: fitting the target " in shown
    stopped = cli(inventory, "run", "stop", "host200", run_id, "--now", "--timeout", "30")
    assert f"{run_id}: stopped at step 0 (while fitting the target " in stopped.stdout
    doc = json.loads(cli(inventory, "run", "status", "host200", run_id, "--json").stdout)
    assert doc["effective_state"] == "stopped" and doc["phase"]["name"] == "fitting the target"
    stopped_during_the_fit(tmp_path / "simnode" / "ct200" / "opt" / "dflash" / "runs" / run_id, "signal")
