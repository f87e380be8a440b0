"""The FX-tracing race the threaded trainer hit in the field, and why the pipeline can't hit it."""
import threading

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from trainer.pipeline.compile_safety import (
    CompileGuard,
    LateRecompileError,
    configure_compile_for_thread,
    fx_tracing_flag_is_process_global,
)


@pytest.fixture
def guard():
    g = CompileGuard()
    yield g
    g.unfreeze()
    torch._dynamo.reset()


def test_compiled_call_during_another_threads_make_fx_raises():
    """Reproduces `Detected that you are using FX to symbolically trace a dynamo-optimized function`."""
    if not fx_tracing_flag_is_process_global():
        pytest.skip(f"torch {torch.__version__}: FX tracing flag is thread-local (torch >= 2.14), no race")
    compiled = torch.compile(lambda x: x.sin() + 1, backend="eager")
    compiled(torch.randn(4))
    inside, release = threading.Event(), threading.Event()

    def slow_traced(x):
        inside.set()
        release.wait(30)
        return x.cos()

    tracer = threading.Thread(target=lambda: make_fx(slow_traced)(torch.randn(4)), name="tracer")
    tracer.start()
    try:
        assert inside.wait(30)
        with pytest.raises(RuntimeError, match="FX to symbolically trace a dynamo-optimized function"):
            compiled(torch.randn(4))
    finally:
        release.set()
        tracer.join()
    torch._dynamo.reset()


def _train_step(model):
    def step(shape):
        model(torch.randn(*shape)).square().sum().backward()

    return step


def test_after_warmup_and_freeze_worker_threads_never_trace(fx_trace_threads, guard):
    shapes = [(2, 16), (5, 16)]
    models = {name: torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
              for name in ("cpu:a", "cpu:b")}
    compiled = {name: torch.compile(m, backend="aot_eager", dynamic=False) for name, m in models.items()}
    for name, fn in compiled.items():
        guard.warm_up(name, shapes, _train_step(fn))
    assert fx_trace_threads, "warm-up must have traced (forward and backward) on the main thread"
    assert set(fx_trace_threads) == {threading.current_thread().name}
    guard.freeze()
    fx_trace_threads.clear()

    errors = []

    def worker(name):
        configure_compile_for_thread()  # as every pipeline worker does: dynamo guards on the thread's config
        try:
            for i in range(20):
                shape = shapes[i % 2]
                guard.run_warmed(name, shape, lambda shape=shape: _train_step(compiled[name])(shape))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,), name=f"drafter-{n}") for n in compiled]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert fx_trace_threads == []
    assert guard.recompiles() == 0


def test_unwarmed_shape_after_freeze_is_a_named_error_not_a_trace(fx_trace_threads, guard):
    fn = torch.compile(torch.nn.Linear(8, 3), backend="aot_eager", dynamic=False)
    guard.warm_up("cpu:0", [(4, 8)], _train_step(fn))
    guard.freeze()
    fx_trace_threads.clear()
    with pytest.raises(LateRecompileError, match=r"cpu:0: shape \(7, 8\) was not warmed up"):
        guard.run_warmed("cpu:0", (7, 8), lambda: _train_step(fn)((7, 8)))
    assert fx_trace_threads == []
    assert guard.recompiles() == 1
    assert guard.spurious_misses == 0


def test_a_guard_cache_miss_that_torch_rechecks_as_passing_is_called_again(guard):
    """Threads sharing compiled code can miss its guard cache although every guard holds (torch
    then says so in the stance error); the call is made again instead of failing the run."""
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("Detected recompile when torch.compile stance is 'fail_on_recompile'. "
                               "- Unexpected recompilation: runtime guards failed even though they passed "
                               "during recompilation-reason analysis.")
        return "ran"

    guard.freeze()
    assert guard.run_warmed("cpu:0", (4, 8), flaky) == "ran"
    assert len(calls) == 2 and guard.spurious_misses == 1 and guard.recompiles() == 0


def test_a_spurious_miss_that_keeps_coming_is_raised(guard):
    def always():
        raise RuntimeError("fail_on_recompile: runtime guards failed even though they passed")

    guard.freeze()
    with pytest.raises(RuntimeError, match="even though they passed"):
        guard.run_warmed("cpu:0", (4, 8), always)
