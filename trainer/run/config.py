"""Trainer configuration: dataclasses loaded from YAML, validated with file:line errors.

Every field is documented in its dataclass. Unknown keys are rejected with a near-miss
suggestion; wrong types and out-of-range values name the YAML file and line.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from trainer.run import yamlsafe
from trainer.run.layout import Layout


class ConfigError(ValueError):
    """A configuration problem, with the YAML location when one is known."""


@dataclass
class TinyTargetConfig:
    """A small random-weight Qwen3 target built in code (tests, CPU demo)."""

    layers: int = 4  # decoder layers of the target
    hidden: int = 64  # hidden size
    heads: int = 4  # attention heads
    kv_heads: int = 2  # key/value heads
    head_dim: int = 16  # per-head width
    intermediate: int = 128  # MLP width
    seed: int = 0  # weight-initialisation seed
    fit_steps: int = 0  # LM steps on the training data before drafting, so greedy outputs are learnable
    fit_lr: float = 3e-3  # learning rate of that fit


@dataclass
class TargetConfig:
    """Where the frozen target comes from: exactly one of `path`, `tiny`, `random_8b_shape`."""

    path: str | None = None  # local Hugging Face model directory (nothing is downloaded)
    tiny: TinyTargetConfig | None = None  # build a tiny random Qwen3 in code
    random_8b_shape: bool = False  # build a Qwen3-8B-shaped random bf16 target on the device
    # fp8: the decoder layers' linear layers run in FP8 e4m3 (weights quantized once at load, one scale per
    # output channel; activations per token; torch._scaled_mm), the tapped features in bf16; an FP8
    # checkpoint stays 1 byte a weight. Needs CUDA devices of compute capability 8.9+ and model.dtype bf16
    precision: Literal["bf16", "fp8"] = "bf16"
    fp8_fast_accum: bool = False  # fp8: torch._scaled_mm's fast accumulation (Hopper: no periodic fp32 promotion; faster, coarser sums)
    # a MoE target's experts: grouped_mm (every expert's matmul in one grouped GEMM), eager (transformers'
    # per-expert loop); auto: grouped_mm where the installed transformers and torch offer it
    experts: Literal["auto", "grouped_mm", "eager"] = "auto"


@dataclass
class DrafterShapeConfig:
    """The drafter's own architecture (docs/engine-vllm.md: what each engine serves). Unset: the
    2025 layout (every layer full attention, non-causal inside the block, no sinks) with the
    target's heads, KV heads, head_dim and MLP width; the hidden size is always the target's.
    With model.drafter_init the draft's config.json decides, and what is set here must agree."""

    layer_types: list[Literal["full_attention", "sliding_attention"]] | None = None  # per drafter layer
    sliding_window: int | None = None  # window of the sliding_attention layers (needed with any)
    causal: bool | list[bool] | None = None  # inside the block: all layers, or per layer; default: the sliding layers (vLLM's reading)
    num_attention_heads: int | None = None  # default: the target's
    num_key_value_heads: int | None = None  # default: the target's (or num_attention_heads)
    head_dim: int | None = None  # default: the target's
    intermediate_size: int | None = None  # MLP width; default: the target's intermediate_size
    attention_sink: bool | None = None  # a learned per-head attention-sink logit on every layer (vLLM: attention_sink_bias)
    # the draft's generation: dflash (the DFlash drafter) or dflash2 (vLLM's DFlash2DraftModel: a grouped
    # dynamic convolution around every layer's attention and MLP, a candidate selector re-scoring each
    # slot's top-k; docs/objectives.md, docs/engine-vllm.md). The next five are dflash2's (unset: the
    # published draft's values); with drafter_init a DFlash2 draft's own decide, a DFlash draft warm-starts one
    kind: Literal["dflash", "dflash2"] = "dflash"
    conv_kernel_size: int | None = None  # dflash2: taps of the convolutions (default 2)
    conv_group_size: int | None = None  # dflash2: channels sharing a dynamic coefficient; divides the hidden size (default 16)
    selector_rank: int | None = None  # dflash2: rank of the selector's codebooks (default 256)
    selector_top_k: int | None = None  # dflash2: candidates per draft slot, at most the vocabulary (default 16)
    selector_loss_weight: float | None = None  # dflash2: weight of the selector's K-way cross-entropy beside the token loss (default 1)
    # the drafter's linear layers while training: bf16 matmuls (over fp32 master weights), or fp8 (e4m3,
    # dynamic per-tensor scales, forward and backward on FP8 tensor cores; trainer/models/fp8_training.py).
    # Master weights, optimizer, evaluation and the export stay as with bf16; needs a GPU of 8.9 or later
    precision: Literal["bf16", "fp8"] = "bf16"


@dataclass
class LossMix:
    """model.loss as a mapping: a·CE + b·KL + c·TV (docs/objectives.md)."""

    ce: float = 0.0  # weight of cross-entropy on the data's tokens
    kl: float = 0.0  # weight of forward KL to the target's next-token distribution
    tv: float = 0.0  # weight of the total variation to it (the share of sampled proposals rejected)


