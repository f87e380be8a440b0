"""Fixtures shared by the integration tests."""

from __future__ import annotations

import pytest

from dflash_ops.simnode import gpus as simgpus
from dflash_ops.simnode.containers import stop_all
from tests.conftest import sim_backend
from tests.integration.test_provision import DRIVER, INVENTORY


@pytest.fixture
def node(tmp_path):
    """An inventory naming host500 on a simulated node with 2 fixture GPUs; CT 500 does not exist
    (the provision tests; a module with a `node` of its own keeps it)."""
    root = tmp_path / "sim"
    simgpus.install_gpus(root, 2, DRIVER)
    path = tmp_path / "inventory.yaml"
    path.write_text(INVENTORY.format(root=root, backend=sim_backend()))
    yield path
    stop_all(root)
