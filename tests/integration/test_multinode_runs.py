"""One run across two Proxmox nodes of the netns tier (own namespace, address and sshd each):
`dflash-ops run start n0-200 n1-200 --restart on-failure:1`, the REAL trainer, one torchrun rank
per node, gloo.

The one scenario covers the promises of docs/multi-node.md: the two hosts train exactly what
one host does with the same global batch, step for step; kill -9 of one rank stops the other,
and the supervisors restart both ranks from the same checkpoint step (the group's newest) to the
losses of an uninterrupted run, the restart shown in `run status` for every member and told
once (by the first member's notify command); a second kill -9, with no restart left, leaves
both failed with their statuses saying why; `run resume` (named on either member) continues both
from the last checkpoint to the same losses; logs --rank, status and pull act on the group.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml
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
# The run's length: the group must still be training when the test has seen it pass step 12 and, restarted,
# 8 steps past its restart step, and its kill (through `dflash-ops exec`) has landed. In LXC containers the
# ranks train ~37 steps/s and a kill lands ~1-3 s after the test saw the step: the first landed at steps
# 39-52, the ranks restarted from step 50, and with 150 steps the run had ended before the second kill.
# 300 leaves ~240 steps (~6 s) after a restart at 50.
STEPS = 300
# every checkpoint kept: the test reads the one the ranks resumed from after the resumed run has written
# more (with the default 3 kept, a fast machine rotated it away before the assertion)
CONFIG = two_host_config(STEPS, "run: {keep_checkpoints: 100}")


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Fleet:
    unavailable(netns_unavailable_reason(), "the netns tier")
    fleet = start_fleet(tmp_path_factory.mktemp("pair"), nodes=2, ctids=(200,), connect_timeout=3, keepalive=1)
    doc = yaml.safe_load(fleet.inventory.read_text())
    for t in TARGETS:  # a command in the container writes each event it is told (notify.py)
        told = fleet.target_node(t).base_dir(200) / "told.jsonl"
        doc["targets"][t]["notify"] = {"commands": [["/bin/sh", "-c", f"cat >> {told}; echo >> {told}"]]}
    fleet.inventory.write_text(yaml.safe_dump(doc, sort_keys=False))
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


def events(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def losses(path: Path, last_life_only: bool = False) -> dict[int, float]:
    found = events(path)
    if last_life_only:
        found = found[max(i for i, e in enumerate(found) if e["event"] == "start"):]
    return {e["step"]: e["loss"] for e in found if e["event"] == "step"}


def restarts(path: Path) -> dict:
    try:
        return json.loads((path / "restarts.json").read_text())
    except (OSError, ValueError):
        return {}


def told(fleet: Fleet, target: str) -> list[str]:
    path = fleet.target_node(target).base_dir(200) / "told.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line)["state"] for line in lines if line.strip()]


def wait_for(predicate, what: str, seconds: float = 120.0):
    """Poll until predicate() is truthy (a bound for a hung test, not a timing assertion)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    pytest.fail(f"not within {seconds:.0f}s: {what}")