@dataclass
class ModelConfig:
    """The target and the DFlash drafter."""

    target: TargetConfig = field(default_factory=TargetConfig)
    drafter_layers: int = 5  # decoder layers of the drafter (5 for a Qwen3-8B target); default with drafter.layer_types or drafter_init: theirs
    drafter: DrafterShapeConfig = field(default_factory=DrafterShapeConfig)  # the drafter's own architecture
    block_size: int = 16  # tokens per draft block: the anchor plus block_size-1 masks
    num_target_layers: int = 5  # how many target layers feed the context features
    target_layer_ids: list[int] | None = None  # explicit layer ids; default: spaced from 1 to T-3
    drafter_init: str | None = None  # a published-format draft directory (our export, z-lab's, what SGLang/vLLM load), a trainer checkpoint or run directory (its latest): its weights start training; checked against the target
    mask_token_id: int | None = None  # default: the tokenizer's mask token, else the first embedding row past the tokenizer (151669 for Qwen3)
    attention: Literal["auto", "flex", "sdpa"] = "auto"  # auto: flex on cuda, sdpa dense mask on cpu
    dtype: Literal["bf16", "fp32"] = "bf16"  # target dtype and drafter autocast dtype
    gamma: float | None = None  # loss decay; default 7 (block 16), 5 (10), 4 (8)
    # the objective (docs/objectives.md): ce = cross-entropy on the data's tokens (the DFlash recipe);
    # kl = forward KL to the target's next-token distribution at each block position (runs the target's
    # layers above the last tapped one and its head); {ce: a, kl: b} = a·CE + b·KL
    loss: Literal["ce", "kl", "tv"] | LossMix = "ce"
    kl_temperature: float = 1.0  # softens target and drafter in the KL and TV terms (scaled by T², T)
    # decay: exp(-(k-1)/gamma); dpace: D-PACE weights from the drafter's own confidence (detached). dpace by
    # default: the recipe ablation (issue #50, docs/objectives.md) measured it ahead of decay beyond the seed spread
    position_weight: Literal["decay", "dpace"] = "dpace"
    dpace_alpha: float = 0.5  # D-PACE's smoothing floor, in (0, 1]
    loss_chunk: int = 2048  # block positions per logits chunk (keeps vocab logits small)
    # threaded pipeline on CUDA: torch.compile the target's decoder layers (warmed shapes only).
    # auto: on when every target device is CUDA and the rows are packed (one shape: one compile,
    # +11% tokens/s, bench/RESULTS.md); off on the CPU and for bucketed lengths
    compile_target: bool | Literal["auto"] = "auto"
    # the drafter's matmuls use bf16 copies of the fp32 master weights made once per optimizer step
    # (not per use under autocast), and each layer runs as two compiled regions around attention on
    # CUDA (norms, RoPE, residuals, SiLU fused with their neighbours). false: the previous path
    fuse_drafter: bool = True
    # activation checkpointing of the drafter's layers: only each layer's input is kept for backward,
    # which runs the layer's forward again (a third more drafter compute), so activations stop growing
    # with layers x anchors. true: every layer; auto: none where the memory plan says the step fits
    # without, else the fewest first layers with which it fits (trainer/models/memory_plan.py; long
    # packed rows: 3 of 5 at 65,536 tokens on one H200)
    checkpoint_drafter: bool | Literal["auto"] = "auto"


@dataclass
class SyntheticDataConfig:
    """Generate synthetic conversations into the run directory (no data files needed)."""

    n_train: int = 2000  # training conversations
    n_eval: int = 32  # held-out conversations
    seed: int = 0  # generator seed
    min_len: int = 12  # shortest assistant answer (tokens)
    max_len: int = 40  # longest assistant answer (tokens)


@dataclass
class DataConfig:
    """Conversations and batching."""

    train_path: str | list[str] | None = None  # JSONL file(s): OpenAI messages, ShareGPT or prompt/response
    eval_path: str | list[str] | None = None  # held-out JSONL file(s), same formats
    enable_thinking: bool | None = None  # passed to the chat template (Qwen3: false = the prompt pre-fills an empty think block); None: the template's default
    synthetic: SyntheticDataConfig | None = None  # generate data instead of reading files
    max_length: int = 3072  # longer conversations are truncated
    num_anchors: int = 512  # draft blocks sampled per sequence
    token_budget: int = 3072  # padded tokens per micro-batch
    bucket_edges: list[int] = field(default_factory=lambda: [256, 512, 1024, 2048, 3072])  # length bucket upper bounds
    pad_multiple: int = 64  # batches are padded to a multiple of this length (fewer distinct shapes)
    pack_length: int = 0  # 0: length buckets; else whole conversations packed into rows of this many tokens (a multiple of 128, >= max_length): one shape for the run
    pack_rows: int = 1  # packed rows per micro-batch
    anchors_per_row: int | None = None  # packed: draft blocks per row; default num_anchors per max_length tokens, same density
    seed: int = 0  # data order and anchor sampling seed
    token_cache: str | None = None  # a directory: the tokenized conversations are kept there (trainer.data.token_cache), keyed by the data, tokenizer, chat template, max_length and the encoding code, so the run's next start (resume, restart) and other runs on the same data read them instead of tokenizing again; None: not kept
    workers: int | Literal["auto"] = "auto"  # processes that tokenize the conversations (chat template, loss mask) when there are 2,000 or more (fewer: one); auto: min(usable CPUs, 16); 1: in the trainer's process


@dataclass
class OptimConfig:
    """AdamW with cosine decay after a linear warm-up."""

    lr: float = 6e-4  # peak learning rate
    weight_decay: float = 0.0  # AdamW weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW betas
    eps: float = 1e-8  # AdamW epsilon
    warmup_ratio: float = 0.04  # share of total_steps spent warming up
    min_lr_ratio: float = 0.0  # final lr as a share of lr
    grad_clip: float = 1.0  # max global gradient norm (0 = off)
    total_steps: int = 1000  # optimizer steps in the whole run
    micro_batches: int = 1  # micro-batches per optimizer step (loss normalised over all of them)
    offload: Literal["none", "host"] = "none"  # host: the drafter's fp32 master weights and AdamW states in host memory, the update on the host's CPU; the device keeps model.dtype weights and gradients (trainer.train.offload)


@dataclass
class DevicesConfig:
    """Device strings ("cpu", "cuda:0", ...): the reference loop (loop.Trainer) uses the first of
    each; the threaded pipeline runs one worker thread per entry."""

    target: list[str | list[str]] = field(default_factory=lambda: ["cpu"])  # target replicas: a device each, or a list = one replica split in layer stages over those devices
    drafter: list[str] = field(default_factory=lambda: ["cpu"])  # devices holding drafter replicas
    target_split: list[int] | None = None  # layers per stage of every split replica (from layer 0); default: balanced by parameter bytes
    memory_gib: float | None = None  # per-device memory budget: the plan and the loader refuse more (default: each GPU's memory, no limit on cpu)


@dataclass
class WandbConfig:
    """Optional Weights & Biases logging (only if the package is installed)."""

    project: str = "dflash"  # wandb project name
    name: str | None = None  # run name; default the run directory's name


