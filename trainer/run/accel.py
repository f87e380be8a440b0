"""What the installed torch, transformers and GPUs offer the target's kernels, asked at config load
(trainer.run.config) and where the target is built (trainer.models.fp8, trainer.models.moe).

Only torch and transformers are imported, lazily: the config loads on a machine without them
(dflash-ops on the control side), where nothing is refused here but the CPU.
"""

from __future__ import annotations

MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada; Hopper is (9, 0)
EXPERTS = ("auto", "grouped_mm", "eager")


def fp8_refusal(device: str) -> str | None:
    """Why the target cannot run its matmuls in FP8 on `device`, or None. A CUDA device this process
    cannot see (the config read on a control machine) is not judged here: the trainer checks it
    again where it builds the target (trainer.models.fp8.check_device)."""
    import torch

    d = torch.device(device)
    if d.type != "cuda":
        return (f"{device}: FP8 needs a GPU with FP8 tensor cores (compute capability 8.9 or later, "
                "torch._scaled_mm); the CPU has none: use precision bf16")
    if not hasattr(torch, "_scaled_mm"):
        return f"this torch ({torch.__version__}) has no torch._scaled_mm: use precision bf16"
    if not torch.cuda.is_available() or (d.index or 0) >= torch.cuda.device_count():
        return None
    capability = torch.cuda.get_device_capability(d)
    if tuple(capability) < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(d)
        return (f"{device} ({name}) has compute capability {capability[0]}.{capability[1]}; FP8 matmuls need "
                f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} (Ada) or 9.0 (Hopper) and later: use precision bf16")
    return None


def grouped_available() -> str | None:
    """Why grouped expert matmuls are not offered here, or None."""
    import torch

    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return "this transformers has no experts interface (transformers.integrations.moe)"
    if "grouped_mm" not in ALL_EXPERTS_FUNCTIONS:
        return "this transformers' experts interface has no grouped_mm"
    if not (hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")):
        return f"this torch ({torch.__version__}) has no grouped_mm"
    return None
