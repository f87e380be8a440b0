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