@dataclass
class RunConfig:
    """Logging, checkpointing and the process."""

    log_every: int = 1  # steps between `step` metrics lines
    checkpoint_every: int = 0  # steps between periodic checkpoints (0 = only on stop/done)
    keep_checkpoints: int = 3  # most recent checkpoints kept on disk
    keep_best: bool = False  # also keep the checkpoint with the best τ so far (checkpoints/best.json names it)
    heartbeat_s: float = 5.0  # seconds between status.json heartbeats (contract: <= 10)
    warmup_shapes: int = 4  # largest batch shapes (one per bucket) run once before training
    threads: int | None = None  # torch CPU threads; default torch's choice
    seed: int = 0  # model initialisation seed
    wandb: WandbConfig | None = None  # W&B's project and run name; setting it names wandb as a tracker
    trackers: list[Literal["wandb", "tensorboard", "mlflow"]] = field(default_factory=list)  # also log the metrics there (trainer.train.trackers); one not installed is refused before the run
    mlflow_uri: str | None = None  # MLflow tracking URI; default a file store in RUN_DIR/mlruns


@dataclass
class EvalConfig:
    """Speculative-decoding evaluation on held-out conversations."""

    every: int = 0  # steps between evaluations (0 = only at the end)
    samples: int = 16  # held-out conversations decoded
    max_new_tokens: int = 64  # tokens generated per conversation
    batch: int = 16  # conversations decoded at once (rounds are launch-bound: more is faster, and takes more memory)
    # where a conversation is judged (trainer.data.turns): its last assistant turn, every one, or auto (every
    # turn of a conversation holding tool results: an agent's answers after each result; the last otherwise)
    turns: Literal["auto", "last", "every"] = "auto"
    # τ at each temperature, sampled as the engine samples (trainer.generate.sampling; 0: greedy); the first
    # is the run's τ (status tau, keep_best), each is reported (eval event `temperatures`)
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    top_p: float = 1.0  # the engine's top-p at T > 0 (1: off)
    top_k: int = 0  # the engine's top-k at T > 0 (0: off)
    seed: int = 0  # the sampling noise's seed (prompt i draws from stream i: the same figures for any batch)
    draft_sample_method: Literal["greedy", "probabilistic"] = "greedy"  # vLLM's: argmax drafts, or sampled with q


@dataclass
class PipelineConfig:
    """How steps are executed: the single-threaded reference loop or the threaded pipeline."""

    kind: Literal["reference", "threaded"] = "reference"  # threaded: trainer/pipeline, a thread per device role
    prefetch: int = 4  # micro-batches built ahead per target worker (bounded queue)
    queue_depth: int = 2  # packed feature batches queued per target->drafter pair
    pad_to_warm_shapes: Literal["auto", "always", "never"] = "auto"  # auto: when the drafter runs compiled flex


@dataclass
class DistributedConfig:
    """Across hosts (torchrun, one rank per host; docs/multi-node.md). Unused in a one-host run."""

    backend: Literal["auto", "nccl", "gloo"] = "auto"  # auto (nccl when the drafters are on GPUs, else gloo) | nccl | gloo
    timeout_s: float = 900.0  # collective timeout (a slow peer's warm-up or checkpoint load waits this long)
    peer_timeout_s: float = 10.0  # a peer whose heartbeat is this old is lost: every host stops
    socket_ifname: str | None = None  # GLOO_/NCCL_SOCKET_IFNAME; default the interface holding the host's address


@dataclass
class TrainerConfig:
    """The whole trainer configuration."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    devices: DevicesConfig = field(default_factory=DevicesConfig)
    run: RunConfig = field(default_factory=RunConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)


# ---------------------------------------------------------------------------- loading


class _Located(dict):
    """A mapping that remembers the YAML line of each key."""

    def __init__(self, items: dict, lines: dict) -> None:
        super().__init__(items)
        self.lines = lines


def _plain(node: yaml.Node) -> Any:
    if isinstance(node, yaml.MappingNode):
        items, lines = {}, {}
        for key_node, value_node in node.value:
            key = key_node.value
            if key in items:
                raise ConfigError(f"line {key_node.start_mark.line + 1}: duplicate key {key!r}")
            items[key] = _plain(value_node)
            lines[key] = key_node.start_mark.line + 1
        return _Located(items, lines)
    if isinstance(node, yaml.SequenceNode):
        return [_plain(n) for n in node.value]
    return yaml.safe_load(yaml.serialize(node))


def _where(source: str, mapping: Any, key: str) -> str:
    line = getattr(mapping, "lines", {}).get(key)
    return f"{source}:{line}" if line else source


def _allowed(tp: Any) -> tuple[Any, ...]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return (tp,)


_YAML11_EXPONENT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _convert(value: Any, tp: Any, name: str, where: str) -> Any:
    options = _allowed(tp)
    if value is None:
        if type(None) in options:
            return None
        raise ConfigError(f"{where}: {name} must not be empty")
    for option in options:
        if option is type(None):
            continue
        if dataclasses.is_dataclass(option) and isinstance(option, type):
            if isinstance(value, dict):
                return _build(option, value, name, where_source=where.rsplit(":", 1)[0])
            continue
        origin = typing.get_origin(option)
        if origin is Literal:
            if value in typing.get_args(option):
                return value
            continue
        if origin is list:
            if isinstance(value, list):
                (item_tp,) = typing.get_args(option)
                return [_convert(v, item_tp, f"{name}[{i}]", where) for i, v in enumerate(value)]
            continue
        if option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if option is float and isinstance(value, str) and _YAML11_EXPONENT.fullmatch(value):
            return float(value)  # YAML 1.1 (PyYAML) reads 1e-3 as a string; everyone means the number
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if option in (str, bool) and isinstance(value, option):
            return value
    wanted = " or ".join(_type_name(o) for o in options)
    raise ConfigError(f"{where}: {name} must be {wanted}, got {value!r}")


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    if typing.get_origin(tp) is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(choice) for choice in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _build(cls: type, raw: dict, prefix: str, where_source: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        where = _where(where_source, raw, key)
        full = f"{prefix}.{key}" if prefix else key
        if key not in names:
            near = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else f" (known: {', '.join(names)})"
            raise ConfigError(f"{where}: unknown key {full!r}{hint}")
        kwargs[key] = _convert(value, hints[key], full, where)
    return cls(**kwargs)


def load_config(path: str | Path) -> TrainerConfig:
    """Read, convert and validate a trainer YAML file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror}") from None
    return parse_config(text, str(path))


