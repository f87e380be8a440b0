"""Shared set-up for deploy tests: containers on either tier, and a small source package."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from dflash_ops.container import Container
from dflash_ops.inventory import load_inventory
from dflash_ops.transport.local import LocalTransport
from tests.conftest import write_sim_inventory


def sim_container(root: Path, name: str = "host200", ctids: tuple[int, ...] = (200,)) -> Container:
    """A container on a fresh simulated node under `root`, with its own transport (own counter)."""
    inventory = load_inventory(write_sim_inventory(root / "simnode", ctids))
    return Container(inventory.target(name), LocalTransport())


def sshd_container(node) -> Container:
    """host200 behind the session's real sshd, emptied first (the node outlives one test)."""
    from dflash_ops.transport.ssh import SSHTransport

    shutil.rmtree(node.base_dir, ignore_errors=True)
    target = load_inventory(node.inventory).target("host200")
    return Container(target, SSHTransport(target.node))


def transfer_tier(request, tmp_path: Path):
    """The `tier` fixture of the transfer tests: (container, a data dir for this test, sshd node or None)."""
    if request.param == "sim":
        container = sim_container(tmp_path)
        node = None
    else:
        node = request.getfixturevalue("sshd_node")
        container = sshd_container(node)
    # container paths are real paths on both tiers: a data directory beside the container's base_dir
    data = Path(container.base_dir).parent / "data" / tmp_path.name
    yield container, data, node
    container.transport.close()


REPO = Path(__file__).resolve().parents[2]


def fake_package(root: Path) -> Path:
    """A `trainer` package whose __main__ is tests/fake_trainer.py (steps in milliseconds)."""
    package = root / "src" / "trainer"
    shutil.copytree(REPO / "tests" / "fixtures" / "patches" / "release" / "trainer", package)
    shutil.copyfile(REPO / "tests" / "fake_trainer.py", package / "__main__.py")
    return package


def make_package(root: Path, files: int = 5) -> Path:
    """A package dir `root/src/trainer` with `files` small modules and a requirements.txt."""
    package = root / "src" / "trainer"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "requirements.txt").write_text("pyyaml\n")
    for i in range(files):
        sub = package / f"part{i % 10}"
        sub.mkdir(exist_ok=True)
        (sub / f"mod{i}.py").write_text(f"VALUE = {i}\n")
    (package / "__pycache__").mkdir()
    (package / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"junk")
    return package


def _deploy_and_report(root: Path, package: Path) -> None:
    """Subprocess entry for the SIGKILL test: print 'streaming' once the tar is on its way."""
    from dflash_ops.deploy.push import deploy_target

    said = []

    def progress(phase: str, n: int, total: int) -> None:
        if not said:
            said.append(True)
            sys.stdout.write("streaming\n")
            sys.stdout.flush()

    deploy_target(sim_container(root), source=package, venv=None, on_progress=progress)


if __name__ == "__main__":
    if sys.argv[1] == "deploy":
        _deploy_and_report(Path(sys.argv[2]), Path(sys.argv[3]))
