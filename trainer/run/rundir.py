"""The run directory's writer (docs/run-directory.md; its contract, the version, final states, status
fields and the atomic write, is trainer/run/contract.py): status.json, metrics.jsonl, train.log."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from trainer.run.contract import CONTRACT_VERSION, phase_text, process_start_ticks, write_atomic


class RunDir:
    """Writes status.json, metrics.jsonl and train.log; safe to call from several threads."""

    def __init__(self, root: str | Path, total_steps: int):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "control").mkdir(exist_ok=True)
        (self.root / "checkpoints").mkdir(exist_ok=True)
        self._lock = threading.Lock()
        pid = os.getpid()
        self.status: dict[str, Any] = {
            "version": CONTRACT_VERSION, "run_id": self.root.name, "state": "starting", "pid": pid,
            "pid_start": process_start_ticks(pid), "step": 0, "total_steps": total_steps,
            "started": time.time(), "heartbeat": time.time(), "loss": None, "acc": None, "tau": None,
            "tokens_per_s": None, "gpus": [], "last_checkpoint": None, "recompiles": 0, "error": None,
            "phase": {"name": "starting", "done": None, "total": None, "since": time.time()},
        }
        self._phase_written = 0.0  # when a progress count was last written to status.json
        self._log_copy = None if self._stdout_is_train_log() else open(self.root / "train.log", "a")
        self._heartbeat_stop = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None
        self.write_failures = {"status": 0, "metrics": 0, "log": 0}  # writes lost (e.g. a full disk)
        self._failing: set[str] = set()
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
            try:
                print(line, flush=True)
                if self._log_copy is not None:
                    self._log_copy.write(line + "\n")
                    self._log_copy.flush()
            except OSError as e:
                self._lost("log", e)

    def _lost(self, what: str, error: OSError) -> None:
        """A write failed (ENOSPC, EIO...): training goes on; status.json reports it once it can
        be written again (write_failures, last_write_error). Called with the lock held."""
        self.write_failures[what] += 1
        self._failing.add(what)
        self.status["write_failures"] = dict(self.write_failures)
        self.status["last_write_error"] = {"what": what, "message": f"{type(error).__name__}: {error}",
                                           "time": time.time()}

    def update(self, **fields: Any) -> None:
        with self._lock:
            self.status.update(fields)
        self.write_status()

    def phase(self, name: str, done: int | None = None, total: int | None = None) -> None:
        """What the run does now (status.json `phase`, trainer.run.contract.PHASES), from its first
        second: a new phase is written, logged and recorded (a metrics.jsonl `phase` event) at once; a
        progress count within one (`done` of `total`) is written to status.json at most once a second,
        and recorded at each tenth of the count, so a fast loop costs no fsync or line per item."""
        with self._lock:
            current = self.status["phase"]
            new = current.get("name") != name
            tenth = (total is not None and done is not None and total > 0
                     and done * 10 // total != (current.get("done") or 0) * 10 // total)
            self.status["phase"] = {"name": name, "done": done, "total": total,
                                    "since": time.time() if new else current.get("since")}
            due = new or time.time() - self._phase_written >= 1.0 or (done is not None and done == total)
            step = self.status.get("step", 0)
        if due:
            self._phase_written = time.time()
            self.write_status()
        if new or tenth:
            self.event("phase", step, name=name, done=done, total=total)
        if new:
            self.log(f"phase: {phase_text(self.status['phase'])}")

    def write_status(self) -> bool:
        """Replace status.json. A failure never stops training: it is counted, and the next
        heartbeat (or update) tries again with everything the lost write held."""
        with self._lock:
            self.status["heartbeat"] = time.time()
            data = json.dumps(self.status, indent=1).encode()
            try:
                write_atomic(self.root / "status.json", data)
            except OSError as e:
                self._lost("status", e)
                return False
            if self._failing:
                recovered, self._failing = sorted(self._failing), set()
                self._note(f"writes to the run directory work again after failures ({', '.join(recovered)}: "
                           f"{self.status['last_write_error']['message']}); counts in status.json write_failures")
            return True

    def _note(self, line: str) -> None:
        try:
            print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True)
        except OSError:
            pass

    def event(self, event: str, step: int, **fields: Any) -> dict:
        """Append one metrics.jsonl line, written whole with a single write."""
        record = {"event": event, "time": time.time(), "step": step, **fields}
        line = (json.dumps(record) + "\n").encode()
        with self._lock:
            try:
                fd = os.open(self.root / "metrics.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    written = os.write(fd, line)
                    if written != len(line):  # a torn line: end it so the next event starts clean
                        os.write(fd, b"\n")
                        raise OSError(28, "short write to metrics.jsonl")
                finally:
                    os.close(fd)
            except OSError as e:
                self._lost("metrics", e)
        return record

    def start_heartbeat(self, interval_s: float) -> None:
        def beat() -> None:
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