def parse_config(text: str, source: str = "<config>") -> TrainerConfig:
    try:
        node = yamlsafe.compose(text, source)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        raise ConfigError(f"{source}{line}: invalid YAML: {getattr(exc, 'problem', exc)}") from None
    try:
        raw = _plain(node) if node is not None else _Located({}, {})
    except ConfigError as exc:
        raise ConfigError(f"{source}:{str(exc)[len('line '):]}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the config must be a mapping of sections")
    config = _build(TrainerConfig, raw, "", source)
    _validate(config, raw, source)
    return config


def _fp8_refusal(device: str) -> str | None:
    """trainer.run.accel.fp8_refusal, where torch is installed (else only the CPU is refused here)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return None if device.startswith("cuda") else f"{device}: FP8 needs a GPU with FP8 tensor cores"
    from trainer.run import accel

    return accel.fp8_refusal(device)


def _grouped_refusal() -> str | None:
    try:
        import torch  # noqa: F401
    except ImportError:
        return None
    from trainer.run import accel

    return accel.grouped_available()


def _section_where(raw: Any, source: str, *keys: str) -> str:
    mapping = raw
    for key in keys[:-1]:
        mapping = mapping.get(key, {}) if isinstance(mapping, dict) else {}
    return _where(source, mapping, keys[-1])


def _non_finite(obj: Any, keys: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], float]]:
    """(keys, value) of every NaN or infinite number in a config section, nested sections and lists included."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _non_finite(getattr(obj, f.name), (*keys, f.name))
    elif isinstance(obj, float) and not math.isfinite(obj):
        yield keys, obj
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _non_finite(v, keys)


INT_LIMIT = 2**63 - 1  # what a torch int64 (a step, a count, a seed) holds


def _huge_ints(obj: Any, keys: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], int]]:
    """(keys, value) of every integer beyond +-INT_LIMIT (YAML reads any length of digits): such a
    value passed every `>= 1` and overflowed later, far from the user's line."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _huge_ints(getattr(obj, f.name), (*keys, f.name))
    elif isinstance(obj, int) and not isinstance(obj, bool) and abs(obj) > INT_LIMIT:
        yield keys, obj
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _huge_ints(v, keys)


class _Check:
    """Raises the first problem as `file:line: section.key message`; every section's validator gets one."""

    def __init__(self, raw: dict, source: str) -> None:
        self.raw, self.source = raw, source

    def __call__(self, ok: bool, keys: tuple[str, ...], message: str) -> None:
        if not ok:
            raise ConfigError(f"{_section_where(self.raw, self.source, *keys)}: {'.'.join(keys)} {message}")


def _validate(c: TrainerConfig, raw: dict, source: str) -> None:
    """Every section's own validator, in the file's order; a key added to a section is checked in its
    section's function. Values that cross sections are checked by the section whose key is named."""
    check = _Check(raw, source)
    for keys, value in _non_finite(c):  # .inf / .nan parse as floats: every range below would take them
        check(False, keys, f"must be a finite number, got {value}")
    for keys, big in _huge_ints(c):
        check(False, keys, f"must be at most {INT_LIMIT} in magnitude, got a {len(str(abs(big)))}-digit number")
    _validate_target(c, check)
    _validate_model(c, check)
    _validate_drafter(c, check)
    _validate_drafter_precision(c, check)
    _validate_data(c, check)
    _validate_optim(c, check)
    _validate_devices(c, check)
    _validate_run(c, check)
    _validate_eval(c, check)
    _validate_pipeline(c, check)
    _validate_distributed(c, check)


def _target_family(c: TrainerConfig) -> Any:
    """The family of model.target.path's directory on this machine (None: not a directory we know)."""
    from trainer.run.family import family_of_dir

    return family_of_dir(c.model.target.path) if c.model.target.path is not None else None


def _validate_target(c: TrainerConfig, check: _Check) -> None:
    """model.target: one source, its precision and experts, and a model directory's family."""
    t = c.model.target
    chosen = [t.path is not None, t.tiny is not None, t.random_8b_shape]
    check(sum(chosen) == 1, ("model", "target"), "needs exactly one of path, tiny, random_8b_shape")
    check(not t.fp8_fast_accum or t.precision == "fp8", ("model", "target", "fp8_fast_accum"), "needs precision fp8")
    if t.precision == "fp8":
        check(c.model.dtype == "bf16", ("model", "target", "precision"),
              "fp8 returns bf16 features: it needs model.dtype bf16")
        for d in dict.fromkeys(one for r in c.devices.target for one in ([r] if isinstance(r, str) else r)):
            reason = _fp8_refusal(d)
            check(reason is None, ("model", "target", "precision"), f"fp8 is refused: {reason}")
    if t.experts == "grouped_mm":
        reason = _grouped_refusal()
        check(reason is None, ("model", "target", "experts"), f"grouped_mm is not offered here: {reason}")
    if t.path is not None:  # a directory on this machine: its family decides
        from trainer.run.family import installed_transformers, transformers_refusal

        family = _target_family(c)
        refusal = family and transformers_refusal(family.model_type, installed_transformers())
        check(not refusal, ("model", "target", "path"), f"{t.path}: {refusal}")
        check(family is None or family.quantization_refusal is None, ("model", "target", "path"),
              f"{t.path}: {family.quantization_refusal if family else ''}")


