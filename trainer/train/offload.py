"""optim.offload host: the drafter's fp32 master weights and AdamW states in host memory.

A 5-layer drafter beside a Llama-3.3-70B-shaped FP8 target holds ~69 GiB of fp32 weights, gradients
and AdamW states on the device (16 bytes a parameter); with this choice the device keeps only the
weights and gradients in the compute dtype (model.dtype: 4 bytes a parameter in bf16), and the host
keeps the fp32 masters and both moments (12 bytes a parameter), as ZeRO-Offload does.

Why not the AdamW states alone: the update runs where the states are, and it reads and writes the
master weights, so states on the host with masters on the device would move the fp32 weights across
PCIe twice a step (3x the bytes of this design) to free less device memory (the plan: 146 GiB for
the 70B + 5-layer drafter, still more than an H200).

One step (`HostAdamW.step`), in chunks of about CHUNK_ELEMENTS parameters:

1. down: every chunk's gradients are copied (non_blocking, on a side stream ordered after the
   backward: trainer.train.streams.after_current) into one pinned host buffer in the compute dtype, an event recorded per chunk;
2. as each chunk lands: its gradients widened to fp32 (and divided by the step's normalising and
   clipping factor, `grad_scale`, which trainer.distributed.grad_sync.FlatGrads hands an optimizer
   that takes it, as it does the fused CUDA AdamW), the AdamW update on that chunk's masters (torch's
   fused CPU kernel), the updated masters narrowed into the same pinned region and copied up
   (non_blocking) into the device's weights;
3. the training stream waits for the last upload on the device (no host wait), so the next
   forward reads the updated weights.

What overlaps: the downloads of later chunks and the uploads of earlier ones with the host's update
of the chunk between them; on the device, the target's next forward (the threaded pipeline's target
thread runs ahead into the feature queue) with the whole update. What does not: the drafter's next
forward waits for the last upload, since it must read this step's weights (a one-step-delayed
update would hide that wait but changes the math; it is not offered).

The math is the non-offloaded run's with two differences: the device accumulates gradients over
micro-batches in the compute dtype (bf16: the weight gradients autocast produces are bf16 already;
their sum over micro-batches is rounded to bf16), and the fused CPU AdamW kernel rounds its update
differently from the CUDA kernel or the CPU for-loop (a few ulps of the fp32 masters a step). With
model.dtype fp32 (the CPU tests) the first difference vanishes.

Checkpoints hold what a run without offload holds: the model's fp32 weights (the masters:
`model_state`) and the AdamW state dict (the same keys, per parameter index; torch's
load_state_dict moves its tensors to the masters' device or back), so a run resumes across the two
settings. The masters and moments are ordinary (pageable) host memory: only the compute-dtype
gradients and weights cross PCIe, through the pinned buffer; page-locking 55 GiB of states would
take seconds and RAM from the OS for no transfer gain.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch

from trainer.models.memory_plan import OFFLOAD_CHUNK_ELEMENTS as CHUNK_ELEMENTS
from trainer.run.config import OptimConfig
from trainer.train.streams import after_current, on_stream, record_event


def pinned(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host buffer, page-locked when `device` is a GPU (what a non_blocking copy needs to be async);
    pageable where no page-locked memory is left (the copies then wait for the GPU: slower, the same
    numbers), as the checkpointer's staging does."""
    try:
        return torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")
    except RuntimeError:
        return torch.empty(shape, dtype=dtype)


def chunked(sizes: list[int], limit: int) -> list[list[int]]:
    """Indices of consecutive parameters in chunks of at most `limit` elements (a larger parameter alone)."""
    chunks: list[list[int]] = []
    total = limit
    for i, n in enumerate(sizes):
        if total + n > limit:
            chunks.append([])
            total = 0
        chunks[-1].append(i)
        total += n
    return chunks


