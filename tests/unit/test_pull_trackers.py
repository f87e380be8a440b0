"""`pull` brings a run's tracker files with its checkpoint (issue #53 item 2): TensorBoard event files
(and an MLflow file store) that run.trackers wrote into the run directory."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from dflash_ops import runs
from dflash_ops.cli import app
from dflash_ops.connect import close_all, open_container
from dflash_ops.inventory import load_inventory
from tests.unit.runs_double import make_release

TARGET = "host200"


def test_pull_fetches_the_tensorboard_event_files_beside_the_checkpoint(sim_inventory, tmp_path):
    inventory = load_inventory(sim_inventory)
    base = Path(inventory.target(TARGET).base_dir)
    base.mkdir(parents=True, exist_ok=True)
    make_release(base)
    container = open_container(inventory, TARGET)
    try:
        config = tmp_path / "tiny.yaml"
        config.write_text("total_steps: 3\n")
        runs.start_run(container, config, run_id="tb")
        runs.wait_until_final(container, "tb", poll=0.05)
    finally:
        close_all()
    board = base / "runs" / "tb" / "tensorboard"  # what the trainer's tensorboard tracker leaves
    board.mkdir()
    (board / "events.out.tfevents.1.host").write_bytes(b"\x00event bytes\xff" * 100)
    dest = tmp_path / "pulled"
    result = CliRunner().invoke(app, ["pull", TARGET, "tb", str(dest), "--inventory", str(sim_inventory)])
    assert result.exit_code == 0, (result.stdout, result.stderr)
    assert (dest / "tensorboard" / "events.out.tfevents.1.host").read_bytes() == b"\x00event bytes\xff" * 100
    assert f"{dest / 'tensorboard'}: the run's tensorboard files" in result.stdout
    assert not (dest / "mlruns").exists()  # the run logged to no MLflow store: skipped
    again = CliRunner().invoke(app, ["pull", TARGET, "tb", str(dest), "--inventory", str(sim_inventory)])
    assert again.exit_code == 0, (again.stdout, again.stderr)  # an earlier pull's files are replaced
