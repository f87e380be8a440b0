"""A stand-in trainer for tests (stdlib only): obeys docs/run-directory.md, steps in milliseconds.

Tests install it as `<release>/trainer/__main__.py` so `python -m trainer` runs it exactly
like the real one. Its config is `key: value` lines:

  total_steps       steps to do (default 20)
  step_seconds      sleep per step (default 0.001)
  log_lines         train.log lines per step (default 1)
  checkpoint_every  write a checkpoint every N steps (default 0: only on request and at the end)
  crash_at_step     raise at that step (state failed, exit 1)
  vanish_at_step    os._exit(9) at that step without touching status.json
  hog_mib_at_step   "N M": at step N allocate and touch M MiB (a container's memory limit kills it)
  exit_before_status  exit 5 before writing status.json
  checkpoint_bytes  size of each checkpoint state file (default 3000)
  gpus              comma-separated GPU indices to report
  dump_env          write env.json (environment and cwd) into the run dir
  hold_at_step      a run not resumed stops stepping at that step (requests still served) until a stop
                    comes: a test's requests land mid-run however slow the machine is
"""

import argparse
import hashlib
import json
import os
import re
import signal
import sys
import time
import traceback

stop_signalled = False


def on_sigterm(signum, frame):
    global stop_signalled
    stop_signalled = True


def read_config(path):
    config = {}
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                key, _, value = line.partition(":")
                config[key.strip()] = value.strip()
    return config


def pid_start():
    with open("/proc/self/stat") as f:
        stat = f.read()
    return int(stat[stat.rfind(")") + 2:].split()[19])


