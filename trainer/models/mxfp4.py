"""MXFP4 expert matrices (gpt-oss as the hub ships it) decoded into the run's dtype at load.

The format (OCP Microscaling, as in openai/gpt-oss-20b's safetensors): an expert matrix of
`in` inputs and `out` outputs is stored per output row in blocks of 32 inputs, as
`NAME_blocks` (E, out, in/32, 16) uint8, two FP4 E2M1 values a byte (the low nibble first), and
`NAME_scales` (E, out, in/32) uint8, one E8M0 scale a block (2 ** (byte - 127)). transformers holds
the decoded matrix as `NAME` (E, in, out). Every FP4 value times a power of two is exact in bf16,
so decoding loses nothing: the model trains on the weights the checkpoint holds.
"""

from __future__ import annotations

import torch

BLOCK = 32
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127


class Mxfp4Error(ValueError):
    """Blocks and scales that do not describe one matrix."""


def decode(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(E, in, out) in `dtype` on the tensors' device, one expert at a time (the temporaries stay
    a few times one expert's bytes)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise Mxfp4Error(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() != 4 or blocks.shape[-1] != BLOCK // 2 or tuple(scales.shape) != tuple(blocks.shape[:3]):
        raise Mxfp4Error(f"MXFP4 blocks (E, out, in/{BLOCK}, {BLOCK // 2}) and scales (E, out, in/{BLOCK}) expected, "
                         f"got {tuple(blocks.shape)} and {tuple(scales.shape)}")
    experts, outputs, count, _ = blocks.shape
    table = torch.tensor(FP4_E2M1, dtype=torch.float32, device=blocks.device)
    decoded = torch.empty(experts, count * BLOCK, outputs, dtype=dtype, device=blocks.device)
    for e in range(experts):
        packed = blocks[e].long()
        values = torch.stack((table[packed & 0x0F], table[packed >> 4]), dim=-1).reshape(outputs, count, BLOCK)
        values = torch.ldexp(values, (scales[e].int() - SCALE_BIAS).unsqueeze(-1).float())
        decoded[e] = values.reshape(outputs, count * BLOCK).t()
    return decoded
