"""Loading a target in layer stages: each stage reads only its own layers' tensors from the shards.

The model is first built on the meta device from config.json (no memory); then each stage's
modules are filled with their tensors, read one tensor at a time through the safetensors index
straight onto the stage's device (never the whole model on one device or in host memory). For
training only the layers up to the last tapped one and the embedding are loaded; the layers above,
the final norm and the LM head (needed to decode, for τ) are loaded onto the last stage when
evaluation first asks for them (`complete_for_decoding`), and a model directory whose shards lack
them still trains.

A target spanning several devices decodes through the Hugging Face forward with a pre-hook on each
decoder layer, the final norm and the head that moves the hidden state (and the mask, the position
embeddings) to that module's device: point-to-point copies, as accelerate's hooks do.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from trainer.models import quantized
from trainer.models.hf import base_model, input_embeddings, output_embeddings
from trainer.models.stages import StagePlan

SAFETENSORS_INDEX = "model.safetensors.index.json"
_EXPERTS = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


class MissingWeights(ValueError):
    """The model directory lacks tensors a stage needs."""


class ShardReader:
    """The tensors of a model directory by name, read one by one through its index (or its one file)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        index = self.path / SAFETENSORS_INDEX
        if index.exists():
            self.weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        else:
            from safetensors import safe_open

            single = self.path / "model.safetensors"
            with safe_open(str(single), framework="pt") as f:
                self.weight_map = dict.fromkeys(f.keys(), single.name)

        # a vision-language checkpoint (Qwen3.5) holds its text model under model.language_model.
        self.aliases = {k.replace("model.language_model.", "model.", 1): k for k in self.weight_map
                        if k.startswith("model.language_model.")}
        try:  # FP8 checkpoints: the tile each weight_scale_inv entry scales
            quantization = json.loads((self.path / "config.json").read_text()).get("quantization_config") or {}
        except (OSError, ValueError):
            quantization = {}
        block = quantization.get("weight_block_size")
        self.fp8_block: tuple[int, int] | None = (int(block[0]), int(block[1])) if block else None

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map or name in self.aliases

    def _file(self, name: str) -> tuple[str, str]:
        """(shard file, name in the shard) of a model tensor."""
        stored = name if name in self.weight_map else self.aliases[name]
        return self.weight_map[stored], stored

    def read(self, names: Sequence[str], device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The named tensors on `device` in `dtype`, opened shard by shard (each tensor read once);
        an FP8 weight comes decoded with its `weight_scale_inv` (trainer.models.quantized)."""
        scales = [f"{name}_scale_inv" for name in names if f"{name}_scale_inv" in self]
        stored = self._read_stored([*names, *scales], device)  # each shard opened once, scales with their weights
        out: dict[str, torch.Tensor] = {}
        for key in names:
            tensor = stored[key]
            if tensor.dtype in quantized.FP8_DTYPES and dtype not in quantized.FP8_DTYPES:
                scale = f"{key}_scale_inv"
                if scale not in stored:
                    raise MissingWeights(f"{self.path}: tensor {scale} (the scales of FP8 {key}) is in no shard "
                                         f"of {SAFETENSORS_INDEX}")
                out[key] = quantized.decode_fp8(tensor, stored[scale], self.fp8_block, dtype)
            else:
                out[key] = tensor.to(dtype)
        return out

    def _read_stored(self, names: Sequence[str], device: torch.device) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        by_file: dict[str, list[tuple[str, str]]] = {}
        for name in names:
            file, stored = self._file(name)
            by_file.setdefault(file, []).append((name, stored))
        out: dict[str, torch.Tensor] = {}
        target = "cpu" if device.type == "cpu" else str(device)
        for file, keys in by_file.items():
            with safe_open(str(self.path / file), framework="pt", device=target) as f:
                for key, stored in keys:
                    out[key] = f.get_tensor(stored)
        return out


def meta_model(config: Any, dtype: torch.dtype) -> torch.nn.Module:
    """The causal LM built on the meta device: every module, no memory; with the attention
    implementation its family needs (trainer.run.family: SDPA, eager for gpt-oss's sinks)."""
    from transformers import AutoModelForCausalLM

    from trainer.run.family import read_family

    impl = read_family(config.to_dict()).attn_implementation
    config = config.get_text_config(decoder=True)  # a vision-language checkpoint (Qwen3.5): its text part
    config._attn_implementation = impl
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=impl)
    return model.eval()


def _module_tensors(reader: ShardReader, prefix: str, module: torch.nn.Module, device: torch.device,
                    dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """module's state dict read from the shards; per-expert checkpoints (the hub's Qwen MoE format) are
    stacked into the fused expert tensors transformers 5 holds, MXFP4 ones (gpt-oss) decoded into them;
    a module's FP8 weights come decoded by the reader."""
    wanted = list(module.state_dict())
    direct = [k for k in wanted if prefix + k in reader]
    tensors = {k[len(prefix):]: v for k, v in reader.read([prefix + k for k in direct], device, dtype).items()}
    for key in wanted:
        if key in tensors:
            continue
        name = prefix + key
        m = _EXPERTS.match(name)
        if m is None:
            raise MissingWeights(f"{reader.path}: tensor {name} is in no shard of {SAFETENSORS_INDEX}")
        packed = [f"{name}_blocks", f"{name}_scales"]
        if any(p in reader for p in packed):  # MXFP4: gpt-oss as the hub ships it
            missing = [p for p in packed if p not in reader]
            if missing:
                raise MissingWeights(f"{reader.path}: tensor {missing[0]} is in no shard of {SAFETENSORS_INDEX}")
            got = reader.read(packed, device, torch.uint8)
            tensors[key] = quantized.decode_mxfp4(got[packed[0]], got[packed[1]], dtype)
        else:
            tensors[key] = _stacked_experts(reader, m["prefix"], m["kind"], device, dtype)
    return tensors


def _stacked_experts(reader: ShardReader, prefix: str, kind: str, device: torch.device,
                     dtype: torch.dtype) -> torch.Tensor:
    parts = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
    experts = []
    e = 0
    while f"{prefix}.{e}.{parts[0]}.weight" in reader:
        names = [f"{prefix}.{e}.{p}.weight" for p in parts]
        got = reader.read(names, device, dtype)
        experts.append(torch.cat([got[n] for n in names], dim=0))
        e += 1
    if not experts:
        raise MissingWeights(f"{reader.path}: tensor {prefix}.{kind} is in no shard of {SAFETENSORS_INDEX}")
    return torch.stack(experts)


def fill(module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Give a meta module its tensors (assigned, not copied: no second allocation)."""
    module.load_state_dict(tensors, strict=True, assign=True)
    for p in module.parameters():
        p.requires_grad_(False)


def _rebuild_rotary(model: torch.nn.Module, device: torch.device) -> None:
    """The rotary embedding's inverse frequencies are computed at construction, not stored: rebuild it."""
    base, _ = _base(model)
    if getattr(base, "rotary_emb", None) is None:
        return
    with torch.device("cpu"):
        rotary = type(base.rotary_emb)(config=base.rotary_emb.config)
    base.rotary_emb = rotary.to(device)


def load_staged(path: str | Path, plan: StagePlan, dtype: torch.dtype,
                log: Callable[[str], None] = print, budget: int | None = None,
                precision: str = "bf16") -> torch.nn.Module:
    """The target with the embedding on stage 0 and layers [lo, hi) of each stage on its device;
    everything above the plan's last layer stays on the meta device (`complete_for_decoding`).
    budget: bytes per device (devices.memory_gib); a stage whose weights exceed it is refused before
    any of its tensors is read. precision fp8: each layer's linear weights are quantized to e4m3 as
    the layer loads (trainer.models.fp8), so a device never holds more than one layer in bf16."""
    from transformers import AutoConfig

    from trainer.run.family import read_family

    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    refusal = read_family(config.to_dict()).quantization_refusal
    if refusal:
        raise ValueError(f"{path}: {refusal}")
    model = meta_model(config, dtype)
    reader = ShardReader(path)
    base, prefix = _base(model)
    if precision == "fp8":
        from trainer.models.fp8 import check_device

        for device in dict.fromkeys(plan.devices):
            check_device(device)
    if budget is not None:
        per_layer = layer_bytes(model, precision)
        for s, ((lo, hi), device) in enumerate(zip(plan.bounds, plan.devices)):
            need = sum(per_layer[lo:hi]) + (module_bytes(base.embed_tokens) if s == 0 else 0)
            if need > budget:
                raise SplitError(f"stage {s} on {device} (layers {lo}..{hi - 1}) holds {need / 2**30:.2f} GiB of "
                                 f"weights, more than the {budget / 2**30:.2f} GiB budget (devices.memory_gib): "
                                 "split the target in more stages")
    fill(base.embed_tokens, _module_tensors(reader, f"{prefix}embed_tokens.", base.embed_tokens, plan.devices[0],
                                            dtype))
    _rebuild_rotary(model, plan.devices[0])
    for (lo, hi), device in zip(plan.bounds, plan.devices):
        for i in range(lo, hi):
            layer = base.layers[i]
            fill(layer, _module_tensors(reader, f"{prefix}layers.{i}.", layer, device, dtype))
            if precision == "fp8":
                from trainer.models.fp8 import quantize_linears

                quantize_linears(layer, dtype)
    if plan.layers == len(base.layers):  # the last layer is tapped: its features are read after the norm
        fill(base.norm, _module_tensors(reader, f"{prefix}norm.", base.norm, plan.devices[-1], dtype))
    model.__dict__["_dflash_source"] = str(path)  # where complete_for_decoding reads the rest
    model.__dict__["_dflash_precision"] = precision  # replica_target loads replicas the same way
    model.__dict__["_dflash_plan"] = plan  # trainer.models.stages.plan_of
    if len(set(plan.devices)) > 1:
        align_devices(model)
    return model


def is_complete(model: torch.nn.Module) -> bool:
    return not any(p.is_meta for p in model.parameters())


def complete_for_decoding(model: torch.nn.Module, plan: StagePlan, log: Callable[[str], None] = print) -> bool:
    """Load the layers above the plan's last, the final norm and the LM head onto the last stage, once.
    False (and one log line) when the model directory does not have them: τ cannot be measured."""
    if is_complete(model):
        return True
    source = getattr(model, "_dflash_source", None)
    if source is None:
        return False
    reader, device = ShardReader(source), plan.devices[-1]
    base, prefix = _base(model)
    dtype = base.embed_tokens.weight.dtype
    rest = [(f"{prefix}layers.{i}.", base.layers[i]) for i in range(plan.layers, len(base.layers))]
    rest += [(f"{prefix}norm.", base.norm)]
    head = output_embeddings(model)
    try:
        loaded = [(m, _module_tensors(reader, name, m, device, dtype)) for name, m in rest if _is_meta(m)]
        head_weight = _head_tensor(model, device) if head.weight.is_meta else None
    except (MissingWeights, KeyError) as exc:
        log(f"τ not measured: decoding needs the target's layers above {plan.layers - 1}, its final norm and "
            f"LM head, and {source} lacks some ({exc})")
        return False
    for module, tensors in loaded:
        fill(module, tensors)
    if head_weight is not None:
        head.weight = torch.nn.Parameter(head_weight, requires_grad=False)
    if len(set(plan.devices)) > 1:
        align_devices(model)
    return True


def _is_meta(module: torch.nn.Module) -> bool:
    return any(t.is_meta for t in module.state_dict().values())


def _move(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, tuple):
        return tuple(_move(v, device) for v in value)
    if isinstance(value, list):
        return [_move(v, device) for v in value]
    if isinstance(value, dict):
        return {k: _move(v, device) for k, v in value.items()}
    return value


def _device_of(module: torch.nn.Module) -> torch.device | None:
    for t in module.state_dict().values():
        if not t.is_meta:
            return t.device
    return None


def _base(model: torch.nn.Module) -> tuple[Any, str]:
    """The decoder stack and its tensors' name prefix ("model." for every causal LM we load)."""
    return base_model(model), f"{model.base_model_prefix}."


def align_devices(model: torch.nn.Module) -> None:
    """Pre-hooks moving each decoder layer's, the final norm's and the head's inputs to its device."""
    base, _ = _base(model)
    for module in [*base.layers, base.norm, output_embeddings(model)]:
        device = _device_of(module)
        old = module.__dict__.pop("_dflash_align", None)  # a hook id (survives copy.deepcopy, a handle would not)
        if old is not None:
            module._forward_pre_hooks.pop(old, None)
            module._forward_pre_hooks_with_kwargs.pop(old, None)
        if device is None:
            continue

        def hook(_m: torch.nn.Module, args: tuple, kwargs: dict, device: torch.device = device) -> tuple:
            return _move(args, device), _move(kwargs, device)

        module.__dict__["_dflash_align"] = module.register_forward_pre_hook(hook, with_kwargs=True).id


def place(model: torch.nn.Module, plan: StagePlan) -> torch.nn.Module:
    """An in-memory target (built in code) moved onto the plan's devices; layers above the plan stay
    with the last stage (they are already there to decode)."""
    base, _ = _base(model)
    base.embed_tokens.to(plan.devices[0])
    _rebuild_rotary(model, plan.devices[0])
    for i, layer in enumerate(base.layers):
        if not _is_meta(layer):  # a target built truncated keeps the layers above its last tap on meta
            layer.to(plan.devices[plan.stage_of(i)])
    for module in (base.norm, output_embeddings(model)):
        if not _is_meta(module):
            module.to(plan.devices[-1])
    model.__dict__["_dflash_plan"] = plan
    if len(set(plan.devices)) > 1:
        align_devices(model)
    return model


def partition(layer_bytes: Sequence[int], stages: int, first_extra: int = 0, last_extra: int = 0) -> list[int]:
    """Layers per stage (contiguous, from layer 0) minimising the largest stage's bytes; stage 0 also
    holds `first_extra` bytes (the embedding), the last `last_extra` (what decoding adds)."""
    n = len(layer_bytes)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot split {n} layers in {stages} stages")
    prefix = [0]
    for b in layer_bytes:
        prefix.append(prefix[-1] + b)

    def cost(s: int, lo: int, hi: int) -> int:
        return prefix[hi] - prefix[lo] + (first_extra if s == 0 else 0) + (last_extra if s == stages - 1 else 0)

    inf = float("inf")
    best: list[list[float]] = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut: list[list[int]] = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for hi in range(s, n + 1):
            for lo in range(s - 1, hi):
                value = max(best[s - 1][lo], cost(s - 1, lo, hi))
                if value < best[s][hi]:
                    best[s][hi], cut[s][hi] = value, lo
    sizes, hi = [], n
    for s in range(stages, 0, -1):
        lo = cut[s][hi]
        sizes.append(hi - lo)
        hi = lo
    return sizes[::-1]


def layer_bytes(model: torch.nn.Module, precision: str = "bf16") -> list[int]:
    """Parameter bytes of each decoder layer (from the meta model: no weights read); precision fp8:
    as the layer holds them once quantized (trainer.models.fp8: 1 byte a linear weight + its scales)."""
    if precision == "fp8":
        from trainer.models.fp8 import fp8_bytes

        return [fp8_bytes(layer) for layer in _base(model)[0].layers]
    return [sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in _base(model)[0].layers]


def module_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


class SplitError(ValueError):
    """A split that cannot be made (one line naming the problem)."""


def stage_plan(model: torch.nn.Module, layer_ids: Sequence[int], devices: Sequence[str],
               split: Sequence[int] | None = None) -> StagePlan:
    """Stages for one replica over `devices`: `split` layers each, else balanced by parameter bytes
    over the layers training runs (0..max(layer_ids)), the embedding counted with stage 0."""
    run = max(layer_ids) + 1
    if len(devices) > run:
        raise SplitError(f"devices.target: a replica of {len(devices)} stages, but training runs only "
                         f"{run} layers (0..{run - 1}, the last tapped one)")
    if split is not None:
        if sum(split) != run:
            raise SplitError(f"devices.target_split: {list(split)} sums to {sum(split)} layers; training runs "
                             f"{run} (layers 0..{run - 1}, up to the last tapped one)")
        sizes = list(split)
    else:
        sizes = partition(layer_bytes(model)[:run], len(devices), module_bytes(_base(model)[0].embed_tokens))
    return StagePlan.from_sizes(sizes, devices)


def head_weights(model: torch.nn.Module, device: str | torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The input embedding and LM head weights on `device` (the drafter's): the head is read from the
    shards when the target holds it only on the meta device (a target loaded for training)."""
    embed = input_embeddings(model).weight.detach().to(device)
    head = output_embeddings(model).weight
    if not head.is_meta:
        return embed, head.detach().to(device)
    return embed, _head_tensor(model, torch.device(device))


def _head_tensor(model: torch.nn.Module, device: torch.device) -> torch.Tensor:
    reader = ShardReader(model.__dict__["_dflash_source"])  # set by load_staged
    name = "lm_head.weight" if "lm_head.weight" in reader else f"{_base(model)[1]}embed_tokens.weight"  # tied
    return reader.read([name], device, input_embeddings(model).weight.dtype)[name]


def replica_target(target: torch.nn.Module, plan: StagePlan, dtype: str) -> torch.nn.Module:
    """Another replica of `target` on the plan's devices: read again from its model directory stage by
    stage, or (a target built in code) copied and moved."""
    import copy

    source = getattr(target, "_dflash_source", None)
    if source is not None:
        replica = load_staged(source, plan, {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype],
                              precision=target.__dict__.get("_dflash_precision", "bf16"))
        from trainer.models.fp8 import FP8Linear, set_fast_accum

        if any(isinstance(m, FP8Linear) and m.fast_accum for m in target.modules()):
            set_fast_accum([replica])
        return replica
    return place(copy.deepcopy(target), plan)
