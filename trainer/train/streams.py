"""The CUDA side streams a worker or an update runs its copies and kernels on, and the events that
order them; on a CPU device there is no stream (None) and both are no-ops."""

from __future__ import annotations

import contextlib

import torch


def on_stream(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def record_event(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


def after_current(stream: torch.cuda.Stream | None, device: torch.device) -> contextlib.AbstractContextManager:
    """`stream` made current, ordered after everything queued so far on the stream that was current.

    The wait must name the caller's stream before entering `stream`: inside, current_stream is
    `stream` itself, and `stream.wait_stream(stream)` orders nothing (optim.offload host's NaN on
    the GPU: its gradient copies started before the backward that writes them had finished)."""
    if stream is None:
        return contextlib.nullcontext()
    stream.wait_stream(torch.cuda.current_stream(device))
    return torch.cuda.stream(stream)
