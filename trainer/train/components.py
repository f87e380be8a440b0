"""Build everything a run needs from its config: tokenizer, data, target, drafter, optimizer."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from safetensors.torch import load_file, save_file

from trainer.data.batches import PreloadedDataset, dataset_of, read_conversations
from trainer.data.encoding import Encoded, encode_all, process_count
from trainer.data.synth import synthetic_conversations, write_jsonl
from trainer.data.token_cache import cached_encode
from trainer.data.tokenizer import build_tokenizer
from trainer.models.drafter import DFlashDrafter, DrafterConfig
from trainer.models.fp8 import converter_for
from trainer.models.frozen_target import Target, as_target
from trainer.models.hf import hf_config
from trainer.models.masks import resolve_backend
from trainer.models.memory_plan import drafter_checkpointing
from trainer.models.objective import Objective, base_gamma, objective_of
from trainer.models.target import (
    QWEN3_8B_MASK_TOKEN_ID,
    FrozenHead,
    fit_tiny_target,
    freeze,
    num_layers,
    random_8b_shape_target,
    tapped_layer_ids,
    target_family,
    tiny_target,
)
from trainer.models.target_loading import complete_for_decoding, load_staged, meta_model, place, stage_plan
from trainer.run.config import (
    SHAPE_FIELDS,
    ConfigError,
    TrainerConfig,
    data_paths,
    default_gamma,
    disagreements,
    drafter_own,
    generation_own,
    target_replicas,
    template_kwargs,
)
from trainer.train.optim import build_optimizer, build_scheduler

if TYPE_CHECKING:
    from trainer.data.packing import PackedDataset

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class Phase(Protocol):
    """Reports what is being built (trainer.run.rundir.RunDir.phase): a name, and progress where
    there is a count."""

    def __call__(self, name: str, done: int | None = None, total: int | None = None) -> None: ...


def _no_phase(name: str, done: int | None = None, total: int | None = None) -> None:
    """A phase reporter that reports nothing (callers outside a run directory)."""


@dataclass
class Components:
    tokenizer: object
    target: Target  # the frozen target and its facts (trainer.models.frozen_target)
    head: FrozenHead
    drafter: DFlashDrafter
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    train_data: PreloadedDataset | PackedDataset  # PackedDataset when data.pack_length is set
    eval_conversations: list[dict]
    eval_data: PreloadedDataset
    gamma: float  # what the blocks' base weights are built with (trainer.models.objective.base_gamma)
    objective: Objective  # model.loss, kl_temperature, position_weight (trainer.models.objective)
    target_device: str
    drafter_device: str
    backend: str  # the drafter's attention kernel: "flex" | "sdpa" (trainer.models.masks.resolve_backend)


def load_conversations(cfg: TrainerConfig, run_dir: Path) -> tuple[list[dict], list[dict]]:
    """Training and held-out conversations; synthetic ones are (re)generated into run_dir/data/."""
    s = cfg.data.synthetic
    if s is not None:
        train = synthetic_conversations(s.n_train, s.seed, s.min_len, s.max_len)
        held_out = synthetic_conversations(s.n_eval, s.seed + 1, s.min_len, s.max_len)
        write_jsonl(train, run_dir / "data" / "train.jsonl")
        write_jsonl(held_out, run_dir / "data" / "eval.jsonl")
        return train, held_out
    train = [c for path in data_paths(cfg.data.train_path) for c in read_conversations(path)]
    return train, [c for path in data_paths(cfg.data.eval_path) for c in read_conversations(path)]


def target_layer_ids(cfg: TrainerConfig, layers: int) -> list[int]:
    """The tapped layers: configured, else spaced from 1 to layers-3; each must be a layer of the target."""
    return tapped_layer_ids(cfg.model.target_layer_ids, cfg.model.num_target_layers, layers)


def build_target(cfg: TrainerConfig, tokenizer: Any, train_data: PreloadedDataset, run_dir: Path,
                 log: Callable[[str], None], devices: list[str] | None = None,
                 phase: Phase = _no_phase) -> Target:
    """The frozen target of one replica (default the first) in its layer stages (trainer.models.stages),
    as one Target value: its converter (model.target.precision), experts, stages and tapped layers.

    A model directory is read stage by stage, only the layers training runs (the rest is read when
    evaluation decodes); a tiny target with fit_steps > 0 is fitted once and kept in run_dir/target/."""
    t = cfg.model.target
    devices = devices or target_replicas(cfg.devices)[0]
    device = devices[0]
    dtype = TORCH_DTYPES[cfg.model.dtype]
    fp8 = converter_for(t.precision, t.fp8_fast_accum, dtype)
    if t.path is not None:
        from transformers import AutoConfig

        began = time.perf_counter()
        config = AutoConfig.from_pretrained(t.path, local_files_only=True)
        meta = meta_model(config, dtype)
        layer_ids = target_layer_ids(cfg, num_layers(meta))
        plan = stage_plan(meta, layer_ids, devices, cfg.devices.target_split)
        budget = None if cfg.devices.memory_gib is None else int(cfg.devices.memory_gib * 2**30)
        loaded = load_staged(t.path, plan, dtype, log, budget, fp8, layer_ids)
        fam = target_family(meta)
        log(f"target family: {fam.summary()}; layers: {fam.layer_table()}")
        target = target_kernels(loaded, cfg, log)
        peak = ""
        for d in dict.fromkeys(plan.devices):
            if d.type == "cuda":
                torch.cuda.synchronize(d)
                peak += f", {torch.cuda.max_memory_allocated(d) / 2**30:.1f} GiB peak on {d}"
        stages = f" in {len(plan)} stages {[hi - lo for lo, hi in plan.bounds]}" if len(plan) > 1 else ""
        log(f"target {t.path}: layers 0..{plan.layers - 1} of {num_layers(target.module)} loaded{stages} in "
            f"{time.perf_counter() - began:.1f}s{peak}")
        return target
    if t.random_8b_shape:
        model = freeze(random_8b_shape_target(device, dtype))
    else:
        tiny = t.tiny
        assert tiny is not None, "the config gives a path, random_8b_shape or tiny (trainer.run.config)"
        model = tiny_target(tiny, len(tokenizer), device)
        if tiny.fit_steps > 0:
            saved = run_dir / "target" / "model.safetensors"
            if saved.exists():
                model.load_state_dict(load_file(str(saved), device=device))
            else:
                batches = []
                for _ in range(min(tiny.fit_steps, 64)):
                    b = train_data.next_batch()
                    batches.append((b.input_ids.to(device), b.attention_mask.to(device)))
                train_data.load_state_dict({**train_data.state_dict(), "epoch": 0, "cursor": 0})
                phase("fitting the target", 0, tiny.fit_steps)
                fit_tiny_target(model, batches, tiny.fit_steps, tiny.fit_lr, log,
                                progress=lambda done: phase("fitting the target", done, tiny.fit_steps))
                saved.parent.mkdir(exist_ok=True)
                tmp = saved.with_name(".model.safetensors.tmp")
                save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp))
                tmp.rename(saved)
        model = freeze(model.to(dtype).eval())  # type: ignore[arg-type]  # transformers types PreTrainedModel.to's wrapper as taking the model
    layer_ids = target_layer_ids(cfg, num_layers(model))
    plan = stage_plan(model, layer_ids, devices, cfg.devices.target_split)
    return target_kernels(place(model, plan, layer_ids, fp8), cfg, log)


def target_kernels(target: Target, cfg: TrainerConfig, log: Callable[[str], None]) -> Target:
    """`target` with a MoE target's experts implementation set (model.target.experts,
    trainer.models.moe) and kept on the value (its replicas run the same); one log line each for
    the experts and, at precision fp8, what runs in FP8."""
    import dataclasses

    from trainer.models.moe import set_experts

    experts = set_experts(target.module, cfg.model.target.experts)
    if experts is not None:
        log(f"target experts: {experts} (model.target.experts: {cfg.model.target.experts})")
    if target.fp8 is not None:
        from trainer.models.fp8 import fp8_summary

        fast = ", fast accumulation" if target.fast_accum else ""
        log(f"target precision fp8{fast}: {fp8_summary(target.module)}")
    return dataclasses.replace(target, experts=experts)


def resolve_mask_token_id(cfg: TrainerConfig, tokenizer: Any, vocab_size: int | None = None) -> int:
    """The configured id, else the tokenizer's mask token, else the first embedding row past the
    tokenizer's tokens: the published Qwen3 drafts use 151669, the row after `</think>`, which the
    target's 151936-row embedding has but no text ever produces."""
    if cfg.model.mask_token_id is not None:
        if vocab_size is not None and not 0 <= cfg.model.mask_token_id < vocab_size:
            raise ValueError(f"model.mask_token_id: {cfg.model.mask_token_id} is not a row of the "
                             f"{vocab_size}-row embedding")
        return cfg.model.mask_token_id
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return tokenizer.mask_token_id
    if cfg.model.target.random_8b_shape:
        return QWEN3_8B_MASK_TOKEN_ID
    if vocab_size is not None and len(tokenizer) < vocab_size:
        return len(tokenizer)
    raise ValueError("model.mask_token_id: the tokenizer has no mask token and the target's embedding has no "
                     "unused row; set one in the config")


