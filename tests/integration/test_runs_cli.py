"""The run lifecycle and guarded patches through the CLI, on the simulated node and a real sshd.

The release is a small `trainer` package: the fake trainer as __main__ (steps in milliseconds)
plus the sample module the field's patches were written against.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import dflash_ops.cli.runs as cli_runs
from dflash_ops import runs
from dflash_ops.cli import app
from dflash_ops.container import Container
from dflash_ops.deploy.push import deploy_target
from dflash_ops.inventory import load_inventory
from dflash_ops.transport.local import LocalTransport
from tests.conftest import write_sim_inventory
from tests.containers import process_inside
from tests.integration.deploy_support import fake_package

pytestmark = pytest.mark.lxc_tier

REPO = Path(__file__).resolve().parents[2]
PATCHES = REPO / "tests" / "fixtures" / "patches"
LONG = "total_steps: 1000000\nstep_seconds: 0.005\n"


class Tier:
    def __init__(self, inventory: Path, container: Container):
        self.inventory = inventory
        self.container = container
        self.base = Path(container.base_dir)

    def cli(self, *args: str, code: int | None = 0):
        result = CliRunner().invoke(app, [*args, "--inventory", str(self.inventory)])
        if code is not None:
            assert result.exit_code == code, (result.stdout, result.stderr, result.exception)
        return result


TIERS = ["sim", pytest.param("sshd", marks=pytest.mark.sshd)]
WITH_SUDO = [*TIERS, pytest.param("sudo", marks=pytest.mark.sshd)]  # + `sudo -n pct` with a non-root login


@pytest.fixture(params=TIERS)
def tier(request, tmp_path):
    if request.param == "sim":
        inventory = write_sim_inventory(tmp_path / "simnode")
        transport = LocalTransport()
    else:
        from dflash_ops.transport.ssh import SSHTransport

        node = request.getfixturevalue("sshd_node" if request.param == "sshd" else "sudo_sshd_node")
        shutil.rmtree(node.base_dir, ignore_errors=True)
        inventory = node.inventory
        transport = SSHTransport(load_inventory(inventory).target("host200").node)
    container = Container(load_inventory(inventory).target("host200"), transport)
    t = Tier(inventory, container)
    t.package = fake_package(tmp_path)
    yield t
    for info in runs.list_runs(container):
        if info.alive:
            runs.signal_run(container, info.run_id, "KILL")
    transport.close()


def mark_node_temp_files(monkeypatch, tmp_path: Path) -> str:
    """Give this test's node-side temp paths a prefix of their own; returns the glob for them."""
    import uuid

    from dflash_ops import container as container_module

    prefix = f"/tmp/dflash-ops-{tmp_path.name[:20]}-{uuid.uuid4().hex[:8]}"
    monkeypatch.setattr(container_module, "_node_temp_path", lambda: f"{prefix}-{uuid.uuid4().hex}")
    return Path(prefix).name + "-*"


def deployed(tier: Tier) -> str:
    return deploy_target(tier.container, source=tier.package, venv=None).release


def config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def metrics_events(tier: Tier, run_id: str) -> list[dict]:
    return [json.loads(line) for line in (tier.base / "runs" / run_id / "metrics.jsonl").read_text().splitlines()]


def test_start_before_deploy_says_deploy_first(tier, tmp_path):
    result = tier.cli("run", "start", "host200", "--config", config(tmp_path, LONG), code=1)
    assert "nothing is deployed on host200 yet" in result.stderr
    assert "run `dflash-ops deploy host200` first" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("tier", WITH_SUDO, indirect=True)
