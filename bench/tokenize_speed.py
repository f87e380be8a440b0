"""Data preparation speed: the trainer's chat-template tokenization (chat templates, loss masks)
of N conversations in one process, then in worker processes (trainer.data.encoding,
data.workers), with the same tokenizer and conversations; the outputs must be identical.

    PYTHONPATH=. python bench/tokenize_speed.py -n 4096                    # one process vs auto
    PYTHONPATH=. python bench/tokenize_speed.py -n 32768 --processes 4,16 --out $OUT/tokenize.json

Last, data.token_cache: what keeping the encoding adds to a first start, and what a next start's read takes.

The conversations are the quality bench's kind (bench/quality.py): a code prefix of a Python
source file of this machine as the user turn (200-1000 characters), its continuation as the
answer (~1280 characters), max_length 768, enable_thinking false. The tokenizer is the Qwen3
fixture's (trainer_tools.fixtures.hub_model: a byte-level BPE with the Qwen3 chat template),
or --model-dir's. Timing starts after the data is read; a worker process's start-up (importing
transformers, unpickling the tokenizer) is part of its figure, as it is in the trainer.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

# Only light imports at the top: worker processes are spawned and import this script again.
from bench.common import report

MAX_LENGTH = 768  # bench/quality.py's h200 preset


def conversations(n: int, seed: int = 0) -> list[dict]:
    """n [user: code prefix, assistant: its continuation] conversations from this machine's sources."""
    from quality import collect_sources, windows

    rng = random.Random(seed)
    corpus = collect_sources(max_bytes=max(8 << 20, n * 4000), max_file_bytes=512 << 10, heldout_permille=0,
                             seed=seed)
    pairs: list[tuple[str, str]] = []
    for text in corpus["train"]:  # at most 4 windows a file, as quality.write_prompts
        pairs += [w for _, w in zip(range(4), windows(text, rng, (200, 1000), 256 * 5))]
        if len(pairs) >= n:
            break
    if not pairs:
        raise SystemExit("tokenize_speed: no Python sources found to cut conversations from")
    pairs = pairs * -(-n // len(pairs))  # a small machine's sources repeat
    return [{"messages": [{"role": "user", "content": u}, {"role": "assistant", "content": a}],
             "source": f"bench:{i + 1}"} for i, (u, a) in enumerate(pairs[:n])]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=4096, help="conversations (default 4096)")
    ap.add_argument("--processes", default="auto",
                    help="comma-separated process counts to time after one process; auto: data.workers auto")
    ap.add_argument("--model-dir", type=Path, default=None, help="a model directory whose tokenizer to use")
    ap.add_argument("--out", type=Path, default=None, help="also write the figures here as JSON")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from trainer.data.encoding import AUTO_MAX, encode_all, usable_cpus

    out: dict = {"conversations": args.n, "usable_cpus": usable_cpus(), "max_length": MAX_LENGTH}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir
        if model_dir is None:
            from trainer_tools.fixtures.hub_model import write_hub_model

            model_dir = write_hub_model(Path(tmp) / "Qwen3-tiny", "qwen3")
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    out["tokenizer"] = str(args.model_dir or "Qwen3 fixture (trainer_tools.fixtures.hub_model)")
    began = time.perf_counter()
    data = conversations(args.n)
    out["read_sources_s"] = round(time.perf_counter() - began, 1)
    kwargs = {"enable_thinking": False}

    began = time.perf_counter()
    one = encode_all(tokenizer, data, MAX_LENGTH, kwargs, processes=1)
    seconds = time.perf_counter() - began
    out["tokens"] = sum(len(ids) for ids, _, _ in one)
    out["one_process_s"] = round(seconds, 2)
    out["one_process_ms_per_conversation"] = round(1000 * seconds / args.n, 3)
    print(f"1 process: {args.n} conversations in {seconds:.2f}s ({1000 * seconds / args.n:.2f} ms each)", flush=True)
    counts = [min(usable_cpus(), AUTO_MAX) if p == "auto" else int(p) for p in args.processes.split(",")]
    out["parallel"] = []
    for p in counts:
        began = time.perf_counter()
        many = encode_all(tokenizer, data, MAX_LENGTH, kwargs, processes=p)
        took = time.perf_counter() - began
        row = {"processes": p, "seconds": round(took, 2), "speedup": round(seconds / took, 2),
               "identical": many == one}
        out["parallel"].append(row)
        print(f"{p} processes: {took:.2f}s, {seconds / took:.2f}x one process, identical: {many == one}", flush=True)
        if not row["identical"]:
            raise SystemExit("tokenize_speed: the workers' ids or masks differ from one process's")
    out["token_cache"] = token_cache_leg(tokenizer, data, kwargs, seconds, one)
    return report(out, args.out)


def token_cache_leg(tokenizer, data: list[dict], kwargs: dict, encode_s: float, encoded: list) -> dict:
    """data.token_cache (trainer.data.token_cache): a first start's key and entry written beside the one
    process's encoding (taken as done: `encoded`), then a next start's read, against encoding again."""
    from trainer.data.token_cache import cached_encode

    with tempfile.TemporaryDirectory() as cache:
        began = time.perf_counter()
        cached_encode(cache, tokenizer, data, MAX_LENGTH, kwargs, lambda: encoded)
        written = time.perf_counter() - began
        began = time.perf_counter()
        read, found = cached_encode(cache, tokenizer, data, MAX_LENGTH, kwargs, lambda: [])
        took = time.perf_counter() - began
        size = sum(f.stat().st_size for f in Path(cache).glob("*.tokens"))
    row = {"write_s": round(written, 2), "read_s": round(took, 2), "speedup_over_one_process": round(encode_s / took, 1),
           "entry_mb": round(size / 2**20, 1), "identical": found and read == encoded}
    print(f"data.token_cache: the first start adds {written:.2f}s (key and entry, {size / 2**20:.1f} MB), a next start "
          f"reads it in {took:.2f}s ({encode_s / took:.1f}x one process), identical: {row['identical']}", flush=True)
    if not row["identical"]:
        raise SystemExit("tokenize_speed: the token cache's entry differs from the encoding")
    return row


if __name__ == "__main__":
    main()
