"""Commands over several targets: `run list T...` and `hosts`, with one node that refuses connections."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import yaml
from typer.testing import CliRunner

from dflash_ops import connect
from dflash_ops.cli import app
from tests.conftest import write_sim_inventory


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once it is closed


def mixed_inventory(tmp_path: Path) -> Path:
    """host200/host201 on a simulated node with a run each; dead200 on an ssh node that refuses."""
    path = write_sim_inventory(tmp_path / "sim", ctids=(200, 201))
    doc = yaml.safe_load(path.read_text())
    key = tmp_path / "id"
    key.write_text("not a key\n")
    doc["nodes"]["dead"] = {"transport": "ssh", "address": "127.0.0.1", "port": closed_port(), "identity_file": str(key),
                            "connect_timeout": 5}
    doc["targets"]["dead200"] = {"node": "dead", "ctid": 200, "base_dir": "/opt/dflash"}
    path.write_text(yaml.safe_dump(doc))
    for ctid in (200, 201):
        run = tmp_path / "sim" / f"ct{ctid}" / "opt" / "dflash" / "runs" / f"r{ctid}"
        run.mkdir(parents=True)
        (run / "status.json").write_text(json.dumps({"version": 1, "state": "done", "step": ctid, "pid": 1}))
    return path


def test_run_list_over_targets_shows_each_and_reports_the_unreachable_one(tmp_path):
    inventory = mixed_inventory(tmp_path)
    connect.close_all()
    result = CliRunner().invoke(app, ["run", "list", "host200", "dead200", "host201", "--inventory", str(inventory)])
    connect.close_all()
    assert result.exit_code == 255, result.output
    lines = result.stdout.splitlines()
    header = lines[0].split()
    assert header[:3] == ["target", "run", "state"]
    step = header.index("step")
    assert [line.split()[:3] + [line.split()[step]] for line in lines[1:]] == [
        ["host200", "r200", "done", "200"], ["host201", "r201", "done", "201"]]
    assert result.stderr.startswith("dflash-ops: error: dead200: node 'dead': cannot connect to 127.0.0.1:")
    assert "Connection refused" in result.stderr and "Traceback" not in result.stderr


def test_run_list_json_over_targets(tmp_path):
    inventory = mixed_inventory(tmp_path)
    result = CliRunner().invoke(app, ["run", "list", "host200", "host201", "--json", "--inventory", str(inventory)])
    connect.close_all()
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert sorted(doc) == ["host200", "host201"] and [r["run_id"] for r in doc["host201"]] == ["r201"]


def test_hosts_marks_the_refusing_node_unreachable_and_lists_the_rest(tmp_path):
    inventory = mixed_inventory(tmp_path)
    result = CliRunner().invoke(app, ["hosts", "--inventory", str(inventory)])
    connect.close_all()
    assert result.exit_code == 0, result.output
    rows = {line.split()[0]: line for line in result.stdout.splitlines()[1:]}
    assert rows["host200"].split()[5] == "running" and rows["host201"].split()[5] == "running"  # then the doctor column
    assert "unreachable (node 'dead': cannot connect to 127.0.0.1:" in rows["dead200"]
