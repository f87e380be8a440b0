"""τ evaluation speed, old and new in one run, same target, drafter and prompts:

* uncached: the reference decoder (trainer.generate.evaluate.speculative_generate), the target re-run on
  the whole sequence every round, one prompt at a time;
* dynamic: the batched decoder with a growing Hugging Face DynamicCache (trainer.generate.speculative,
  implementation="dynamic"; what evaluation used before);
* static: the batched decoder on preallocated caches, its round captured as a CUDA graph
  (trainer.generate.speculative, the default for Qwen3/Qwen2/Llama targets; what evaluation uses).

    PYTHONPATH=. python bench/eval_speed.py --device cuda:0 --shape 8b      # H200: 8B-shaped target
    PYTHONPATH=. python bench/eval_speed.py --device cpu --shape tiny        # anywhere, seconds

The 8B shape is written as a hub-format model directory (sharded safetensors, random weights)
and loaded back through the trainer's own loader, so the load time and peak memory of
`model.target.path` are measured too (--model-dir keeps the directory, or reuses one). Weights
are random, so drafts are rarely accepted: the figures are decoding speed (tokens per second),
not τ. Token agreement between the decoders is printed, exactness is the CPU parity tests' job.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import transformers

from bench.common import hub_model_dir, report
from trainer.generate.evaluate import speculative_generate
from trainer.generate.speculative import speculative_generate_cached
from trainer.models.drafter import DFlashDrafter, DrafterConfig
from trainer.models.target import FrozenHead, default_target_layer_ids, freeze, load_target


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _agree(runs_a, runs_b) -> str:
    """Tokens equal at the same index, over the common length of each pair of generations."""
    same = total = 0
    for g, h in zip(runs_a, runs_b):
        n = min(len(g.tokens), len(h.tokens))
        same += sum(x == y for x, y in zip(g.tokens[:n], h.tokens[:n]))
        total += n
    return f"{same}/{total}"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", choices=["8b", "tiny"], default="8b")
    p.add_argument("--model-dir", type=Path, help="write the target directory here (reused if it has a config.json)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new", type=int, default=256, help="new tokens per prompt, static decoder")
    p.add_argument("--dynamic-new", type=int, default=64, help="new tokens per prompt, dynamic decoder (0: skip)")
    p.add_argument("--eager-new", type=int, default=32, help="new tokens per prompt, static decoder without a "
                                                              "CUDA graph (0: skip)")
    p.add_argument("--old-prompts", type=int, default=2, help="prompts through the uncached reference")
    p.add_argument("--old-new", type=int, default=64, help="new tokens per prompt, uncached reference")
    p.add_argument("--drafter-layers", type=int, default=5)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--out", type=Path)
    p.add_argument("--profile", action="store_true", help="also print a torch.profiler table of 8 static rounds")
    return p


def loaded_target(args: argparse.Namespace, out: dict) -> Any:  # a transformers model: its .config is read
    """The hub-format target (written to --model-dir, else to a temporary directory gone once it is
    loaded), frozen in bf16 on the device; its load time and peak memory in `out`."""
    dev = args.device
    with contextlib.ExitStack() as stack:
        if args.model_dir is None:
            args.model_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="eval-speed-"))) / "target"
        model_dir = hub_model_dir(args.model_dir, args.shape, dev, out)
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
    return target


def timed(dev: str, fn: Callable[[], Any]) -> tuple[Any, float]:
    """fn's result and its wall seconds, the device synchronised before and after."""
    sync(dev)
    t = time.perf_counter()
    result = fn()
    sync(dev)
    return result, time.perf_counter() - t


def figures(gens: list, seconds: float, **extra: Any) -> dict:
    """Throughput of a set of generations: prompts, new tokens, tokens/s, rounds and ms per round."""
    tokens = sum(len(g.tokens) for g in gens)
    rounds = max(len(g.acceptance_lengths) for g in gens)
    return {"prompts": len(gens), "new_tokens": max(len(g.tokens) for g in gens), "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds, 1), "rounds": rounds,
            "ms_per_round": round(1000 * seconds / max(rounds, 1), 1), **extra}


def print_profile(target: Any, drafter: DFlashDrafter, head: FrozenHead, prompts: list, dev: str) -> None:
    """A torch.profiler table of 8 static rounds, by self CPU time and by device time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        speculative_generate_cached(target, drafter, head, prompts, 9, set())
        sync(dev)
    for key in ("self_cpu_time_total", "cuda_time_total" if dev.startswith("cuda") else "cpu_time_total"):
        print(f"--- profile of 8 static rounds, by {key}")
        print(prof.key_averages().table(sort_by=key, row_limit=25), flush=True)


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    dev = args.device
    out: dict = {"device": dev, "shape": args.shape, "torch": torch.__version__,
                 "transformers": transformers.__version__}
    target = loaded_target(args, out)
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

    with torch.no_grad():
        for implementation in ("static", "dynamic"):  # warm-up: kernels, cuBLAS handles, allocator
            speculative_generate_cached(target, drafter, head, prompts[:2], 4, set(), implementation=implementation)
        info: dict = {}
        new, new_s = timed(dev, lambda: speculative_generate_cached(target, drafter, head, prompts, args.new, set(),
                                                               info=info))
        out["static"] = figures(new, new_s, **info)
        print(json.dumps({"static": out["static"]}), flush=True)
        if args.eager_new:
            eager_info: dict = {}
            eager, eager_s = timed(dev, lambda: speculative_generate_cached(target, drafter, head, prompts, args.eager_new,
                                                                       set(), cuda_graph=False, info=eager_info))
            out["static_eager"] = figures(eager, eager_s, **eager_info)
            print(json.dumps({"static_eager": out["static_eager"]}), flush=True)
        if args.dynamic_new:
            dyn, dyn_s = timed(dev, lambda: speculative_generate_cached(target, drafter, head, prompts, args.dynamic_new,
                                                                   set(), implementation="dynamic"))
            out["dynamic"] = figures(dyn, dyn_s)
            out["same_tokens_static_vs_dynamic"] = _agree(new, dyn)
            print(json.dumps({"dynamic": out["dynamic"]}), flush=True)
        old, old_s = timed(dev, lambda: [speculative_generate(target, drafter, head, q, args.old_new, set())
                                    for q in prompts[: args.old_prompts]])
        out["uncached"] = figures(old, old_s)
        out["same_tokens_static_vs_uncached"] = _agree(new, old)
        if args.profile:
            print_profile(target, drafter, head, prompts, dev)
    for name in ("uncached", "dynamic", "static_eager"):
        if name in out:
            out[f"static_vs_{name}_tokens_per_s"] = round(out["static"]["tokens_per_s"] / out[name]["tokens_per_s"], 1)
    if dev.startswith("cuda"):
        out["peak_gib"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 1)
    return report(out, args.out)


if __name__ == "__main__":
    main()