class FakeRun:
    def __init__(self, run_dir, config, resume):
        self.run_dir = run_dir
        self.config = config
        self.total_steps = int(config.get("total_steps", 20))
        self.step_seconds = float(config.get("step_seconds", 0.001))
        self.log_lines = int(config.get("log_lines", 1))
        self.checkpoint_bytes = int(config.get("checkpoint_bytes", 3000))
        gpus = config.get("gpus", "")
        self.gpus = [int(g) for g in gpus.split(",")] if gpus else []
        self.step = 0
        self.last_checkpoint = None
        self.state = "starting"
        self.started = time.time()
        self.pid_start = pid_start()
        self.resumed_from = None
        if resume is not None:
            self.resume(resume)

    def resume(self, which):
        steps = sorted(int(m.group(1)) for m in
                       (re.match(r"^step_(\d+)$", n) for n in os.listdir(os.path.join(self.run_dir, "checkpoints")))
                       if m)
        step = steps[-1] if which == "latest" else int(which)
        if step not in steps:
            raise SystemExit("no checkpoint step_%d" % step)
        self.step = step
        self.last_checkpoint = "checkpoints/step_%d" % step
        self.resumed_from = self.last_checkpoint

    def write_status(self, error=None):
        status = {
            "version": 1, "run_id": os.path.basename(self.run_dir), "state": self.state,
            "pid": os.getpid(), "pid_start": self.pid_start, "step": self.step,
            "total_steps": self.total_steps, "started": self.started, "heartbeat": time.time(),
            "loss": 1.0 / (1 + self.step), "acc": 0.5, "tokens_per_s": 1000.0, "gpus": self.gpus,
            "last_checkpoint": self.last_checkpoint, "recompiles": 0, "error": error,
        }
        path = os.path.join(self.run_dir, "status.json")
        with open(path + ".tmp", "w") as f:
            json.dump(status, f)
        os.replace(path + ".tmp", path)

    def metric(self, event, **fields):
        line = json.dumps(dict(event=event, time=time.time(), step=self.step, **fields))
        with open(os.path.join(self.run_dir, "metrics.jsonl"), "a") as f:
            f.write(line + "\n")

    def checkpoint(self, request=None):
        name = "step_%d" % self.step
        root = os.path.join(self.run_dir, "checkpoints")
        tmp = os.path.join(root, ".tmp-%s-%d" % (name, os.getpid()))
        os.makedirs(tmp, exist_ok=True)
        files = {}
        for fname, seed in (("state.bin", b"s"), ("optim/adam.bin", b"o")):
            data = (seed + str(self.step).encode()) * (self.checkpoint_bytes // 4)
            path = os.path.join(tmp, fname)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
            files[fname] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        with open(os.path.join(tmp, "manifest.json"), "w") as f:
            json.dump({"step": self.step, "files": files}, f)
        final = os.path.join(root, name)
        if os.path.isdir(final):
            for dirpath, dirnames, filenames in os.walk(final, topdown=False):
                for n in filenames:
                    os.unlink(os.path.join(dirpath, n))
                for n in dirnames:
                    os.rmdir(os.path.join(dirpath, n))
            os.rmdir(final)
        os.rename(tmp, final)
        self.last_checkpoint = "checkpoints/" + name
        self.metric("checkpoint", path=self.last_checkpoint, seconds=0.0, request=request)
        print("checkpoint %s written" % self.last_checkpoint)

    def take_request(self, kind):
        path = os.path.join(self.run_dir, "control", kind)
        try:
            with open(path) as f:
                request = json.load(f)
        except FileNotFoundError:
            return None
        os.unlink(path)
        return request

    def run(self, config_path):
        with open(config_path, "rb") as src, open(os.path.join(self.run_dir, "config.yaml"), "wb") as dst:
            dst.write(src.read())
        self.write_status()
        self.metric("start", resumed_from=self.resumed_from, total_steps=self.total_steps, config={})
        print("fake trainer pid %d starting at step %d" % (os.getpid(), self.step))
        self.state = "running"
        crash_at = int(self.config.get("crash_at_step", -1))
        vanish_at = int(self.config.get("vanish_at_step", -1))
        hog_at, hog_mib = (int(x) for x in str(self.config.get("hog_mib_at_step", "-1 0")).split())
        hold_at = int(self.config.get("hold_at_step", -1)) if self.resumed_from is None else -1
        while self.step < self.total_steps:
            stop = self.take_request("stop")
            if stop is not None or stop_signalled:
                self.state = "checkpointing"
                self.write_status()
                self.checkpoint(request=stop["id"] if stop else None)
                self.state = "stopped"
                self.metric("stop", reason="control" if stop else "signal")
                self.write_status()
                print("stopped at step %d" % self.step)
                return 0
            request = self.take_request("checkpoint")
            if request is not None:
                self.checkpoint(request=request["id"])
            time.sleep(self.step_seconds)
            if self.step == hold_at:
                continue
            self.step += 1
            if self.step == crash_at:
                raise RuntimeError("fake crash at step %d" % self.step)
            if self.step == vanish_at:
                sys.stdout.flush()
                os._exit(9)
            if self.step == hog_at:
                hog = bytearray(hog_mib << 20)
                hog[::4096] = b"x" * len(hog[::4096])
            for i in range(self.log_lines):
                print("step %d line %d loss %.4f" % (self.step, i, 1.0 / (1 + self.step)))
            self.metric("step", loss=1.0 / (1 + self.step), acc=0.5, lr=1e-4, grad_norm=1.0, tokens_per_s=1000.0)
            self.write_status()
            every = int(self.config.get("checkpoint_every", 0))
            if every and self.step % every == 0 and self.step < self.total_steps:
                self.checkpoint()
        self.checkpoint()
        self.state = "done"
        self.metric("stop", reason="done")
        self.write_status()
        print("done")
        return 0


def main():
    parser = argparse.ArgumentParser(prog="trainer")
    parser.add_argument("--config", required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--resume")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, on_sigterm)
    config = read_config(args.config)
    if config.get("dump_env"):
        with open(os.path.join(args.run_dir, "env.json"), "w") as f:
            json.dump({"env": dict(os.environ), "cwd": os.getcwd()}, f)
    if config.get("exit_before_status"):
        print("fake trainer: refusing to start (exit_before_status)")
        return 5
    run = FakeRun(args.run_dir, config, args.resume)
    try:
        return run.run(args.config)
    except Exception as e:  # noqa: BLE001 - like the trainer: any crash lands in status.json
        run.state = "failed"
        run.metric("error", message=str(e), traceback=traceback.format_exc(), thread="main")
        run.write_status(error={"message": str(e), "traceback": traceback.format_exc(), "thread": "main"})
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main())
