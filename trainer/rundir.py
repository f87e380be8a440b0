"""The run directory (docs/run-directory.md, version 1): status.json, metrics.jsonl, train.log."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

CONTRACT_VERSION = 1
FINAL_STATES = ("stopped", "failed", "done")


def atomic_write(path: Path, data: bytes) -> None:
    """Write tmp, fsync, rename: readers see the old or the new file, never half of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def process_start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (start time in clock ticks), or None off Linux."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[19])


class RunDir:
    """Writes status.json, metrics.jsonl and train.log; safe to call from several threads."""

    def __init__(self, root: str | Path, total_steps: int):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "control").mkdir(exist_ok=True)
        (self.root / "checkpoints").mkdir(exist_ok=True)
        self._lock = threading.Lock()
        pid = os.getpid()
        self.status = {
            "version": CONTRACT_VERSION, "run_id": self.root.name, "state": "starting", "pid": pid,
            "pid_start": process_start_ticks(pid), "step": 0, "total_steps": total_steps,
            "started": time.time(), "heartbeat": time.time(), "loss": None, "acc": None, "tau": None,
            "tokens_per_s": None, "gpus": [], "last_checkpoint": None, "recompiles": 0, "error": None,
        }
        self._log_copy = None if self._stdout_is_train_log() else open(self.root / "train.log", "a")
        self._heartbeat_stop = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None
        self.write_status()

    def _stdout_is_train_log(self) -> bool:
        try:
            out, log = os.fstat(sys.stdout.fileno()), os.stat(self.root / "train.log")
        except (OSError, ValueError, AttributeError):
            return False
        return (out.st_dev, out.st_ino) == (log.st_dev, log.st_ino)

    def log(self, message: str) -> None:
        """Human progress: stdout (which ops redirects into train.log), else also appended to train.log."""
        line = f"[{time.strftime('%H:%M:%S')}] {message}"
        with self._lock:
            print(line, flush=True)
            if self._log_copy is not None:
                self._log_copy.write(line + "\n")
                self._log_copy.flush()

    def update(self, **fields) -> None:
        with self._lock:
            self.status.update(fields)
        self.write_status()

    def write_status(self) -> None:
        with self._lock:
            self.status["heartbeat"] = time.time()
            data = json.dumps(self.status, indent=1).encode()
            atomic_write(self.root / "status.json", data)

    def event(self, event: str, step: int, **fields) -> dict:
        """Append one metrics.jsonl line, written whole with a single write."""
        record = {"event": event, "time": time.time(), "step": step, **fields}
        line = (json.dumps(record) + "\n").encode()
        with self._lock:
            fd = os.open(self.root / "metrics.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
        return record

    def start_heartbeat(self, interval_s: float) -> None:
        def beat():
            while not self._heartbeat_stop.wait(interval_s):
                self.write_status()

        self._heartbeat_thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
        self._heartbeat_thread.start()

    def close(self) -> None:
        self._heartbeat_stop.set()
        if self._heartbeat_thread is not None:
            self._heartbeat_thread.join()
        if self._log_copy is not None:
            self._log_copy.close()