def build_drafter(cfg: TrainerConfig, target: Target | torch.nn.Module, mask_token_id: int, device: str,
                  log: Callable[[str], None] | None = None) -> DFlashDrafter:
    """The drafter model.drafter describes, or model.drafter_init's draft: its weights; a DFlash draft
    (a published directory or a trainer checkpoint) under kind dflash2 is a warm start: the shared
    weights loaded, the DFlash2 parts initialised (trainer.models.dflash2: identity convolutions,
    a selector adding nothing yet), said in the log."""
    target_config = as_target(target).config
    layer_ids = target_layer_ids(cfg, int(target_config.num_hidden_layers))
    published = read_init(cfg.model.drafter_init) if cfg.model.drafter_init else None
    warm = False
    if published is None:
        dcfg = DrafterConfig.from_target(target_config, cfg.model.drafter_layers, cfg.model.block_size,
                                         mask_token_id, layer_ids, **drafter_own(cfg.model))
        weights = None
    else:  # the draft's own config decides its architecture (model.drafter agreed at config load)
        draft, weights = published
        own = {k: getattr(draft, k) for k in (*OWN_FIELDS, *GENERATION_OWN)}
        if cfg.model.drafter.kind == "dflash2" and draft.kind != "dflash2":
            own.update(generation_own(cfg.model))  # DFlash -> DFlash2
            warm = True
        elif cfg.model.drafter.kind != draft.kind:
            raise ConfigError(f"model.drafter_init: {cfg.model.drafter_init} is a {draft.kind} draft, "
                              f"model.drafter.kind is {cfg.model.drafter.kind}")
        dcfg = DrafterConfig.from_target(target_config, draft.num_hidden_layers, cfg.model.block_size,
                                         mask_token_id, layer_ids, **own)
        check_init(cfg, draft, dcfg)
    torch.manual_seed(cfg.run.seed)
    with torch.device(device):
        drafter = DFlashDrafter(dcfg)
    drafter.fused = cfg.model.fuse_drafter
    if cfg.model.drafter.precision == "fp8":
        from trainer.models.fp8_training import fp8_linear

        drafter.linear = fp8_linear
    drafter.checkpoint_layers = drafter_checkpointing(cfg)  # auto: the memory plan decides
    if weights is not None:
        from trainer.models.weights_check import check_fits

        try:  # one line naming the directory and the tensor, not torch's multi-line RuntimeError
            check_fits(f"model.drafter_init: {cfg.model.drafter_init}", weights, drafter.state_dict(),
                       may_miss=drafter.dflash2_parameters() if warm else ())
        except ValueError as e:
            raise ConfigError(str(e)) from None
        result = drafter.load_state_dict(weights, strict=not warm)
        if warm:
            new = drafter.dflash2_parameters()
            if sorted(result.missing_keys) != sorted(new) or result.unexpected_keys:
                raise ConfigError(f"model.drafter_init: {cfg.model.drafter_init} does not hold the DFlash weights "
                                  f"(missing {sorted(set(result.missing_keys) - set(new))}, unexpected "
                                  f"{result.unexpected_keys})")
            (log or print)(f"warm start from the DFlash draft {cfg.model.drafter_init}: {len(weights)} shared tensors "
                           f"loaded; the DFlash2 parts initialised ({len(new)} tensors: identity convolutions, a "
                           "candidate selector adding nothing yet, so it drafts what the DFlash draft drafts)")
    return drafter.float().train()


