"""The drafter step alone (forward + backward + AdamW) at Qwen3-8B shape: tok/s and MFU per variant.

    PYTHONPATH=. python bench/drafter_mfu.py                      # cuda:0, every variant, one process
    PYTHONPATH=. python bench/drafter_mfu.py --tiny --device cpu  # CPU smoke run (tiny dims)

No target model: the context features are random bf16 tensors of the target's width, so the
figure is the drafter stage alone. Variants are cumulative and run in the order given, the first
one being the baseline (the code as it was before issue #5's MFU work, except for the RMSNorm
dtype fix, which is not switchable); each is warmed up, then timed over --steps optimizer steps
of --micro micro-batches. MFU counts model FLOPs with trainer.pipeline.flops.
"""
from __future__ import annotations

import os

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from transformers import Qwen3Config  # noqa: E402

import trainer.models.drafter as drafter_module  # noqa: E402
from trainer.models.drafter import DFlashDrafter, DrafterConfig  # noqa: E402
from trainer.models.masks import prepare_blocks, resolve_backend  # noqa: E402
from trainer.models.objective import drafter_loss_sums  # noqa: E402
from trainer.models.target import QWEN3_8B_DIMS, QWEN3_8B_MASK_TOKEN_ID, FrozenHead, default_target_layer_ids  # noqa: E402
from trainer.pipeline.compile_safety import configure_compile_for_thread  # noqa: E402
from trainer.pipeline.flops import drafter_step_flops, peak_tflops  # noqa: E402
from trainer.run.config import OptimConfig, default_gamma  # noqa: E402
from trainer.train.optim import build_optimizer, clip_gradients  # noqa: E402

BASELINE = dict(ce="checkpoint", fused_adamw=False, compile_pointwise=False, chunk=2048)
VARIANTS: dict[str, dict[str, Any]] = {
    "baseline": {},
    "fused_adamw": dict(fused_adamw=True),
    "fused_ce": dict(fused_adamw=True, ce="fused"),
    "compiled": dict(fused_adamw=True, ce="fused", compile_pointwise=True),
    "compiled_chunk4096": dict(fused_adamw=True, ce="fused", compile_pointwise=True, chunk=4096),
    "compiled_chunk8192": dict(fused_adamw=True, ce="fused", compile_pointwise=True, chunk=8192),
}
TINY_DIMS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_variant(name, opts, drafter, head, feats, blocks, backend, device, args, peak):
    drafter_module.COMPILE_POINTWISE = opts["compile_pointwise"]
    optimizer = build_optimizer(drafter.parameters(), OptimConfig(), fused=opts["fused_adamw"])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def step():
        for i in range(args.micro):
            with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
                loss_sum, weight_sum, _ = drafter_loss_sums(drafter, head, feats, blocks[i % len(blocks)], backend,
                                                            opts["chunk"], opts["ce"])
                loss_sum.backward()
        clip_gradients(drafter.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    began = time.perf_counter()
    for _ in range(args.warmup):
        step()
    sync(device)
    warm = time.perf_counter() - began
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    began = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync(device)
    seconds = time.perf_counter() - began
    micro = args.steps * args.micro
    flops = micro * drafter_step_flops(drafter.config, 1, args.seq, args.anchors)
    result = {"variant": name, **opts, "tokens_per_s": round(micro * args.seq / seconds, 1),
              "ms_per_micro_batch": round(1e3 * seconds / micro, 1), "warmup_s": round(warm, 1),
              "mfu": round(flops / seconds / (peak * 1e12), 4) if peak else None,
              "peak_mem_gb": round(torch.cuda.max_memory_allocated(device) / 1e9, 1) if device.type == "cuda" else None}
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--seq", type=int, default=3072)
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--micro", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--warmup", type=int, default=1, help="untimed optimizer steps per variant")
    p.add_argument("--steps", type=int, default=4, help="timed optimizer steps per variant")
    p.add_argument("--tiny", action="store_true", help="tiny dimensions (CPU smoke run)")
    args = p.parse_args()
    device = torch.device(args.device)
    configure_compile_for_thread()
    if args.tiny:
        args.seq, args.anchors = min(args.seq, 256), min(args.anchors, 16)
    tcfg = Qwen3Config(**(TINY_DIMS if args.tiny else QWEN3_8B_DIMS))
    layer_ids = default_target_layer_ids(tcfg.num_hidden_layers, 5)
    mask_id = tcfg.vocab_size - 1 if args.tiny else QWEN3_8B_MASK_TOKEN_ID
    dcfg = DrafterConfig.from_target(tcfg, 5, 16, mask_id, layer_ids)
    torch.manual_seed(0)
    with torch.device(device):
        drafter = DFlashDrafter(dcfg).float().train()
    fdtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    head = FrozenHead(torch.randn(tcfg.vocab_size, tcfg.hidden_size, device=device, dtype=fdtype) * 0.02,
                      torch.randn(tcfg.vocab_size, tcfg.hidden_size, device=device, dtype=fdtype) * 0.02)
    feats = torch.randn(1, args.seq, len(layer_ids) * tcfg.hidden_size, device=device, dtype=fdtype)
    gen = torch.Generator().manual_seed(0)
    blocks = []
    for _ in range(2):
        ids = torch.randint(0, tcfg.vocab_size - 1, (1, args.seq), generator=gen)
        loss_mask = torch.ones_like(ids, dtype=torch.bool)
        loss_mask[:, : args.seq // 4] = False
        blocks.append(prepare_blocks(ids, loss_mask, args.anchors, 16, default_gamma(16), mask_id, gen).to(device))
    backend = resolve_backend("auto", device, needs_grad=True)
    peak = peak_tflops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    per_token = drafter_step_flops(dcfg, 1, args.seq, args.anchors) / args.seq
    print(json.dumps({"torch": torch.__version__, "device": str(device), "backend": backend, "seq": args.seq,
                      "anchors": args.anchors, "drafter_params": sum(q.numel() for q in drafter.parameters()),
                      "drafter_flops_per_token": per_token, "peak_tflops": peak}), flush=True)
    results = []
    for name in args.variants:
        results.append(run_variant(name, {**BASELINE, **VARIANTS[name]}, drafter, head, feats, blocks, backend,
                                   device, args, peak))
        print(json.dumps(results[-1]), flush=True)
    base = results[0]["tokens_per_s"]
    print(json.dumps({"summary": {r["variant"]: {"x_first": round(r["tokens_per_s"] / base, 3), "mfu": r["mfu"]}
                                  for r in results}}), flush=True)


if __name__ == "__main__":
    main()