class HostAdamW(torch.optim.AdamW):
    """AdamW over fp32 masters on the host for device parameters kept in `compute_dtype` (module doc).

    Built from the drafter's fp32 parameters: they become the masters' initial values, and the
    parameters themselves are narrowed to `compute_dtype` in place (`.data`), so the module trains in
    that dtype from here on. Its state dict is AdamW's over the masters, in the parameters' order."""

    def __init__(self, params: Iterable[torch.nn.Parameter], cfg: OptimConfig, compute_dtype: torch.dtype,
                 chunk_elements: int = CHUNK_ELEMENTS) -> None:
        self.device_params = [p for p in params if p.requires_grad]
        if not self.device_params:
            raise ValueError("no trainable parameters")
        devices = {p.device for p in self.device_params}
        if len(devices) != 1:
            raise ValueError(f"optim.offload: the drafter's parameters must share one device, got {devices}")
        self.device = self.device_params[0].device
        self.compute_dtype = compute_dtype
        masters = [p.detach().to("cpu", torch.float32, copy=True) for p in self.device_params]
        for p in self.device_params:
            p.data = p.data.to(compute_dtype)
        beta1, beta2 = cfg.betas
        super().__init__(masters, lr=cfg.lr, betas=(beta1, beta2), eps=cfg.eps, weight_decay=cfg.weight_decay,
                         fused=True)
        self.masters = masters
        sizes = [p.numel() for p in self.device_params]
        self.chunks = chunked(sizes, chunk_elements)
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        # one pinned buffer, both directions: a chunk's region holds its gradients until they are
        # widened, then its updated weights until they are uploaded (the side stream orders the uses)
        self.staging = pinned((self.offsets[-1],), compute_dtype, self.device)
        largest = max(self.offsets[c[-1] + 1] - self.offsets[c[0]] for c in self.chunks)
        self.scratch = torch.empty(largest, dtype=torch.float32)  # one chunk's fp32 gradients
        self.scale = pinned((), torch.float32, self.device)
        self.grad_scale: torch.Tensor | None = None
        self.step_s, self.steps = 0.0, 0  # seconds in step() from its call (the backward may still run) to the last upload queued (a benchmark reads it)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # FlatGrads.finish_step hands this optimizer its 1/scale factor (as the fused CUDA AdamW gets it)
        self._step_supports_amp_scaling = True

    def host_bytes(self) -> int:
        """Host memory this optimizer holds: masters, moments (once stepped), staging and scratch."""
        tensors = [*self.masters, self.staging, self.scratch,
                   *(t for s in self.state.values() for t in s.values() if isinstance(t, torch.Tensor))]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _view(self, buf: torch.Tensor, i: int) -> torch.Tensor:
        return buf[self.offsets[i]:self.offsets[i + 1]].view(self.device_params[i].shape)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]  # closures re-run the forward: not here
        if closure is not None:
            raise ValueError("HostAdamW.step takes no closure")
        began = time.perf_counter()
        scale, self.grad_scale = self.grad_scale, None
        stream = self.stream
        grads = [p.grad for p in self.device_params]
        events: list[torch.cuda.Event | None] = []
        with after_current(stream, self.device):
            if scale is not None:
                self.scale.copy_(scale.detach().reshape(()), non_blocking=True)
            for chunk in self.chunks:
                for i in chunk:
                    grad = grads[i]
                    if grad is not None:
                        self._view(self.staging, i).copy_(grad, non_blocking=True)
                events.append(record_event(stream))
        for chunk, event in zip(self.chunks, events):
            if event is not None:
                event.synchronize()
            start = self.offsets[chunk[0]]
            for i in chunk:
                if grads[i] is None:  # AdamW skips a parameter without a gradient: so does this
                    continue
                g = self.scratch[self.offsets[i] - start:self.offsets[i + 1] - start].view(self.masters[i].shape)
                g.copy_(self._view(self.staging, i))
                if scale is not None:
                    g.div_(self.scale)
                self.masters[i].grad = g
            torch.optim.AdamW.step(self)  # the masters holding a gradient: this chunk's
            for i in chunk:
                if self.masters[i].grad is None:
                    continue
                self.masters[i].grad = None
                self._view(self.staging, i).copy_(self.masters[i])
            with on_stream(stream):
                for i in chunk:
                    if grads[i] is not None:
                        self.device_params[i].copy_(self._view(self.staging, i), non_blocking=True)
        if stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(stream)
        self.step_s += time.perf_counter() - began
        self.steps += 1

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """AdamW's state dict from any run (its tensors land on the host); the update stays the fused
        CPU kernel whatever implementation the saving run used (the dict's groups carry theirs)."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            group.update(fused=True, foreach=None, capturable=False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The device parameters' gradients (what backward accumulates into), not the masters'."""
        for p in self.device_params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.zero_()

    def master_state(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The masters by the module's parameter names (fp32, what a checkpoint's model holds)."""
        index = {id(p): i for i, p in enumerate(self.device_params)}
        return {name: self.masters[index[id(p)]] for name, p in module.named_parameters() if id(p) in index}

    def load_masters(self, module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Set the masters from a checkpoint's model state (fp32) by the module's parameter names."""
        for name, master in self.master_state(module).items():
            master.copy_(state[name])


def model_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """What a checkpoint's model holds: the module's state dict, its trainable weights in fp32 (the
    host masters under optim.offload host, else the module's own)."""
    state = module.state_dict()
    if isinstance(optimizer, HostAdamW):
        state.update(optimizer.master_state(module))
    return state


def load_model_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, torch.Tensor]) -> None:
    """A checkpoint's model into the module (cast to its dtype) and, under offload, into the masters."""
    module.load_state_dict(state)
    if isinstance(optimizer, HostAdamW):
        optimizer.load_masters(module, state)
