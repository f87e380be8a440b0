"""`dflash-ops deploy` and `dflash-ops play` on the simulated node, through the CLI."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash_ops.cli import app
from dflash_ops.container import Container
from dflash_ops.inventory import load_inventory
from dflash_ops.playbook.play import load_playbook, run_playbook
from dflash_ops.simnode import containers as simct
from dflash_ops.transport.local import LocalTransport
from tests import container_checks as checks
from tests.conftest import write_sim_inventory

pytestmark = pytest.mark.lxc_tier

REPO = Path(__file__).resolve().parents[2]


def test_multi_target_one_failing_exits_nonzero_while_the_other_completes(tmp_path):
    inventory = write_sim_inventory(tmp_path, ctids=(200, 201))
    subprocess.run([*simct.stand_in_argv(tmp_path / "sim"), "stop", "201"], check=True)
    result = CliRunner().invoke(app, ["deploy", "host200", "host201", "--json", "--inventory", str(inventory)])
    assert result.exit_code == 1, result.output
    ok, failed = json.loads(result.stdout)
    assert ok["target"] == "host200" and ok["error"] is None and ok["action"] == "build"
    assert failed["target"] == "host201" and "not running" in failed["error"]
    base = tmp_path / "ct200" / "opt" / "dflash"
    assert os.readlink(base / "current") == f"releases/{ok['release']}"

    again = CliRunner().invoke(app, ["deploy", "host200", "--inventory", str(inventory)])
    assert again.exit_code == 0 and "nothing to send" in again.stdout


def test_deploy_playbook_runs_and_exposes_the_release_python(tmp_path):
    inventory = load_inventory(write_sim_inventory(tmp_path))
    container = Container(inventory.target("host200"), LocalTransport())
    said = []
    result = run_playbook(load_playbook(REPO / "playbooks" / "deploy.yaml"), container, say=said.append)
    assert result.ok, result.error
    assert result.steps_done == 3
    venv = result.results[0]["venv"]
    assert result.variables["release_python"] == f"{container.base_dir}/{venv}/bin/python"
    assert any(line.startswith("Python 3") for line in said)
    assert "requirements.txt" in said


def test_failing_step_stops_the_play_and_names_its_file_and_line(tmp_path):
    inventory = write_sim_inventory(tmp_path)
    book = tmp_path / "book.yaml"
    book.write_text("steps:\n  - echo: one\n  - name: fails\n    exec: [sh, -c, 'exit 3']\n  - echo: never\n")
    result = CliRunner().invoke(app, ["play", str(book), "host200", "--inventory", str(inventory)])
    assert result.exit_code == 1
    assert f"{book}:3: step 2 (fails) failed:" in result.stderr and "status 3" in result.stderr
    assert "host200: one" in result.stdout and "never" not in result.stdout


def test_playbook_deploy_step_uses_the_targets_inventory_settings(tmp_path):
    """`deploy: {}` in a playbook ships what `dflash-ops deploy TARGET` ships: the target's
    venv setting and extra paths from the inventory, so both give the same release."""
    import yaml

    from dflash_ops.deploy.push import deploy_target, target_options

    path = write_sim_inventory(tmp_path)
    doc = yaml.safe_load(path.read_text())
    notes = tmp_path / "NOTES.txt"
    notes.write_text("shipped beside trainer/\n")
    doc["targets"]["host200"].update({"venv": False, "extra_paths": [str(notes)]})
    path.write_text(yaml.safe_dump(doc))
    target = load_inventory(path).target("host200")
    container = Container(target, LocalTransport())
    book = tmp_path / "book.yaml"
    book.write_text("steps:\n  - deploy: {}\n")
    result = run_playbook(load_playbook(book), container, say=lambda line: None)
    assert result.ok, result.error
    assert result.results[0]["venv"] is None
    assert (Path(container.base_dir) / "current" / "NOTES.txt").read_text() == "shipped beside trainer/\n"
    assert deploy_target(container, **target_options(target)).action == "none"

    book.write_text("vars: {keep: 5}\nsteps:\n  - deploy: {keep: \"${keep}\"}\n")
    refused = run_playbook(load_playbook(book, {"keep": "-1"}), container, say=lambda line: None)
    assert refused.error == f"{book}:3: step 1 (deploy) failed: keep must be at least 1 (the current release), got -1"


def test_playbook_exec_timeout_kills_the_command_in_the_container(tmp_path):
    inventory = write_sim_inventory(tmp_path / "simnode")
    container = Container(load_inventory(inventory).target("host200"), LocalTransport())
    marker = f"300.0{os.getpid()}"  # a sleep argument no other process has
    book = tmp_path / "book.yaml"
    book.write_text(f"steps:\n  - exec: {{argv: [sleep, '{marker}'], timeout: 0.5}}\n")
    result = run_playbook(load_playbook(book), container, say=lambda line: None)
    assert result.error == f"{book}:2: step 1 (exec) failed: command timed out after 0.5s: sleep {marker}"
    assert not checks.processes_running(["sleep", marker])

