"""The helpers under the oldest python3 we promise for containers (docs/simulated-node.md: 3.8).

A container's python is not ours: the simulated container here is made from the oldest
interpreter this machine has (a pyenv 3.8 where present, else the system's /usr/bin/python3,
which CI's bare Debian always has), sees only the standard library, and runs the whole
deploy -> venv -> run -> checkpoint -> pull cycle. The syntax check runs everywhere.
"""

from __future__ import annotations

import ast
import glob
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from dflash_ops import runs
from dflash_ops.connect import open_container
from dflash_ops.deploy.push import deploy_target
from dflash_ops.deploy.venv_spec import VenvSpec
from dflash_ops.inventory import load_inventory
from dflash_ops.simnode import pct as stand_in
from tests.conftest import write_sim_inventory

pytestmark = pytest.mark.lxc_tier

REPO = Path(__file__).resolve().parents[2]
# the helpers and the shared modules that live in the trainer (dflash_ops/helpers/__init__.py SHARED_ELSEWHERE)
HELPERS = sorted((REPO / "dflash_ops" / "helpers").glob("*.py")) + [REPO / "trainer" / "run" / "contract.py",
                                                                     REPO / "trainer" / "run" / "destination.py"]
OLDEST = (3, 8)


def oldest_python() -> str:
    """A pyenv 3.8 when this machine has one, else the system python3 (never skipped)."""
    found = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.8.*/bin/python3")))
    if found:
        return found[-1]
    assert os.access("/usr/bin/python3", os.X_OK), "no /usr/bin/python3: a container python to test with is needed"
    return "/usr/bin/python3"


@pytest.mark.parametrize("helper", HELPERS + [REPO / "tests" / "fake_trainer.py"], ids=lambda p: p.name)
def test_helpers_parse_as_the_oldest_promised_python(helper):
    ast.parse(helper.read_text(), filename=str(helper), feature_version=OLDEST)


def test_stand_in_parses_as_the_oldest_supported_operator_python():
    # the stand-in runs with the operator's interpreter (pyproject: requires-python >= 3.10)
    ast.parse(Path(stand_in.__file__).read_text(), feature_version=(3, 10))


@pytest.mark.slow
def test_deploy_venv_run_pull_with_the_oldest_container_python(tmp_path):
    python = oldest_python()
    inventory = load_inventory(write_sim_inventory(tmp_path / "simnode", python=python, packages=(),
                                                         backend="directory"))
    container = open_container(inventory, "host200")
    version = container.exec([container.target.python, "-c", "import sys; print(sys.version_info[:2])"], check=True)
    if python != "/usr/bin/python3":
        assert version.stdout.strip() == "(3, 8)"
    package = tmp_path / "src" / "trainer"
    package.mkdir(parents=True)
    shutil.copyfile(REPO / "tests" / "fake_trainer.py", package / "__main__.py")
    (package / "requirements.txt").write_text("# stdlib only\n")
    summary = deploy_target(container, source=package, venv=VenvSpec(requirements=package / "requirements.txt"))
    assert summary.ok and summary.venv_action == "built"
    config = tmp_path / "run.yaml"
    config.write_text("total_steps: 1000000\nstep_seconds: 0.005\n")
    run_id = runs.start_run(container, config, name="old")
    info = runs.stop_run(container, run_id, now=True, poll=0.05)
    assert info.effective_state == "stopped"
    dest = runs.pull_checkpoint(container, run_id, "latest", tmp_path / "pulled")
    assert any(dest.rglob("*.bin"))
    listed = subprocess.run([container.target.python, "-c", "import sys; print(sys.prefix)"],
                            capture_output=True, text=True, check=True).stdout.strip()
    assert listed.startswith(str(tmp_path))  # the container's own interpreter ran it all


def test_the_venv_sees_what_the_containers_python_sees_never_more(tmp_path):
    """system_site_packages means the container's packages, not its python's base interpreter's.

    The simulated container's python is a venv over a base whose own site-packages it does not
    see (like a venv or conda python in a real container); `venv --system-site-packages` from it
    exposed the base's packages to the trainer venv anyway.
    """
    container = open_container(load_inventory(write_sim_inventory(tmp_path / "simnode")), "host200")
    package = tmp_path / "src" / "trainer"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "requirements.txt").write_text("pyyaml\n")
    summary = deploy_target(container, source=package, venv=VenvSpec(requirements=package / "requirements.txt"))
    assert summary.ok and summary.venv_action == "built"  # satisfied by the container's packages: no pip
    probe = "import sys, json; print(json.dumps([p for p in sys.path if p.endswith('-packages')]))"
    ct_sites = json.loads(container.exec([container.target.python, "-c", probe], check=True).stdout)
    venv_python = f"{container.base_dir}/{summary.venv}/bin/python"
    venv_sites = json.loads(container.exec([venv_python, "-c", probe], check=True).stdout)
    own = f"{container.base_dir}/{summary.venv}/"
    assert [p for p in venv_sites if not p.startswith(own)] == ct_sites
