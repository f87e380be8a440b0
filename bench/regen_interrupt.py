"""How soon `python -m trainer_tools.regen --engine hf` stops on SIGINT mid-batch (the quality
bench's deadline), beside how long the same batch takes to decode.

    PYTHONPATH=. python bench/regen_interrupt.py --device cuda:0 --rows 16384 --prompt-words 300 --out /tmp/ri  # 1 GPU
    PYTHONPATH=. python bench/regen_interrupt.py --device cpu --rows 64 --hf-rows 64 --prompt-words 8 --max-tokens 64 --out /tmp/ri

The target is bench/quality.py's h200 target shape (33.6M parameters, random weights) in a hub-format
directory; the prompts are one batch (-n ROWS; --hf-rows for transformers' generate, whose cache
grows: recipe_ablation's sampled batch), greedy, --max-tokens new tokens each. For each
decoder (static: the preallocated-cache loop; hf: transformers' generate), regen runs twice as a
user runs it: once to the end (batch_s: from regen's "decoding" line to its exit), then on a fresh
output with a SIGINT half that time after the "decoding" line (stop_s: from the SIGINT to its
exit; exit 130 and whole lines expected; `cancelled`: regen's own line, the decode step its batch stopped at).
`--to thread` delivers that SIGINT to another thread than the main one (tgkill), as the kernel may deliver a
kill(2); `first_batch` is the rows of regen's first "decoding" line. Prints one JSON line per decoder;
OUT/results.jsonl too.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def sigint(pid: int, to: str) -> None:
    """SIGINT to the process, or to its newest thread other than the main one that does not block it."""
    if to == "process":
        os.kill(pid, signal.SIGINT)
        return
    for tid in sorted((int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid), reverse=True):
        try:
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except FileNotFoundError:
            continue
        blocked = int(next(line for line in status.splitlines() if line.startswith("SigBlk:")).split()[1], 16)
        if not blocked & (1 << (signal.SIGINT - 1)) and ctypes.CDLL(None, use_errno=True).tgkill(pid, tid, signal.SIGINT) == 0:
            return
    os.kill(pid, signal.SIGINT)


def regen(argv: list[str], out: Path, log: Path, sigint_after_s: float | None = None, to: str = "process") -> dict:
    """One regen run: seconds from its batch line to its exit, and from the SIGINT (if sent) to its exit."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "trainer_tools.regen", *argv, "--out", str(out)],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env, cwd=ROOT)
    assert proc.stderr is not None
    lines, decoding, width, sent, first = [], None, None, None, None
    with open(log, "w") as f:
        for line in proc.stderr:
            f.write(line)
            lines.append(line)
            if decoding is None and line.startswith("regen: decoding"):
                decoding = time.monotonic()
                width = int(line.split("up to ")[1].split()[0])
                first = int(line.split("decoding ")[1].split()[0])
                if sigint_after_s is not None:
                    time.sleep(sigint_after_s)
                    sigint(proc.pid, to)
                    sent = time.monotonic()
        proc.wait()
    ended = time.monotonic()
    data = out.read_bytes() if out.exists() else b""
    cancelled = next((line.split("cancelled ")[1].split(";")[0] for line in lines if "regen: interrupted: cancelled" in line),
                     None)
    return {"exit": proc.returncode, "prompt_tokens": width, "first_batch": first, "cancelled": cancelled,
            "batch_s": round(ended - decoding, 2) if decoding is not None and sent is None else None,
            "stop_s": round(ended - sent, 2) if sent is not None else None,
            "lines": data.count(b"\n"), "whole_lines": data == b"" or data.endswith(b"\n"),
            "tail": "".join(lines[-3:]).strip()}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--rows", type=int, default=16384, help="the batch of the static decoder (bench/quality.py's)")
    p.add_argument("--hf-rows", type=int, default=2048, help="the batch of transformers' generate")
    p.add_argument("--prompt-words", type=int, default=300, help="words per prompt (about 1.5 tokens each)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--decoders", default="static,hf")
    p.add_argument("--to", choices=["process", "thread"], default="process",
                   help="where the SIGINT goes: the process (kill), or another thread than the main one (tgkill)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from bench.quality import PRESETS, target_dims
    from trainer_tools.fixtures.hub_model import write_hub_model

    model = out / "target"
    if not model.exists():
        write_hub_model(model, "qwen3", target_dims(PRESETS["h200"]))
    words = "the target verifies a block of drafted tokens and keeps what it would have said".split()
    with open(out / "prompts.jsonl", "w") as f:
        for i in range(args.rows):
            text = " ".join(words[(i + k) % len(words)] for k in range(args.prompt_words))
            f.write(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"{i}: {text}"}]}) + "\n")
    results = []
    for decoder in args.decoders.split(","):
        rows = args.rows if decoder == "static" else min(args.rows, args.hf_rows)
        argv_ = ["--engine", "hf", "--model-path", str(model), "--in", str(out / "prompts.jsonl"), "--device", args.device,
                 "--dtype", "bf16" if args.device.startswith("cuda") else "fp32", "-n", str(rows), "--limit", str(rows),
                 "--max-tokens", str(args.max_tokens), "--decode", decoder, "--progress-every", "0"]
        full_out, cut_out = out / f"{decoder}-full.jsonl", out / f"{decoder}-cut.jsonl"
        for path in (full_out, cut_out):
            path.unlink(missing_ok=True)
        full = regen(argv_, full_out, out / f"{decoder}-full.log")
        after = (full["batch_s"] or 0.0) / 2
        cut = regen(argv_, cut_out, out / f"{decoder}-cut.log", sigint_after_s=after, to=args.to)
        row = {"decoder": decoder, "device": args.device, "rows": rows, "prompt_tokens": full["prompt_tokens"],
               "max_tokens": args.max_tokens, "first_batch": full["first_batch"], "batch_s": full["batch_s"],
               "full_exit": full["exit"], "to": args.to, "cancelled": cut["cancelled"],
               "full_lines": full["lines"], "sigint_after_s": round(after, 2), "stop_s": cut["stop_s"],
               "exit": cut["exit"], "lines_after_sigint": cut["lines"], "whole_lines": cut["whole_lines"],
               "tail": cut["tail"]}
        print(json.dumps(row), flush=True)
        with open(out / "results.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        results.append(row)
    return results


if __name__ == "__main__":
    main()
