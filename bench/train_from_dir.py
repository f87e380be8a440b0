"""Training tokens/s with the target loaded from a model directory: `python -m trainer` with
`model.target.path` pointing at a hub-format directory (sharded safetensors + index, config.json,
tokenizer files; random weights, written by trainer_tools.fixtures.hub_model.write_hub_model), the
trainer run as a user runs it, in a child process.

    PYTHONPATH=. python bench/train_from_dir.py --device cuda:0 --model-dir /tmp/qwen3-8b-random   # H200
    PYTHONPATH=. python bench/train_from_dir.py --device cpu --shape tiny --steps 3                  # CPU smoke

The 8B run uses trainer/configs/gpu-8b-shape.yaml with only the target (and the data size, step
count and checkpointing) changed, so its figure compares with that config's in-code random target
(bench/RESULTS.md, issue #13). Reported: the trainer's own figures (steady real tokens/s from
status.json, the target's load time and peak memory from train.log, per-device peak memory from
metrics.jsonl, warm-up, the end-of-run τ evaluation and checkpoint) and the whole run's wall time.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from bench.common import hub_model_dir, report
from trainer.run.contract import read_events, read_log, read_status

ROOT = Path(__file__).resolve().parents[1]


def config_for(model_dir: Path, args) -> dict:
    cfg = yaml.safe_load((ROOT / "trainer" / "configs" / "gpu-8b-shape.yaml").read_text())
    cfg["model"]["target"] = {"path": str(model_dir)}
    cfg["data"]["synthetic"].update(n_train=args.conversations, n_eval=4)
    cfg["optim"]["total_steps"] = args.steps
    cfg["run"].update(checkpoint_every=0, log_every=1)
    cfg["devices"] = {"target": [args.device], "drafter": [args.device]}
    cfg["eval"] = {"samples": 2, "max_new_tokens": 32}
    if args.shape == "tiny":  # CPU smoke: small rows, short answers, the reference loop
        cfg["data"].update(max_length=512, pack_length=1024, num_anchors=32, token_budget=512,
                           bucket_edges=[256, 512], pad_multiple=64)
        cfg["data"]["synthetic"].update(min_len=40, max_len=200)
        cfg["optim"]["micro_batches"] = 1
        cfg["model"]["dtype"] = "fp32"
        cfg["pipeline"]["kind"] = "reference"
    return cfg


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--shape", choices=["8b", "tiny"], default="8b")
    p.add_argument("--model-dir", type=Path, help="the target directory (written here if it has no config.json)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--conversations", type=int, default=500)
    p.add_argument("--timeout", type=float, default=480, help="seconds before the trainer is stopped")
    p.add_argument("--out", type=Path)
    p.add_argument("--keep", action="store_true", help="keep the run directory (and a model directory written here)")
    args = p.parse_args(argv)
    out: dict = {"device": args.device, "shape": args.shape, "steps": args.steps}
    work = Path(tempfile.mkdtemp(prefix="train-from-dir-"))
    model_dir = hub_model_dir(args.model_dir or work / "target", args.shape, args.device, out)
    config = work / "config.yaml"
    config.write_text(yaml.safe_dump(config_for(model_dir, args), sort_keys=False))
    run_dir = work / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    began = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "trainer", "--config", str(config), "--run-dir", str(run_dir)],
                              cwd=ROOT, env=env, timeout=args.timeout, capture_output=True, text=True)
        out["exit"] = proc.returncode
        if proc.returncode:
            out["stderr_tail"] = proc.stderr[-3000:]
    except subprocess.TimeoutExpired:
        out["exit"] = f"timed out after {args.timeout:.0f}s"
    out["wall_s"] = round(time.perf_counter() - began, 1)
    log = read_log(run_dir)
    status = read_status(run_dir) or {}
    metrics = read_events(run_dir)
    for key in ("step", "tokens_per_s", "tokens_per_s_steady", "state"):
        if key in status:
            out[key] = status[key]
    wanted = ("target ", "packing ", "warm-up", "eval step", "checkpoint ", "done", "FAILED", "drafter ")
    out["log"] = [re.sub(r"^\S+ ", "", line) for line in log.splitlines() if any(w in line for w in wanted)]
    mems = [g["mem_gb"] for m in metrics for g in m.get("gpus") or [] if g.get("mem_gb") is not None]
    if mems:  # the threaded pipeline's per-window device entries (CUDA only)
        out["peak_mem_gib"] = round(max(mems), 1)
    steps = [m for m in metrics if "tokens_per_s" in m]
    out["tokens_per_s_by_window"] = [round(m["tokens_per_s"]) for m in steps]
    if args.keep:
        out["work_dir"] = str(work)
    else:
        shutil.rmtree(work)  # what this run created: its config, run directory and any model written in it
    return report(out, args.out)


if __name__ == "__main__":
    main()