def _validate_model(c: TrainerConfig, check: _Check) -> None:
    """model's own keys (the drafter's shape and kind: `_validate_drafter`)."""
    m = c.model
    check(m.block_size >= 2, ("model", "block_size"), "must be at least 2")
    check(m.drafter_layers >= 1, ("model", "drafter_layers"), "must be at least 1")
    check(m.num_target_layers >= 1, ("model", "num_target_layers"), "must be at least 1")
    check(m.loss_chunk >= 1, ("model", "loss_chunk"), "must be positive")
    check(m.gamma is None or m.gamma > 0, ("model", "gamma"), "must be positive")
    if isinstance(m.loss, LossMix):
        mix = m.loss
        check(min(mix.ce, mix.kl, mix.tv) >= 0 and mix.ce + mix.kl + mix.tv > 0, ("model", "loss"),
              f"needs non-negative weights, not all zero (got ce {mix.ce:g}, kl {mix.kl:g}, tv {mix.tv:g})")
    check(m.kl_temperature > 0, ("model", "kl_temperature"), "must be positive")
    check(0 < m.dpace_alpha <= 1, ("model", "dpace_alpha"), "must be in (0, 1]")
    # a knob of one objective set under another had no effect, silently (#55 item 8): the user meant
    # that objective, or the knob is left over; either way they are told, with the file's line
    given: dict = check.raw["model"] if isinstance(check.raw.get("model"), dict) else {}
    target_weight = m.loss.kl + m.loss.tv if isinstance(m.loss, LossMix) else float(m.loss in ("kl", "tv"))
    loss_text = m.loss if isinstance(m.loss, str) else (f"{{ce: {m.loss.ce:g}, kl: {m.loss.kl:g}"
                                                        + (f", tv: {m.loss.tv:g}" if m.loss.tv else "") + "}")
    check("kl_temperature" not in given or target_weight > 0, ("model", "kl_temperature"),
          f"applies only to a loss with a KL (or TV) term, and model.loss is {loss_text}: it would be ignored "
          "(remove it, or set loss: kl or {ce: a, kl: b})")
    weighting = m.position_weight + ("" if "position_weight" in given else " (the default)")
    check("dpace_alpha" not in given or m.position_weight == "dpace", ("model", "dpace_alpha"),
          f"applies only to position_weight: dpace, and model.position_weight is {weighting}: it would be "
          "ignored (remove it, or set position_weight: dpace)")
    check("gamma" not in given or m.gamma is None or m.position_weight == "decay", ("model", "gamma"),
          f"shapes position_weight: decay, and model.position_weight is {weighting} (its base weights are "
          "uniform): it would be ignored (remove it, or set position_weight: decay)")
    if m.target_layer_ids is not None:
        check(len(m.target_layer_ids) == m.num_target_layers, ("model", "target_layer_ids"),
              "must list num_target_layers ids")
        # an engine collects the tapped hidden states as its layers run, each layer once: a drafter trained on
        # them in another order, or on one twice, would read other features where it is served
        check(list(m.target_layer_ids) == sorted(set(m.target_layer_ids)), ("model", "target_layer_ids"),
              f"{list(m.target_layer_ids)} must be increasing, each layer once (the order an engine collects them in)")


def _validate_data(c: TrainerConfig, check: _Check) -> None:
    data = c.data
    check(data.synthetic is not None or data.train_path is not None, ("data",), "needs train_path or synthetic")
    for key in ("train_path", "eval_path"):
        paths = getattr(data, key)
        check(paths is None or (paths != [] and all(isinstance(p, str) and p for p in ([paths] if isinstance(paths, str) else paths))),
              ("data", key), "must be a file path or a non-empty list of them")
    check(data.max_length >= c.model.block_size, ("data", "max_length"), "must be at least block_size")
    check(data.num_anchors >= 1, ("data", "num_anchors"), "must be positive")
    check(data.token_budget >= data.max_length, ("data", "token_budget"), "must be at least max_length")
    check(data.bucket_edges == sorted(data.bucket_edges) and len(data.bucket_edges) > 0,
          ("data", "bucket_edges"), "must be a non-empty increasing list")
    check(data.pack_length == 0 or (data.pack_length % 128 == 0 and data.pack_length >= data.max_length),
          ("data", "pack_length"), "must be 0 or a multiple of 128 no shorter than max_length")
    check(data.pack_rows >= 1, ("data", "pack_rows"), "must be at least 1")
    check(data.workers == "auto" or (isinstance(data.workers, int) and data.workers >= 1), ("data", "workers"), "must be auto or at least 1")
    check(data.token_cache is None or (isinstance(data.token_cache, str) and data.token_cache.strip() != ""),
          ("data", "token_cache"), "must be a directory path or null")
    if data.pack_length:
        family = _target_family(c)
        check(family is None or family.pack_refusal is None, ("data", "pack_length"),
              f"cannot be exact for this target ({family.pack_refusal if family else ''}); "
              "leave it 0 (length buckets)")
    check(data.anchors_per_row is None or data.anchors_per_row >= 1, ("data", "anchors_per_row"),
          "must be positive")


def _validate_optim(c: TrainerConfig, check: _Check) -> None:
    o = c.optim
    check(o.lr > 0, ("optim", "lr"), "must be positive")
    check(0 <= o.warmup_ratio < 1, ("optim", "warmup_ratio"), "must be in [0, 1)")
    check(o.total_steps >= 1, ("optim", "total_steps"), "must be at least 1")
    check(o.micro_batches >= 1, ("optim", "micro_batches"), "must be at least 1")
    check(len(o.betas) == 2, ("optim", "betas"), "must hold two numbers")
    check(all(0 <= b < 1 for b in o.betas), ("optim", "betas"), "must be in [0, 1)")
    check(o.eps > 0, ("optim", "eps"), "must be positive")
    check(o.weight_decay >= 0, ("optim", "weight_decay"), "must be at least 0")
    check(0 <= o.min_lr_ratio <= 1, ("optim", "min_lr_ratio"), "must be in [0, 1]")
    check(o.grad_clip >= 0, ("optim", "grad_clip"), "must be at least 0 (0: no clipping)")
    if o.offload == "host":
        check(len(c.devices.drafter) == 1, ("optim", "offload"),
              f"host needs one drafter replica (devices.drafter lists {len(c.devices.drafter)}): each replica "
              "would hold its own host copy of the fp32 weights and AdamW states")


