"""The run directory format and the runs helper's wire protocol stay compatible with a release
already deployed: the previous release's helpers (from git, installed as dflash-ops installs them:
BASE/helpers/<hash>/ with their shared modules) and this release's work on the same run directories.
A run started by either is listed, described and followed by the other alike."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from dflash_ops import runs
from dflash_ops.helpers import bundle
from tests.unit.runs_double import LocalHelperContainer, eventually, make_release

REPO = Path(__file__).resolve().parents[2]
# main before the runs helper was split into a dispatcher and shared modules (issue 34)
PREVIOUS_RELEASE = "ff65216fc9eca47e6890a11da3796839e39d4c2b"
VOLATILE = {"heartbeat_age"}  # depends on when it is asked


def previous_helpers(into: Path) -> Path:
    """dflash_ops/helpers/ as PREVIOUS_RELEASE had it (runs.py and the nodefacts.py beside it)."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", PREVIOUS_RELEASE, "dflash_ops/helpers"],
                             capture_output=True, check=False)
    assert archive.returncode == 0, f"this test needs the repository's history: {archive.stderr.decode()}"
    into.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into / "dflash_ops" / "helpers"


def installed_helpers(into: Path) -> Path:
    """This release's runs helper as Container.helper installs it: its bundle's files in one directory."""
    found = bundle("runs")
    directory = into / found.digest
    directory.mkdir(parents=True)
    for name, content in found.files:
        (directory / name).write_bytes(content)
    return directory


@pytest.fixture
def both(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    make_release(base)
    old = LocalHelperContainer(base, helpers_dir=previous_helpers(tmp_path / "old"))
    new = LocalHelperContainer(base, helpers_dir=installed_helpers(tmp_path / "new"))
    assert (old.helpers_dir / "runs.py").read_bytes() != (new.helpers_dir / "runs.py").read_bytes()
    yield old, new
    for info in runs.list_runs(new):
        if info.alive:
            runs.signal_run(new, info.run_id, "KILL")


def described(container, run_id):
    (doc,) = container.helper_json("runs", ["list", container.base_dir, "--run", run_id])["runs"]
    return {k: v for k, v in doc.items() if k not in VOLATILE}


def assert_described_alike(old, new, run_id):
    """Every field the previous release describes, the new one describes equally; a newer helper
    may add fields (an older operator ignores them)."""
    before, now = described(old, run_id), described(new, run_id)
    assert before == {k: now.get(k, "<missing>") for k in before}


def followed(container, run_id, name):
    lines: list[bytes] = []
    end = runs.follow_file(container, run_id, name, lines.append, offset=0)
    return end, b"".join(lines)


@pytest.mark.parametrize("starter", ["old", "new"])
def test_a_run_started_by_one_release_reads_the_same_through_the_other(both, tmp_path, starter):
    old, new = both
    first, other = (old, new) if starter == "old" else (new, old)
    config = tmp_path / "config.yaml"
    config.write_text("total_steps: 5\ncheckpoint_every: 2\n")
    run_id = runs.start_run(first, config, name="compat", restart="on-failure:1")
    eventually(lambda: runs.run_status(first, run_id).final and not runs.run_status(first, run_id).alive,
               "the run ends")
    assert_described_alike(old, new, run_id)
    info = runs.run_status(other, run_id)
    assert (info.effective_state, info.step, info.checkpoints) == ("done", 5, [2, 4, 5])
    assert info.supervised is False and info.restart_policy == "on-failure:1"
    for name in ("train.log", "metrics.jsonl"):
        assert followed(first, run_id, name) == followed(other, run_id, name)
    run_dir = f"{first.base_dir}/runs/{run_id}"
    assert first.helper_json("runs", ["checkpoints", run_dir]) == other.helper_json("runs", ["checkpoints", run_dir])


def test_the_other_release_resumes_and_controls_a_run(both, tmp_path):
    """Control requests and a resume by one release on a run the other started."""
    old, new = both
    config = tmp_path / "config.yaml"
    config.write_text("total_steps: 1000000\nstep_seconds: 0.005\n")
    run_id = runs.start_run(old, config, name="mixed")
    eventually(lambda: (runs.run_status(new, run_id).step or 0) > 2, "the run steps")
    runs.stop_run(new, run_id)
    assert runs.run_status(old, run_id).effective_state == "stopped"
    runs.resume_run(new, run_id)
    eventually(lambda: runs.run_status(old, run_id).effective_state == "running", "the resumed run runs")
    runs.stop_run(old, run_id)
    assert_described_alike(old, new, run_id)
