"""LocalHelperContainer: a test double of dflash_ops.container.Container for the run helpers.

It runs the real helper scripts with a local subprocess against a temporary base_dir, calling
on_line per stdout line as the real Container does, and can cut a stream after K lines
(optionally mid-line) by killing the helper and raising ConnectionLost, like a dropped SSH
channel. The helpers are the thing under test, so they always really run.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from dflash_ops.container import helper_answer
from dflash_ops.errors import ConnectionLost

HELPERS = Path(__file__).resolve().parents[2] / "dflash_ops" / "helpers"
FAKE_TRAINER = Path(__file__).resolve().parents[1] / "fake_trainer.py"


@dataclass
class Result:
    exit_code: int
    stdout_bytes: bytes
    stderr: str

    @property
    def stdout(self) -> str:
        return self.stdout_bytes.decode("utf-8", "replace")

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


@dataclass
class Drop:
    """Cut the next streaming call after `after_lines` stdout lines; `mid_line` first hands
    on half of the following line without its newline."""

    after_lines: int
    mid_line: bool = False


@dataclass
class LocalHelperContainer:
    base: Path
    gpus: list[int] | None = None
    drops: list[Drop] = field(default_factory=list)
    refusals: list[Exception] = field(default_factory=list)  # raised by the next streaming calls, before they run
    corrupt_pulls: set[str] = field(default_factory=set)
    calls: list[list[str]] = field(default_factory=list)
    helpers_dir: Path = HELPERS  # where the helper scripts run from (another release's, installed)

    def __post_init__(self):
        self.base_dir = str(self.base)
        self.target = SimpleNamespace(name="local", ctid="0", base_dir=self.base_dir,
                                      python=sys.executable, gpus=self.gpus)

    def helper(self, name: str, args: list[str], **kwargs) -> Result:
        script = self.helpers_dir / (name.replace("-", "_") + ".py")
        return self.exec([sys.executable, str(script), *args], **kwargs)

    def helper_json(self, name: str, args: list[str], *, answers: tuple[int, ...] = (), **kwargs) -> object:
        return helper_answer(name, args, self.helper(name, args, **kwargs), answers)

    def exec(self, argv, *, stdin=None, on_line=None, on_stderr_line=None, timeout=None, check=False) -> Result:
        self.calls.append(list(argv))
        if on_line is not None and self.refusals:
            raise self.refusals.pop(0)
        drop = self.drops.pop(0) if (on_line is not None and self.drops) else None
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        stderr_chunks: list[bytes] = []
        reader = threading.Thread(target=lambda: stderr_chunks.append(proc.stderr.read()))
        reader.start()
        if stdin is not None:
            proc.stdin.write(stdin)
            proc.stdin.close()
        out = bytearray()
        lines = 0
        for line in iter(proc.stdout.readline, b""):
            if drop is not None and lines == drop.after_lines:
                if drop.mid_line and len(line) > 1:
                    on_line(line[: len(line) // 2])
                proc.kill()
                proc.wait()
                reader.join()
                raise ConnectionLost(f"simulated drop after {lines} lines")
            out += line
            lines += 1
            if on_line is not None:
                on_line(line)
        code = proc.wait(timeout)
        reader.join()
        result = Result(code, bytes(out), b"".join(stderr_chunks).decode("utf-8", "replace"))
        if check and not result.ok:
            raise RuntimeError(f"{argv} exited {code}: {result.stderr}")
        return result

    def push(self, local: Path, remote: str) -> None:
        Path(remote).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(local, remote)

    def pull(self, remote: str, local: Path) -> None:
        self.calls.append(["pull", remote])
        shutil.copyfile(remote, local)
        if remote in self.corrupt_pulls:
            self.corrupt_pulls.discard(remote)
            data = Path(local).read_bytes()
            Path(local).write_bytes(data[: len(data) // 2])


def make_release(base: Path, release_hash: str = "abc123") -> Path:
    """BASE/releases/<hash> holding the fake trainer as package `trainer`; BASE/current -> it."""
    root = base / "releases" / release_hash
    (root / "trainer").mkdir(parents=True)
    shutil.copyfile(FAKE_TRAINER, root / "trainer" / "__main__.py")
    (root / ".dflash-release.json").write_text(json.dumps({"version": 1, "hash": release_hash}))
    (base / "current").symlink_to(root.relative_to(base))
    return root


@contextlib.contextmanager
def released_container(tmp_path: Path):
    """A LocalHelperContainer over tmp_path/base holding one release; afterwards every run still
    alive in it is killed, so no fake trainer outlives its test."""
    from dflash_ops import runs

    base = tmp_path / "base"
    base.mkdir()
    make_release(base)
    container = LocalHelperContainer(base)
    try:
        yield container
    finally:
        for info in runs.list_runs(container):
            if info.alive:
                runs.signal_run(container, info.run_id, "KILL")


def eventually(predicate, what: str, tries: int = 3000) -> None:
    """Poll `predicate` every 10 ms; fail (not hang) after `tries` polls."""
    for _ in range(tries):
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(f"gave up waiting for: {what}")