def _validate_devices(c: TrainerConfig, check: _Check) -> None:
    """devices: known devices, replicas that do not share a GPU, stages that agree with target_split."""
    for role in ("target", "drafter"):
        devices = getattr(c.devices, role)
        check(len(devices) >= 1, ("devices", role), "must list at least one device")
        for d in devices:
            check(d != [], ("devices", role), "has an empty list (a split replica needs at least one device)")
            for one in ([d] if isinstance(d, str) else d):
                check(one == "cpu" or one.startswith("cuda"), ("devices", role), f"has unknown device {one!r}")
    split = [r for r in c.devices.target if isinstance(r, list)]
    seen: dict[str, int] = {}
    for r, replica in enumerate(c.devices.target):
        for d in dict.fromkeys([replica] if isinstance(replica, str) else replica):
            check(not split or d == "cpu" or seen.setdefault(d, r) == r, ("devices", "target"),
                  f"puts {d} in two replicas (entries {seen.get(d)} and {r}); a GPU holds stages of one replica")
    counts = {len(r) if isinstance(r, list) else 1 for r in c.devices.target}
    check(len(counts) == 1, ("devices", "target"),
          f"mixes replicas of {sorted(counts)} stages; every replica needs the same number of stages")
    if c.devices.target_split is not None:
        sizes = c.devices.target_split
        check(bool(split), ("devices", "target_split"), "needs a split replica in devices.target (a list of devices)")
        check(all(n >= 1 for n in sizes), ("devices", "target_split"), "must list positive layer counts")
        for replica in split:
            check(len(replica) == len(sizes), ("devices", "target_split"),
                  f"lists {len(sizes)} stages, but the replica {replica} has {len(replica)}")
    if c.model.target.tiny is not None:
        stages = max((len(r) for r in split), default=1)
        check(stages <= c.model.target.tiny.layers, ("devices", "target"),
              f"splits a replica in {stages} stages, more than the target's {c.model.target.tiny.layers} layers")
    check(c.devices.memory_gib is None or c.devices.memory_gib > 0, ("devices", "memory_gib"), "must be positive")


def _validate_run(c: TrainerConfig, check: _Check) -> None:
    r = c.run
    check(r.checkpoint_every >= 0, ("run", "checkpoint_every"), "must be at least 0 (0: only on stop and done)")
    check(r.warmup_shapes >= 1, ("run", "warmup_shapes"), "must be at least 1")
    check(r.keep_checkpoints >= 1, ("run", "keep_checkpoints"), "must be at least 1")
    check(not r.keep_best or not c.eval.every
          or (r.checkpoint_every > 0 and c.eval.every % r.checkpoint_every == 0), ("run", "keep_best"),
          "needs eval.every to be a multiple of run.checkpoint_every (the best τ's checkpoint must exist)")
    check(0 < r.heartbeat_s <= 10, ("run", "heartbeat_s"), "must be in (0, 10]")
    check(r.log_every >= 1, ("run", "log_every"), "must be at least 1")
    check(len(set(r.trackers)) == len(r.trackers), ("run", "trackers"), "names a tracker twice")


def _validate_eval(c: TrainerConfig, check: _Check) -> None:
    e = c.eval
    check(e.every >= 0, ("eval", "every"), "must be at least 0 (0: only at the end)")
    check(e.samples >= 1, ("eval", "samples"), "must be at least 1")
    check(e.max_new_tokens >= 1, ("eval", "max_new_tokens"), "must be at least 1")
    check(e.batch >= 1, ("eval", "batch"), "must be at least 1")
    check(bool(e.temperatures), ("eval", "temperatures"), "must name at least one temperature (0: greedy)")
    check(len(set(e.temperatures)) == len(e.temperatures), ("eval", "temperatures"), "names a temperature twice")
    for i, t in enumerate(e.temperatures):
        check(0 <= t <= 100, ("eval", "temperatures"), f"[{i}] must be in [0, 100], got {t}")
    check(0 < e.top_p <= 1, ("eval", "top_p"), "must be in (0, 1] (1: off)")
    check(e.top_k >= 0, ("eval", "top_k"), "must be at least 0 (0: off)")
    check(0 <= e.seed < 2**32, ("eval", "seed"), "must be in 0..2**32-1")


def _validate_pipeline(c: TrainerConfig, check: _Check) -> None:
    check(c.pipeline.prefetch >= 1, ("pipeline", "prefetch"), "must be at least 1")
    check(c.pipeline.queue_depth >= 1, ("pipeline", "queue_depth"), "must be at least 1")


def _validate_distributed(c: TrainerConfig, check: _Check) -> None:
    check(c.distributed.timeout_s > 0, ("distributed", "timeout_s"), "must be positive")
    check(0 < c.distributed.peer_timeout_s <= 25, ("distributed", "peer_timeout_s"),
          "must be in (0, 25] (a lost host must stop the others within 30 s)")


SHAPE_FIELDS = ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")


def _validate_drafter_precision(c: TrainerConfig, check: _Check) -> None:
    """model.drafter.precision: fp8 matmuls need bf16 autocast and FP8 tensor cores on every drafter device."""
    if c.model.drafter.precision == "fp8":
        check(c.model.dtype == "bf16", ("model", "drafter", "precision"), "fp8 needs model.dtype bf16")
        for d in dict.fromkeys(c.devices.drafter):
            reason = _fp8_refusal(d)
            check(reason is None, ("model", "drafter", "precision"), f"fp8 is refused: {reason}")


def _not_a_draft_config(doc: object) -> str | None:
    """What makes a drafter_init's config.json unreadable as a draft's (None: readable): not a JSON
    object, or a size the drafter is built from missing or not a positive integer."""
    if not isinstance(doc, dict):
        return f"a JSON {type(doc).__name__}, not an object"
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads"):
        value = doc.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            return f"{key} is {value!r}" if key in doc else f"no {key}"
    return None


