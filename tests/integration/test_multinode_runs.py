"""One run across two Proxmox nodes of the netns tier (own namespace, address and sshd each):
`dflash-ops run start n0-200 n1-200`, the REAL trainer, one torchrun rank per node, gloo.

The one scenario covers the promises of docs/multi-node.md: the two hosts train exactly what
one host does with the same global batch, step for step; kill -9 of one rank stops the other
with both statuses saying why; `run resume` (named on either member) continues both from the
last checkpoint to the same losses; logs --rank, status and pull act on the group.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash_ops import connect
from dflash_ops.cli import app
from dflash_ops.connect import open_container
from dflash_ops.deploy.push import deploy_target
from dflash_ops.inventory import load_inventory
from dflash_ops.testing.netns import Fleet, netns_unavailable_reason, start_fleet
from tests.conftest import unavailable
from tests.trainer.tiny_config import two_host_config

pytestmark = [pytest.mark.netns, pytest.mark.sshd, pytest.mark.slow, pytest.mark.lxc_tier]

TARGETS = ("n0-200", "n1-200")
STEPS = 300
CONFIG = two_host_config(STEPS)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Fleet:
    unavailable(netns_unavailable_reason(), "the netns tier")
    fleet = start_fleet(tmp_path_factory.mktemp("pair"), nodes=2, ctids=(200,), connect_timeout=3, keepalive=1)
    yield fleet
    connect.close_all()
    fleet.close()


def cli(fleet: Fleet, *args: str, code: int | None = 0):
    result = CliRunner().invoke(app, [*args, "--inventory", str(fleet.inventory)])
    if code is not None:
        assert result.exit_code == code, (args, result.stdout, result.stderr, result.exception)
    return result


def run_dir(fleet: Fleet, target: str, run_id: str) -> Path:
    return fleet.target_node(target).base_dir(200) / "runs" / run_id


def on_disk(path: Path) -> dict:
    try:
        return json.loads((path / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def losses(path: Path, last_life_only: bool = False) -> dict[int, float]:
    events = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    if last_life_only:
        events = events[max(i for i, e in enumerate(events) if e["event"] == "start"):]
    return {e["step"]: e["loss"] for e in events if e["event"] == "step"}


def wait_for(predicate, what: str, seconds: float = 120.0):
    """Poll until predicate() is truthy (a bound for a hung test, not a timing assertion)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    pytest.fail(f"not within {seconds:.0f}s: {what}")


def test_two_node_run_matches_one_host_survives_kill_minus_9_and_resumes(pair, tmp_path):
    from trainer.entry import train
    from trainer.run.config import parse_config

    config = tmp_path / "two-hosts.yaml"
    config.write_text(CONFIG)
    assert train(parse_config(CONFIG), tmp_path / "one-host") == 0
    one = losses(tmp_path / "one-host")

    inv = load_inventory(pair.inventory)
    for t in TARGETS:
        deploy_target(open_container(inv, t), venv=None)
    run_id = cli(pair, "run", "start", *TARGETS, "--config", str(config)).stdout.strip()
    dirs = {t: run_dir(pair, t, run_id) for t in TARGETS}
    for t in TARGETS:
        group = json.loads((dirs[t] / "group.json").read_text())
        assert group["targets"] == list(TARGETS) and group["endpoint"].startswith(pair.nodes[0].address + ":")

    def both_past_a_checkpoint():
        states = {t: on_disk(d) for t, d in dirs.items()}
        assert not any(s.get("state") == "failed" for s in states.values()), states
        if all(s.get("step", 0) >= 12 and "rank" in s.get("distributed", {}) for s in states.values()):
            return states
        return None

    states = wait_for(both_past_a_checkpoint, "both ranks past step 12")
    by_rank = {s["distributed"]["rank"]: t for t, s in states.items()}
    writer, victim = by_rank[0], by_rank[1]
    assert {states[t]["distributed"]["node"] for t in TARGETS} and states[writer]["distributed"]["writer"]
    # signalled from inside each container: status.json's pid is the container's (in an LXC container
    # another PID namespace than this machine's)
    def signal_in(target: str, name: str) -> None:
        done = CliRunner().invoke(app, ["exec", "--inventory", str(pair.inventory), target, "--",
                                        "kill", f"-{name}", str(states[target]["pid"])])
        assert done.exit_code == 0, (done.stdout, done.stderr)

    signal_in(writer, "STOP")  # hold the group at this step: the run cannot finish first
    signal_in(victim, "KILL")
    signal_in(writer, "CONT")
    wait_for(lambda: all(on_disk(d).get("state") == "failed" for d in dirs.values()), "both ranks failed")

    shown = json.loads(cli(pair, "run", "status", writer, run_id, "--json").stdout)
    assert set(shown) == set(TARGETS)
    assert shown[victim]["error"]["message"] == f"the trainer process (pid {states[victim]['pid']}) killed by signal 9 (SIGKILL)"
    assert shown[writer]["error"]["message"].startswith("PeerLost: ")
    table = cli(pair, "run", "status", victim, run_id).stdout
    assert f"{writer} (rank 0)" in table and f"{victim} (rank 1)" in table and "group: 2 hosts" in table

    first = {**losses(dirs[writer]), **losses(dirs[victim])}
    assert len(first) >= 12
    for step, loss in first.items():
        assert loss == pytest.approx(one[step], rel=1e-6, abs=1e-7), step
    saved = max(int(p.name[5:]) for p in (dirs[writer] / "checkpoints").glob("step_*"))

    cli(pair, "run", "resume", victim, run_id)  # named on the member without checkpoints
    wait_for(lambda: all(on_disk(d).get("state") == "done" for d in dirs.values()), "both ranks done")
    for t in TARGETS:
        assert on_disk(dirs[t])["step"] == STEPS
        resumed = losses(dirs[t], last_life_only=True)
        assert sorted(resumed) == list(range(saved + 1, STEPS + 1)), t
        for step, loss in resumed.items():
            assert loss == pytest.approx(one[step], rel=1e-6, abs=1e-7), (t, step)

    rank1 = next(t for t in TARGETS if on_disk(dirs[t])["distributed"]["rank"] == 1)  # ranks follow the rendezvous
    log = cli(pair, "logs", TARGETS[0], run_id, "--rank", "1").stdout_bytes
    assert log == (dirs[rank1] / "train.log").read_bytes()
    pulled = cli(pair, "pull", victim, run_id, str(tmp_path / "pulled"))
    assert (tmp_path / "pulled" / f"step_{STEPS}" / "manifest.json").is_file() and "sha256 verified" in pulled.stdout
