"""Greedy decoding speed of the one target decoder (trainer.models.decoder.greedy: what
`regen --engine hf` runs for greedy answers), beside transformers' `generate` on the same rows.

    PYTHONPATH=. python bench/decoder_speed.py --device cuda:0 --shape 8b --rows 1024 --new 128   # H200
    PYTHONPATH=. python bench/decoder_speed.py --device cuda:0 --shape quality --rows 4096 --new 256 --profile
    PYTHONPATH=. python bench/decoder_speed.py --device cpu --shape tiny --rows 8 --new 8         # anywhere
    PYTHONPATH=. python bench/decoder_speed.py --device cpu --shape quality --rows 128 --min-prompt-len 16 \
        --prompt-len 512 --new 16 --max-rows 32 --hf-rows 0     # mixed lengths, in chunks (regen's prompts)

--shape quality is bench/quality.py's h200 target (33.6M parameters, vocab 8201): the regen stage's
decode. --profile also prints torch.profiler's top operators of 8 decode steps (where a step's time goes).

Random weights and random prompts (lengths uniform in [--min-prompt-len, --prompt-len]), no stop
token, so every row decodes --new tokens: the figures are tokens per second of the decode and the
peak memory, not quality; tokens_sha1 tells whether two builds decoded the same tokens (in bf16 the
rows a chunk holds may move a near tie). `generate` runs on --hf-rows rows (0: skipped); the tokens of those rows
are compared with the decoder's (exactness is the CPU parity test's job: test_regen_static.py).
Prints one JSON line; --out also writes it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import time

import torch
from transformers import Qwen3Config

from trainer.models import decoder
from trainer.models.target import random_8b_shape_target, random_target, tiny_target
from trainer.run.config import TinyTargetConfig


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def profile_decode(model: torch.nn.Module, prompts: list[list[int]], device: str) -> str:
    """torch.profiler's operator table (by device time) of a greedy decode of 8 new tokens; the
    prefill is in it too, once."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        decoder.greedy(model, prompts, 8, set())
        sync(device)
    key = "cuda_time_total" if device.startswith("cuda") else "cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=20)
    print(table, flush=True)
    return table


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", choices=["8b", "quality", "tiny"], default="8b")
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--min-prompt-len", type=int, default=None, help="prompt lengths' lower end (default --prompt-len/2)")
    p.add_argument("--max-rows", type=int, default=None,
                   help="rows decoded at once (default: what the device memory holds; on the CPU all of them)")
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--hf-rows", type=int, default=64, help="rows decoded by transformers' generate too (0: none)")
    p.add_argument("--profile", action="store_true", help="also print the top operators of 8 decode steps")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    if args.shape == "8b":
        model = random_8b_shape_target(args.device, torch.bfloat16).eval()
    elif args.shape == "quality":
        from bench.quality import PRESETS, target_dims

        # the h200 preset's dims; 8201: its BPE vocabulary of 8192 plus the Qwen3 special tokens
        model = random_target(Qwen3Config(vocab_size=8201, max_position_embeddings=4096, tie_word_embeddings=False,
                                          **target_dims(PRESETS["h200"])), args.device, torch.bfloat16)
    else:
        model = tiny_target(TinyTargetConfig(layers=4, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128),
                            512, args.device).eval()
    assert decoder.supports(model)
    vocab = int(model.config.vocab_size)
    rng = random.Random(0)
    low = args.prompt_len // 2 if args.min_prompt_len is None else args.min_prompt_len
    prompts = [[rng.randrange(10, vocab) for _ in range(rng.randint(low, args.prompt_len))] for _ in range(args.rows)]
    out: dict = {"shape": args.shape, "device": args.device, "rows": args.rows, "prompt_len": [low, args.prompt_len],
                 "new": args.new, "max_rows": args.max_rows, "torch": torch.__version__}
    if args.device.startswith("cuda"):
        out["gpu"] = torch.cuda.get_device_name(args.device)
    decoder.greedy(model, prompts[:2], 2, set())  # first call: kernels, allocator
    sync(args.device)
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(args.device)
    began = time.perf_counter()
    tokens = decoder.greedy(model, prompts, args.new, set(), max_rows=args.max_rows)
    sync(args.device)
    seconds = time.perf_counter() - began
    out["decoder"] = {"seconds": round(seconds, 2), "tokens_per_s": round(args.rows * args.new / seconds, 1),
                      "tokens_sha1": hashlib.sha1(tokens.cpu().numpy().tobytes()).hexdigest()[:12]}
    if args.device.startswith("cuda"):
        out["decoder"]["peak_mem_gb"] = round(torch.cuda.max_memory_allocated(args.device) / 2**30, 1)
    if args.hf_rows:
        rows = prompts[:args.hf_rows]
        width = max(map(len, rows))
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows], device=args.device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=args.device)
        sync(args.device)
        began = time.perf_counter()
        with torch.no_grad():
            hf = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.new, do_sample=False,
                                eos_token_id=None, pad_token_id=0, top_k=None, use_cache=True)[:, width:]
        sync(args.device)
        seconds = time.perf_counter() - began
        same = (hf == tokens[:args.hf_rows]).float().mean().item()
        out["generate"] = {"rows": len(rows), "seconds": round(seconds, 2),
                           "tokens_per_s": round(len(rows) * args.new / seconds, 1),
                           "tokens_equal_to_decoder": round(same, 4)}
    if args.profile:
        out["profile"] = profile_decode(model, prompts[:args.rows], args.device)
    print(json.dumps(out), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
