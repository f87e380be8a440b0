"""The memory plan: bytes per target stage, per drafter replica and per device, from the config alone.

`python -m trainer plan --config C` prints it. The target's sizes come from its config.json (the model
is built on the meta device: shapes, no weights) and its safetensors index (which layers the shards
hold); nothing is read from the weights. Activations are estimated at the configured micro-batch
shape. A per-device budget (devices.memory_gib, else each GPU's memory; none on the CPU) decides
whether it fits, and the plan names the smallest split that does.

optim.offload host moves the drafter's fp32 weights and AdamW states to the host (trainer.train.offload):
the drafter's device keeps its weights and gradients in model.dtype, and the plan gains a `host`
entry (masters, moments, the pinned transfer buffer, one chunk's fp32 gradients) judged against the
host's RAM when it is known (this machine's, or host_bytes for another).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from trainer.run.config import TrainerConfig, drafter_own, missing_devices, target_replicas

GIB = 2**30


class DoesNotFit(ValueError):
    """The memory plan exceeds a device's budget (one line naming the device and the shortfall)."""
ADAM_STATE = 2  # AdamW moments, fp32, per drafter parameter
HOST = "host"  # the plan's entry for host memory (optim.offload host)
# optim.offload host updates in chunks of this many parameters (256 MiB of bf16 gradients), copies overlapping
# the update (trainer.train.offload.HostAdamW); the plan counts one chunk's scratch
OFFLOAD_CHUNK_ELEMENTS = 1 << 27


@dataclass
class DevicePlan:
    device: str
    items: dict[str, int] = field(default_factory=dict)  # what it holds -> bytes
    budget: int | None = None

    @property
    def total(self) -> int:
        return sum(self.items.values())

    @property
    def reserve(self) -> int:
        return cuda_reserve(self.device, self.budget)

    @property
    def shortfall(self) -> int:
        return 0 if self.budget is None else max(0, self.total + self.reserve - self.budget)


@dataclass
class MemoryPlan:
    stages: list[dict]  # per stage of replica 0: device, layers, weight and activation bytes
    drafter: dict[str, int]  # one drafter replica: weights, grads, optimizer, head, activations
    devices: list[DevicePlan]
    smallest_split: int | None  # fewest stages of one replica that fit the budget (None: none does)
    notes: list[str]
    gpus: int = 0  # GPUs this host has (0: none visible)
    suggestion: str | None = None  # a devices: section for them with the smallest split
    checkpoint_drafter: int = 0  # the drafter's layers checkpointed, the first ones (model.checkpoint_drafter resolved)
    drafter_layers: int = 0
    checkpoint_reason: str = ""  # why (auto: what the step needs without it)
    # per device with a budget: the largest data.pack_length whose step fits there (None: none does)
    largest_pack_length: dict[str, int | None] = field(default_factory=dict)  # checkpointed unless it is off
    largest_pack_length_unchecked: dict[str, int | None] = field(default_factory=dict)  # auto: without, beside it
    missing: str | None = None  # a device the config names that the host lacks (trainer.run.config.missing_devices)
    offloaded: int = 0  # bytes per drafter replica that optim.offload moves off its device
    drafter_params: int = 0  # parameters of one drafter replica

    @property
    def fits(self) -> bool:
        return self.missing is None and all(d.shortfall == 0 for d in self.devices)

    def refusal(self) -> str | None:
        """One line naming a device the host lacks, or the first device that does not fit and by how
        much, else None."""
        if self.missing is not None:
            return self.missing
        for d in self.devices:
            if d.shortfall:
                hint = (f"; a split in {self.smallest_split} stages fits (devices.target: [[...{self.smallest_split} "
                        "devices]])" if self.smallest_split and self.smallest_split > len(self.stages) else "")
                reserve = f" + {size(d.reserve)} reserve" if d.reserve else ""
                return (f"{d.device} needs {size(d.total)}{reserve}, {size(d.shortfall)} more than its "
                        f"{size(d.budget or 0)} budget" + hint)
        return None


def cuda_reserve(device: str, budget: int | None) -> int:
    """What a GPU loses besides the tensors the plan counts: the CUDA context, cuBLAS/compile
    workspaces and the caching allocator's fragmentation (1 GiB + 3 % of the device; none on the CPU)."""
    if budget is None or not device.startswith("cuda"):
        return 0
    return GIB + budget * 3 // 100


