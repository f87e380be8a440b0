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
from trainer.models.fp8 import FP8Converter
from trainer.models.frozen_target import Target, as_target
from trainer.models.hf import base_model, input_embeddings, output_embeddings
from trainer.models.stages import StagePlan
from trainer.run.family import ModelDirError, check_model_dir

SAFETENSORS_INDEX = "model.safetensors.index.json"
_EXPERTS = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


class MissingWeights(ModelDirError):
    """The model directory lacks tensors a stage needs."""


class NonFiniteWeights(ModelDirError):
    """A tensor read from the model directory (or what a quantized one decodes to) holds NaN or inf:
    a broken or badly converted checkpoint, refused at load instead of training on NaN features."""


E8M0_NAN = 0xFF  # OCP Microscaling: the one E8M0 scale byte that is not a power of two


def check_finite(path: str | Path, name: str, tensor: torch.Tensor, decoded_from: str | None = None) -> None:
    """Refuse a floating tensor holding NaN or inf, naming it (and the scales it was decoded with)."""
    if not tensor.is_floating_point() or tensor.dtype in quantized.FP8_DTYPES or tensor.numel() == 0:
        return
    lo, hi = torch.aminmax(tensor)  # NaN propagates to both; no tensor-sized temporary on a full GPU
    if bool(torch.isfinite(lo) & torch.isfinite(hi)):
        return
    bad = int((~torch.isfinite(tensor)).sum())
    how = f" (decoded with {decoded_from})" if decoded_from else ""
    raise NonFiniteWeights(f"{path}: tensor {name}{how} holds {bad} NaN/inf value(s) of {tensor.numel()}: the "
                           "checkpoint is broken or badly converted; re-download or re-convert it")


