"""Shared fixtures: an isolated simulated node (`sim_inventory`) and a real sshd (`sshd_node`).

Other areas' tests reuse these: `sim_inventory` is a local-transport inventory file with
target host200 whose state lives in a temp dir; `sshd_node` is a session-scoped
dflash_ops.testing.sshd.SshdNode whose `.inventory` has target host200 behind real OpenSSH.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from dflash_ops.cli import app
from dflash_ops.simnode import containers as simct
from dflash_ops.testing.sshd import SshdNode, sshd_unavailable_reason, start_sshd, sudo_login_unavailable_reason

REPO = Path(__file__).resolve().parents[1]
# Simulated containers the tests create (and the default inventory's) are directories unless
# $DFLASH_OPS_SIM_BACKEND says lxc (.ci/run's second pass: the tests marked lxc_tier, which pass in
# real LXC containers; under CI=true a machine that cannot run them fails). Set before any
# fixture, module-scoped ones included.
os.environ.setdefault(simct.BACKEND_ENV, "directory")
# One torch (OpenMP) thread per process: the suite runs 3 workers on 2 cores, and an intra-op thread
# pool on busy cores waits for its descheduled threads at every op (the tiny CPU demo: 274 s with 2
# threads against 38 s with 1 at a load of 4). Set before torch is imported; the trainer processes
# the tests start inherit it unless their config says `run.threads`.
os.environ.setdefault("OMP_NUM_THREADS", "1")


SUITE_TMP = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    """What the suite's processes leave in the temp directory (vLLM's IPC sockets and dist dirs, torchrun's
    rendezvous dirs, the benches' run dirs: ~40 entries a run, 1,200 in /tmp after a day) goes to one
    directory of this run, removed when it ends. The controller sets it before xdist starts the workers,
    which inherit TMPDIR; pytest's own tmp_path stays where it was (kept for a failure's post-mortem)."""
    if hasattr(config, "workerinput"):
        return
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
    path = tempfile.mkdtemp(prefix="dflash-tests-")
    os.chmod(path, 0o1777)  # as /tmp: the non-root users some tests run as (sudo, pct's root check) read and write in it
    config.stash[SUITE_TMP] = path
    os.environ["TMPDIR"] = path
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again


def pytest_unconfigure(config: pytest.Config) -> None:
    path = config.stash.get(SUITE_TMP, None)
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests marked slow run first, each group in its collection order: xdist hands work out in
    this order (an xdist_group of many tests before single tests), so the long ones start while the
    workers are fresh and the end of the run is short tests that even out across the workers, not one
    trainer run that starts last and keeps the others waiting."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_terminal_summary(terminalreporter) -> None:
    """The run log says what the simulated containers were (.ci/run's second pass: real LXC ones);
    printed under -q too, unlike a report header."""
    backend = simct.pick_backend()
    terminalreporter.write_line(f"simulated containers: {backend} (${simct.BACKEND_ENV}={os.environ[simct.BACKEND_ENV]})")


def write_listed_sim_inventory(directory: Path, backend: str) -> Path:
    """DIRECTORY/inventory.yaml: a `pct: simulated` node (state in DIRECTORY/sim) that lists CT 200
    under sim_containers, as the embedded default does: created (or mended and started) on first use."""
    path = directory / "inventory.yaml"
    path.write_text(yaml.safe_dump({
        "nodes": {"sim": {"transport": "local", "pct": "simulated", "sim_root": str(directory / "sim"),
                          "sim_containers": [200], "sim_backend": backend}},
        "targets": {"host200": {"node": "sim", "ctid": 200}},
    }))
    return path


def write_sim_inventory(directory: Path, ctids: tuple[int, ...] = (200,), *, create: bool = True,
                        python: str | None = None, packages: tuple[str, ...] | None = None,
                        backend: str | None = None) -> Path:
    """An inventory whose node is the pct stand-in with its state under `directory`.

    Each ctid is `pct create`d (running; `packages` provisioned, default the trainer's) unless
    `create` is false; `backend`: lxc or directory (default: sim_backend(); a directory container's
    python is made from `python`). An LXC container sees its test directory DIRECTORY/ct<ctid> at
    the same path (a bind mount point), so its base_dir there is one the test can read. The
    targets name the container's python, as an inventory for one off pct's PATH must.
    """
    directory.mkdir(parents=True, exist_ok=True)
    sim_root = directory / "sim"
    backend = backend or sim_backend()
    for ctid in ctids if create else ():
        if not simct.is_created(sim_root, ctid):
            simct.create(sim_root, ctid, python=python, packages=packages, hostname=f"host{ctid}", backend=backend,
                         binds=mount_points(directory / f"ct{ctid}") if backend == "lxc" else ())
    path = directory / "inventory.yaml"
    path.write_text(yaml.safe_dump({
        "nodes": {"sim": {"transport": "local", "pct": "simulated", "sim_root": str(sim_root)}},
        "targets": {
            f"host{ctid}": {"node": "sim", "ctid": ctid, "base_dir": str(directory / f"ct{ctid}" / "opt" / "dflash"),
                            "python": simct.container_python(sim_root, ctid)}
            for ctid in ctids
        },
    }))
    return path


def mount_points(directory: Path) -> list[str]:
    """`directory` and every file system mounted below it, parents first: the bind mount points an
    LXC container gets to see the test directory as this machine does. A bind mount (pct's mpN, as
    `mount -o bind`) does not carry the mounts below its source, so a test's small disk (a tmpfs
    mounted there before the container is created) is a mount point of its own, as an admin's
    small volume would be."""
    below = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4])  # \040: a space
        if Path(point).is_relative_to(directory) and Path(point) != directory:
            below.append(point)
    return [str(directory), *sorted(set(below))]


def sim_backend() -> str:
    """The backend of the simulated containers the tests create; under CI=true a machine that
    cannot run LXC containers fails the test instead of skipping it."""
    backend = simct.pick_backend()
    if backend == "lxc":
        from dflash_ops.simnode import rootfs

        unavailable(rootfs.unavailable_reason(), "the LXC backend")
    return backend


def play(inventory: Path, book: str, *variables: str, target: str = "host200"):
    """`dflash-ops play playbooks/BOOK TARGET --var ...` in-process: the CliRunner result."""
    args = ["play", str(REPO / "playbooks" / book), target, "--inventory", str(inventory)]
    for variable in variables:
        args += ["--var", variable]
    return CliRunner().invoke(app, args)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (a server the test starts binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session", autouse=True)
def _stop_lxc_containers():
    """LXC containers are processes: every one simct.create made in this session is stopped at its
    end (a directory container is only files)."""
    yield
    for sim_root in list(simct.CREATED_ROOTS):
        simct.stop_all(sim_root)


@pytest.fixture(autouse=True)
def _one_torch_thread() -> None:
    """Each test starts on one torch thread: a trainer run in the test's process (run.threads) sets the
    count for the whole worker, and the next test would pay for its thread pool (OMP_NUM_THREADS above)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _private_state_home(tmp_path_factory, monkeypatch) -> None:
    """Doctor verdicts (and anything else under $XDG_STATE_HOME) stay out of the real home, and the
    user's own inventory ($XDG_CONFIG_HOME/dflash-ops/hosts.yaml) is never read nor written by a test."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state")))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.mktemp("config")))


@pytest.fixture
def sim_inventory(tmp_path: Path) -> Path:
    return write_sim_inventory(tmp_path / "simnode")


@pytest.fixture(scope="session")
def sshd_node(tmp_path_factory) -> Iterator[SshdNode]:
    unavailable(sshd_unavailable_reason(), "the sshd tier")
    node = start_sshd(tmp_path_factory.mktemp("sshd"))
    yield node
    node.close()


def unavailable(reason: str | None, what: str = "this tier") -> None:
    """Skip for `reason`, except under CI=true, where a tier that cannot run is a failure."""
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but {what} cannot run: {reason}")
        pytest.skip(reason)


@pytest.fixture(scope="session")
def sudo_sshd_node(tmp_path_factory) -> Iterator[SshdNode]:
    """Like sshd_node, but the login is a throw-away non-root user whose inventory runs `sudo -n pct`."""
    unavailable(sshd_unavailable_reason() or sudo_login_unavailable_reason())
    node = start_sshd(tmp_path_factory.mktemp("sshd-sudo"), sudo_login=f"dfo-sudo-{os.getpid()}")
    yield node
    node.close()