def test_start_checkpoint_stop_resume_logs_pull(tier, tmp_path, monkeypatch):
    node_temp = mark_node_temp_files(monkeypatch, tmp_path)
    release = deployed(tier)
    run_id = tier.cli("run", "start", "host200", "--config", config(tmp_path, LONG), "--name", "cycle",
                      "--gpus", "0,1").stdout.strip()
    assert run_id.startswith("cycle-")
    busy = tier.cli("run", "start", "host200", "--config", config(tmp_path, LONG), "--gpus", "1", code=1)
    assert f"GPUs busy: {run_id}" in busy.stderr and "holds GPU 1" in busy.stderr

    written = tier.cli("run", "checkpoint", "host200", run_id, "--wait").stdout
    assert written.startswith("checkpoint checkpoints/step_") and " written (request " in written
    listed = tier.cli("run", "list", "host200").stdout
    assert run_id in listed and "running" in listed and release in listed

    stopped = tier.cli("run", "stop", "host200", run_id).stdout
    status = json.loads(tier.cli("run", "status", "host200", run_id, "--json").stdout)
    assert status["effective_state"] == "stopped" and f"stopped at step {status['step']}" in stopped
    stopped_at = status["step"]

    assert tier.cli("run", "resume", "host200", run_id).stdout.strip() == run_id
    info = runs.stop_run(tier.container, run_id, now=True, poll=0.05)  # --now: SIGTERM, checkpoint
    assert info.effective_state == "stopped" and info.step >= stopped_at
    starts = [e for e in metrics_events(tier, run_id) if e["event"] == "start"]
    assert [s["step"] for s in starts] == [0, stopped_at]  # the step count continues
    assert starts[1]["resumed_from"] == f"checkpoints/step_{stopped_at}"

    log = (tier.base / "runs" / run_id / "train.log").read_bytes()
    assert tier.cli("logs", "host200", run_id, "-f").stdout_bytes == log  # final run: -f returns
    assert tier.cli("logs", "host200", "-n", "2").stdout_bytes == b"".join(log.splitlines(keepends=True)[-2:])
    pretty = tier.cli("metrics", "host200", run_id).stdout.splitlines()
    assert pretty[0] == "start at step 0 of 1000000" and pretty[-1].startswith(f"stop at step {info.step}: signal")

    dest = tmp_path / "pulled"
    pulled = tier.cli("pull", "host200", run_id, str(dest)).stdout
    assert "sha256 verified" in pulled
    remote = tier.base / "runs" / run_id / "checkpoints" / f"step_{info.step}"
    for rel in ("state.bin", "optim/adam.bin", "manifest.json"):
        assert (dest / f"step_{info.step}" / rel).read_bytes() == (remote / rel).read_bytes()
    # Nothing left on the node: with `sudo pct` the pulled copies are root's, and the login's cleanup
    # must still remove them (in /tmp's sticky directory it could not: they leaked).
    assert list(Path("/tmp").glob(node_temp)) == []


# sim only: the death is found and told by the node-side runs helper; the transport carries its JSON and
# the log tail as any other call does (a run's log over sshd: test_logs_follow_survives_dropped_connections)
@pytest.mark.parametrize("tier", ["sim"], indirect=True)
def test_dead_run_is_failed_with_its_log_tail(tier, tmp_path):
    deployed(tier)
    run_id = tier.cli("run", "start", "host200", "--config",
                      config(tmp_path, "total_steps: 100000\nvanish_at_step: 20\n")).stdout.strip()
    for _ in range(500):
        status = json.loads(tier.cli("run", "status", "host200", "--json").stdout)
        if not status["alive"]:
            break
        time.sleep(0.02)
    shown = tier.cli("run", "status", "host200").stdout
    assert run_id in shown and "failed" in shown and "process died without saying so" in shown
    assert "step 19 line 0" in shown  # the log tail
    assert tier.cli("logs", "host200", run_id, "-f", code=1).stderr.strip() == f"{run_id}: failed at step 19"


def deployed_over_sshd(sshd_node, tmp_path) -> Tier:
    """A fresh base dir behind the real sshd, the fake trainer deployed, the connection closed."""
    from dflash_ops.transport.ssh import SSHTransport

    shutil.rmtree(sshd_node.base_dir, ignore_errors=True)
    target = load_inventory(sshd_node.inventory).target("host200")
    tier = Tier(sshd_node.inventory, Container(target, SSHTransport(target.node)))
    tier.package = fake_package(tmp_path)
    deployed(tier)
    tier.container.transport.close()
    return tier