# the draft's own architecture (DrafterConfig fields)
OWN_FIELDS = ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "layout", "mask_embedding")
GENERATION_OWN = ("kind", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",
                  "input_embedding_scale", "output_multiplier", "final_logit_softcapping")


def read_init(path: str) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    from trainer.models.export import read_published
    from trainer.run.config import ConfigError

    try:
        return read_published(path)
    except ValueError as e:
        raise ConfigError(f"model.drafter_init: {e}") from None


def check_init(cfg: TrainerConfig, draft: DrafterConfig, dcfg: DrafterConfig) -> None:
    """model.drafter_init against this run: the target's hidden size and vocab, the tapped target
    layers, the mask token, and what model.drafter / drafter_layers set (the draft decides, they must
    agree). Every mismatch is named in one error (block_size is not a weight: the run's own applies)."""
    from trainer.run.config import ConfigError

    path = cfg.model.drafter_init
    fields = draft.to_dict()
    want = {**dcfg.to_dict(), "num_target_layers": draft.num_target_layers or dcfg.num_target_layers}
    names = {"hidden_size": "hidden size (the target's)", "vocab_size": "vocab (the target's)",
             "target_layer_ids": "target layer ids (model.target_layer_ids)",
             "num_target_layers": "target layers", "mask_token_id": "mask token (model.mask_token_id)"}
    problems = [f"{label} {fields[key]} (this run: {want[key]})" for key, label in names.items()
                if fields.get(key) != want[key]]
    n = draft.num_hidden_layers
    problems += disagreements(cfg.model.drafter, {**draft.layout.spelled(n), **{k: getattr(draft, k) for k in SHAPE_FIELDS}}, n)
    if problems:
        raise ConfigError(f"model.drafter_init: {path} does not fit this target and config: " + "; ".join(problems))


