"""Shared fixtures: an isolated simulated node (`sim_inventory`) and a real sshd (`sshd_node`).

Other areas' tests reuse these: `sim_inventory` is a local-transport inventory file with
target host200 whose state lives in a temp dir; `sshd_node` is a session-scoped
dflash_ops.testing.sshd.SshdNode whose `.inventory` has target host200 behind real OpenSSH.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from dflash_ops.testing.sshd import SshdNode, sshd_unavailable_reason, start_sshd


def write_sim_inventory(directory: Path, ctids: tuple[int, ...] = (200,)) -> Path:
    """An inventory whose node is the pct stand-in with its state under `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "inventory.yaml"
    path.write_text(yaml.safe_dump({
        "nodes": {"sim": {"transport": "local", "pct": "simulated", "sim_root": str(directory / "sim")}},
        "targets": {
            f"host{ctid}": {"node": "sim", "ctid": ctid, "base_dir": str(directory / f"ct{ctid}" / "opt" / "dflash")}
            for ctid in ctids
        },
    }))
    return path


@pytest.fixture(autouse=True)
def _private_state_home(tmp_path_factory, monkeypatch) -> None:
    """Doctor verdicts (and anything else under $XDG_STATE_HOME) stay out of the real home."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state")))


@pytest.fixture
def sim_inventory(tmp_path: Path) -> Path:
    return write_sim_inventory(tmp_path / "simnode")


@pytest.fixture(scope="session")
def sshd_node(tmp_path_factory) -> SshdNode:
    reason = sshd_unavailable_reason()
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but the sshd tier cannot run: {reason}")
        pytest.skip(reason)
    node = start_sshd(tmp_path_factory.mktemp("sshd"))
    yield node
    node.stop()