@pytest.mark.sshd
def test_logs_follow_survives_dropped_connections(sshd_node, tmp_path, monkeypatch):
    """Kill every SSH session mid-stream, twice, while `logs -f` follows a live run: the
    received bytes must equal train.log exactly (no line lost, none repeated)."""
    tier = deployed_over_sshd(sshd_node, tmp_path)
    run_id = tier.cli("run", "start", "host200", "--config",
                      config(tmp_path, "total_steps: 400\nstep_seconds: 0.005\nlog_lines: 3\n")).stdout.strip()
    received: list[bytes] = []
    kills = []

    def record(line: bytes) -> None:
        received.append(line)
        if len(received) in (100, 500):
            kills.append(sshd_node.kill_sessions())

    monkeypatch.setattr(cli_runs, "write_stdout", record)
    tier.cli("logs", "host200", run_id, "-f")
    assert len(kills) == 2 and all(kills)
    assert b"".join(received) == (tier.base / "runs" / run_id / "train.log").read_bytes()
    assert received[-1] == b"done\n"


@pytest.mark.sshd
def test_logs_follow_waits_for_the_sshd_listener_to_come_back(sshd_node, tmp_path, monkeypatch):
    """sshd goes away entirely (listener and sessions; reconnects are refused) for a while
    mid-stream: `logs -f` retries with backoff and ends byte-identical to train.log. It used
    to exit 255 a fraction of a second after the listener went away."""
    tier = deployed_over_sshd(sshd_node, tmp_path)
    run_id = tier.cli("run", "start", "host200", "--config",
                      config(tmp_path, "total_steps: 300\nstep_seconds: 0.01\nlog_lines: 2\n")).stdout.strip()
    received: list[bytes] = []
    outage = threading.Event()

    def record(line: bytes) -> None:
        received.append(line)
        if len(received) == 50:
            sshd_node.stop()
            threading.Timer(2.0, lambda: (sshd_node.start(), outage.set())).start()

    monkeypatch.setattr(cli_runs, "write_stdout", record)
    try:
        result = tier.cli("logs", "host200", run_id, "-f")
    finally:
        outage.wait(30)
        sshd_node.start()
    assert outage.is_set() and "retrying in" in result.stderr and "cannot connect" in result.stderr
    assert b"".join(received) == (tier.base / "runs" / run_id / "train.log").read_bytes()
    assert received[-1] == b"done\n"


def test_patch_check_refuses_broken_accepts_fixed_then_release_and_rollback(tier, tmp_path):
    first = deployed(tier)
    broken = tier.cli("patch", "host200", str(PATCHES / "broken_warmup_inside_class.diff"), "--check", code=1)
    assert "patch REFUSED" in broken.stdout
    assert "BatchPrefetcher.__iter__ (was line 34) → select_target_warmup_shapes.__iter__" in broken.stdout
    assert "select_target_warmup_shapes.__iter__ is unreachable" in broken.stdout
    assert "refused by the structural guard" in broken.stderr

    fixed = str(PATCHES / "fixed_warmup_at_module_level.diff")
    checked = tier.cli("patch", "host200", fixed, "--check").stdout
    assert "patch OK" in checked and "import trainer.data: ok" in checked and "nothing changed" in checked
    assert os.readlink(tier.base / "current") == f"releases/{first}"
    assert not list((tier.base / "patches").iterdir())  # the scratch copy is gone

    run_id = tier.cli("run", "start", "host200", "--config", config(tmp_path, LONG)).stdout.strip()
    applied = tier.cli("patch", "host200", fixed, "--restart", run_id).stdout
    new = os.readlink(tier.base / "current").removeprefix("releases/")
    assert new != first and f"release {new} (parent {first}) is current" in applied
    meta = json.loads((tier.base / "current" / ".dflash-release.json").read_text())
    assert meta["parent"] == first
    assert "def select_target_warmup_shapes" in (tier.base / "current" / "trainer" / "data.py").read_text()
    assert (tier.base / "runs" / run_id / "release").read_text().strip() == new  # resumed on the new release
    starts = [e for e in metrics_events(tier, run_id) if e["event"] == "start"]
    assert len(starts) == 2 and starts[1]["resumed_from"] is not None

    assert tier.cli("rollback", "host200").stdout.strip() == f"host200: current {new} -> {first}"
    assert os.readlink(tier.base / "current") == f"releases/{first}"
    assert "no parent" in tier.cli("rollback", "host200", code=1).stderr


