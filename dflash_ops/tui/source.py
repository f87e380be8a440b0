"""Where the dashboard's data comes from: the `DashSource` interface and the local source.

The dashboard never touches files, SSH or containers itself; it calls a `DashSource` from
worker threads. `LocalDirSource` reads run directories on this machine (the `transport:
local` targets and the tests); a remote source adapts `dflash_ops.runs` to the same five
methods. Every method may block and may raise (a dropped connection raises
`ConnectionError` or any `OSError`); the dashboard shows the failure on that target and
retries with backoff.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Literal, Mapping, Protocol

LogName = Literal["train.log", "metrics.jsonl"]
RequestKind = Literal["checkpoint", "stop"]
FINAL_STATES = frozenset({"stopped", "failed", "done"})
GPU_HELPER = Path(__file__).resolve().parent.parent / "helpers" / "gpu_sample.py"


@dataclass(frozen=True)
class RunRow:
    """One run as its status.json (plus its `release` file) describes it."""

    target: str
    run_id: str
    state: str
    step: int = 0
    total_steps: int | None = None
    loss: float | None = None
    acc: float | None = None
    tau: float | None = None
    tokens_per_s: float | None = None
    tokens_per_s_steady: float | None = None
    pad_share: float | None = None
    heartbeat: float | None = None
    release: str | None = None
    recompiles: int = 0
    last_checkpoint: str | None = None
    gpus: tuple[int, ...] = ()
    error: str | None = None
    rank: int | None = None  # a run across hosts: this member's rank of `world`
    world: int | None = None


def group_fields(status: dict) -> dict:
    """rank/world of a rank of a run across hosts (status.json `distributed`), else {}."""
    d = status.get("distributed")
    if not isinstance(d, dict):
        return {}
    world = d.get("world_size", d.get("nnodes"))
    rank = d.get("rank")
    return {"rank": rank if isinstance(rank, int) else None, "world": world if isinstance(world, int) else None}


@dataclass(frozen=True)
class GpuSample:
    """One GPU seen from the host side (NVML / nvidia-smi); busy in percent."""

    index: int
    busy: float | None
    mem_gb: float | None
    mem_total_gb: float | None = None


# on_lines(lines, end_offset): complete lines (no newline) and the byte offset just past them.
OnLines = Callable[[list[str], int], None]


class DashSource(Protocol):
    def targets(self) -> list[str]:
        """Target names, in display order."""

    def list_runs(self, target: str) -> list[RunRow]:
        """Every run under the target's base dir. Polled every ~2 s per target."""

    def follow(
        self,
        target: str,
        run_id: str,
        name: LogName,
        on_lines: OnLines,
        stop: threading.Event,
        start: int | None = None,
        tail_lines: int = 200,
    ) -> None:
        """Stream a run file's complete lines until `stop` is set.

        `start=None` begins with the last `tail_lines` lines; `start=N` resumes at byte
        offset N (the last `end_offset` handed to `on_lines`), so a reconnect neither
        loses nor repeats a line. Blocks; raises on a dropped connection.
        """

    def request(self, target: str, run_id: str, kind: RequestKind) -> str:
        """Drop a control request (run-directory contract); return its id."""

    def gpu_samples(self, target: str) -> list[GpuSample] | None:
        """The target's GPUs now, or None when it has no GPU."""


def write_atomic(path: Path, text: str, tmp: Path | None = None) -> None:
    """Write, fsync, rename: a reader sees the old file or the whole new one (run-directory.md)."""
    tmp = tmp or path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def run_row_from_status(target: str, run_id: str, status: dict, release: str | None) -> RunRow:
    """Build a RunRow from a parsed status.json (tolerates missing fields)."""
    error = status.get("error")
    return RunRow(
        target=target,
        run_id=run_id,
        state=str(status.get("state", "unknown")),
        step=int(status.get("step") or 0),
        total_steps=status.get("total_steps"),
        loss=status.get("loss"),
        acc=status.get("acc"),
        tau=status.get("tau"),
        tokens_per_s=status.get("tokens_per_s"),
        tokens_per_s_steady=status.get("tokens_per_s_steady"),
        pad_share=status.get("pad_share"),
        heartbeat=status.get("heartbeat"),
        release=release,
        recompiles=int(status.get("recompiles") or 0),
        last_checkpoint=status.get("last_checkpoint"),
        gpus=tuple(status.get("gpus") or ()),
        error=error.get("message") if isinstance(error, dict) else None,
        **group_fields(status),
    )


def gpu_samples_from_json(payload: dict) -> list[GpuSample] | None:
    """Turn the gpu_sample helper's JSON into samples (None = no GPU)."""
    gpus = payload.get("gpus")
    if gpus is None:
        return None
    return [
        GpuSample(
            index=int(g["index"]),
            busy=g.get("busy"),
            mem_gb=g.get("mem_gb"),
            mem_total_gb=g.get("mem_total_gb"),
        )
        for g in gpus
    ]


