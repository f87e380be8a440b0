"""The drafter's linear layers trained with FP8 matmuls (`model.drafter.precision: fp8`).

`fp8_linear(x, w)` computes y = x w^T like `F.linear`, but each of its three matmuls (the forward,
the input's gradient and the weight's gradient) multiplies float8 e4m3 operands on the GPU's FP8
tensor cores (`torch._scaled_mm`, fp32 accumulation, a bf16 result), about twice Hopper's bf16
rate. Scales are dynamic and per tensor, computed from each operand's largest magnitude at every
call (the "tensorwise" recipe of float8 training libraries): one scale per tensor lets the same
quantized copy serve both layouts a matmul pair needs (x w^T in the forward, g^T x for the weight's
gradient), so each operand is quantized once per call and only transposed. As in those libraries,
the forward products accumulate fast (`FORWARD_FAST_ACCUM`: Hopper's FP8 tensor cores without the
periodic promotion to fp32, as the FP8 target's `fp8_fast_accum`), the gradients' products do not.

`FP8Head` does the same for the frozen LM head's two matmuls in the fused objective (the logits and
the hidden states' gradient, a fifth of an 8B-shaped drafter step in bf16): its weight is quantized
once, both layouts kept (it never changes), and each chunk's hidden states and logit gradients are
quantized as they are made (trainer.models.objective).

What stays as today: the fp32 master weights and AdamW states, the bf16 copies the drafter's
matmuls take (trainer.models.drafter.LowPrecisionWeights), the norms, attention and the loss's
softmax (fp32, from bf16 logits). What changes is the rounding of the linear layers' inputs, weights
and output gradients, and of the LM head's (3 mantissa bits), whose cost is τ (the quality bench's
drafter precision comparison, bench/RESULTS.md).

The function also runs on the CPU (torch 2.13's `_scaled_mm`, else the dequantized product): the
tests check its gradients there; a run is refused FP8 on a CPU drafter at config load
(trainer.run.accel.fp8_refusal), as the target's FP8 is.
"""

from __future__ import annotations

from typing import Any

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
ALIGN = 16  # torch._scaled_mm: every dimension it reads as a matrix's inner or column count
_AMAX_FLOOR = 1e-12  # an all-zero tensor gets a tiny scale, not a division by zero
FORWARD_FAST_ACCUM = True  # the forward products (projections, LM-head logits) with use_fast_accum


def quantize_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x as e4m3 values q and one fp32 scale s (a 0-d tensor) with x ~= q * s: the tensor's largest
    magnitude maps to 448. No host sync: the scale stays on x's device."""
    scale = scale_of(x.detach())
    return to_e4m3(x, scale), scale


def scale_of(x: torch.Tensor) -> torch.Tensor:
    """The tensorwise scale that maps x's largest magnitude to 448 (fp32, 0-d, on x's device)."""
    return torch.clamp(x.abs().amax().float(), min=_AMAX_FLOOR) / E4M3_MAX


def to_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale as e4m3, saturated at +-448."""
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def _pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = -t.shape[0] % multiple
    if not pad:
        return t
    return torch.nn.functional.pad(t.view(torch.uint8), (0, 0, 0, pad)).view(t.dtype)


def scaled_mm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
              out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    """(a * sa) @ (b * sb) for e4m3 a [M, K] (row-major) and b [K, N] (column-major), fp32 accumulation
    (fast_accum on CUDA: Hopper's FP8 accumulation, promoted to fp32 at the end only). K and N must be
    multiples of 16 (the callers pad); a CPU torch without the kernel takes the dequantized product
    (same values up to accumulation order)."""
    cuda = a.device.type == "cuda"
    if cuda or _cpu_kernel():
        return torch._scaled_mm(a, b, scale_a=sa.reshape(1, 1), scale_b=sb.reshape(1, 1), out_dtype=out_dtype,
                                use_fast_accum=fast_accum and cuda)
    return ((a.float() * sa) @ (b.float() * sb)).to(out_dtype)


@torch.library.custom_op("dflash::e4m3_transposed", mutates_args=())
def e4m3_transposed(x: torch.Tensor) -> torch.Tensor:
    """The transpose of x [M, N] (e4m3), contiguous: the layout the weight gradient's `_scaled_mm` takes.

    A copy of its own, opaque to inductor on purpose: left to inductor, this copy was fused into the row
    reductions that make its source (the RMS-norm and SiLU backward), where each row's bytes land a column
    stride apart (5.2 ms for a [21,888 x 4,096] tensor on an H100, 12 % of the FP8 drafter's step,
    bench/RESULTS.md); an eager strided copy is slower still. On CUDA a tiled Triton copy (`_transpose`),
    elsewhere torch's."""
    if x.device.type != "cuda":
        return x.t().clone(memory_format=torch.contiguous_format)  # a copy even where .t() is contiguous
    out = torch.empty((x.shape[1], x.shape[0]), dtype=x.dtype, device=x.device)
    _transpose()(x.view(torch.uint8), out.view(torch.uint8))
    return out


@e4m3_transposed.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[1], x.shape[0]))


_TRANSPOSE: Any = None