class ShardReader:
    """The tensors of a model directory by name, read one by one through its index (or its one file)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        index = self.path / SAFETENSORS_INDEX
        if index.exists():
            self.weight_map: dict[str, str] = _weight_map(index)
        else:
            from safetensors import SafetensorError, safe_open

            single = self.path / "model.safetensors"
            if not single.is_file():
                raise MissingWeights(f"{self.path}: has no weights ({SAFETENSORS_INDEX} or {single.name})")
            try:
                with safe_open(str(single), framework="pt") as f:
                    self.weight_map = dict.fromkeys(f.keys(), single.name)
            except SafetensorError as exc:
                raise ModelDirError(f"{single}: not a safetensors file ({exc})") from None

        # a vision-language checkpoint (Qwen3.5) holds its text model under model.language_model.
        self.aliases = {k.replace("model.language_model.", "model.", 1): k for k in self.weight_map
                        if k.startswith("model.language_model.")}
        try:  # FP8 checkpoints: the tile each weight_scale_inv entry scales
            quantization = json.loads((self.path / "config.json").read_text()).get("quantization_config") or {}
        except (OSError, ValueError):
            quantization = {}
        block = quantization.get("weight_block_size") if isinstance(quantization, dict) else None
        if block is not None and not (isinstance(block, list) and len(block) == 2
                                      and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in block)):
            raise ModelDirError(f"{self.path}/config.json: quantization_config.weight_block_size must be two positive "
                                f"integers (rows, columns of a scale's tile), got {block!r}")
        self.fp8_block: tuple[int, int] | None = (block[0], block[1]) if block else None

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
                check_finite(self.path, scale, stored[scale])
                out[key] = quantized.decode_fp8(tensor, stored[scale], self.fp8_block, dtype)
                check_finite(self.path, key, out[key], decoded_from=scale)
            else:
                out[key] = tensor.to(dtype)
                check_finite(self.path, key, out[key])
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
            if not (self.path / file).is_file():
                raise MissingWeights(f"{self.path}: shard {file} (of tensor {keys[0][1]}, in {SAFETENSORS_INDEX}) "
                                     "is not in the directory")
            with safe_open(str(self.path / file), framework="pt", device=target) as f:
                for key, stored in keys:
                    out[key] = f.get_tensor(stored)
        return out


def _weight_map(index: Path) -> dict[str, str]:
    """model.safetensors.index.json's weight_map (tensor name -> shard file), checked: one line naming
    what is wrong instead of a KeyError."""
    try:
        doc = json.loads(index.read_text())
    except ValueError as exc:
        raise ModelDirError(f"{index}: not JSON ({exc})") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise ModelDirError(f"{index}: has no weight_map (an object of tensor name -> shard file)")
    return weight_map


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
            nan_scales = int((got[packed[1]] == E8M0_NAN).sum())
            if nan_scales:
                raise NonFiniteWeights(f"{reader.path}: tensor {packed[1]} holds {nan_scales} NaN scale(s) (E8M0 byte "
                                       f"0x{E8M0_NAN:X}): the checkpoint is broken or badly converted")
            tensors[key] = quantized.decode_mxfp4(got[packed[0]], got[packed[1]], dtype)
            check_finite(reader.path, name, tensors[key], decoded_from=packed[1])
        else:
            tensors[key] = _stacked_experts(reader, m["prefix"], m["kind"], device, dtype)
    expected = module.state_dict()
    for key, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(expected[key].shape):
            raise ModelDirError(f"{reader.path}: tensor {prefix + key} has shape {tuple(tensor.shape)}, but its "
                                f"config.json makes it {tuple(expected[key].shape)}")
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
                fp8: FP8Converter | None = None, layer_ids: Sequence[int] = ()) -> Target:
    """The target with the embedding on stage 0 and layers [lo, hi) of each stage on its device;
    everything above the plan's last layer stays on the meta device (`complete_for_decoding`).
    budget: bytes per device (devices.memory_gib); a stage whose weights exceed it is refused before
    any of its tensors is read. fp8 (model.target.precision fp8): each layer's linear weights are
    converted to e4m3 as the layer loads (trainer.models.fp8.FP8Converter), so a device never holds
    more than one layer in bf16. layer_ids: the tapped layers, kept on the Target."""
    from transformers import AutoConfig

    from trainer.run.family import read_family

    check_model_dir(path, weights=False)
    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    refusal = read_family(config.to_dict()).quantization_refusal
    if refusal:
        raise ValueError(f"{path}: {refusal}")
    check_model_dir(path)  # its weights, after the quantization it could not read is named
    model = meta_model(config, dtype)
    reader = ShardReader(path)
    base, prefix = _base(model)
    if fp8 is not None:
        fp8.check(plan.devices)
    if budget is not None:
        per_layer = layer_bytes(model, fp8)
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
            if fp8 is not None:
                fp8.convert(layer)
    if plan.layers == len(base.layers):  # the last layer is tapped: its features are read after the norm
        fill(base.norm, _module_tensors(reader, f"{prefix}norm.", base.norm, plan.devices[-1], dtype))
    if len(set(plan.devices)) > 1:
        align_devices(model)
    return Target(module=model, plan=plan, dtype=dtype, layer_ids=tuple(layer_ids), fp8=fp8, source=Path(path))


def is_complete(model: torch.nn.Module) -> bool:
    return not any(p.is_meta for p in model.parameters())


def complete_for_decoding(target: Target, log: Callable[[str], None] = print) -> bool:
    """Load the layers above the plan's last, the final norm and the LM head onto the last stage, once.
    False (and one log line) when the model directory does not have them: τ cannot be measured."""
    model, plan, source = target.module, target.plan, target.source
    if is_complete(model):
        return True
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
        head_weight = _head_tensor(target, device) if head.weight.is_meta else None
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


class _ToDevice:
    """A forward pre-hook moving a module's inputs to `device` (where its weights are). The hook itself
    says what it is, so aligning again (more layers loaded, or a deep copy placed elsewhere) updates it
    in place instead of adding a second one."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self, _m: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
        return _move(args, self.device), _move(kwargs, self.device)