def _validate_drafter(c: TrainerConfig, check: _Check) -> None:
    """model.drafter, and model.drafter_init's own architecture (which decides: the keys set here must
    agree). Fills model.drafter / drafter_layers from the draft so `plan` and doctor size it."""
    from trainer.run.layout import LayoutError, checked_layout, default_causal, resolve_published

    d, m, raw = c.model.drafter, c.model, check.raw
    model_raw = raw.get("model", {}) if isinstance(raw.get("model"), dict) else {}
    layers_given = "drafter_layers" in model_raw
    drafter_raw = model_raw.get("drafter", {}) if isinstance(model_raw.get("drafter"), dict) else {}
    if m.drafter_init is not None:
        path = Path(m.drafter_init).expanduser() / "config.json"
        if path.is_file():
            import json

            try:
                published = json.loads(path.read_text())
            except (ValueError, OSError) as e:
                check(False, ("model", "drafter_init"), f"{path}: not a draft's config.json ({e})")
                return
            foreign = _not_a_draft_config(published)
            try:  # first: it names another model's architecture, where there is one
                layout = resolve_published(published, str(path))
            except ValueError as e:
                message = str(e) if isinstance(e, LayoutError) else f"{path}: {e}"
                check(False, ("model", "drafter_init"), f"cannot be trained as served: {message}")
                return
            except (KeyError, TypeError, AttributeError):
                foreign = foreign or "a field of another type"
            if foreign:  # another model's directory, or no model's: one line, not a KeyError's traceback
                check(False, ("model", "drafter_init"), f"{path}: not a DFlash draft's config.json ({foreign})")
                return
            n = published["num_hidden_layers"]
            check(isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= INT_LIMIT, ("model", "drafter_init"),
                  f"{path}: num_hidden_layers is {n!r}: a drafter needs at least 1 layer")
            theirs: dict[str, Any] = {
                "drafter_layers": n, **layout.spelled(n),
                "num_attention_heads": published.get("num_attention_heads"),
                "num_key_value_heads": published.get("num_key_value_heads", published.get("num_attention_heads")),
                "head_dim": published.get("head_dim") or published["hidden_size"] // published["num_attention_heads"],
                "intermediate_size": published.get("intermediate_size")}
            differ = disagreements(d, theirs, n)
            if layers_given and m.drafter_layers != n:
                differ.append(f"model.drafter_layers {m.drafter_layers!r} (the draft: {n!r})")
            check(not differ, ("model", "drafter_init"),
                  f"{m.drafter_init}: the draft's own config decides its architecture, and this config differs: "
                  + "; ".join(differ))
            _validate_kind(c, drafter_raw, published, check)
            m.drafter_layers = n
            for k in ("layer_types", "sliding_window", "causal", "attention_sink", *SHAPE_FIELDS):
                setattr(d, k, theirs[k] if k != "layer_types" or layout.layer_types else None)
            if layout.layer_types is None:
                d.sliding_window = None
            return
    if d.layer_types is not None and not layers_given:
        m.drafter_layers = len(d.layer_types)
    # checked again after derivation: `layer_types: []` set drafter_layers to 0 past _validate_model
    check(m.drafter_layers >= 1, ("model", "drafter", "layer_types") if d.layer_types is not None
          else ("model", "drafter_layers"), f"gives the drafter {m.drafter_layers} layers: it needs at least 1")
    sliding = "sliding_attention" in (d.layer_types or [])
    check(d.sliding_window is None or sliding, ("model", "drafter", "sliding_window"),
          "is set, but no layer of model.drafter.layer_types is sliding_attention")
    try:  # the layout's rules are trainer.run.layout's: here they name the key at fault, with its line
        checked_layout(drafter_layout(m), m.drafter_layers)
    except LayoutError as e:  # named at its key, or at layer_types where that asks for the missing key
        key = e.field if e.field is not None and e.field in drafter_raw else "layer_types"
        check(False, ("model", "drafter", key), f"is refused: {e}")
    for key in SHAPE_FIELDS:
        value = getattr(d, key)
        check(value is None or value >= 1, ("model", "drafter", key), "must be positive")
    check(d.head_dim is None or d.head_dim % 2 == 0, ("model", "drafter", "head_dim"), "must be even (RoPE)")
    if d.num_attention_heads is not None and d.num_key_value_heads is not None:
        check(d.num_attention_heads % d.num_key_value_heads == 0, ("model", "drafter", "num_key_value_heads"),
              f"must divide num_attention_heads ({d.num_attention_heads})")
    if d.causal is None and sliding:
        d.causal = default_causal(d.layer_types, m.drafter_layers)
    _validate_kind(c, drafter_raw, _checkpoint_generation(m.drafter_init), check)


def _checkpoint_generation(init: str | None) -> dict | None:
    """model.drafter_init naming a trainer checkpoint (drafter_config.json, no config.json) or a run
    directory (its latest): its generation as the config.json fields `_validate_kind` reads, else None."""
    if init is None:
        return None
    from trainer.run.layout import run_checkpoint

    init = str(run_checkpoint(init) or init)  # a run directory: its latest checkpoint
    saved_path = Path(init).expanduser() / "drafter_config.json"
    if (Path(init).expanduser() / "config.json").is_file() or not saved_path.is_file():
        return None
    import json

    from trainer.run.layout import DFLASH2_ARCHITECTURE, DFLASH2_FIELDS, DFLASH_ARCHITECTURE

    try:
        saved = json.loads(saved_path.read_text())
    except (OSError, ValueError):
        return None  # the build reads it again and says what is wrong
    if not isinstance(saved, dict) or saved.get("kind", "dflash") != "dflash2":
        return {"architectures": [DFLASH_ARCHITECTURE]}
    return {"architectures": [DFLASH2_ARCHITECTURE], "hidden_size": saved.get("hidden_size"),
            "vocab_size": saved.get("vocab_size"), "dflash_config": {k: saved[k] for k in DFLASH2_FIELDS if k in saved}}


def _target_dims(c: TrainerConfig) -> tuple[int | None, int | None]:
    """(hidden size, vocabulary) of the target where the config alone tells (a tiny target: its
    hidden size; the 8B shape; a model directory's config.json), else None each."""
    t = c.model.target
    if t.tiny is not None:
        return t.tiny.hidden, None
    if t.random_8b_shape:
        return 4096, 151936
    if t.path is not None:
        import json

        try:
            config = json.loads((Path(t.path).expanduser() / "config.json").read_text())
        except (OSError, ValueError):
            return None, None
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        hidden, vocab = text.get("hidden_size"), text.get("vocab_size")
        return (hidden if isinstance(hidden, int) else None), (vocab if isinstance(vocab, int) else None)
    return None, None