def _device_budget(device: str, cfg: TrainerConfig, gpu_bytes: dict[int, int] | None = None) -> int | None:
    """devices.memory_gib, else the GPU's memory (gpu_bytes: cuda index -> bytes, as measured on the
    node; else this process's GPUs), else none."""
    if cfg.devices.memory_gib is not None:
        return int(cfg.devices.memory_gib * GIB)
    d = torch.device(device.split(":target")[0].split(":drafter")[0])
    if d.type != "cuda":
        return None
    if gpu_bytes is not None:
        return gpu_bytes.get(d.index or 0)
    if torch.cuda.is_available() and (d.index or 0) < torch.cuda.device_count():
        return int(torch.cuda.get_device_properties(d).total_memory)
    return None


def _meta_target(cfg: TrainerConfig, dtype: torch.dtype, model_config: dict | None) -> tuple[Any, list[str]]:
    from trainer.models.target import QWEN3_8B_DIMS
    from trainer.models.target_loading import ShardReader, meta_model

    notes = []
    t = cfg.model.target
    if model_config is not None:  # config.json as read on the node (or a random target's)
        from transformers import AutoConfig

        doc = dict(model_config)
        config = AutoConfig.for_model(doc.pop("model_type"), **doc)
        notes.append(f"sized from {t.path}/config.json as read on the node (its index not read)" if t.path
                     else f"sized from the given {config.model_type} config")
        return meta_model(config, dtype), notes
    if t.path is not None:
        from transformers import AutoConfig

        from trainer.run.family import check_model_dir

        check_model_dir(t.path, weights=False)  # what training checks first: the directory, its config.json
        config = AutoConfig.from_pretrained(t.path, local_files_only=True)
        model = meta_model(config, dtype)
        text_config: Any = model.config  # a vision-language checkpoint's text part (Qwen3.5)
        try:
            check_model_dir(t.path)
        except ValueError as exc:  # config.json alone plans a model not downloaded yet
            notes.append(f"no weights read ({exc}; training needs them)")
            return model, notes
        reader = ShardReader(t.path)  # the index as the loader reads it (ModelDirError when it cannot)
        missing = [i for i in range(text_config.num_hidden_layers)
                   if not any(k.startswith(f"model.layers.{i}.") for k in [*reader.weight_map, *reader.aliases])]
        if missing:
            notes.append(f"the shards lack layers {missing[0]}..{missing[-1]} (training does not need them "
                         "if they are above the last tapped layer; τ is then not measured)")
        return model, notes
    from transformers import Qwen3Config

    if t.random_8b_shape:
        config = Qwen3Config(**QWEN3_8B_DIMS)
    else:
        tiny = t.tiny
        assert tiny is not None
        config = Qwen3Config(vocab_size=cfg.model.mask_token_id + 1 if cfg.model.mask_token_id else 512,
                             hidden_size=tiny.hidden, intermediate_size=tiny.intermediate,
                             num_hidden_layers=tiny.layers, num_attention_heads=tiny.heads,
                             num_key_value_heads=tiny.kv_heads, head_dim=tiny.head_dim, tie_word_embeddings=False)
        notes.append("tiny target: vocabulary size estimated (the synthetic tokenizer is not built for the plan)")
    return meta_model(config, dtype), notes


def _tokens_per_micro_batch(cfg: TrainerConfig) -> int:
    d = cfg.data
    return d.pack_rows * d.pack_length if d.pack_length else d.token_budget


@dataclass
class _Sizes:
    """What the plan reads of the models once (the meta target, the drafter's parameter count)."""

    config: Any  # the target's (text) config
    layer_ids: list[int]
    per_layer: list[int]  # parameter bytes of each target layer
    embed: int
    head: int
    drafter_params: int
    largest_param: int  # elements of the drafter's largest parameter (offload's update scratch)
    drafter: Any  # the draft's own DrafterConfig (model.drafter: its attention shape and MLP)
    elt: int  # bytes per element of the run's dtype (target weights and activations, drafter autocast)
    notes: list[str]