def run_gpu_helper() -> dict:
    """Run the gpu_sample helper on this machine (a local target's "container")."""
    done = subprocess.run(
        [sys.executable, str(GPU_HELPER)], capture_output=True, text=True, timeout=30
    )
    if done.returncode != 0:
        raise RuntimeError(f"gpu_sample helper failed: {done.stderr.strip()}")
    return json.loads(done.stdout)


def tail_offset(handle, tail_lines: int, block: int = 1 << 16) -> int:
    """Byte offset where the last `tail_lines` complete lines of an open binary file start.

    A trailing line without its newline is not counted (it is still being written).
    """
    end = handle.seek(0, os.SEEK_END)
    pos, buf = end, b""
    while pos > 0 and buf.count(b"\n") <= tail_lines:
        step = min(block, pos)
        pos -= step
        handle.seek(pos)
        buf = handle.read(step) + buf
    cut = buf.rfind(b"\n")  # end of the last complete line
    for _ in range(tail_lines):
        if cut < 0:
            return pos
        cut = buf.rfind(b"\n", 0, cut)
    return pos + cut + 1 if cut >= 0 else pos


def process_alive(pid: int, pid_start: int | None) -> bool:
    """True when /proc/<pid> exists and (if known) started at `pid_start` clock ticks."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    if pid_start is None:
        return True
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[19]) == int(pid_start)  # field 22 overall; fields[0] is field 3


class LocalDirSource:
    """Runs under `{target: base_dir}` on this filesystem: base_dir/runs/<run-id>/."""

    def __init__(
        self,
        bases: Mapping[str, str | Path],
        gpu_probe: Callable[[], dict] | None = run_gpu_helper,
        poll_s: float = 0.1,
        check_pids: bool = True,
    ) -> None:
        self._bases = {name: Path(base) for name, base in bases.items()}
        self._gpu_probe = gpu_probe
        self._poll_s = poll_s
        self._check_pids = check_pids

    def targets(self) -> list[str]:
        return list(self._bases)

    def run_dir(self, target: str, run_id: str) -> Path:
        if "/" in run_id or run_id.startswith("."):
            raise ValueError(f"bad run id {run_id!r}")
        return self._bases[target] / "runs" / run_id

    def list_runs(self, target: str) -> list[RunRow]:
        runs = self._bases[target] / "runs"
        if not runs.is_dir():
            return []
        rows = []
        for run_dir in sorted(p for p in runs.iterdir() if p.is_dir() and not p.name.startswith(".")):
            rows.append(self._read_row(target, run_dir))
        return rows

    def _read_row(self, target: str, run_dir: Path) -> RunRow:
        try:
            release = (run_dir / "release").read_text().strip() or None
        except OSError:
            release = None
        try:
            status = json.loads((run_dir / "status.json").read_text())
        except FileNotFoundError:
            return RunRow(target, run_dir.name, "unknown", release=release, error="no status.json yet")
        except (OSError, ValueError) as exc:
            return RunRow(target, run_dir.name, "unknown", release=release, error=f"status.json: {exc}")
        row = run_row_from_status(target, run_dir.name, status, release)
        if (
            self._check_pids
            and row.state not in FINAL_STATES
            and isinstance(status.get("pid"), int)
            and not process_alive(status["pid"], status.get("pid_start"))
        ):
            return replace(row, state="failed", error="process died without saying so")
        return row

    def follow(self, target, run_id, name, on_lines, stop, start=None, tail_lines=200) -> None:
        if name not in ("train.log", "metrics.jsonl"):
            raise ValueError(f"cannot follow {name!r}")
        path = self.run_dir(target, run_id) / name
        while not path.exists():
            if stop.wait(self._poll_s):
                return
        with open(path, "rb") as handle:
            offset = tail_offset(handle, tail_lines) if start is None else start
            handle.seek(offset)
            partial = b""
            while not stop.is_set():
                chunk = handle.read(1 << 20)
                if not chunk:
                    if os.fstat(handle.fileno()).st_size < offset:
                        raise ConnectionResetError(f"{path} was truncated")
                    stop.wait(self._poll_s)
                    continue
                data = partial + chunk
                cut = data.rfind(b"\n") + 1
                partial = data[cut:]
                if cut:
                    offset += cut
                    on_lines(data[:cut].decode("utf-8", "replace").splitlines(), offset)

    def request(self, target: str, run_id: str, kind: RequestKind) -> str:
        if kind not in ("checkpoint", "stop"):
            raise ValueError(f"unknown request kind {kind!r}")
        run_dir = self.run_dir(target, run_id)
        if not run_dir.is_dir():
            raise FileNotFoundError(f"no run {run_id!r} on {target}")
        control = run_dir / "control"
        control.mkdir(exist_ok=True)
        request_id = uuid.uuid4().hex[:12]
        write_atomic(control / kind, json.dumps({"id": request_id, "time": time.time()}),
                     tmp=control / f".{kind}.{request_id}.tmp")
        return request_id

    def gpu_samples(self, target: str) -> list[GpuSample] | None:
        if self._gpu_probe is None:
            return None
        return gpu_samples_from_json(self._gpu_probe())
