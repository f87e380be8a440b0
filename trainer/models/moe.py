"""How a MoE target runs its experts (`model.target.experts`).

transformers 5 holds a MoE layer's experts as fused 3-D tensors and dispatches their matmuls
through its experts interface (`config._experts_implementation`): `eager`, the per-expert loop
(a gather, two small matmuls and a scatter per expert hit), or `grouped_mm`, the tokens sorted by
expert and every expert's matmul in one `torch._grouped_mm` (torch.nn.functional.grouped_mm)
call. Each token's experts and weights are its own either way (routing is per token), so packed
rows keep every document's features equal to the document run alone.

`auto` picks grouped_mm where the installed transformers and torch offer it, else eager.
"""

from __future__ import annotations

from typing import Any

from trainer.run.accel import EXPERTS, grouped_available


def is_moe(model: Any) -> bool:
    config = getattr(model, "config", None)
    return bool(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None))


def current(model: Any) -> str | None:
    """The experts implementation the model runs (None: not a MoE model of the experts interface)."""
    config = getattr(model, "config", None)
    return getattr(config, "_experts_implementation", None) if is_moe(model) else None


def set_experts(model: Any, choice: str = "auto") -> str | None:
    """Run `model`'s experts with `choice` (EXPERTS); returns what it now runs, or None for a
    dense model or one whose experts class does not take an implementation. grouped_mm asked
    for where it is not offered is an error naming why."""
    if choice not in EXPERTS:
        raise ValueError(f"model.target.experts: {choice!r} is not one of {', '.join(EXPERTS)}")
    if not is_moe(model) or current(model) is None and not hasattr(model, "set_experts_implementation"):
        return None
    missing = grouped_available()
    if choice == "grouped_mm" and missing:
        raise ValueError(f"model.target.experts grouped_mm: {missing}")
    want = "eager" if choice == "eager" or missing else "grouped_mm"
    if hasattr(model, "set_experts_implementation"):
        try:
            model.set_experts_implementation(want)
        except (ValueError, ImportError) as exc:
            if choice == "grouped_mm":
                raise ValueError(f"model.target.experts grouped_mm: {exc}") from None
            model.set_experts_implementation("eager")
    else:
        model.config._experts_implementation = want
    return current(model)