def _sizes(cfg: TrainerConfig, model_config: dict | None) -> _Sizes:
    from trainer.models.drafter import DFlashDrafter, DrafterConfig
    from trainer.models.fp8 import converter_for
    from trainer.models.target import tapped_layer_ids
    from trainer.models.target_loading import layer_bytes, module_bytes, stage_plan

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[cfg.model.dtype]
    target, notes = _meta_target(cfg, dtype, model_config)
    config = target.config
    n_layers = int(config.num_hidden_layers)
    layer_ids = tapped_layer_ids(cfg.model.target_layer_ids, cfg.model.num_target_layers, n_layers)
    for replica in target_replicas(cfg.devices):  # the loader's own split check (SplitError): what training would refuse
        stage_plan(target, layer_ids, replica, cfg.devices.target_split)
    run = max(layer_ids) + 1
    per_layer = layer_bytes(target)
    fp8 = converter_for(cfg.model.target.precision, cfg.model.target.fp8_fast_accum, dtype)
    if fp8 is not None:  # the layers training runs hold 1 byte a linear weight; those above
        per_layer = layer_bytes(target, fp8)[:run] + per_layer[run:]  # (decoding) load in bf16
        notes.append(f"precision fp8: layers 0..{run - 1} counted at 1 byte a linear weight (+ fp32 per-channel "
                     "scales), the embedding, norms and the decoding share in bf16")
    base = getattr(target, target.base_model_prefix)
    dcfg = DrafterConfig.from_target(config, cfg.model.drafter_layers, cfg.model.block_size,
                                     cfg.model.mask_token_id or 0, layer_ids, **drafter_own(cfg.model))
    with torch.device("meta"):
        sizes = [p.numel() for p in DFlashDrafter(dcfg).parameters()]
    return _Sizes(config, list(layer_ids), per_layer, module_bytes(base.embed_tokens),
                  module_bytes(target.get_output_embeddings()), sum(sizes), max(sizes), dcfg,
                  torch.finfo(dtype).bits // 8, notes)


def drafter_activation_bytes(cfg: TrainerConfig, dcfg: Any, context_tokens: int, block_tokens: int,
                             checkpointed: int, kl: bool = False, fp8: bool = False) -> int:
    """Peak bytes of one drafter step's activations (the backward's peak), at the autocast dtype.

    Each layer keeps for backward what its two compiled regions and attention save: per block slot
    the residual stream before and after attention and its normed copy, the query before and after
    RoPE and the attention output, the MLP's gate, up and product (3 x hidden + 3 x q width + 3 x
    MLP width), and the keys and values of [context | block] before and after their norm and RoPE.
    A DFlash2 drafter (dcfg.kind) adds its convolutions' and selector's share (an estimate).
    The first `checkpointed` layers (model.checkpoint_drafter) keep their input only. Around the
    layers: the context's projection and its norm, the block embeddings, the final norm's input and
    output, the LM head's gradient of the hidden states. On top of those, the larger of two phases
    that never overlap: the loss, with every layer's saved activations and the LM-head logits chunks
    (loss_chunk x vocab in fp32: the logits, their copy and gradient; under kl also the target's
    logits and probabilities); and the layers' backward, which meets the saved layers first (the last
    ones, freed as it goes) and then recomputes one checkpointed layer at a time, beside one layer's
    transient gradients (the MLP's two products, two residual widths). dcfg: the draft's own
    DrafterConfig. Measured against the pipeline's peaks at 8,192 to 65,536-token rows,
    checkpointing off and on (bench/RESULTS.md, issue #35).

    With `fp8` (model.drafter.precision fp8) a layer's projections save their inputs as e4m3
    (fp8_operand_bytes counts those), so two bf16 tensors kept only as projection inputs are no
    longer saved: the normed residual and the MLP's product (the norm's and the product's own
    backward read their inputs, not these); the attention output stays (attention's backward reads
    it). Measured: the plan was 1.14x the FP8 drafter's peak before this (bench/RESULTS.md, #51)."""
    elt = 4 if cfg.model.dtype == "fp32" else 2
    hidden, heads, head_dim = int(dcfg.hidden_size), int(dcfg.num_attention_heads), int(dcfg.head_dim)
    kv_width = int(dcfg.num_key_value_heads) * head_dim
    mlp = int(dcfg.intermediate_size)
    per_layer = (block_tokens * (3 * hidden + 3 * heads * head_dim + 3 * mlp) * elt
                 + (context_tokens + block_tokens) * 4 * kv_width * elt + block_tokens * heads * 4)
    if fp8:
        per_layer -= block_tokens * (hidden + mlp) * elt
    selector = 0
    if getattr(dcfg, "kind", "dflash") == "dflash2":
        # DFlash2 (an estimate, not yet measured): each of a layer's four convolutions keeps its input,
        # the shifted copies and the product per tap; the selector its candidates' successor rows and
        # the projected hidden states (fp32), per loss slot
        per_layer += block_tokens * 4 * (int(dcfg.conv_kernel_size) + 1) * hidden * elt
        selector = block_tokens * (int(dcfg.selector_top_k) + 2) * int(dcfg.selector_rank) * 4
    layers = cfg.model.drafter_layers
    checkpointed = min(checkpointed, layers)
    inputs = checkpointed * block_tokens * hidden * elt
    saved = (layers - checkpointed) * per_layer
    around = (2 * context_tokens + 4 * block_tokens) * hidden * elt
    logits = min(block_tokens, cfg.model.loss_chunk) * int(dcfg.vocab_size) * 4 * (5 if kl else 3)
    transient = block_tokens * (2 * mlp + 2 * hidden) * elt
    loss_phase = saved + logits
    backward_phase = max(saved, per_layer if checkpointed else 0) + transient
    return inputs + around + max(loss_phase, backward_phase) + selector


def fp8_operand_bytes(cfg: TrainerConfig, dcfg: Any, params: int, context_tokens: int, block_tokens: int,
                      checkpointed: int) -> int:
    """What model.drafter.precision fp8 keeps beside the bf16 activations (an estimate, 1 byte an
    element): each projection's quantized input and weight, saved by fp8_linear for its backward, in
    the layers not checkpointed (a checkpointed layer's are remade one layer at a time)."""
    hidden, q_width = int(dcfg.hidden_size), int(dcfg.num_attention_heads) * int(dcfg.head_dim)
    mlp = int(dcfg.intermediate_size)
    per_layer = block_tokens * (5 * hidden + q_width + mlp) + 2 * context_tokens * hidden
    kept = cfg.model.drafter_layers - min(checkpointed, cfg.model.drafter_layers)
    return params + max(kept, 1 if checkpointed else 0) * per_layer + context_tokens * len(dcfg.target_layer_ids) * hidden


def host_ram() -> int | None:
    """This machine's physical memory (None where the OS does not say)."""
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def offload_items(cfg: TrainerConfig, z: _Sizes) -> tuple[dict[str, int], dict[str, int]]:
    """The drafter's weight, gradient and optimizer bytes on its device, and what the host holds (empty
    without offload): optim.offload host keeps model.dtype weights and gradients on the device and the
    fp32 masters, both AdamW moments, the pinned transfer buffer (model.dtype, both directions) and one
    chunk's fp32 gradients on the host (trainer.train.offload)."""
    params = z.drafter_params
    if cfg.optim.offload == "none":
        return {"weights (fp32)": 4 * params, "gradients (fp32)": 4 * params,
                "optimizer (fp32)": ADAM_STATE * 4 * params}, {}
    dtype = cfg.model.dtype
    device = {f"weights ({dtype})": z.elt * params, f"gradients ({dtype})": z.elt * params}
    host = {"drafter master weights (fp32)": 4 * params, "AdamW states (fp32)": ADAM_STATE * 4 * params,
            f"transfer buffer ({dtype}, pinned)": z.elt * params,
            "update scratch (fp32, one chunk)": 4 * min(params, max(OFFLOAD_CHUNK_ELEMENTS, z.largest_param))}
    return device, host


def _assemble(cfg: TrainerConfig, z: _Sizes, checkpointed: int, gpu_bytes: dict[int, int] | None,
              notes: list[str], find_split: bool = True, host_bytes: int | None = None) -> MemoryPlan:
    """The plan for `cfg` with the first `checkpointed` drafter layers checkpointed (find_split: also the
    smallest split that fits)."""
    from trainer.models.target_loading import partition
    from trainer.run.config import row_anchors

    config = z.config
    hidden, elt = int(config.hidden_size), z.elt
    layer_ids, per_layer, embed, head = z.layer_ids, z.per_layer, z.embed, z.head
    run = max(layer_ids) + 1
    tokens = _tokens_per_micro_batch(cfg)
    intermediate = int(getattr(config, "intermediate_size", 4 * hidden) or 4 * hidden)
    # live during one layer: the residual stream, its normed copy, q/k/v/attention out and the MLP's
    # gate/up/product (dense) at the target's dtype
    layer_activation = tokens * (6 * hidden + 3 * intermediate) * elt
    replicas = target_replicas(cfg.devices)
    R = len(cfg.devices.drafter)
    from trainer.models.objective import objective_of

    kl = objective_of(cfg.model).needs_target  # the slots also carry the target's last hidden states
    slot_bytes = tokens * (len(layer_ids) + kl) * hidden * elt

    def stage_items(sizes: list[int], devices: list[str]) -> list[dict]:
        out, lo = [], 0
        for s, (n, device) in enumerate(zip(sizes, devices)):
            weights = sum(per_layer[lo:lo + n]) + (embed if s == 0 else 0)
            items = {"target weights": weights, "target activations": layer_activation + 2 * tokens * hidden * elt}
            if s == len(sizes) - 1:
                slots = cfg.pipeline.queue_depth * (R + len(sizes) - 1) + 2
                items["feature slots"] = slots * slot_bytes
                items["decoding (τ): layers above, norm, head"] = sum(per_layer[run:]) + head
            out.append({"stage": s, "device": device, "layers": [lo, lo + n - 1], **items})
            lo += n
        return out

    def split_sizes(stages: int) -> list[int]:
        if cfg.devices.target_split is not None and len(cfg.devices.target_split) == stages:
            return list(cfg.devices.target_split)
        return partition(per_layer[:run], stages, embed)

    stages = stage_items(split_sizes(len(replicas[0])), replicas[0])
    params = z.drafter_params
    rows = cfg.data.pack_rows if cfg.data.pack_length else max(1, tokens // cfg.data.max_length)
    block_tokens = row_anchors(cfg.data, cfg.model.block_size) * rows * cfg.model.block_size
    on_device, on_host = offload_items(cfg, z)
    drafter = {
        **on_device,
        "embedding + head": embed + head,
        "features": slot_bytes,
        "activations" + (f" ({checkpointed} layers checkpointed)" if checkpointed else ""):
            drafter_activation_bytes(cfg, z.drafter, tokens, block_tokens, checkpointed, kl,
                                     fp8=cfg.model.drafter.precision == "fp8"),
    }
    if cfg.model.drafter.precision == "fp8":
        drafter["fp8 operands (e4m3, kept for backward)"] = fp8_operand_bytes(cfg, z.drafter, params, tokens,
                                                                              block_tokens, checkpointed)
        drafter["LM head (e4m3, both layouts: fp8_training.FP8Head)"] = 2 * int(z.drafter.vocab_size) * \
            int(z.drafter.hidden_size)
    by_device: dict[str, DevicePlan] = {}

    def add(device: str, items: dict[str, int]) -> None:
        plan = by_device.setdefault(device, DevicePlan(device, budget=_device_budget(device, cfg, gpu_bytes)))
        for k, v in items.items():
            plan.items[k] = plan.items.get(k, 0) + v

    # "cpu" stands in for as many devices as it is named (tests, the CPU demo): each use its own budget
    for t, replica in enumerate(replicas):
        for st in stage_items(split_sizes(len(replica)), replica):
            key = st["device"] if st["device"] != "cpu" else f"cpu:target{t}.{st['stage']}"
            add(key, {k: v for k, v in st.items() if k not in ("stage", "device", "layers")})
    for r, d in enumerate(cfg.devices.drafter):
        add(d if d != "cpu" else f"cpu:drafter{r}", drafter)
    offloaded = 0
    if on_host:
        by_device[HOST] = DevicePlan(HOST, {k: v * len(cfg.devices.drafter) for k, v in on_host.items()}, host_bytes)
        offloaded = 16 * params - sum(on_device.values())
    budget = _device_budget(replicas[0][0], cfg, gpu_bytes)
    smallest = None
    for n in range(1, run + 1 if find_split else 1):
        worst = max(sum(v for k, v in st.items() if k not in ("stage", "device", "layers"))
                    for st in stage_items(split_sizes(n), [replicas[0][0]] * n))
        if budget is None or worst + cuda_reserve(replicas[0][0], budget) <= budget:
            smallest = n
            break
    gpus = len(gpu_bytes) if gpu_bytes is not None else torch.cuda.device_count() if torch.cuda.is_available() else 0
    # the host's GPUs are known when given (--gpus, the doctor's measurement) or visible here; a plan
    # made on a machine without CUDA for another host judges only the budgets
    known = gpu_bytes is not None or torch.cuda.is_available()
    return MemoryPlan(stages, drafter, list(by_device.values()), smallest, list(notes), gpus,
                      suggest_devices(gpus, smallest) if gpus and smallest else None, checkpointed,
                      cfg.model.drafter_layers, missing=missing_devices(cfg.devices, gpus) if known else None,
                      offloaded=offloaded, drafter_params=params)


PACK_STEP = 1024  # the largest pack_length the plan names is a multiple of this
PACK_LIMIT = 1 << 20  # and at most this


def _with_pack_length(cfg: TrainerConfig, pack_length: int) -> TrainerConfig:
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, pack_length=pack_length))