def test_patch_that_does_not_import_is_refused(tier, tmp_path):
    first = deployed(tier)
    diff = tmp_path / "bad-import.diff"
    diff.write_text("--- a/trainer/data.py\n+++ b/trainer/data.py\n@@ -1,1 +1,2 @@\n"
                    "+import no_such_module_anywhere\n"
                    f" {(tier.package / 'data.py').read_text().splitlines()[0]}\n")
    refused = tier.cli("patch", "host200", str(diff), code=1)
    assert "import trainer.data: FAILED: trainer/data.py:1: ModuleNotFoundError" in refused.stdout
    assert os.readlink(tier.base / "current") == f"releases/{first}"


def test_patch_check_runs_none_of_the_patched_code(tier, tmp_path):
    """--check changes nothing: the patched module's top-level code must not run (it used to be imported)."""
    first = deployed(tier)
    marker = tmp_path / "module-level-code-ran"
    first_line = (tier.package / "data.py").read_text().splitlines()[0]
    diff = tmp_path / "side-effect.diff"
    diff.write_text("--- a/trainer/data.py\n+++ b/trainer/data.py\n@@ -1,1 +1,2 @@\n"
                    f"+open({str(marker)!r}, 'w').close()\n {first_line}\n")
    checked = tier.cli("patch", "host200", str(diff), "--check").stdout
    assert "patch OK" in checked and "nothing changed" in checked and not marker.exists()
    missing = tmp_path / "bad-import.diff"
    missing.write_text("--- a/trainer/data.py\n+++ b/trainer/data.py\n@@ -1,1 +1,2 @@\n"
                       f"+import no_such_module_anywhere\n {first_line}\n")
    refused = tier.cli("patch", "host200", str(missing), "--check", code=1)
    assert "import trainer.data: FAILED: trainer/data.py:1: ModuleNotFoundError" in refused.stdout
    assert os.readlink(tier.base / "current") == f"releases/{first}"


def test_patch_to_the_requirements_is_refused_with_the_way_forward(tier, tmp_path):
    first = deployed(tier)
    diff = tmp_path / "reqs.diff"
    diff.write_text("--- /dev/null\n+++ b/trainer/requirements.txt\n@@ -0,0 +1,1 @@\n+numpy\n")
    refused = tier.cli("patch", "host200", str(diff), code=1)
    assert "changes the venv" in refused.stderr and "dflash-ops deploy host200" in refused.stderr
    assert os.readlink(tier.base / "current") == f"releases/{first}"


def test_resume_with_a_new_config(tier, tmp_path):
    deployed(tier)
    run_id = tier.cli("run", "start", "host200", "--config", config(tmp_path, LONG)).stdout.strip()
    tier.cli("run", "stop", "host200", run_id)
    longer = tmp_path / "longer.yaml"
    longer.write_text("total_steps: 2000000\nstep_seconds: 0.005\n")
    assert tier.cli("run", "resume", "host200", run_id, "--config", str(longer)).stdout.strip() == run_id
    info = runs.stop_run(tier.container, run_id, poll=0.05)
    assert info.effective_state == "stopped" and info.total_steps == 2_000_000
    assert (tier.base / "runs" / run_id / "config.input.yaml").read_bytes() == longer.read_bytes()
    tier.cli("run", "resume", "host200", run_id, "--config", str(tmp_path / "missing.yaml"), code=2)


# sim only: the failure is planted in the operator's own Container.helper_json; what is asserted is the
# operator-side recovery, the same over any transport
@pytest.mark.parametrize("tier", ["sim"], indirect=True)
def test_patch_restart_whose_release_fails_resumes_the_run_on_the_old_release(tier, tmp_path, monkeypatch):
    """`patch --restart RUN` stops the run before the new release is built: when that build
    fails, the run must not be left stopped."""
    from dflash_ops.container import Container
    from dflash_ops.errors import HelperFailed

    first = deployed(tier)
    run_id = tier.cli("run", "start", "host200", "--config", config(tmp_path, LONG)).stdout.strip()
    real_helper_json = Container.helper_json

    def apply_fails(container, name, args, **kwargs):
        if name == "release-store" and args[0] == "apply":
            raise HelperFailed(name, args, 1, "OSError: [Errno 28] disk full")
        return real_helper_json(container, name, args, **kwargs)

    monkeypatch.setattr(Container, "helper_json", apply_fails)
    failed = tier.cli("patch", "host200", str(PATCHES / "fixed_warmup_at_module_level.diff"), "--restart", run_id,
                      code=1)
    assert "disk full" in failed.stderr
    assert os.readlink(tier.base / "current") == f"releases/{first}"
    assert runs.run_status(tier.container, run_id).effective_state in ("starting", "running")
    assert (tier.base / "runs" / run_id / "release").read_text().strip() == first
    tier.cli("run", "stop", "host200", run_id, "--now")


