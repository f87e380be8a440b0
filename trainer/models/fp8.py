"""The frozen target's linear layers in FP8 (`model.target.precision: fp8`).

Each `nn.Linear` of the decoder layers that training runs becomes an `FP8Linear`: its weight
(out, in) is quantized once, at load, to float8 e4m3 with one fp32 scale per output channel
(the row's largest magnitude maps to e4m3's largest finite value, 448); at every call the input
rows (tokens) are quantized the same way, one scale per token, and `torch._scaled_mm` multiplies
the two on the GPU's FP8 tensor cores (Ada 8.9, Hopper 9.0 and later) with fp32 accumulation,
the per-token and per-channel scales applied to the product, the result in bf16. The tapped
features therefore stay bf16, as the drafter expects; what changes is the rounding of the
target's weights and activations (3 mantissa bits), whose cost is τ (bench/RESULTS.md, issue #42).

An FP8 checkpoint (block-scaled, Qwen3-FP8) is decoded one tensor at a time and re-quantized
per channel as its layer loads (trainer.models.target_loading.load_staged): the target then holds
one byte per weight, never the whole model in bf16.

Everything here also runs on the CPU (the quantization math, the tests); `fp8_refusal` says why
a run may not use it there.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from trainer.run.accel import MIN_CAPABILITY, fp8_refusal

__all__ = ["MIN_CAPABILITY", "fp8_refusal"]  # re-exported: the refusal lives with the config (trainer.run.accel)

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
ALIGN = 16  # torch._scaled_mm: both matrix dimensions of the weight a multiple of 16
_AMAX_FLOOR = 1e-12  # an all-zero row gets a tiny scale instead of a division by zero


class FP8Error(RuntimeError):
    """FP8 matmuls cannot run here (one line naming the device and why)."""


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., K) as e4m3 values q and fp32 scales s (..., 1) with x ~= q * s: each row's largest
    magnitude maps to 448 (per output channel for a weight, per token for an activation)."""
    amax = x.detach().abs().amax(dim=-1, keepdim=True).float()
    scale = torch.clamp(amax, min=_AMAX_FLOOR) / E4M3_MAX
    q = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q * scale in fp32 (scale broadcast along q's rows)."""
    return q.float() * scale.float()


class FP8Linear(torch.nn.Module):
    """y = x W^T (+ b) with W in e4m3 and one scale per output channel, x quantized per token at
    each call; y in `out_dtype` (bf16). Frozen: no gradients flow through it."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 out_dtype: torch.dtype = torch.bfloat16, fast_accum: bool = False) -> None:
        super().__init__()
        out_features, in_features = weight.shape
        self.in_features, self.out_features, self.out_dtype = in_features, out_features, out_dtype
        self.fast_accum = fast_accum  # torch._scaled_mm's use_fast_accum (Hopper: no periodic fp32 promotion)
        # parameters (frozen), not buffers: the memory plan and the stage split count them at 1 byte
        self.weight = torch.nn.Parameter(weight, requires_grad=False)  # (out, in) e4m3, row-major
        self.scale = torch.nn.Parameter(scale.reshape(1, out_features).float().contiguous(), requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().to(out_dtype), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, out_dtype: torch.dtype = torch.bfloat16,
                    fast_accum: bool = False) -> "FP8Linear":
        w = linear.weight
        if w.is_meta:  # the memory plan's meta model: shapes only
            q = torch.empty(w.shape, dtype=E4M3, device="meta")
            scale = torch.empty(w.shape[0], 1, device="meta")
        else:
            q, scale = quantize_rows(w.detach())
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(q, scale, bias, out_dtype, fast_accum)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 per-channel x per-token"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        q, sx = quantize_rows(rows)
        if rows.device.type == "cuda" or _scaled_mm_on_cpu():
            m = q.shape[0]
            pad = -m % ALIGN  # a few decode rows: padded to whole tiles (kernels of some builds want them)
            if pad and rows.device.type == "cuda":
                q = torch.nn.functional.pad(q.view(torch.uint8), (0, 0, 0, pad)).view(E4M3)
                sx = torch.nn.functional.pad(sx, (0, 0, 0, pad), value=1.0)
            if self.fast_accum and rows.device.type == "cuda":
                y = torch._scaled_mm(q, self.weight.t(), scale_a=sx, scale_b=self.scale, out_dtype=self.out_dtype,
                                     use_fast_accum=True)
            else:
                y = torch._scaled_mm(q, self.weight.t(), scale_a=sx, scale_b=self.scale, out_dtype=self.out_dtype)
            y = y[:m] if pad and rows.device.type == "cuda" else y
        else:  # a torch without the CPU kernel: the same product, dequantized (tests only: the CPU is refused)
            y = (dequantize(q, sx) @ dequantize(self.weight, self.scale.t()).t()).to(self.out_dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


_CPU_SCALED_MM: bool | None = None


def _scaled_mm_on_cpu() -> bool:
    """Whether this torch runs torch._scaled_mm with per-row scales on the CPU (2.13 does; older not)."""
    global _CPU_SCALED_MM
    if _CPU_SCALED_MM is None:
        try:
            a = torch.ones(16, 16).to(E4M3)
            torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
            _CPU_SCALED_MM = True
        except (RuntimeError, NotImplementedError, AttributeError, TypeError):
            _CPU_SCALED_MM = False
    return _CPU_SCALED_MM


def quantizable(linear: torch.nn.Module) -> bool:
    return (type(linear) is torch.nn.Linear and linear.in_features % ALIGN == 0
            and linear.out_features % ALIGN == 0)


def quantize_linears(module: torch.nn.Module, out_dtype: torch.dtype = torch.bfloat16,
                     fast_accum: bool = False) -> int:
    """Replace every plain nn.Linear under `module` (both dimensions multiples of 16) by an
    FP8Linear, in place, one at a time (the bf16 weight is freed as its FP8 copy is made).
    Works on meta modules too (the memory plan). Returns how many were replaced."""
    replaced = 0
    for name, child in list(module.named_children()):
        if quantizable(child):
            setattr(module, name, FP8Linear.from_linear(child, out_dtype, fast_accum))  # type: ignore[arg-type]
            replaced += 1
        else:
            replaced += quantize_linears(child, out_dtype, fast_accum)
    return replaced


def quantize_layers(layers: Iterable[torch.nn.Module], out_dtype: torch.dtype = torch.bfloat16,
                    fast_accum: bool = False) -> int:
    """quantize_linears over decoder layers; layers still on the meta device (above the last tap
    of a target loaded for training) are quantized as shapes. fast_accum: model.target.fp8_fast_accum."""
    return sum(quantize_linears(layer, out_dtype, fast_accum) for layer in layers)


@dataclass(frozen=True, kw_only=True)
class FP8Converter:
    """model.target.precision fp8, applied by the loaders (trainer.models.target_loading, the targets
    built in code) to each decoder layer that training runs as it is made: what was converted is
    known from this value (trainer.models.frozen_target.Target), never found again by scanning.
    One converter per target: its replicas are loaded with the same one."""

    out_dtype: torch.dtype = torch.bfloat16
    fast_accum: bool = False  # model.target.fp8_fast_accum

    def check(self, devices: Iterable[torch.device | str]) -> None:
        """Refuse (FP8Error) before any weight is read where FP8 matmuls cannot run (`check_device`)."""
        for device in dict.fromkeys(torch.device(d) for d in devices):
            check_device(device)

    def convert(self, layer: torch.nn.Module) -> int:
        """The layer's linear layers in FP8, in place; how many were replaced."""
        return quantize_linears(layer, self.out_dtype, self.fast_accum)


def fp8_bytes(module: torch.nn.Module) -> int:
    """Parameter bytes of `module` once quantize_linears ran on it (a meta module: shapes only)."""
    total = 0
    for m in module.modules():
        own = list(m.parameters(recurse=False))
        if isinstance(m, torch.nn.Linear) and quantizable(m):
            total += m.weight.numel() + 4 * m.out_features + sum(
                p.numel() * p.element_size() for p in own if p is not m.weight)
        else:
            total += sum(p.numel() * p.element_size() for p in own)
    return total


def check_device(device: torch.device | str) -> None:
    """Refuse (FP8Error, one line) a device where FP8 matmuls cannot run, and on a CUDA device run
    one small FP8Linear against its dequantized reference, so a torch whose `_scaled_mm` lacks
    per-row scales on this GPU, or computes something else, stops the run at load, not as wrong
    features."""
    d = torch.device(device)
    reason = fp8_refusal(str(d))
    if reason is None and d.type == "cuda" and not torch.cuda.is_available():
        reason = f"{d}: CUDA is not available in this process"
    if reason:
        raise FP8Error(f"model.target.precision fp8: {reason}")
    generator = torch.Generator(device="cpu").manual_seed(0)
    w = torch.randn(64, 128, generator=generator)
    x = torch.randn(32, 128, generator=generator)
    layer = FP8Linear.from_linear(_linear(w)).to(d)
    try:
        got = layer(x.to(d, torch.bfloat16)).float().cpu()
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise FP8Error(f"model.target.precision fp8: torch._scaled_mm with per-token and per-channel scales "
                       f"fails on {d} (torch {torch.__version__}): {first}; use precision bf16") from None
    qx, sx = quantize_rows(x.to(torch.bfloat16))
    want = dequantize(qx, sx) @ dequantize(layer.weight.cpu(), layer.scale.cpu().t()).t()
    err = float((got - want).norm() / want.norm())
    if not err < 2e-2:
        raise FP8Error(f"model.target.precision fp8: torch._scaled_mm on {d} (torch {torch.__version__}) differs "
                       f"from its dequantized reference by {err:.3g} (relative): use precision bf16")


def _linear(weight: torch.Tensor) -> torch.nn.Linear:
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    return linear


def fp8_summary(model: Any) -> str:
    """`N linear layers in FP8 (X GiB), M kept in bf16` for the log."""
    fp8 = [m for m in model.modules() if isinstance(m, FP8Linear)]
    plain = [m for m in model.modules() if type(m) is torch.nn.Linear and m.weight.device.type != "meta"]
    size = sum(m.weight.numel() for m in fp8 if not m.weight.is_meta)
    return (f"{len(fp8)} linear layers in FP8 e4m3 ({size / 2**30:.2f} GiB, per-channel weight and per-token "
            f"activation scales), {len(plain)} kept in bf16 (the LM head and what is not a multiple of {ALIGN})")


def converter_for(precision: str, fast_accum: bool = False,
                  out_dtype: torch.dtype = torch.bfloat16) -> FP8Converter | None:
    """model.target.precision (and fp8_fast_accum) as the converter the loaders apply: None for bf16.
    The one reading of the precision: the loaders, the replicas and the memory plan all ask here."""
    if precision == "bf16":
        return None
    if precision != "fp8":
        raise ValueError(f"model.target.precision: {precision!r} is not one of 'bf16', 'fp8'")
    return FP8Converter(out_dtype=out_dtype, fast_accum=fast_accum)