def _checkpointing(cfg: TrainerConfig, z: _Sizes, gpu_bytes: dict[int, int] | None,
                   host_bytes: int | None = None) -> tuple[MemoryPlan, str]:
    """The plan with model.checkpoint_drafter resolved, and why: true checkpoints every layer; auto
    none when the step fits without, else the fewest first layers with which it fits (each one
    costs its forward again in backward), all of them when none fits."""
    choice, layers = cfg.model.checkpoint_drafter, cfg.model.drafter_layers
    if choice != "auto":
        n = layers if choice else 0
        return _assemble(cfg, z, n, gpu_bytes, z.notes, host_bytes=host_bytes), \
            f"model.checkpoint_drafter: {str(choice).lower()}"
    off = _assemble(cfg, z, 0, gpu_bytes, z.notes, host_bytes=host_bytes)
    if all(d.budget is None for d in off.devices):
        return off, "model.checkpoint_drafter auto: none (no device has a memory budget)"
    if off.fits:
        return off, "model.checkpoint_drafter auto: none (the step fits without)"
    short = off.refusal()
    for n in range(1, layers + 1):
        plan = _assemble(cfg, z, n, gpu_bytes, z.notes, host_bytes=host_bytes)
        if plan.fits:
            break
    return plan, f"model.checkpoint_drafter auto: the fewest that fit (without it {short})"


