"""Compile safety for a process with one thread per device.

Facts this module is built around (checked in torch 2.11-2.13 sources):

* Up to torch 2.13 the FX tracing flag (`torch.fx._symbolic_trace._is_fx_tracing_flag`) is a
  process-wide global. Every `make_fx` sets it: AOTAutograd on each (re)compile, the lazy
  backward compile at the first `backward()`, and eager `flex_attention` with grad on every call.
  A compiled function called in any other thread while it is set raises "Detected that you are
  using FX to symbolically trace a dynamo-optimized function". Dynamo's compile lock does not
  cover running compiled code. torch 2.14 makes the flag thread-local, but compiling from several
  threads at once is still unsupported.
* `torch._dynamo.config` / `torch._inductor.config` user overrides are per thread (ContextVar),
  so a setting made on the main thread is not seen by worker threads: apply them in every thread.
* `torch.compiler.set_stance` is a process-wide global.
* Dynamo guards on device, so every drafter device needs its own warm-up.

The design: warm up every (device, shape, mode) on ONE thread before any worker starts (forward
and backward, so AOTAutograd's lazy backward compile happens then too), then freeze with
`set_stance("fail_on_recompile")`. After that no thread ever traces, so the race cannot happen;
a shape that was not warmed up fails loudly with `LateRecompileError` naming it.

One more fact: threads running the same compiled code share its guard cache, and under
contention a lookup can miss although every guard holds (torch 2.13 then reports "runtime guards
failed even though they passed during recompilation-reason analysis"). Nothing of the missed
frame has run at that point, so `run_warmed` calls it again instead of failing the run.
"""
from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import Callable, Iterable, TypeVar

import torch

ALLOCATOR_DEFAULT = "expandable_segments:True"

# Applied in every thread that compiles or runs compiled code (config is thread-local since 2.12).
DYNAMO_SETTINGS = {
    "automatic_dynamic_shapes": False,  # one static graph per warmed shape, no surprise dynamic recompiles
    "recompile_limit": 64,
    "accumulated_recompile_limit": 1024,
}
INDUCTOR_SETTINGS = {
    "max_autotune": False,  # autotuning at a new shape is what OOMed in the field
    "max_autotune_gemm": False,
    "coordinate_descent_tuning": False,
}


T = TypeVar("T")

SPURIOUS_GUARD_MISS = "runtime guards failed even though they passed"
SPURIOUS_RETRIES = 3


class LateRecompileError(RuntimeError):
    """A compiled function met an input it was not warmed up for after the freeze."""


def set_allocator_defaults(environ: MutableMapping[str, str] = os.environ) -> None:
    """PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless the user chose otherwise.

    Must run before CUDA is initialised (the allocator reads it once)."""
    if "PYTORCH_CUDA_ALLOC_CONF" in environ:
        return
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        raise RuntimeError("set_allocator_defaults() called after CUDA was initialised; call it first")
    environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOCATOR_DEFAULT


def configure_compile_for_thread() -> None:
    """Apply the compile settings to the calling thread (call first thing in every worker)."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    for name, value in DYNAMO_SETTINGS.items():
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, value)
    for name, value in INDUCTOR_SETTINGS.items():
        if hasattr(inductor_config, name):
            setattr(inductor_config, name, value)


def fx_tracing_flag_is_process_global() -> bool:
    """True on torch versions (<= 2.13) where the FX tracing flag is one module-level bool."""
    return isinstance(getattr(torch.fx._symbolic_trace, "_is_fx_tracing_flag", None), bool)


def compiled_frames() -> int:
    """Frames Dynamo has tried to compile so far in this process (all threads)."""
    from torch._dynamo.utils import counters

    return int(counters["frames"]["total"])


@dataclass
class CompileGuard:
    """Warm-up bookkeeping and the freeze. One per process."""

    frozen: bool = False
    warm_shapes: dict[str, list[tuple]] = field(default_factory=dict)
    warmup_seconds: float = 0.0
    frames_at_freeze: int = 0
    refused: int = 0
    spurious_misses: int = 0

    def warm_up(self, device_key: str, shapes: Iterable[tuple], step: Callable[[tuple], None]) -> None:
        """Run `step(shape)` (forward + backward, every grad/autocast mode used) for each shape.

        Must be called on one thread, before any worker thread starts."""
        if self.frozen:
            raise RuntimeError("warm_up after freeze(): warm every device before starting workers")
        configure_compile_for_thread()
        start = time.perf_counter()
        for shape in shapes:
            step(tuple(shape))
            self.warm_shapes.setdefault(device_key, []).append(tuple(shape))
        self.warmup_seconds += time.perf_counter() - start

    def freeze(self) -> None:
        """From now on a recompile anywhere is an error, never a trace racing another thread."""
        torch.compiler.set_stance("fail_on_recompile")
        self.frozen = True
        self.frames_at_freeze = compiled_frames()

    def unfreeze(self) -> None:
        if self.frozen:
            torch.compiler.set_stance("default")
            self.frozen = False

    def recompiles(self) -> int:
        """Compilations attempted since the freeze (each one is refused and raised)."""
        if not self.frozen:
            return 0
        return compiled_frames() - self.frames_at_freeze + self.refused

    def run_warmed(self, device_key: str, shape: tuple, fn: Callable[[], T]) -> T:
        """`fn()` under `expect_warmed`, called again after a spurious guard-cache miss.

        `fn` must have no effect before its compiled frames run (a forward and its backward)."""
        for attempt in range(SPURIOUS_RETRIES + 1):
            try:
                with self.expect_warmed(device_key, shape):
                    return fn()
            except _SpuriousGuardMiss:
                self.spurious_misses += 1
                if attempt == SPURIOUS_RETRIES:
                    raise
        raise AssertionError("unreachable")

    @contextlib.contextmanager
    def expect_warmed(self, device_key: str, shape: tuple) -> Iterator[None]:
        """Turn the stance's recompile error into one that names the device and shape."""
        try:
            yield
        except RuntimeError as exc:
            if "fail_on_recompile" not in str(exc):
                raise
            if SPURIOUS_GUARD_MISS in str(exc):
                raise _SpuriousGuardMiss(str(exc)) from exc
            self.refused += 1
            warmed = self.warm_shapes.get(device_key, [])
            raise LateRecompileError(
                f"{device_key}: shape {tuple(shape)} was not warmed up (warmed: {warmed}); "
                "refusing to compile after the freeze because it would race the other threads"
            ) from exc


class _SpuriousGuardMiss(RuntimeError):
    """A guard-cache miss that torch's own re-check found to be no miss (see the module docstring)."""
