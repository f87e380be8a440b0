"""One-GPU DFlash training step at Qwen3-8B shape: peak memory, step time, target vs drafter split, MFU.

    PYTHONPATH=. python bench/one_step_8b.py                 # cuda: 8B-shaped bf16 target + 5-layer drafter
    PYTHONPATH=. python bench/one_step_8b.py --steps 8 --seq 3072 --anchors 512
    PYTHONPATH=. python bench/one_step_8b.py --tiny          # CPU smoke run with a tiny target

Random weights and random tokens: this measures speed and memory, not learning.
Run from the repository (or release) root: PYTHONPATH=. makes `trainer` importable.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch

from trainer.models.drafter import DFlashDrafter, DrafterConfig
from trainer.models.masks import prepare_blocks, resolve_backend
from trainer.models.objective import drafter_loss_sums
from trainer.models.target import (
    QWEN3_8B_MASK_TOKEN_ID,
    FrozenHead,
    default_target_layer_ids,
    freeze,
    random_8b_shape_target,
    target_context_features,
    tiny_target,
)
from trainer.pipeline.flops import drafter_step_flops, peak_tflops, target_forward_flops
from trainer.run.config import OptimConfig, TinyTargetConfig, default_gamma
from trainer.train.loop import autocast_for
from trainer.train.optim import build_optimizer, clip_gradients


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def count(module) -> int:
    return sum(p.numel() for p in module.parameters())


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6, help="timed steps after warm-up (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation)")
    p.add_argument("--seq", type=int, default=3072, help="sequence length")
    p.add_argument("--batch", type=int, default=1, help="sequences per step")
    p.add_argument("--anchors", type=int, default=512, help="draft blocks per sequence")
    p.add_argument("--block", type=int, default=16, help="block size")
    p.add_argument("--drafter-layers", type=int, default=5)
    p.add_argument("--attention", default="auto", choices=["auto", "flex", "sdpa"])
    p.add_argument("--device", default=None, help="default cuda:0, or cpu with --tiny")
    p.add_argument("--tiny", action="store_true", help="tiny target on CPU (smoke test)")
    return p


def built_target(args: argparse.Namespace, device: str) -> tuple[Any, int, str]:  # a transformers model
    """The frozen target (--tiny: a tiny one, and --seq/--anchors cut to its size; else the 8B shape in
    bf16, random weights), its mask token id and the drafter's autocast dtype."""
    if args.tiny:
        target = freeze(tiny_target(TinyTargetConfig(layers=4, hidden=64, heads=4, kv_heads=2, head_dim=16,
                                                     intermediate=128), 1000, device))
        args.seq, args.anchors = min(args.seq, 256), min(args.anchors, 32)
        return target, 999, "fp32"
    began = time.perf_counter()
    target = freeze(random_8b_shape_target(device))
    sync(device)
    print(f"built 8B-shaped bf16 target on {device} in {time.perf_counter() - began:.1f}s "
          f"({count(target) / 1e9:.2f}B params)")
    return target, QWEN3_8B_MASK_TOKEN_ID, "bf16"


def report(args: argparse.Namespace, device: str, target: Any, dcfg: DrafterConfig,
           times: tuple[list[float], list[float], list[float]]) -> None:
    """The median step split into the target's forward and the drafter's step, tokens/s, TFLOP/s, and
    on CUDA the peak memory and MFU."""
    target_times, drafter_times, step_times = times
    med_t, med_d, med_s = (statistics.median(x) for x in (target_times, drafter_times, step_times))
    target_flops = target_forward_flops(target.config, args.batch, args.seq)
    drafter_flops = drafter_step_flops(dcfg, args.batch, args.seq, args.anchors)
    achieved = (target_flops + drafter_flops) / med_s / 1e12
    print("---")
    print(f"median step {1e3 * med_s:.1f} ms = target forward {1e3 * med_t:.1f} ms ({100 * med_t / med_s:.0f}%) "
          f"+ drafter step {1e3 * med_d:.1f} ms ({100 * med_d / med_s:.0f}%)  [median of {len(step_times)}]")
    print(f"tokens/s {args.batch * args.seq / med_s:.0f}; est. TFLOP/step target {target_flops / 1e12:.2f}, "
          f"drafter {drafter_flops / 1e12:.2f} (trainer.pipeline.flops); achieved {achieved:.1f} TFLOP/s")
    if device.startswith("cuda"):
        peak = peak_tflops(torch.cuda.get_device_name(device))
        print(f"peak memory {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB")
        if peak:
            print(f"MFU {100 * achieved / peak:.1f}% (target {100 * target_flops / med_t / 1e12 / peak:.1f}%, "
                  f"drafter {100 * drafter_flops / med_d / 1e12 / peak:.1f}%) of {peak:.0f} TFLOP/s bf16 dense")


def main() -> int:
    args = parser().parse_args()

    device = args.device or ("cpu" if args.tiny else "cuda:0")
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device; use --tiny for a CPU smoke run", file=sys.stderr)
        return 2
    target, mask_id, dtype = built_target(args, device)
    layer_ids = default_target_layer_ids(target.config.num_hidden_layers, 5 if not args.tiny else 2)
    dcfg = DrafterConfig.from_target(target.config, args.drafter_layers, args.block, mask_id, layer_ids)
    torch.manual_seed(0)
    with torch.device(device):
        drafter = DFlashDrafter(dcfg).float().train()
    head = FrozenHead.from_target(target, device)
    optimizer = build_optimizer(drafter.parameters(), OptimConfig())
    backend = resolve_backend(args.attention, device, needs_grad=True)
    print(f"drafter {count(drafter) / 1e6:.1f}M params, {args.drafter_layers} layers, target layers {layer_ids}, "
          f"attention {backend}, batch {args.batch} x seq {args.seq}, {args.anchors} anchors x {args.block}")

    gen = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    ids = torch.randint(0, min(vocab, 150000), (args.batch, args.seq), generator=gen)
    attn = torch.ones_like(ids)
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    loss_mask[:, : args.seq // 8] = False  # a prompt without loss
    gamma = default_gamma(args.block)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)

    target_times, drafter_times, step_times = [], [], []
    for step in range(args.warmup + args.steps):
        sync(device)
        t0 = time.perf_counter()
        feats = target_context_features(target, ids.to(device), attn.to(device), layer_ids)
        sync(device)
        t1 = time.perf_counter()
        blocks = prepare_blocks(ids, loss_mask, args.anchors, args.block, gamma, mask_id, gen).to(device)
        with autocast_for(device, dtype):
            loss_sum, weight_sum, correct_sum = drafter_loss_sums(drafter, head, feats, blocks, backend)
        (loss_sum / weight_sum).backward()
        clip_gradients(drafter.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        t2 = time.perf_counter()
        loss = float(loss_sum.detach() / weight_sum)
        tag = "warm-up" if step < args.warmup else "timed"
        print(f"step {step + 1} ({tag}): loss {loss:.3f} target {1e3 * (t1 - t0):.1f} ms, "
              f"drafter {1e3 * (t2 - t1):.1f} ms")
        if step >= args.warmup:
            target_times.append(t1 - t0)
            drafter_times.append(t2 - t1)
            step_times.append(t2 - t0)

    report(args, device, target, dcfg, (target_times, drafter_times, step_times))
    return 0


if __name__ == "__main__":
    sys.exit(main())