def _transpose() -> Any:
    """A launcher of a tiled byte transpose (Triton: each 64 x 64 tile read along rows and written along
    columns through shared memory, both coalesced). Built at the first CUDA use: a CPU machine has no Triton."""
    global _TRANSPOSE
    if _TRANSPOSE is None:
        import triton
        import triton.language as tl

        @triton.jit
        def kernel(src, dst, m, n, bm: tl.constexpr, bn: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton reads annotations
            rows = tl.program_id(0).to(tl.int64) * bm + tl.arange(0, bm)
            cols = tl.program_id(1).to(tl.int64) * bn + tl.arange(0, bn)
            inside = (rows[:, None] < m) & (cols[None, :] < n)
            tile = tl.load(src + rows[:, None] * n + cols[None, :], mask=inside)
            tl.store(dst + cols[None, :] * m + rows[:, None], tile, mask=inside)

        def launch(src: torch.Tensor, dst: torch.Tensor) -> None:
            m, n = src.shape
            kernel[(triton.cdiv(m, 64), triton.cdiv(n, 64))](src, dst, m, n, bm=64, bn=64)

        _TRANSPOSE = launch
    return _TRANSPOSE


class _FP8Linear(torch.autograd.Function):
    """y = x w^T with every matmul in e4m3, tensorwise scales. x [M, K], w [N, K], both 2-D."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16
        xq, sx = quantize_tensor(x)
        wq, sw = quantize_tensor(w)
        ctx.save_for_backward(xq, sx, wq, sw)
        ctx.x_dtype, ctx.w_dtype, ctx.m = x.dtype, w.dtype, x.shape[0]
        return scaled_mm(xq, sx, wq.t(), sw, out_dtype, FORWARD_FAST_ACCUM)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        xq, sx, wq, sw = ctx.saved_tensors
        gq, sg = quantize_tensor(grad)
        dx = dw = None
        if ctx.needs_input_grad[0]:  # g [M, N] @ w [N, K]: w column-major is w^T made contiguous
            dx = scaled_mm(gq, sg, wq.t().contiguous().t(), sw, ctx.x_dtype)
        if ctx.needs_input_grad[1]:  # g^T [N, M] @ x [M, K]: M is the inner dimension, padded to 16
            g_t = e4m3_transposed(_pad_rows(gq, ALIGN))
            x_cols = e4m3_transposed(_pad_rows(xq, ALIGN)).t()
            dw = scaled_mm(g_t, sg, x_cols, sx, torch.float32).to(ctx.w_dtype)
        return dx, dw


def fp8_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) (no bias) with FP8 matmuls forward and backward; x [..., K], weight [N, K]
    (K and N multiples of 16: every drafter projection of a real target is)."""
    shape = x.shape
    y = _FP8Linear.apply(x.reshape(-1, shape[-1]), weight)
    return y.reshape(*shape[:-1], weight.shape[0])


class FP8Head:
    """A frozen LM head weight [V, H] in e4m3 for the fused objective's two matmuls: logits = h W^T
    and grad_h = g W. Quantized once (tensorwise) and kept in both layouts torch._scaled_mm reads, 2 x V x H
    bytes (1 GB at a 128K vocabulary and H 4,096), beside the bf16 head evaluation uses."""

    def __init__(self, weight: torch.Tensor, rows_at_once: int = 8192):
        """Quantized `rows_at_once` rows at a time: made at the first step, beside its activations, the
        whole head in fp32 would be a 2 GB transient at a 128K vocabulary."""
        with torch.no_grad():
            self.scale = scale_of(weight)
            rows = torch.empty(weight.shape, dtype=E4M3, device=weight.device)
            for start in range(0, weight.shape[0], rows_at_once):
                rows[start:start + rows_at_once] = to_e4m3(weight[start:start + rows_at_once], self.scale)
            self.rows = rows  # [V, H]: .t() is the column-major [H, V] the logits take
            self.cols = rows.t().contiguous()  # [H, V]: .t() is the column-major [V, H] the gradient takes
        self.source = weight

    def logits(self, hidden_q: torch.Tensor, hidden_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """[M, V] logits of quantized hidden states [M, H] (`quantize_tensor`)."""
        return scaled_mm(hidden_q, hidden_scale, self.rows.t(), self.scale, out_dtype, FORWARD_FAST_ACCUM)

    def grad_hidden(self, grad_q: torch.Tensor, grad_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """[M, H] gradient of the hidden states from the quantized logits' gradient [M, V]."""
        return scaled_mm(grad_q, grad_scale, self.cols.t(), self.scale, out_dtype)


def fp8_trainable(weight_shape: tuple[int, ...] | torch.Size) -> bool:
    """Whether a weight of this shape can take FP8 matmuls (both dimensions multiples of 16)."""
    return len(weight_shape) == 2 and weight_shape[0] % ALIGN == 0 and weight_shape[1] % ALIGN == 0


_CPU_KERNEL: bool | None = None


def _cpu_kernel() -> bool:
    """Whether this torch runs tensorwise torch._scaled_mm on the CPU."""
    global _CPU_KERNEL
    if _CPU_KERNEL is None:
        try:
            a = torch.ones(16, 16).to(E4M3)
            one = torch.ones(1, 1)
            torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
            _CPU_KERNEL = True
        except (RuntimeError, NotImplementedError, AttributeError, TypeError):
            _CPU_KERNEL = False
    return _CPU_KERNEL
