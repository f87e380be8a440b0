"""Weights read from a directory the user names (model.drafter_init: a published draft or a
trainer checkpoint; a resumed run's checkpoint), checked before they reach the drafter.

Why: a directory of another shape ended in torch's multi-line `Error(s) in loading state_dict`
with a traceback, and an integer tensor under a drafter's name was cast to float without a word
(#55 item 8). Here each problem is one line naming the directory and the tensor."""

from __future__ import annotations

import torch


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def float_weights(where: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors in float32; ValueError naming the first one that is not floating point (an
    integer tensor holds no weights a drafter could train from: it is refused, never cast)."""
    for name, t in tensors.items():
        if not t.is_floating_point():
            raise ValueError(f"{where}: tensor {name} is {_dtype(t)}, not floating point: not a drafter's weights "
                             "(an integer tensor is never cast to float)")
    return {k: v.float() for k, v in tensors.items()}


def check_fits(where: str, weights: dict[str, torch.Tensor], model: dict[str, torch.Tensor],
               may_miss: tuple[str, ...] | list[str] = ()) -> None:
    """ValueError naming the first way `weights` do not fit `model` (the drafter's state_dict): a
    tensor the drafter does not have, one of another shape or kind, or one of the drafter's that
    `weights` lack (apart from may_miss: a warm start's new parts)."""
    for name, t in weights.items():
        if name not in model:
            raise ValueError(f"{where}: tensor {name} is not one of this drafter's "
                             f"(a draft of another shape or kind?)")
        if tuple(t.shape) != tuple(model[name].shape):
            raise ValueError(f"{where}: tensor {name} has shape {list(t.shape)}; this drafter's is "
                             f"{list(model[name].shape)}")
        if t.is_floating_point() != model[name].is_floating_point():
            raise ValueError(f"{where}: tensor {name} is {_dtype(t)}; this drafter's is {_dtype(model[name])} "
                             "(never cast)")
    missing = [name for name in model if name not in weights and name not in may_miss]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{where}: no tensor {missing[0]}{more}: this drafter has it")
