"""The drafter's training attention alone, on a packed row: flex_attention forward and backward per
compile mode / kernel options, timed with CUDA events, with its TFLOP/s over the visible tiles.

    PYTHONPATH=. python bench/drafter_attention.py                    # cuda:0, Qwen3-8B heads, a row of 8192
    PYTHONPATH=. python bench/drafter_attention.py --variants default autotune

The mask is the one a training micro-batch builds (trainer.models.masks.draft_block_mask over
anchors sampled per document of a packed row), so tile counts and sparsity are the run's own.
"""
from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from trainer.data.packing import anchors_for_row, warmup_packed_batch
from trainer.models.masks import TILE, draft_block_mask, prepare_blocks
from trainer.models.target import QWEN3_8B_DIMS, QWEN3_8B_MASK_TOKEN_ID

VARIANTS: dict[str, dict[str, Any]] = {
    "default": dict(mode=None, options=None),
    "autotune": dict(mode="max-autotune-no-cudagraphs", options=None),
    "bwd_64x128": dict(mode=None, options={"BLOCK_M1": 64, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 64,
                                           "bwd_num_warps": 8, "bwd_num_stages": 2}),
    "fwd_128x64_s3": dict(mode=None, options={"BLOCK_M": 128, "BLOCK_N": 64, "fwd_num_warps": 8, "fwd_num_stages": 3}),
}


def timed(fn, reps):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--pack-length", type=int, default=8192)
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/drafter_attention.py times CUDA kernels: it needs a GPU (none is visible)")
    from torch.nn.attention.flex_attention import flex_attention

    dev = torch.device("cuda:0")
    heads, kv_heads, d = QWEN3_8B_DIMS["num_attention_heads"], QWEN3_8B_DIMS["num_key_value_heads"], 128
    gen = torch.Generator().manual_seed(0)
    batch = warmup_packed_batch(1, args.pack_length, 1000, gen)
    anchors = anchors_for_row(512, 3072, args.pack_length, 16)
    blocks = prepare_blocks(batch.input_ids, batch.loss_mask, anchors, 16, 7.0, QWEN3_8B_MASK_TOKEN_ID, gen,
                            batch.doc_start).to(dev)
    q_len, kv_len = anchors * 16, args.pack_length + anchors * 16
    mask = draft_block_mask(blocks.anchors, blocks.valid, blocks.starts, args.pack_length, 16)
    assert mask.full_kv_num_blocks is not None  # draft_block_mask gives full tiles apart
    tiles = int(mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum())
    fwd_flops = tiles * TILE * TILE * d * 4 * heads  # QK^T and PV over every visited tile
    q = torch.randn(1, heads, q_len, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, kv_heads, kv_len, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, kv_heads, kv_len, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(1, heads, q_len, d, device=dev, dtype=torch.bfloat16)
    print(json.dumps({"torch": torch.__version__, "q_len": q_len, "kv_len": kv_len, "anchors": anchors,
                      "tiles_partial": int(mask.kv_num_blocks.sum()), "tiles_full": int(mask.full_kv_num_blocks.sum())}),
          flush=True)
    results: dict[str, dict[str, Any]] = {}
    for name in args.variants:
        spec = VARIANTS[name]
        torch._dynamo.reset()
        flex = torch.compile(flex_attention, dynamic=False, mode=spec["mode"])
        extra = {"kernel_options": spec["options"]} if spec["options"] else {}

        def forward(flex=flex, extra=extra):
            return flex(q, k, v, block_mask=mask, enable_gqa=True, **extra)

        def forward_backward(forward=forward):
            q.grad = k.grad = v.grad = None
            forward().backward(grad)

        try:
            with torch.no_grad():
                fwd = timed(forward, args.reps)
            both = timed(forward_backward, args.reps)
        except Exception as e:  # noqa: BLE001 - a kernel option the compiler refuses is reported, the rest measured
            results[name] = {"error": str(e)[-500:]}
            print(json.dumps({name: results[name]}), flush=True)
            continue
        results[name] = {"fwd_ms": round(fwd, 3), "bwd_ms": round(both - fwd, 3), "fwd_bwd_ms": round(both, 3),
                         "fwd_tflops": round(fwd_flops / fwd / 1e9, 1),
                         # backward: 2.5 x the forward's matmuls (QK^T again, dV, dP, dQ, dK)
                         "bwd_tflops": round(2.5 * fwd_flops / max(both - fwd, 1e-9) / 1e9, 1)}
        print(json.dumps({name: results[name]}), flush=True)
    base = results.get("default", {}).get("fwd_bwd_ms")
    if base:
        print(json.dumps({"x_default": {n: round(base / r["fwd_bwd_ms"], 3) for n, r in results.items()
                                        if "fwd_bwd_ms" in r}}), flush=True)


if __name__ == "__main__":
    main()
