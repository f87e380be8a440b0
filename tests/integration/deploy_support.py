"""Shared set-up for deploy tests: a simulated node with one container, and a source tree."""

from __future__ import annotations

from pathlib import Path

from dflash_ops.connect import Container
from dflash_ops.inventory import load_inventory
from dflash_ops.transport.local import LocalTransport

INVENTORY = """\
nodes:
  sim:
    transport: local
    pct: simulated
    sim_root: {root}/sim
targets:
  host200:
    node: sim
    ctid: 200
    base_dir: {root}/ct200/opt/dflash
  host201:
    node: sim
    ctid: 201
    base_dir: {root}/ct201/opt/dflash
"""


def write_inventory(root: Path) -> Path:
    path = root / "hosts.yaml"
    path.write_text(INVENTORY.format(root=root))
    return path


def sim_container(root: Path, name: str = "host200") -> Container:
    inventory = load_inventory(write_inventory(root))
    return Container(inventory.target(name), LocalTransport())


def make_package(root: Path, files: int = 5) -> Path:
    """A package dir `root/trainer` with `files` small modules and a requirements.txt."""
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
    import sys

    from dflash_ops.deploy import deploy_target

    said = []

    def progress(phase: str, n: int, total: int) -> None:
        if not said:
            said.append(True)
            sys.stdout.write("streaming\n")
            sys.stdout.flush()

    deploy_target(sim_container(root), source=package, venv=None, on_progress=progress)


if __name__ == "__main__":
    import sys

    if sys.argv[1] == "deploy":
        _deploy_and_report(Path(sys.argv[2]), Path(sys.argv[3]))