def require_logits(target: Target, log: Callable[[str], None]) -> None:
    """model.loss kl (or tv) reads the target's logits: its layers above the last tapped one, its final norm
    and LM head, loaded onto the last stage now (training alone would leave them unread)."""
    from trainer.run.config import ConfigError

    if not complete_for_decoding(target, log):
        raise ConfigError("model.loss: kl (or tv) needs the target's layers above the last tapped one, its final "
                          "norm and LM head, and the model directory lacks some; use loss: ce")


def build_components(cfg: TrainerConfig, run_dir: Path, log: Callable[[str], None],
                     phase: Phase = _no_phase) -> Components:
    """phase(name, done, total): what is being built, for status.json (trainer.run.rundir.RunDir.phase)."""
    phase("tokenising")
    tokenizer = build_tokenizer(cfg)
    train_conv, eval_conv = load_conversations(cfg, run_dir)

    read: list[bool] = []  # per data set, with data.token_cache: read from it (else encoded and written there)

    def dataset(conversations: list[dict], seed: int, processes: int, training: bool = False) -> PreloadedDataset:
        def progress(done: int) -> None:
            phase("tokenising", done, len(conversations))

        def encode() -> list[Encoded]:
            if training and processes > 1:  # minutes for a million conversations: say what the wait is
                log(f"tokenizing {len(conversations)} training conversations in {processes} processes (data.workers)")
            return encode_all(tokenizer, conversations, cfg.data.max_length, template_kwargs(cfg.data), processes,
                              progress if training else None)

        if cfg.data.token_cache is None:
            encoded = encode()
        else:
            encoded, found = cached_encode(cfg.data.token_cache, tokenizer, conversations, cfg.data.max_length,
                                           template_kwargs(cfg.data), encode)
            read.append(found)
        return dataset_of(tokenizer, encoded, cfg.data.bucket_edges, cfg.data.token_budget, seed, cfg.data.pad_multiple)

    if not eval_conv:
        log("no held-out conversations (data.eval_path unset): evaluating on the first 8 training conversations")
        eval_conv = train_conv[:8]
    began = time.perf_counter()  # chat templates and masks: ~2 ms a conversation (trainer.data.encoding)
    processes = [process_count(cfg.data.workers, len(c)) for c in (train_conv, eval_conv)]
    conversations = dataset(train_conv, cfg.data.seed, processes[0], training=True)
    eval_data = dataset(eval_conv, cfg.data.seed + 1, processes[1])
    seconds = time.perf_counter() - began
    if read and all(read):
        log(f"read {len(train_conv)} training and {len(eval_conv)} held-out tokenized conversations from "
            f"data.token_cache {cfg.data.token_cache} in {seconds:.1f}s")
    else:
        log(f"tokenized {len(train_conv)} training and {len(eval_conv)} held-out conversations in {seconds:.1f}s "
            f"({max(processes)} process{'es' if max(processes) > 1 else ''})"
            + (f"; kept in data.token_cache {cfg.data.token_cache}" if read else ""))
    weighted = sum("loss_weights" in c for c in train_conv)
    if weighted:  # trainer.data.chat.answer_weights: the on-policy stage's rows (trainer_tools.onpolicy)
        log(f"{weighted} of {len(train_conv)} training conversations weigh their last answer's tokens (loss_weights)")
    phase("loading the target")
    target = build_target(cfg, tokenizer, conversations, run_dir, log, phase=phase)
    phase("building the drafter")
    train_data: PreloadedDataset | PackedDataset = conversations
    if cfg.data.pack_length:
        from trainer.data.packing import PackedDataset

        packed = PackedDataset.from_dataset(conversations, cfg.data.pack_length, cfg.data.pack_rows)
        log(f"packing {len(packed)} conversations into rows of {cfg.data.pack_length} tokens, "
            f"{cfg.data.pack_rows} per micro-batch: {packed.pad_share():.1%} padding")
        train_data = packed
    drafter_device = cfg.devices.drafter[0]
    drafter = build_drafter(cfg, target, resolve_mask_token_id(cfg, tokenizer, hf_config(target.module).vocab_size),
                            drafter_device, log)
    if drafter.checkpoint_layers:
        log(f"drafter layers checkpointed: the first {drafter.checkpoint_layers} of {cfg.model.drafter_layers} "
            f"(model.checkpoint_drafter: {cfg.model.checkpoint_drafter}): their forward runs again in backward, "
            "their activations are not kept")
    optimizer = build_optimizer(drafter.parameters(), cfg.optim, compute_dtype=TORCH_DTYPES[cfg.model.dtype])
    if cfg.optim.offload == "host":
        params = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
        log(f"optim.offload host: the drafter's fp32 weights and AdamW states in host memory "
            f"({12 * params / 2**30:.2f} GiB), {cfg.model.dtype} weights and gradients on {drafter_device}; "
            "the update runs on the host's CPU")
    objective = objective_of(cfg.model)
    if objective.needs_target:
        require_logits(target, log)
    log(f"objective: {objective.describe()}")
    return Components(
        tokenizer=tokenizer, target=target, head=FrozenHead.from_target(target, drafter_device), drafter=drafter,
        optimizer=optimizer, scheduler=build_scheduler(optimizer, cfg.optim), train_data=train_data,
        eval_conversations=eval_conv, eval_data=eval_data,
        gamma=base_gamma(objective, cfg.model.gamma or default_gamma(cfg.model.block_size)), objective=objective,
        target_device=target_replicas(cfg.devices)[0][0], drafter_device=drafter_device,
        backend=resolve_backend(cfg.model.attention, drafter_device, needs_grad=True),
    )