def align_devices(model: torch.nn.Module) -> None:
    """Pre-hooks moving each decoder layer's, the final norm's and the head's inputs to its device."""
    base, _ = _base(model)
    for module in [*base.layers, base.norm, output_embeddings(model)]:
        device = _device_of(module)
        hooks = {k: h for k, h in module._forward_pre_hooks.items() if isinstance(h, _ToDevice)}
        if device is None:  # nothing of it loaded: no hook
            for k in hooks:
                module._forward_pre_hooks.pop(k)
                module._forward_pre_hooks_with_kwargs.pop(k, None)
        elif hooks:
            for h in hooks.values():
                h.device = device
        else:
            module.register_forward_pre_hook(_ToDevice(device), with_kwargs=True)


def place(model: torch.nn.Module, plan: StagePlan, layer_ids: Sequence[int] = (),
          fp8: FP8Converter | None = None) -> Target:
    """An in-memory target (built in code) moved onto the plan's devices; layers above the plan stay
    with the last stage (they are already there to decode). fp8: its layers up to the plan's last
    converted (trainer.models.fp8.FP8Converter), after the move (each on its own device)."""
    base, _ = _base(model)
    base.embed_tokens.to(plan.devices[0])
    _rebuild_rotary(model, plan.devices[0])
    for i, layer in enumerate(base.layers):
        if not _is_meta(layer):  # a target built truncated keeps the layers above its last tap on meta
            layer.to(plan.devices[plan.stage_of(i)])
    for module in (base.norm, output_embeddings(model)):
        if not _is_meta(module):
            module.to(plan.devices[-1])
    if fp8 is not None:
        fp8.check(plan.devices)
        for layer in list(base.layers)[:plan.layers]:
            fp8.convert(layer)
    if len(set(plan.devices)) > 1:
        align_devices(model)
    return Target(module=model, plan=plan, dtype=input_embeddings(model).weight.dtype, layer_ids=tuple(layer_ids),
                  fp8=fp8)


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


def layer_bytes(model: torch.nn.Module, fp8: FP8Converter | None = None) -> list[int]:
    """Parameter bytes of each decoder layer (from the meta model: no weights read); fp8: as the layer
    holds them once converted (trainer.models.fp8: 1 byte a linear weight + its scales)."""
    if fp8 is not None:
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


def head_weights(target: Target | torch.nn.Module, device: str | torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The input embedding and LM head weights on `device` (the drafter's): the head is read from the
    shards when the target holds it only on the meta device (a target loaded for training)."""
    target = as_target(target)
    embed = input_embeddings(target.module).weight.detach().to(device)
    head = output_embeddings(target.module).weight
    if not head.is_meta:
        return embed, head.detach().to(device)
    return embed, _head_tensor(target, torch.device(device))


def _head_tensor(target: Target, device: torch.device) -> torch.Tensor:
    if target.source is None:
        raise MissingWeights("the target's LM head is not loaded and it was not read from a model directory")
    reader, model = ShardReader(target.source), target.module
    name = "lm_head.weight" if "lm_head.weight" in reader else f"{_base(model)[1]}embed_tokens.weight"  # tied
    return reader.read([name], device, input_embeddings(model).weight.dtype)[name]


def replica_target(target: Target, plan: StagePlan) -> Target:
    """Another replica of `target` on the plan's devices, with its facts: read again from its model
    directory stage by stage with the same converter and experts, or (a target built in code) copied
    and moved (its converted layers and experts come with the copy)."""
    import copy
    import dataclasses

    if target.source is None:
        return dataclasses.replace(target, module=place(copy.deepcopy(target.module), plan).module, plan=plan)
    replica = load_staged(target.source, plan, target.dtype, fp8=target.fp8, layer_ids=target.layer_ids)
    if target.experts is not None:
        from trainer.models.moe import set_experts

        set_experts(replica.module, target.experts)
    return dataclasses.replace(replica, experts=target.experts)
