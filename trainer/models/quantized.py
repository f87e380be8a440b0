"""Quantized checkpoints decoded into the run's dtype at load, one tensor at a time on its device.

MXFP4 (gpt-oss as the hub ships it; OCP Microscaling): an expert matrix of `in` inputs and `out`
outputs is stored per output row in blocks of 32 inputs, as `NAME_blocks` (E, out, in/32, 16)
uint8, two FP4 E2M1 values a byte (the low nibble first), and `NAME_scales` (E, out, in/32)
uint8, one E8M0 scale a block (2 ** (byte - 127)). transformers holds the decoded matrix as
`NAME` (E, in, out).

FP8 with block scales (`quant_method: fp8`, as Qwen3-8B-FP8 ships; DeepSeek-V3's format): a
linear layer's `weight` is float8 (e4m3), and `weight_scale_inv` holds one multiplier per
`weight_block_size` tile (128 x 128), (ceil(out/128), ceil(in/128)) of them.

Every MXFP4 value times a power of two is exact in bf16, so an MXFP4 checkpoint trains on the
weights it holds; an FP8 value times its tile's float scale is rounded once, to the run's dtype.
"""

from __future__ import annotations

import torch

MXFP4_BLOCK = 32
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_BIAS = 127
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class QuantizedError(ValueError):
    """Tensors that do not describe one quantized matrix."""


def decode_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(E, in, out) in `dtype` on the tensors' device, one expert at a time (the temporaries stay
    a few times one expert's bytes)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise QuantizedError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    half = MXFP4_BLOCK // 2
    if blocks.dim() != 4 or blocks.shape[-1] != half or tuple(scales.shape) != tuple(blocks.shape[:3]):
        raise QuantizedError(f"MXFP4 blocks (E, out, in/{MXFP4_BLOCK}, {half}) and scales (E, out, in/{MXFP4_BLOCK}) "
                             f"expected, got {tuple(blocks.shape)} and {tuple(scales.shape)}")
    experts, outputs, count, _ = blocks.shape
    table = torch.tensor(FP4_E2M1, dtype=torch.float32, device=blocks.device)
    decoded = torch.empty(experts, count * MXFP4_BLOCK, outputs, dtype=dtype, device=blocks.device)
    for e in range(experts):
        packed = blocks[e].long()
        values = torch.stack((table[packed & 0x0F], table[packed >> 4]), dim=-1).reshape(outputs, count, MXFP4_BLOCK)
        values = torch.ldexp(values, (scales[e].int() - E8M0_BIAS).unsqueeze(-1).float())
        decoded[e] = values.reshape(outputs, count * MXFP4_BLOCK).t()
    return decoded


def decode_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] | None,
               dtype: torch.dtype) -> torch.Tensor:
    """weight (out, in) float8 times its tile's multiplier, in `dtype`. `block`: the config's
    weight_block_size; None: one multiplier for the whole tensor (a scalar scale_inv)."""
    if weight.dtype not in FP8_DTYPES or weight.dim() != 2:
        raise QuantizedError(f"an FP8 weight is a float8 matrix, got {weight.dtype} {tuple(weight.shape)}")
    scale = scale_inv.float()
    if block is None:
        if scale.numel() != 1:
            raise QuantizedError(f"weight_scale_inv {tuple(scale.shape)} without a weight_block_size in the config")
        return (weight.float() * scale.reshape(())).to(dtype)
    rows, cols = weight.shape
    want = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale.shape) != want:
        raise QuantizedError(f"weight {tuple(weight.shape)} in {block[0]}x{block[1]} tiles needs weight_scale_inv "
                             f"{want}, got {tuple(scale.shape)}")
    tiles = scale.repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]
    return (weight.float() * tiles).to(dtype)
