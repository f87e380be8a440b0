"""Runs for Prometheus (issue #53 item 3): `metrics --format prometheus` and `dflash-ops exporter`,
scraped over HTTP and parsed with prometheus_client's own parser; a dead node never blocks a scrape."""

from __future__ import annotations

import threading
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from dflash_ops import runs
from dflash_ops.cli import app
from dflash_ops.connect import close_all, open_container
from dflash_ops.exporter import Collector, serve
from dflash_ops.inventory import load_inventory
from dflash_ops.runs.prometheus import exposition, label_value
from tests.unit.runs_double import eventually, make_release

TARGET = "host200"


@pytest.fixture
def live(sim_inventory, tmp_path):
    """host200 with a fake-trainer run `tiny` going (killed at the end)."""
    inventory = load_inventory(sim_inventory)
    base = Path(inventory.target(TARGET).base_dir)
    base.mkdir(parents=True, exist_ok=True)
    make_release(base)
    container = open_container(inventory, TARGET)
    config = tmp_path / "tiny.yaml"
    config.write_text("total_steps: 1000000\nstep_seconds: 0.02\n")
    runs.start_run(container, config, run_id="tiny")
    eventually(lambda: (runs.run_status(container, "tiny").step or 0) >= 2, "the run's steps")
    yield sim_inventory, inventory, container
    for info in runs.list_runs(container):
        if info.alive:
            runs.signal_run(container, info.run_id, "KILL")
    close_all()


def samples(text: str) -> dict[str, list]:
    """{metric name: [(labels, value)]} as prometheus_client parses the text."""
    found: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            found.setdefault(s.name, []).append((s.labels, s.value))
    return found


def test_the_exporter_serves_every_target_and_a_dead_one_does_not_block_it(live):
    _path, inventory, _container = live
    never = threading.Event()

    def dead_node():  # a node whose connection never completes (a partition: packets vanish)
        never.wait()

    collector = Collector({TARGET: lambda: open_container(inventory, TARGET), "dead": dead_node}, timeout=3.0,
                          gpus=False)
    stop, port = threading.Event(), []
    server = threading.Thread(target=serve, args=(collector, "127.0.0.1", 0, port.append, stop), daemon=True)
    server.start()
    eventually(lambda: bool(port), "the exporter listening")
    try:
        for _ in range(3):  # a dead node's thread is reused, not piled up, scrape after scrape
            with urllib.request.urlopen(f"http://127.0.0.1:{port[0]}/metrics", timeout=60) as response:
                assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
                got = samples(response.read().decode())
        up = {labels["target"]: value for labels, value in got["dflash_target_up"]}
        assert up == {TARGET: 1.0, "dead": 0.0}
        assert [labels["error"] for labels, _ in got["dflash_target_error_info"]][0].startswith("no answer within 3s")
        info = [labels for labels, _ in got["dflash_run_info"]]
        assert info[0]["target"] == TARGET and info[0]["run"] == "tiny" and info[0]["state"] == "running"
        step = dict(((labels["run"], value) for labels, value in got["dflash_run_step"]))
        assert step["tiny"] >= 2
        assert got["dflash_queue_length"] == [({"target": TARGET}, 0.0)]
        assert sum(1 for t in threading.enumerate() if t.name == "exporter-dead") == 1
    finally:
        never.set()
        stop.set()
        server.join(10)


def test_metrics_format_prometheus_prints_the_targets_runs(live):
    path, _inventory, _container = live
    result = CliRunner().invoke(app, ["metrics", TARGET, "--format", "prometheus", "--inventory", str(path)])
    assert result.exit_code == 0, (result.stdout, result.stderr)
    got = samples(result.stdout)
    assert got["dflash_target_up"] == [({"target": TARGET}, 1.0)]
    assert [labels["run"] for labels, _ in got["dflash_run_alive"]] == ["tiny"]
    refused = CliRunner().invoke(app, ["metrics", TARGET, "tiny", "--format", "prometheus", "--inventory", str(path)])
    assert refused.exit_code == 2 and "no RUN, -f or -n" in refused.stderr


def test_text_from_a_run_directory_is_escaped_in_labels():
    from dflash_ops.runs.info import RunInfo
    from dflash_ops.runs.prometheus import TargetScrape

    info = RunInfo.from_json({"run_id": "r1", "effective_state": "running", "alive": True, "release": 'a"b\\c\nd\x1b',
                              "phase": {"name": "fitting the target", "done": 3, "total": 4},
                              "tokens_done": 10, "tokens_total": 30, "tokens_per_s_recent": 2.0})
    text = exposition([TargetScrape("t", runs=[info])])
    got = samples(text)
    labels = got["dflash_run_info"][0][0]
    assert labels["release"] == 'a"b\\c\nd\ufffd' and labels["phase"] == "fitting the target 3/4"
    assert got["dflash_run_eta_seconds"] == [({"target": "t", "run": "r1"}, 10.0)]
    assert got["dflash_run_phase_progress_ratio"] == [({"target": "t", "run": "r1"}, 0.75)]
    assert label_value("x\x00") == "x\ufffd"
