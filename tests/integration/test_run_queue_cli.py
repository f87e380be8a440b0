"""`run start --queue --notify`, `run queue`, `run stop` of a queued run, through the CLI on the
simulated node, with the inventory's `notify:` and a webhook on 127.0.0.1 that answers 500 twice."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from dflash_ops import runs
from dflash_ops.cli import app
from dflash_ops.container import Container
from dflash_ops.deploy.push import deploy_target
from dflash_ops.inventory import load_inventory
from dflash_ops.transport.local import LocalTransport
from tests.conftest import sim_backend, write_sim_inventory
from tests.http_sink import HttpSink
from tests.integration.deploy_support import fake_package

pytestmark = pytest.mark.lxc_tier

LONG = "total_steps: 1000000\nstep_seconds: 0.005\n"
SHORT = "total_steps: 30\nstep_seconds: 0.02\n"


@pytest.fixture
def sink():
    s = HttpSink()
    yield s
    s.close()


def test_queue_and_notify_through_the_cli(tmp_path, sink, monkeypatch):
    if sim_backend() == "lxc":
        pytest.skip("an LXC container of the simulated node has no network toward this machine's 127.0.0.1")
    inventory = write_sim_inventory(tmp_path / "simnode")
    doc = yaml.safe_load(inventory.read_text())
    doc["targets"]["host200"].update(gpus=[0], notify={"webhooks": ["env:H39_TEST_HOOK"]})
    inventory.write_text(yaml.safe_dump(doc))
    monkeypatch.setenv("H39_TEST_HOOK", sink.url("/inventory/s3cret-token"))
    container = Container(load_inventory(inventory).target("host200"), LocalTransport())
    base = Path(container.base_dir)
    deploy_target(container, source=fake_package(tmp_path), venv=None)
    (tmp_path / "long.yaml").write_text(LONG)
    (tmp_path / "short.yaml").write_text(SHORT)
    shown: list[str] = []

    def cli(*args: str, code: int = 0):
        result = CliRunner().invoke(app, [*args, "--inventory", str(inventory)])
        assert result.exit_code == code, (result.stdout, result.stderr, result.exception)
        shown.extend([result.stdout, result.stderr])
        return result

    sink.fail_first = [500, 500]
    try:
        first = cli("run", "start", "host200", "--config", str(tmp_path / "long.yaml"), "--queue", "--name", "a")
        first_id = first.stdout.strip()
        second = cli("run", "start", "host200", "--config", str(tmp_path / "short.yaml"), "--queue", "--name", "b",
                     "--notify", sink.url("/cli/s3cret-key?token=s3cret"))
        second_id = second.stdout.strip()
        assert f"queued {second_id} on host200 at position 1" in second.stderr
        assert f"{first_id} (pid" in second.stderr and "holds GPU 0" in second.stderr
        listed = cli("run", "queue", "host200").stdout
        assert listed.startswith(f"1. {second_id} (gpus 0, release ") and "holds GPU 0" in listed
        assert "queued #1" in cli("run", "list", "host200").stdout
        status = json.loads(cli("run", "status", "host200", second_id, "--json").stdout)
        assert status["effective_state"] == "queued" and status["position"] == 1

        cli("run", "stop", "host200", first_id)
        deadline = time.monotonic() + 120
        while runs.run_status(container, second_id).effective_state not in ("done", "failed"):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert runs.run_status(container, second_id).effective_state == "done"
        want = {("/inventory", first_id): ["started", "stopped"], ("/inventory", second_id): ["queued", "started", "done"],
                ("/cli", second_id): ["queued", "started", "done"]}
        deadline = time.monotonic() + 60
        while True:
            got = {(path, run_id): [r.body["state"] for r in sink.received
                                    if r.answered == 200 and r.path.startswith(path) and r.body["run_id"] == run_id]
                   for path, run_id in want}
            if got == want or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert got == want
        assert [r.answered for r in sink.received[:3]] == [500, 500, 200]
        assert all(r.body["target"] == "host200" for r in sink.received)
        # the secrets appear nowhere the operator or the container's logs show
        logs = [p.read_text() for p in base.glob("runs/*/*") if p.is_file() and p.name != "notify.json"]
        logs += [p.read_text() for p in base.glob("runs/.queue/*.log")]
        assert not [text for text in shown + logs if "s3cret" in text]
    finally:
        for info in runs.list_runs(container):
            if info.alive:
                runs.signal_run(container, info.run_id, "KILL")
