"""What a run will ask of its container: GPUs, checkpoint bytes, RAM and /dev/shm (docs/doctor.md).

Built from the target (its GPU list) and, when given, the trainer config the run will use
(validated by the trainer's own loader, so a bad config fails here with file:line).
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dflash_ops.inventory import Target


GIB = 1 << 30
MIB = 1 << 20

# trainer/models/target.py QWEN3_8B_DIMS (that module imports torch; tests keep the two equal)
QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, num_hidden_layers=36, vocab_size=151936)

BYTES_PER_PARAM = 12  # fp32 master weights + AdamW exp_avg + exp_avg_sq (trainer/run/checkpoint.py)
CHECKPOINT_OVERHEAD = 16 * MIB  # trainer state, RNG states, manifest, safetensors header
SHM_CPU_RUN = 64 * MIB  # Docker's default: enough for Python's semaphores, not for NCCL
SHM_PER_GPU = 512 * MIB
SHM_GPU_FLOOR = 1 * GIB  # NCCL troubleshooting guide: containers need --shm-size=1g or more
RAM_BASE = 2 * GIB  # interpreter, torch, tokenizer, data
DISK_MARGIN = 1 * GIB  # logs, metrics, the release and its venv growing


@dataclass(frozen=True)
class RunPlan:
    gpus: tuple[int, ...] = ()  # the GPUs the run holds (CUDA_VISIBLE_DEVICES)
    cuda_indices: tuple[int, ...] = ()  # cuda:N the config uses, counted inside CUDA_VISIBLE_DEVICES
    keep_checkpoints: int | None = None
    dims: dict | None = None  # the drafter's shape source (target dims), when known locally
    model_config_path: str | None = None  # the target model's config.json in the container
    drafter_layers: int = 5
    drafter_shape: dict | None = None  # model.drafter's own attention shape / MLP width / sinks (None: the target's)
    num_target_layers: int = 5
    config_path: str | None = None
    config_error: str | None = None  # the config is not one of the bundled trainer's
    pack_length: int = 0  # data.pack_length: packed rows (the target's family must allow them)
    dtype_bytes: int = 2  # bytes per target weight (model.dtype: bf16 2, fp32 4; model.target.precision fp8: 1)

    @property
    def needs_gpu(self) -> bool:
        """With a config: it names a cuda device. Without: the target lists GPUs."""
        return bool(self.cuda_indices) if self.config_path is not None else bool(self.gpus)

    @property
    def no_gpu(self) -> str:
        """What the GPU checks say they need when the run needs none."""
        return "none (config not read)" if self.config_error else "none (CPU run)"

    @property
    def gpu_count(self) -> int:
        """GPUs the run uses: the ones it holds, else as many as the config's cuda:N need."""
        if not self.needs_gpu:
            return 0
        return len(self.gpus) if self.gpus else max(self.cuda_indices) + 1

    def checkpoint_bytes(self, model_dims: dict | None = None) -> int | None:
        dims = self.dims or model_dims
        if not dims or not all(isinstance(dims.get(k), int) for k in
                               ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")):
            return None
        return drafter_params(dims, self.drafter_layers, self.num_target_layers,
                              self.drafter_shape) * BYTES_PER_PARAM + CHECKPOINT_OVERHEAD

    def shm_needed(self) -> int:
        """One GPU: a single-rank NCCL communicator uses no shared memory (measured on an H200 with
        a 1 MiB /dev/shm, bench/RESULTS.md), so only Python's floor applies."""
        if self.gpu_count < 2:
            return SHM_CPU_RUN
        return max(SHM_GPU_FLOOR, SHM_PER_GPU * self.gpu_count)

    def ram_needed(self, model_dims: dict | None = None) -> int:
        """A checkpoint is assembled in host memory: the weights copied to the CPU and the
        optimizer state serialised into a buffer (trainer/run/checkpoint.py), about 2x its size."""
        size = self.checkpoint_bytes(model_dims) or 0
        return RAM_BASE + 2 * size

    def disk_needed(self, model_dims: dict | None = None) -> int | None:
        """keep + 1 checkpoints: a new one is complete before the oldest is pruned."""
        size = self.checkpoint_bytes(model_dims)
        if size is None or self.keep_checkpoints is None:
            return None
        return size * (self.keep_checkpoints + 1) + DISK_MARGIN


def drafter_params(dims: dict, drafter_layers: int, num_target_layers: int, own: dict | None = None) -> int:
    """Parameters of trainer/models/drafter.py DFlashDrafter for a target of these dimensions, with
    the draft's own attention shape and MLP width where `own` (model.drafter) gives them (the
    defaults of DrafterConfig.from_target: the target's); a DFlash2 draft (own kind) adds its
    convolutions and selector (whose codebooks need dims' vocab_size)."""
    own = {k: v for k, v in (own or {}).items() if v is not None}
    h = dims["hidden_size"]
    inter = own.get("intermediate_size") or dims["intermediate_size"]
    heads = own.get("num_attention_heads") or dims["num_attention_heads"]
    kv_heads = own.get("num_key_value_heads") or (dims["num_key_value_heads"] if heads % dims["num_key_value_heads"] == 0
                                                  else heads)
    head_dim = own.get("head_dim") or dims.get("head_dim") or h // dims["num_attention_heads"]
    attention = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2 + 2 * head_dim
    attention += heads if own.get("attention_sink") else 0
    layer = attention + 3 * h * inter + 2 * h
    selector = 0
    if own.get("kind") == "dflash2":  # trainer/models/dflash2.py: two convolutions a layer, the candidate selector
        taps, group, rank = own.get("conv_kernel_size") or 2, own.get("conv_group_size") or 16, own.get("selector_rank") or 256
        layer += 2 * (2 * taps * h + 2 * taps * (h // group) * h)
        selector = 2 * int(dims.get("vocab_size") or 0) * rank + rank * h
    return num_target_layers * h * h + 2 * h + drafter_layers * layer + selector


def plan_for(target: Target, gpus: list[int] | None = None, config: Path | str | None = None) -> RunPlan:
    """The plan of a run on `target` with these GPUs (default: the target's) and trainer config."""
    run_gpus = tuple(gpus if gpus is not None else target.gpus)
    if config is None:
        return RunPlan(gpus=run_gpus)
    from dflash_ops.errors import UsageError
    from dflash_ops.yamlfile import check_bounds
    from trainer.run.config import ConfigError, load_config

    # YAML over the bounds (a few hundred bytes of aliases expand to 10^9 nodes) is refused with its
    # line before any loader walks it: no trainer can read it, so it is no mere warning.
    check_bounds(Path(config), "trainer config", UsageError)
    try:
        cfg = load_config(config)
    except ConfigError as e:
        # A release may carry its own trainer: a config the bundled trainer rejects is a warning.
        return RunPlan(gpus=run_gpus, config_path=str(config), config_error=str(e))
    from trainer.run.config import target_replicas

    stage_devices = [d for replica in target_replicas(cfg.devices) for d in replica]
    cuda = sorted({_cuda_index(d) for d in [*stage_devices, *cfg.devices.drafter] if d != "cpu"})
    t = cfg.model.target
    dims, model_config_path = None, None
    if t.tiny is not None:
        dims = dict(hidden_size=t.tiny.hidden, intermediate_size=t.tiny.intermediate,
                    num_attention_heads=t.tiny.heads, num_key_value_heads=t.tiny.kv_heads,
                    head_dim=t.tiny.head_dim, num_hidden_layers=t.tiny.layers)
    elif t.random_8b_shape:
        dims = dict(QWEN3_8B)
    elif t.path is not None:
        model_config_path = posixpath.join(t.path, "config.json")
    return RunPlan(gpus=run_gpus, cuda_indices=tuple(cuda), keep_checkpoints=cfg.run.keep_checkpoints,
                   dims=dims, model_config_path=model_config_path, drafter_layers=cfg.model.drafter_layers,
                   drafter_shape={k: getattr(cfg.model.drafter, k) for k in ("num_attention_heads", "num_key_value_heads",
                                                                            "head_dim", "intermediate_size", "attention_sink",
                                                                            "kind", "conv_kernel_size", "conv_group_size",
                                                                            "selector_rank")},
                   num_target_layers=cfg.model.num_target_layers, config_path=str(config),
                   pack_length=cfg.data.pack_length, dtype_bytes=4 if cfg.model.dtype == "fp32" else 1 if t.precision == "fp8" else 2)


def _cuda_index(device: str) -> int:
    _, _, index = device.partition(":")
    return int(index) if index.isdigit() else 0