def _validate_kind(c: TrainerConfig, drafter_raw: dict, published: dict | None, check: _Check) -> None:
    """model.drafter.kind and DFlash2's fields; `published`: model.drafter_init's config.json. A
    DFlash2 draft's own fields decide (what is set here must agree; kind dflash refuses it: the
    run would train something other than the draft); a DFlash draft under kind dflash2 is a warm
    start (its weights, the new parts initialised). Fills the unset fields with their defaults."""
    from trainer.run.layout import DFLASH2, DFLASH2_DEFAULTS, generation

    d = c.model.drafter
    theirs = generation(published) if published is not None else {"kind": "dflash"}
    if theirs["kind"] == DFLASH2:
        check("kind" not in drafter_raw or d.kind == DFLASH2, ("model", "drafter", "kind"),
              f"is {d.kind!r}, but model.drafter_init {c.model.drafter_init} is a DFlash2 draft (set kind: dflash2, "
              "or leave it unset)")
        d.kind = "dflash2"
        for key in DFLASH2_DEFAULTS:
            mine = getattr(d, key)
            check(mine is None or mine == theirs[key], ("model", "drafter", key),
                  f"is {mine}, but model.drafter_init's draft has {theirs[key]} (the draft's own config decides)")
            setattr(d, key, theirs[key])
    if d.kind != DFLASH2:
        for key in (*DFLASH2_DEFAULTS, "selector_loss_weight"):
            check(getattr(d, key) is None, ("model", "drafter", key), "is a dflash2 field: it needs model.drafter.kind: dflash2")
        return
    for key, default in DFLASH2_DEFAULTS.items():
        value = getattr(d, key)
        check(value is None or value >= 1, ("model", "drafter", key), "must be at least 1")
        if value is None:
            setattr(d, key, default)
    if d.selector_loss_weight is None:
        d.selector_loss_weight = 1.0
    check(d.selector_loss_weight > 0, ("model", "drafter", "selector_loss_weight"),
          "must be positive (the selector has no other loss)")
    hidden, vocab = _target_dims(c)
    group, top_k = int(d.conv_group_size or 1), int(d.selector_top_k or 1)  # set just above
    check(hidden is None or hidden % group == 0, ("model", "drafter", "conv_group_size"),
          f"{group} does not divide the target's hidden size {hidden}")
    check(vocab is None or top_k <= vocab, ("model", "drafter", "selector_top_k"),
          f"{top_k} exceeds the target's vocabulary of {vocab}")


def disagreements(d: DrafterShapeConfig, theirs: dict[str, Any], layers: int) -> list[str]:
    """What the model.drafter keys set here say unlike a draft's own architecture (`theirs`: its
    Layout.spelled and SHAPE_FIELDS), one phrase each; the draft decides (model.drafter_init)."""
    ours: dict[str, Any] = {k: getattr(d, k) for k in ("layer_types", "sliding_window", "attention_sink", *SHAPE_FIELDS)
                            if getattr(d, k) is not None}
    if d.causal is not None:
        ours["causal"] = [d.causal] * layers if isinstance(d.causal, bool) else d.causal
    return [f"model.drafter.{k} {v!r} (the draft: {theirs[k]!r})" for k, v in ours.items() if v != theirs[k]]


def drafter_layout(c: ModelConfig) -> Layout:
    """model.drafter's layout keys as the one Layout value (`causal: true` spelled per layer); checked
    by trainer.run.layout.checked_layout where it is held (DrafterConfig) and at load (_validate_drafter)."""
    d = c.drafter
    types: list[str] | None = None if d.layer_types is None else list(d.layer_types)
    causal = [d.causal] * c.drafter_layers if isinstance(d.causal, bool) else d.causal
    return Layout(types, d.sliding_window, causal, bool(d.attention_sink))


def drafter_own(c: ModelConfig) -> dict[str, Any]:
    """model.drafter as DrafterConfig fields (trainer.models.drafter.DrafterConfig.from_target's `own`)."""
    d = c.drafter
    return {"layout": drafter_layout(c), **{k: getattr(d, k) for k in SHAPE_FIELDS}, **generation_own(c)}


GENERATION_FIELDS = ("kind", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def generation_own(c: ModelConfig) -> dict[str, Any]:
    """model.drafter's generation as DrafterConfig fields (the DFlash2 ones only under kind dflash2)."""
    d = c.drafter
    if d.kind != "dflash2":
        return {"kind": "dflash"}
    return {k: getattr(d, k) for k in GENERATION_FIELDS}


def config_to_dict(config: Any) -> dict:
    return dataclasses.asdict(config)


def dump_config(config: TrainerConfig) -> str:
    from trainer.run.yamlsafe import dump

    return dump(config_to_dict(config))


def data_paths(paths: str | list[str] | None) -> list[str]:
    """data.train_path / eval_path as a list of files."""
    if paths is None:
        return []
    return [paths] if isinstance(paths, str) else list(paths)


def template_kwargs(data: DataConfig) -> dict:
    """Extra chat-template variables from the data config (only those the user set)."""
    return {} if data.enable_thinking is None else {"enable_thinking": data.enable_thinking}


def anchors_for_row(num_anchors: int, max_length: int, pack_length: int, block_size: int) -> int:
    """The anchor density of `num_anchors` per `max_length` tokens, for a row of pack_length,
    rounded up so that a row's slots fill whole 128-query tiles."""
    step = 128 // math.gcd(128, block_size)
    want = -(-num_anchors * pack_length // max_length)
    return -(-want // step) * step


def row_anchors(data_cfg: DataConfig, block_size: int) -> int:
    """Draft blocks per micro-batch row: data.num_anchors unpacked; packed, data.anchors_per_row or
    the density of num_anchors per max_length tokens (`anchors_for_row`). Here, on the ground floor,
    because the packed data, the pipelines and the memory plan all count them."""
    if not data_cfg.pack_length:
        return data_cfg.num_anchors
    return data_cfg.anchors_per_row or anchors_for_row(data_cfg.num_anchors, data_cfg.max_length,
                                                       data_cfg.pack_length, block_size)


def default_gamma(block_size: int) -> float:
    """Loss-decay constant of the DFlash recipe: 7 for block 16, 5 for 10, 4 for 8."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, block_size / 16 * 7.0))


def target_replicas(devices: DevicesConfig) -> list[list[str]]:
    """devices.target as one list of stage devices per replica (a plain device is one stage)."""
    return [[r] if isinstance(r, str) else list(r) for r in devices.target]


def missing_devices(devices: DevicesConfig, gpus: int) -> str | None:
    """One line naming the first CUDA device the config lists that a host with `gpus` GPUs lacks,
    else None (training refuses it before loading anything; `python -m trainer plan` and the
    doctor judge the plan by it)."""
    have = "no GPU" if gpus == 0 else f"{gpus} GPU{'s' if gpus > 1 else ''} (cuda:0..cuda:{gpus - 1})"
    for role, listed in (("target", [d for r in target_replicas(devices) for d in r]), ("drafter", devices.drafter)):
        for d in listed:
            if not d.startswith("cuda"):
                continue
            index = d.split(":", 1)[1] if ":" in d else "0"
            if not index.isdigit() or int(index) >= gpus:
                return f"devices.{role} names {d}, but this host has {have}"
    return None