def test_patch_creating_a_file_where_the_release_has_a_file_or_directory_is_refused(tier, tmp_path):
    """--check must not accept what the apply then cannot build."""
    deployed(tier)
    for created in ("trainer/data.py/inner.py", "trainer"):
        diff = tmp_path / "clash.diff"
        diff.write_text(f"--- /dev/null\n+++ b/{created}\n@@ -0,0 +1 @@\n+X = 1\n")
        refused = tier.cli("patch", "host200", str(diff), "--check", code=1)
        assert "patch REFUSED" in refused.stdout and "clashes with the release tree" in refused.stdout


# ---------------------------------------------------------------- --restart on-failure[:N]


def _trainer_pid(tier: Tier, run_id: str) -> int:
    return json.loads((tier.base / "runs" / run_id / "launch.json").read_text())["pid"]


def _wait_status(tier: Tier, run_id: str, done, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        status = json.loads(tier.cli("run", "status", "host200", run_id, "--json").stdout)
        if done(status):
            return status
        assert time.monotonic() < deadline, status
        time.sleep(0.2)


def test_restart_on_failure_resumes_after_sigkill_with_the_same_losses(tier, tmp_path):
    """SIGKILL the trainer mid-run: the node-side supervisor resumes it from its last checkpoint,
    the run completes every step, each step's loss is the one it would have had, and the restart
    and its reason show in `run status`, metrics.jsonl and the log. The kill is sent at step 12 of 80: ~3 s
    of steps to go, whatever the load delays the status poll and the kill by (at 40 steps, ~1.4 s)."""
    deployed(tier)
    text = "total_steps: 80\nstep_seconds: 0.05\ncheckpoint_every: 5\n"
    run_id = tier.cli("run", "start", "host200", "--config", config(tmp_path, text), "--restart", "on-failure:2").stdout.strip()
    first = _wait_status(tier, run_id, lambda s: s.get("step", 0) >= 12)
    # as the OOM killer would: no word from the trainer. Killed from inside the container: launch.json's
    # pid is the container's (in an LXC container another PID namespace than this machine's)
    tier.container.exec(["kill", "-KILL", str(_trainer_pid(tier, run_id))], check=True)
    followed = tier.cli("logs", "host200", run_id, "-f").stdout  # follows across the restart to the end
    assert followed.rstrip().endswith("done") and "killed by SIGKILL" in followed
    done = _wait_status(tier, run_id, lambda s: s["effective_state"] in ("done", "failed"))
    assert done["effective_state"] == "done" and done["step"] == 80, done
    assert len(done["restarts"]) == 1 and done["restart_policy"] == "on-failure:2"
    restart = done["restarts"][0]
    assert restart["reason"] == "killed by SIGKILL" and restart["step"] >= first["step"]
    last = restart["step"] // 5 * 5  # the kill may land while that checkpoint is still being written
    assert restart["from"] in (f"checkpoints/step_{last}", f"checkpoints/step_{last - 5}")
    events = metrics_events(tier, run_id)
    assert [e["reason"] for e in events if e["event"] == "restart"] == ["killed by SIGKILL"]
    steps = {}
    for e in events:
        if e["event"] == "step":
            steps[e["step"]] = e["loss"]  # a step replayed after the restart overwrites the killed attempt's
    assert sorted(steps) == list(range(1, 81)) and all(steps[s] == 1.0 / (1 + s) for s in steps)
    starts = [e for e in events if e["event"] == "start"]
    assert starts[-1]["resumed_from"] == restart["from"]
    shown = tier.cli("run", "status", "host200", run_id).stdout
    assert "restart: on-failure:2, 1 so far" in shown and "killed by SIGKILL; from checkpoints/step_" in shown
    log = (tier.base / "runs" / run_id / "train.log").read_text()
    assert "# dflash-ops supervise" in log and "killed by SIGKILL" in log and "restart 1 of 2" in log


# sim only: the restarts and the stop's effect are the node-side supervisor's (the same helper behind
# either transport); a restart across a transport's follow is test_restart_on_failure_resumes_after_sigkill
@pytest.mark.parametrize("tier", ["sim"], indirect=True)
def test_restart_gives_up_after_n_and_stop_still_stops_for_good(tier, tmp_path):
    deployed(tier)
    crash = "total_steps: 40\nstep_seconds: 0.01\ncheckpoint_every: 2\ncrash_at_step: 7\n"
    run_id = tier.cli("run", "start", "host200", "--config", config(tmp_path, crash), "--restart", "on-failure:2").stdout.strip()
    failed = _wait_status(tier, run_id, lambda s: s["effective_state"] == "failed" and not s["alive"])
    assert [r["reason"] for r in failed["restarts"]] == ["exit 1: fake crash at step 7"] * 2  # at most N
    log = (tier.base / "runs" / run_id / "train.log").read_text()
    assert "no restart left (2 used): the run stays failed" in log

    long = "total_steps: 100000\nstep_seconds: 0.01\ncheckpoint_every: 5\n"
    run_id = tier.cli("run", "start", "host200", "--config", config(tmp_path, long), "--restart", "on-failure").stdout.strip()
    _wait_status(tier, run_id, lambda s: s.get("step", 0) >= 3)
    stopped = tier.cli("run", "stop", "host200", run_id, "--kill", "--timeout", "60").stdout
    assert "failed" in stopped or "stopped" in stopped
    time.sleep(2 * 1.0)  # longer than the supervisor's restart delay
    status = json.loads(tier.cli("run", "status", "host200", run_id, "--json").stdout)
    assert not status["alive"] and status["restarts"] == [] and status["effective_state"] == "failed"
    run_id = tier.cli("run", "start", "host200", "--config", config(tmp_path, long), "--restart", "on-failure").stdout.strip()
    _wait_status(tier, run_id, lambda s: s.get("step", 0) >= 3)
    tier.cli("run", "stop", "host200", run_id, "--timeout", "60")
    status = json.loads(tier.cli("run", "status", "host200", run_id, "--json").stdout)
    assert status["effective_state"] == "stopped" and not status["alive"] and status["restarts"] == []


# sim only: the stop is recorded and served by the node-side helper and supervisor, whichever transport
# carried the `run stop`
@pytest.mark.parametrize("tier", ["sim"], indirect=True)
@pytest.mark.parametrize("how", ["--now", "--kill", None])
def test_run_stop_between_two_attempts_stops_the_run_for_good(tier, tmp_path, how):
    """A run that crashes at step 7 each attempt (resumed from step 6): `run stop` (any form) while
    its supervisor waits to restart it found no trainer to signal and the run trained on until it
    gave up (issue 55). Now the stop is recorded first and the supervisor serves it: `stopped`,
    no attempt after the stop was recorded. (Restarts without end: under load the stop may land a few
    attempts after the test saw `restarting`, never after the policy gave up.)"""
    deployed(tier)
    crash = "total_steps: 40\nstep_seconds: 0.01\ncheckpoint_every: 2\ncrash_at_step: 7\n"
    run_id = tier.cli("run", "start", "host200", "--config", config(tmp_path, crash), "--restart",
                      "on-failure:1000").stdout.strip()
    deadline = time.monotonic() + 60
    while runs.run_status(tier.container, run_id).effective_state != "restarting":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    tier.cli("run", "stop", "host200", run_id, *([how] if how else []), "--timeout", "60")
    time.sleep(2 * 1.0)  # longer than the supervisor's restart delay
    status = json.loads(tier.cli("run", "status", "host200", run_id, "--json").stdout)
    # --kill of an attempt already restarted: no checkpoint, the run reads failed (docs/run-lifecycle.md)
    assert status["effective_state"] in (("stopped", "failed") if how == "--kill" else ("stopped",)), status
    stopped_at = json.loads((tier.base / "runs" / run_id / "control" / ".no-restart").read_text())["time"]
    assert not status["alive"] and status["restarts"] and all(r["time"] < stopped_at for r in status["restarts"])


EVIL = "{{ '\x1b]0;pwned\x07' }}\x1b[2J\x9b31m\rtemplate"  # a chat template's OSC title, a clear, C1 CSI, CR


def test_run_status_shows_text_from_the_run_directory_escaped(tier, tmp_path):
    """Control sequences in a model's chat template reached the operator's terminal raw through
    `run status` (its error, reason and log tail) and retitled it (issue 55): now shown as \\xNN."""
    deployed(tier)
    run = tier.base / "runs" / "evil"
    run.mkdir(parents=True)
    (run / "status.json").write_text(json.dumps({
        "version": 1, "run_id": "evil", "state": "failed", "pid": 0, "step": 3, "phase": None,
        "error": {"message": "bad chat template: " + EVIL, "thread": "data"}}))
    (run / "release").write_text("rel[bold]\x1b[5m\n")
    (run / "train.log").write_text("loading template " + EVIL + "\nTraceback\n")
    shown = tier.cli("run", "status", "host200", "evil").stdout
    assert "\x1b" not in shown and "\x07" not in shown and "\x9b" not in shown and "\r" not in shown
    assert "\\x1b]0;pwned\\x07" in shown and "\\x9b31m" in shown  # still there, readable
    assert "rel[bold]\\x1b[5m" in shown  # a release file's text is not rich markup either
    assert json.loads(tier.cli("run", "status", "host200", "evil", "--json").stdout)["error"]["message"].endswith(EVIL)


# sim only: the policy is refused by the CLI before anything is sent
@pytest.mark.parametrize("tier", ["sim"], indirect=True)
def test_restart_policy_is_checked(tier, tmp_path):
    deployed(tier)
    bad = tier.cli("run", "start", "host200", "--config", config(tmp_path, LONG), "--restart", "always", code=1)
    assert "--restart 'always': use no, on-failure (3 restarts) or on-failure:N" in bad.stderr


@pytest.mark.parametrize("tier", ["sim"], indirect=True)
def test_metrics_before_the_run_wrote_any_says_so(tier, tmp_path):
    """The first minutes of a healthy run (status.json written, the model still loading): `metrics`
    says the run has not written metrics.jsonl yet, exit 0, not "no such file"."""
    deployed(tier)
    run = tier.base / "runs" / "loading"
    (run / "control").mkdir(parents=True)
    with process_inside(tier.container) as trainer:  # the loading trainer: a pid the container sees
        (run / "status.json").write_text(json.dumps({"version": 1, "run_id": "loading", "state": "starting",
                                                     "pid": trainer, "step": 0, "heartbeat": time.time()}))
        result = tier.cli("metrics", "host200", "loading")
    assert "run loading (starting) has not written metrics.jsonl yet" in result.stderr
    assert "no such file" not in result.stderr + result.stdout


HINT = re.compile(r"dflash-ops ([a-z][^;()\n]*?)(?=\s*(?:\(|;|$))", re.M)


def run_hints(tier: Tier, stderr: str) -> list[str]:
    """Run every command a CLI message names (`... follow it: dflash-ops logs host200 RUN -f`): a
    hint the CLI prints must be one it accepts. Returns the hints run."""
    hints = HINT.findall(stderr)
    for hint in hints:
        tier.cli(*shlex.split(hint))
    return hints


@pytest.mark.parametrize("tier", ["sim"], indirect=True)
def test_every_hint_of_run_start_resume_and_a_group_is_a_command_the_cli_accepts(tier, tmp_path, capsys):
    """Issue #54: `run start host200 host300` printed `logs host200 host300 RUN -f`, which `logs`
    rejects (one target). Each hint printed by start, resume and a group start is run here."""
    deployed(tier)
    short = config(tmp_path, "total_steps: 30\nstep_seconds: 0.005\n")
    started = tier.cli("run", "start", "host200", "--config", short)
    run_id = started.stdout.strip()
    assert run_hints(tier, started.stderr) == [f"logs host200 {run_id} -f"]
    longer = config(tmp_path, "total_steps: 60\nstep_seconds: 0.005\n")
    resumed = tier.cli("run", "resume", "host200", run_id, "--config", longer)
    assert run_hints(tier, resumed.stderr) == [f"logs host200 {run_id} -f"]
    cli_runs._announce(run_id, "started", ["host200", "host300"])  # a group's announcement, as start_group's
    group = capsys.readouterr().err
    assert run_hints(tier, group) == [f"logs host200 {run_id} -f"] and "--rank N" in group