def drafter_checkpointing(cfg: TrainerConfig) -> int:
    """How many of the drafter's layers (the first ones) train checkpointed: model.checkpoint_drafter,
    auto resolved by the memory plan (the fewest with which the step fits; none where it fits
    without, or where no drafter device is a GPU)."""
    choice = cfg.model.checkpoint_drafter
    if choice != "auto":
        return cfg.model.drafter_layers if choice else 0
    if not any(d.startswith("cuda") for d in cfg.devices.drafter) and cfg.devices.memory_gib is None:
        return 0
    return build_plan(cfg).checkpoint_drafter


def largest_pack_lengths(cfg: TrainerConfig, z: _Sizes, gpu_bytes: dict[int, int] | None,
                         checkpointed: int) -> dict[str, int | None]:
    """Per device with a budget, the largest pack_length (a multiple of PACK_STEP, at least max_length)
    whose step fits there, the first `checkpointed` drafter layers checkpointed; None: not even the smallest fits."""
    lowest = max(PACK_STEP, -(-cfg.data.max_length // PACK_STEP) * PACK_STEP)
    seen: dict[int, dict[str, bool]] = {}

    def fitting(length: int) -> dict[str, bool]:
        if length not in seen:
            plan = _assemble(_with_pack_length(cfg, length), z, checkpointed, gpu_bytes, [], find_split=False)
            seen[length] = {d.device: d.shortfall == 0 for d in plan.devices if d.budget is not None and d.device != HOST}
        return seen[length]

    out: dict[str, int | None] = {}
    for device, fits in fitting(lowest).items():
        if not fits:
            out[device] = None
            continue
        lo, hi = lowest // PACK_STEP, PACK_LIMIT // PACK_STEP  # lo fits; find the last multiple that does
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fitting(mid * PACK_STEP)[device]:
                lo = mid
            else:
                hi = mid - 1
        out[device] = lo * PACK_STEP
    return out


def build_plan(cfg: TrainerConfig, model_config: dict | None = None,
               gpu_bytes: dict[int, int] | None = None, host_bytes: int | None = None) -> MemoryPlan:
    """model_config: the target's config.json as a dict (read elsewhere, e.g. on the node), else read
    from model.target.path; gpu_bytes: each GPU's memory by cuda index, else this process's GPUs;
    host_bytes: the host's RAM (optim.offload host), else this machine's when planning for it (no
    gpu_bytes), else unknown (not judged)."""
    z = _sizes(cfg, model_config)
    if host_bytes is None and gpu_bytes is None:
        host_bytes = host_ram()
    plan, why = _checkpointing(cfg, z, gpu_bytes, host_bytes)
    plan.checkpoint_reason = why
    every = 0 if cfg.model.checkpoint_drafter is False else cfg.model.drafter_layers
    plan.largest_pack_length = largest_pack_lengths(cfg, z, gpu_bytes, every)
    if cfg.model.checkpoint_drafter == "auto":
        plan.largest_pack_length_unchecked = largest_pack_lengths(cfg, z, gpu_bytes, 0)
    return plan


def suggest_devices(gpus: int, stages: int) -> str | None:
    """Half the GPUs (at least one replica's worth) in target replicas of `stages` stages, the rest drafters."""
    replicas = max(1, (gpus // 2) // stages)
    used = replicas * stages
    if used >= gpus:
        return None
    target = [[f"cuda:{r * stages + s}" for s in range(stages)] for r in range(replicas)]
    drafter = [f"cuda:{i}" for i in range(used, gpus)]
    shown = "[" + ", ".join("[" + ", ".join(t) + "]" for t in target) + "]"
    return f"{{target: {shown}, drafter: [{', '.join(drafter)}]}}"


def size(b: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"


def format_plan(plan: MemoryPlan) -> str:
    lines = ["target stages (replica 0):"]
    for st in plan.stages:
        items = {k: v for k, v in st.items() if k not in ("stage", "device", "layers")}
        lines.append(f"  stage {st['stage']} on {st['device']}: layers {st['layers'][0]}..{st['layers'][1]}, "
                     + ", ".join(f"{k} {size(v)}" for k, v in items.items()))
    lines.append("drafter replica: " + ", ".join(f"{k} {size(v)}" for k, v in plan.drafter.items()))
    host = next((d for d in plan.devices if d.device == HOST), None)
    if host is not None:
        lines.append(f"optim.offload host: {size(plan.offloaded)} of each drafter replica's device memory moved to the "
                     "host; the host holds " + ", ".join(f"{k} {size(v)}" for k, v in host.items.items())
                     + (f" ({size(host.total)} of its {size(host.budget)} RAM)" if host.budget
                        else " (the host's RAM unknown: not checked)"))
    lines.append("devices:")
    for d in plan.devices:
        budget = "no budget" if d.budget is None else f"of {size(d.budget)}" + (
            f" (less {size(d.reserve)} kept for the CUDA context and fragmentation)" if d.reserve else "")
        verdict = "fits" if not d.shortfall else f"SHORT by {size(d.shortfall)}"
        lines.append(f"  {d.device:<18}{size(d.total):>12} {budget}: {verdict}")
    if plan.missing:
        lines.append(f"MISSING: {plan.missing}")
    lines.append(f"fits: {'yes' if plan.fits else 'no'}; smallest split of one replica that fits: "
                 + (f"{plan.smallest_split} stage(s)" if plan.smallest_split else "none (more devices or memory)"))
    lines.append(f"drafter layers checkpointed: {plan.checkpoint_drafter} of {plan.drafter_layers} ({plan.checkpoint_reason})")
    for device, length in plan.largest_pack_length.items():
        unchecked = plan.largest_pack_length_unchecked.get(device, 0)
        lines.append(f"largest data.pack_length that fits {device}: "
                     + (f"{length}" if length else "none (not even the shortest row)")
                     + (" with every drafter layer checkpointed" if plan.largest_pack_length_unchecked else "")
                     + (f", {unchecked or 'none'} without" if plan.largest_pack_length_unchecked else ""))
    if plan.suggestion:
        lines.append(f"on this host's {plan.gpus} GPUs: devices: {plan.suggestion}")
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)