def test_two_node_run_matches_one_host_restarts_itself_after_kill_minus_9_and_resumes(pair, tmp_path):
    from trainer.entry import train
    from trainer.run.config import parse_config

    config = tmp_path / "two-hosts.yaml"
    config.write_text(CONFIG)
    assert train(parse_config(CONFIG), tmp_path / "one-host") == 0
    one = losses(tmp_path / "one-host")

    inv = load_inventory(pair.inventory)
    for t in TARGETS:
        deploy_target(open_container(inv, t), venv=None)
    run_id = cli(pair, "run", "start", *TARGETS, "--config", str(config), "--restart", "on-failure:1").stdout.strip()
    dirs = {t: run_dir(pair, t, run_id) for t in TARGETS}
    for t in TARGETS:
        group = json.loads((dirs[t] / "group.json").read_text())
        assert group["targets"] == list(TARGETS) and group["endpoint"].startswith(pair.nodes[0].address + ":")

    def both_past(step: int, after: float = 0.0):
        def check():
            states = {t: on_disk(d) for t, d in dirs.items()}
            assert not any(s.get("state") == "failed" and not restarts(dirs[t]).get("restarts")
                           for t, s in states.items()), states
            if all(s.get("state") == "running" and s.get("step", 0) >= step and s.get("started", 0) > after
                   and s.get("distributed", {}).get("joined") for s in states.values()):
                return states
            return None
        return check

    def kill_a_rank(states: dict) -> tuple[str, str]:
        """kill -9 of the other rank's trainer, the writer's held meanwhile (SIGSTOP): the run cannot
        finish first. Signalled inside each container: status.json's pid is the container's (in an
        LXC container another PID namespace than this machine's)."""
        writers = [t for t, s in states.items() if s["distributed"].get("writer")]
        assert len(writers) == 1, states
        writer, victim = writers[0], next(t for t in TARGETS if t != writers[0])

        def signal_in(target: str, name: str) -> None:
            done = CliRunner().invoke(app, ["exec", "--inventory", str(pair.inventory), target, "--",
                                            "kill", f"-{name}", str(states[target]["pid"])])
            assert done.exit_code == 0, (done.stdout, done.stderr)

        signal_in(writer, "STOP")
        signal_in(victim, "KILL")
        signal_in(writer, "CONT")
        return writer, victim

    # 1. kill -9 of a rank: both members' supervisors restart their ranks, from the same step
    states = wait_for(both_past(12), "both ranks past step 12")
    writer, victim = kill_a_rank(states)
    killed_at = time.time()
    wait_for(lambda: all(restarts(d).get("restarts") and restarts(d)["restarts"][-1].get("from")
                         for d in dirs.values()), "both members restarted their ranks", 180)
    entries = {t: restarts(d)["restarts"] for t, d in dirs.items()}
    assert all(len(e) == 1 and e[0]["n"] == 1 for e in entries.values()), entries
    assert entries[victim][0]["reason"] == (f"exit 1: the trainer process (pid {states[victim]['pid']}) "
                                            "killed by signal 9 (SIGKILL)")
    assert entries[writer][0]["reason"].startswith("lost peer (exit 1): PeerLost: ")
    resumed = {t: e[0]["from"] for t, e in entries.items()}
    assert resumed[writer] == resumed[victim], resumed  # one step for every rank
    restart_step = int(resumed[writer].rsplit("_", 1)[1])
    assert restart_step >= 5 and (dirs[writer] / "checkpoints" / f"step_{restart_step}").is_dir()
    table = cli(pair, "run", "status", victim, run_id).stdout
    for t in TARGETS:
        assert f"{t}: restart: on-failure:1, 1 so far" in table, table
        assert f"{t}: restart 1 at " in table and f"from checkpoints/step_{restart_step}" in table, table
    for t in TARGETS:
        life = [e for e in events(dirs[t]) if e["event"] == "start"][-1]
        assert life["step"] == restart_step and life["resumed_from"] == f"checkpoints/step_{restart_step}", t

    # 2. again, with no restart left: both fail, each saying why
    states = wait_for(both_past(restart_step + 8, after=killed_at), "both restarted ranks 8 steps on", 180)
    writer, victim = kill_a_rank(states)
    wait_for(lambda: all(restarts(d).get("gave_up") and on_disk(d).get("state") == "failed" for d in dirs.values()),
             "both members gave up")
    shown = json.loads(cli(pair, "run", "status", writer, run_id, "--json").stdout)
    assert set(shown) == set(TARGETS)
    assert shown[victim]["error"]["message"] == f"the trainer process (pid {states[victim]['pid']}) killed by signal 9 (SIGKILL)"
    assert shown[writer]["error"]["message"].startswith("PeerLost: ")
    table = cli(pair, "run", "status", victim, run_id).stdout
    for t in TARGETS:
        assert f"{t} (rank {states[t]['distributed']['rank']})" in table
    assert "group: 2 hosts" in table

    # every life of both ranks trained what one host trains, step for step
    trained = [e for t in TARGETS for e in events(dirs[t]) if e["event"] == "step"]
    assert {e["step"] for e in trained} >= set(range(1, restart_step + 9))
    for e in trained:
        assert e["loss"] == pytest.approx(one[e["step"]], rel=1e-6, abs=1e-7), e["step"]
    held = {t: [int(p.name[5:]) for p in (dirs[t] / "checkpoints").glob("step_*")] for t in TARGETS}
    assert not held[victim], held  # the restarted group checkpoints on the host it resumed from, as before
    saved = max(held[writer])
    assert saved >= restart_step

    # 3. run resume, named on a member
    cli(pair, "run", "resume", victim, run_id)
    wait_for(lambda: all(on_disk(d).get("state") == "done" for d in dirs.values()), "both ranks done")
    for t in TARGETS:
        assert on_disk(dirs[t])["step"] == STEPS
        last = losses(dirs[t], last_life_only=True)
        assert sorted(last) == list(range(saved + 1, STEPS + 1)), t
        for step, loss in last.items():
            assert loss == pytest.approx(one[step], rel=1e-6, abs=1e-7), (t, step)
    # the group's events, told by its first member only: one `restart` for the group restart
    # (a resume keeps who hears of the run: the resumed life's start and its end are told too)
    wait_for(lambda: len(told(pair, TARGETS[0])) >= 5, "the first member's events delivered", 60)
    assert told(pair, TARGETS[0]) == ["started", "restart", "failed", "started", "done"]
    assert told(pair, TARGETS[1]) == []

    rank1 = next(t for t in TARGETS if on_disk(dirs[t])["distributed"]["rank"] == 1)  # ranks follow the rendezvous
    log = cli(pair, "logs", TARGETS[0], run_id, "--rank", "1").stdout_bytes
    assert log == (dirs[rank1] / "train.log").read_bytes()
    pulled = cli(pair, "pull", victim, run_id, str(tmp_path / "pulled"))
    assert (tmp_path / "pulled" / f"step_{STEPS}" / "manifest.json").is_file() and "sha256 verified" in pulled.stdout
