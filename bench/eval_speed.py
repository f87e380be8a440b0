"""τ evaluation speed: the uncached reference decoder (trainer.evaluate.speculative_generate, the
target re-run on the whole sequence every round) against the KV-cached, batched one
(trainer.speculative, what evaluation now uses), same target, drafter and prompts, one run.

    PYTHONPATH=. python bench/eval_speed.py --device cuda:0 --shape 8b      # H200: 8B-shaped target
    PYTHONPATH=. python bench/eval_speed.py --device cpu --shape tiny        # anywhere, seconds

The 8B shape is written as a hub-format model directory (sharded safetensors, random weights)
and loaded back through the trainer's own loader, so the load time and peak memory of
`model.target.path` are measured too. Weights are random, so drafts are rarely accepted: the
figures are decoding speed (tokens per second), not τ.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from trainer.drafter import DFlashDrafter, DrafterConfig
from trainer.evaluate import speculative_generate
from trainer.speculative import speculative_generate_cached
from trainer.target import FrozenHead, default_target_layer_ids, freeze, load_target
from trainer.testing.hub_model import QWEN3_8B_DIMS, TINY_DIMS, write_hub_model


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", choices=["8b", "tiny"], default="8b")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new", type=int, default=256, help="new tokens per prompt, cached decoder")
    p.add_argument("--old-prompts", type=int, default=2, help="prompts through the uncached reference")
    p.add_argument("--old-new", type=int, default=64, help="new tokens per prompt, uncached reference")
    p.add_argument("--drafter-layers", type=int, default=5)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--out", type=Path)
    p.add_argument("--profile", action="store_true", help="also print a torch.profiler table of 8 cached rounds")
    args = p.parse_args(argv)
    dev, dims = args.device, QWEN3_8B_DIMS if args.shape == "8b" else TINY_DIMS
    out: dict = {"device": dev, "shape": args.shape, "torch": torch.__version__}

    with tempfile.TemporaryDirectory(prefix="eval-speed-") as tmp:
        began = time.perf_counter()
        model_dir = write_hub_model(Path(tmp) / "target", "qwen3", dims=dims, shards=None,
                                    max_shard_bytes=4 << 30, device=dev)
        out["write_model_dir_s"] = round(time.perf_counter() - began, 1)
        out["model_dir_files"] = sorted(f.name for f in model_dir.iterdir())
        if dev.startswith("cuda"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        began = time.perf_counter()
        target = freeze(load_target(str(model_dir), dev, torch.bfloat16))
        sync(dev)
        out["load_target_s"] = round(time.perf_counter() - began, 1)
        if dev.startswith("cuda"):
            out["load_peak_gib"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 1)
    n_layers = target.config.num_hidden_layers
    layer_ids = default_target_layer_ids(n_layers, args.drafter_layers)
    cfg = DrafterConfig.from_target(target.config, num_layers=args.drafter_layers, block_size=args.block_size,
                                    mask_token_id=target.config.vocab_size - 1, target_layer_ids=layer_ids)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg).to(dev, torch.bfloat16).eval()
    head = FrozenHead.from_target(target, dev)
    gen = torch.Generator().manual_seed(0)
    top = min(5000, target.config.vocab_size - 2)
    prompts = [torch.randint(0, top, (args.prompt_len,), generator=gen).tolist() for _ in range(args.prompts)]

    def timed(fn):
        sync(dev)
        t = time.perf_counter()
        result = fn()
        sync(dev)
        return result, time.perf_counter() - t

    with torch.no_grad():
        speculative_generate_cached(target, drafter, head, prompts[:2], 4, set())  # warm-up
        old, old_s = timed(lambda: [speculative_generate(target, drafter, head, q, args.old_new, set())
                                    for q in prompts[: args.old_prompts]])
        new, new_s = timed(lambda: speculative_generate_cached(target, drafter, head, prompts, args.new, set()))
        same, _ = timed(lambda: speculative_generate_cached(target, drafter, head, prompts[: args.old_prompts],
                                                            args.old_new, set()))
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.startswith("cuda") else [])
            with profile(activities=activities) as prof:
                speculative_generate_cached(target, drafter, head, prompts, 9, set())
                sync(dev)
            for key in ("self_cpu_time_total", "cuda_time_total" if dev.startswith("cuda") else "cpu_time_total"):
                print(f"--- profile of 8 cached rounds, by {key}")
                print(prof.key_averages().table(sort_by=key, row_limit=25), flush=True)
    old_tokens, new_tokens = sum(len(g.tokens) for g in old), sum(len(g.tokens) for g in new)
    agree = sum(a == b for g, h in zip(old, same) for a, b in zip(g.tokens, h.tokens))
    out.update({
        "uncached": {"prompts": args.old_prompts, "new_tokens": args.old_new, "seconds": round(old_s, 2),
                     "tokens_per_s": round(old_tokens / old_s, 1)},
        "cached": {"prompts": args.prompts, "new_tokens": args.new, "seconds": round(new_s, 2),
                   "tokens_per_s": round(new_tokens / new_s, 1),
                   "rounds": sum(len(g.acceptance_lengths) for g in new)},
        "speedup_tokens_per_s": round((new_tokens / new_s) / (old_tokens / old_s), 1),
        "same_tokens_as_uncached": f"{agree}/{old_tokens}",
    })
    if dev.startswith("cuda"):
        out["peak_gib"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 1)
    print(json.dumps(out, indent=1), flush=True)
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
