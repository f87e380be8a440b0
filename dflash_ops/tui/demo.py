"""A simulated run that writes a run directory the way the trainer does (contract v1).

It stands in for a tiny CPU run where no trainer is at hand: `dflash-ops dash --demo`,
the dashboard tests and its load measurement drive it. It honours control requests
(`checkpoint`, `stop`) at step boundaries like the trainer. GPU entries mimic the pipeline's
dead zones: target GPUs that go choppy and a drafter GPU that idles.
"""

from __future__ import annotations

import json
import math
import os
import random
import threading
import time
from pathlib import Path
from typing import Any, Callable

from trainer.run.contract import CONTRACT_VERSION, process_start_ticks, write_atomic
from trainer.run.control import ControlPoller

ROLES = {0: "target", 1: "target", 2: "drafter", 3: "drafter"}


TOKENS_PER_STEP = 4096  # real tokens a simulated step trains
PHASE_OF = {"starting": "starting", "warmup": "compiling and warming up", "running": "training"}  # status.json `phase`


class SimulatedRun:
    def __init__(self, base_dir: str | Path, run_id: str = "demo", total_steps: int = 200,
                 gpus: dict[int, str] | None = None, seed: int = 0, clock: Callable[[], float] = time.time,
                 log_lines_per_step: int = 2) -> None:
        self.dir = Path(base_dir) / "runs" / run_id
        self.run_id = run_id
        self.total_steps = total_steps
        self.gpus = ROLES if gpus is None else gpus
        self.step = 0
        self.state = "starting"
        self.clock = clock
        self.log_lines_per_step = log_lines_per_step
        self.last_checkpoint: str | None = None
        self._random = random.Random(seed)
        self._started = clock()
        self._loss: float | None = None
        self._acc: float | None = None
        self._tps: float | None = None
        self._tau: float | None = None

    # -- files -----------------------------------------------------------------------
    def _event(self, event: str, **fields: Any) -> None:
        line = json.dumps({"event": event, "time": self.clock(), "step": self.step, **fields})
        with open(self.dir / "metrics.jsonl", "a") as handle:
            handle.write(line + "\n")

    def log(self, *lines: str) -> None:
        with open(self.dir / "train.log", "a") as handle:
            handle.write("".join(line + "\n" for line in lines))

    def write_status(self) -> None:
        pid = os.getpid()
        status = {"version": CONTRACT_VERSION, "run_id": self.run_id, "state": self.state, "pid": pid,
                  "pid_start": process_start_ticks(pid), "step": self.step, "total_steps": self.total_steps,
                  "started": self._started, "heartbeat": self.clock(), "loss": self._loss, "acc": self._acc,
                  "tau": self._tau, "tokens_per_s": self._tps, "gpus": sorted(self.gpus),
                  "last_checkpoint": self.last_checkpoint, "recompiles": 0, "error": None,
                  "phase": {"name": PHASE_OF.get(self.state, "finished"), "done": None, "total": None,
                            "since": self._started},
                  "tokens_done": self.step * TOKENS_PER_STEP, "tokens_total": self.total_steps * TOKENS_PER_STEP,
                  "tokens_per_s_recent": self._tps}
        write_atomic(self.dir / "status.json", json.dumps(status).encode())

    # -- lifecycle ---------------------------------------------------------------------
    def begin(self) -> None:
        self._control = ControlPoller(self.dir)  # creates control/ (and the run directory)
        (self.dir / "checkpoints").mkdir(exist_ok=True)
        write_atomic(self.dir / "release", b"dev\n")
        write_atomic(self.dir / "config.yaml", b"model: tiny\nsteps: %d\n" % self.total_steps)
        self.write_status()
        self._event("start", resumed_from=None, total_steps=self.total_steps, config="tiny demo")
        self.log(f"starting run {self.run_id}: tiny demo, {self.total_steps} steps")
        self.state = "warmup"
        self.write_status()
        self._event("warmup", shapes=[[4, 128], [2, 256]], seconds=1.5)
        self.log("warm-up: compiled 2 shapes in 1.5 s")
        self.state = "running"
        self.write_status()

    def advance(self) -> bool:
        """One optimizer step plus control handling; False once the run is final."""
        if self.state in ("stopped", "done"):
            return False
        self.step += 1
        rng = self._random
        self._loss = round(4.0 * math.exp(-self.step / 60) + 0.5 + rng.uniform(-0.05, 0.05), 4)
        self._acc = round(min(0.95, 0.1 + self.step / (self.total_steps * 1.2)), 4)
        self._tps = round(1800 + 400 * math.sin(self.step / 7) + rng.uniform(-50, 50), 1)
        gpus = [{"index": index, "role": role,
                 "busy": round(rng.choice([0.05, 0.95, 0.9]) if role == "target" else rng.uniform(0.0, 0.15), 2),
                 "mem_gb": 30.0 if role == "target" else 12.5} for index, role in sorted(self.gpus.items())]
        self._event("step", loss=self._loss, acc=self._acc, lr=3e-4, grad_norm=1.0, tokens_per_s=self._tps, gpus=gpus,
                    recompiles=0)
        line = f"step {self.step:>5} loss {self._loss:.4f} acc {self._acc:.3f} tok/s {self._tps:.0f}"
        self.log(*(line + (f" part {i}" if i else "") for i in range(self.log_lines_per_step)))
        if self.step % 50 == 0:
            self._tau = round(1.5 + self.step / 100, 2)
            self._event("eval", tau=self._tau, acc=self._acc, samples=64)
        self._serve_control()
        if self.state == "running" and self.step >= self.total_steps:
            self.state = "done"
            self._event("stop", reason="done")
        self.write_status()
        return self.state not in ("stopped", "done")

    def _serve_control(self) -> None:
        """The trainer's own poller; checkpoints before a stop, as trainer/train/loop.py serves them."""
        for request in sorted(self._control.poll(), key=lambda r: r.kind == "stop"):
            self._checkpoint(request.id)
            self._control.done(request)
            if request.kind == "stop":
                self.state = "stopped"
                self._event("stop", reason="control")
                self.log(f"stop requested ({request.id}): stopped at step {self.step}")

    def _checkpoint(self, request_id: str | None) -> None:
        rel = f"checkpoints/step_{self.step}"
        final = self.dir / rel
        if not final.exists():
            tmp = self.dir / "checkpoints" / f".tmp-step_{self.step}-{os.getpid()}"
            tmp.mkdir(parents=True, exist_ok=True)
            write_atomic(tmp / "manifest.json", json.dumps({"step": self.step, "files": {}}).encode())
            os.replace(tmp, final)
        self.last_checkpoint = rel
        self._event("checkpoint", path=rel, seconds=0.1, request=request_id)
        self.log(f"checkpoint {rel} (request {request_id})")

    def run(self, stop: threading.Event, step_s: float = 0.5) -> None:
        """Begin, then step every `step_s` seconds until final or `stop` is set."""
        self.begin()
        while not stop.is_set() and self.advance():
            stop.wait(step_s)

