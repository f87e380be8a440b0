"""The operator installs light: without the `trainer` extra (torch, transformers, safetensors,
tokenizers) the CLI drives a node, and a command that needs the extra says which, in one line.

The CLI runs in a subprocess whose python cannot import those packages: a sitecustomize on
PYTHONPATH puts a finder in front of sys.meta_path that refuses them. It acts only in this
python (its sys.prefix), not in the container's pythons, which get the same environment from
the local transport and, like a GPU node's, have the trainer's packages.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dflash_ops.extras import TRAINER_INSTALL, TRAINER_PACKAGES
from tests.conftest import write_sim_inventory

pytestmark = pytest.mark.lxc_tier

REPO = Path(__file__).resolve().parents[2]

BLOCKER = f"""
import os
import sys

if sys.prefix == os.environ.get("LIGHT_INSTALL_PREFIX"):
    class LightInstall:
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in {TRAINER_PACKAGES!r}:
                raise ModuleNotFoundError("No module named %r" % name, name=name)
            return None

    sys.meta_path.insert(0, LightInstall())
"""


@pytest.fixture
def light(tmp_path):
    """Run `dflash-ops ARGS` (or `python ARGS` with python=True) as a light install would."""
    site = tmp_path / "light-site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHONPATH": str(site), "LIGHT_INSTALL_PREFIX": sys.prefix,
           "XDG_STATE_HOME": str(tmp_path / "state")}

    def run(*args: str, python: bool = False) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, *args] if python else [sys.executable, "-m", "dflash_ops", *args]
        return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path)

    return run


def test_the_blocker_blocks_and_the_cli_imports_none_of_the_trainer_packages(light):
    blocked = light("-c", "import torch", python=True)
    assert blocked.returncode == 1 and "ModuleNotFoundError: No module named 'torch'" in blocked.stderr
    loaded = light("-c", "import sys, dflash_ops.cli; print(sorted({m.split('.')[0] for m in sys.modules}))", python=True)
    assert loaded.returncode == 0, loaded.stderr
    assert not set(json.loads(loaded.stdout.replace("'", '"'))) & set(TRAINER_PACKAGES)


def test_a_light_install_drives_a_node(light, tmp_path):
    """A node whose container has its own python with the trainer's packages, as a GPU node's."""
    inventory = str(write_sim_inventory(tmp_path / "node"))
    assert light("--help").returncode == 0
    hosts = light("hosts", "--inventory", inventory)
    assert hosts.returncode == 0 and "running" in hosts.stdout, hosts.stderr
    deployed = light("deploy", "host200", "--inventory", inventory)
    assert deployed.returncode == 0, deployed.stderr
    said = light("exec", "host200", "--inventory", inventory, "--", "python3", "-c", "import sys; print(sys.argv[1])", "it's")
    assert said.returncode == 0 and said.stdout == "it's\n", said.stderr
    run_dir = tmp_path / "node" / "ct200" / "opt" / "dflash" / "runs" / "r1"
    run_dir.mkdir(parents=True)
    (run_dir / "status.json").write_text(json.dumps({"state": "done", "step": 5, "total_steps": 5}))
    status = light("run", "status", "host200", "r1", "--inventory", inventory)
    assert status.returncode == 0 and "done" in status.stdout, status.stderr


def test_what_needs_the_trainer_extra_says_so_in_one_line(light, tmp_path):
    """The embedded kind of node: its containers are created on first use, their python linked
    to this one's trainer packages; a light install cannot, and says what to install."""
    sim_root = tmp_path / "sim"
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(yaml.safe_dump({
        "nodes": {"sim": {"transport": "local", "pct": "simulated", "sim_root": str(sim_root),
                          "sim_containers": [200]}},
        "targets": {"host200": {"node": "sim", "ctid": 200, "base_dir": str(tmp_path / "ct200"),
                                "python": str(sim_root / "ct" / "200" / "usr" / "bin" / "python3")}},
    }))
    done = light("exec", "host200", "--inventory", str(inventory), "--", "true")
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.rstrip().endswith(TRAINER_INSTALL), done.stderr
    assert "simulated CT 200" in done.stderr and "torch" in done.stderr
    assert not (sim_root / "ct" / "200").exists()  # nothing half made

    hosts = light("hosts", "--inventory", str(inventory))  # a listing still lists
    assert hosts.returncode == 0 and "missing" in hosts.stdout and TRAINER_INSTALL in hosts.stdout, hosts.stderr

    book = tmp_path / "book.yaml"  # a local step that imports torch, on a node the light install drives
    book.write_text(yaml.safe_dump({"name": "local torch", "steps": [{"local": ["python", "-c", "import torch"]}]}))
    played = light("play", str(book), "host200", "--inventory", str(write_sim_inventory(tmp_path / "node")))
    assert played.returncode != 0 and TRAINER_INSTALL in played.stdout + played.stderr
