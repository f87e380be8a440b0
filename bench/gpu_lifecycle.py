"""The run lifecycle once for real on a GPU host, as a user would drive it from the CLI.

Starts OpenSSH sshd on 127.0.0.1 in front of the pct stand-in (or, where the machine has no
sshd, the simulated node over the local transport, and says so), then: deploy, `run start`
the GPU config, wait for steps, `run checkpoint --wait`, `kill -9` the trainer inside the
container, `run status` (must show failed: the process died without saying so), `run resume`,
wait until the step count passes the checkpoint, `run stop`. Prints a timeline with seconds.

    PYTHONPATH=. python bench/gpu_lifecycle.py [--config trainer/configs/gpu-8b-shape.yaml] [--gpus 0]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from dflash_ops.testing.sshd import sshd_unavailable_reason, start_sshd

REPO = Path(__file__).resolve().parent.parent

T0 = time.monotonic()


def say(message: str) -> None:
    print(f"[{time.monotonic() - T0:7.1f}s] {message}", flush=True)


def cli(inventory: Path, *args: str, check: bool = True) -> str:
    done = subprocess.run([sys.executable, "-m", "dflash_ops", *args], cwd=REPO, capture_output=True,
                          text=True, env=cli_env(inventory))
    out = (done.stdout + done.stderr).strip()
    say(f"$ dflash-ops {' '.join(args)}  (exit {done.returncode})")
    for line in out.splitlines()[-12:]:
        print(f"          {line}", flush=True)
    if check and done.returncode != 0:
        raise SystemExit(f"command failed: {args}")
    return done.stdout


def cli_env(inventory: Path) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "DFLASH_OPS_INVENTORY": str(inventory)}


def wait_for(inventory: Path, run_id: str, predicate, what: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        doc = json.loads(subprocess.run(
            [sys.executable, "-m", "dflash_ops", "run", "status", "host200", run_id, "--json"],
            cwd=REPO, capture_output=True, text=True, env=cli_env(inventory)).stdout or "{}")
        if predicate(doc):
            say(f"{what}: state {doc.get('effective_state')} step {doc.get('step')} loss {doc.get('loss')}")
            return doc
        time.sleep(2)
    raise SystemExit(f"timed out waiting for {what}")


def inventory_for(work: Path, gpus: list[int]) -> tuple[Path, str]:
    reason = sshd_unavailable_reason()
    if reason is None:
        try:
            import paramiko  # noqa: F401
        except ImportError as exc:
            reason = f"no paramiko here ({exc})"
    if reason is None:
        node = start_sshd(work / "sshd")
        doc = yaml.safe_load(node.inventory.read_text())
        how = f"real OpenSSH sshd on 127.0.0.1:{node.port} in front of the pct stand-in"
    else:
        # sim_containers: CT 200 is `pct create`d on first use, with its own python (not on pct's PATH)
        doc = {"nodes": {"sim": {"transport": "local", "pct": "simulated", "sim_root": str(work / "sim"),
                                 "sim_containers": [200]}},
               "targets": {"host200": {"node": "sim", "ctid": 200, "base_dir": str(work / "ct200" / "opt" / "dflash"),
                                       "python": str(work / "sim" / "ct" / "200" / "usr" / "bin" / "python3")}}}
        how = f"simulated node over the local transport (sshd tier unavailable: {reason})"
    doc["targets"]["host200"]["gpus"] = gpus
    path = work / "inventory.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path, how


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="trainer/configs/gpu-8b-shape.yaml")
    ap.add_argument("--gpus", default="0", help="GPU indices for the run; '' for a CPU smoke run")
    ap.add_argument("--steps", type=int, default=60, help="total_steps of the run")
    ap.add_argument("--n-train", type=int, default=200, help="synthetic conversations (keeps data prep short)")
    args = ap.parse_args()
    gpus = [int(g) for g in args.gpus.split(",") if g]
    work = Path(tempfile.mkdtemp(prefix="gpu-lifecycle-"))
    inventory, how = inventory_for(work, gpus)
    say(f"node: {how}")

    config = yaml.safe_load((REPO / args.config).read_text())
    config["optim"]["total_steps"] = args.steps
    config["data"]["synthetic"]["n_train"] = args.n_train
    config["run"]["checkpoint_every"] = 10_000
    run_config = work / "gpu-run.yaml"
    run_config.write_text(yaml.safe_dump(config, sort_keys=False))

    cli(inventory, "deploy", "host200")
    gpu_args = ["--gpus", args.gpus] if gpus else []
    run_id = cli(inventory, "run", "start", "host200", "--config", str(run_config), "--name", "gpu",
                 *gpu_args).strip().splitlines()[-1]
    wait_for(inventory, run_id, lambda d: (d.get("step") or 0) >= 5, "5 steps done", 900)
    cli(inventory, "run", "checkpoint", "host200", run_id, "--wait", "--timeout", "600")
    before = wait_for(inventory, run_id, lambda d: d.get("last_checkpoint"), "checkpoint recorded", 120)
    ckpt_step = int(str(before["last_checkpoint"]).rsplit("_", 1)[-1])
    pid = before["pid"]
    cli(inventory, "exec", "host200", "--", "kill", "-9", str(pid))
    wait_for(inventory, run_id, lambda d: d.get("effective_state") == "failed", "after kill -9", 60)
    cli(inventory, "run", "status", "host200", run_id, check=False)
    cli(inventory, "run", "resume", "host200", run_id, *gpu_args)
    wait_for(inventory, run_id, lambda d: (d.get("step") or 0) > ckpt_step + 3 and d.get("alive"),
             f"resumed past checkpoint step {ckpt_step}", 900)
    cli(inventory, "metrics", "host200", run_id, "-n", "6", check=False)
    cli(inventory, "run", "stop", "host200", run_id, "--timeout", "600", check=False)
    cli(inventory, "run", "list", "host200", check=False)
    cli(inventory, "logs", "host200", run_id, "-n", "15", check=False)
    say("done")


if __name__ == "__main__":
    main()
