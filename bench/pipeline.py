"""Threaded pipeline vs each stage alone (vs the naive loop), bucketed vs packed, on one run's data.

    PYTHONPATH=. python bench/pipeline.py --target cuda:0 --drafter cuda:0          # 1 GPU shared
    PYTHONPATH=. python bench/pipeline.py --target cuda:0 --drafter cuda:1          # 2 GPUs
    PYTHONPATH=. python bench/pipeline.py --mix lognormal --modes bucketed packed   # chat-like lengths
    PYTHONPATH=. python bench/pipeline.py --tiny --target cpu --drafter cpu --steps 4   # CPU smoke
    PYTHONPATH=. python bench/pipeline.py --modes packed --one-rank    # + the same as rank 0 of a 1-host group
    PYTHONPATH=. python bench/pipeline.py --mix lognormal --min-len 64 --modes packed packed+ct all --cli-steps 24
                                                                       # issue #29: one run, CLI included

Issue #35, long rows: each --pack-length once per --checkpoint-drafter choice (model.checkpoint_drafter
off/on/auto), steps sized by --tokens-per-mode so a 64K row takes no longer than an 8K one; a
measurement the memory plan refuses is skipped and named (64K not checkpointed on one H200), so is an
auto that resolves to what off or on measured already; each row's tokens/s over the shortest rows'
(x_shortest), its peak and the plan's over it:

    PYTHONPATH=. python bench/pipeline.py --modes all --no-save --pack-length 65536 8192 32768 16384 \
        --checkpoint-drafter off on auto --tokens-per-mode 131072 --stage-micro 2 --budget-s 480 --out $OUT/long.json

Issue #29's modes: `packed` (the drafter's previous per-op path, eager target), `packed+ct` (with
model.compile_target), `all` (compiled target, the drafter's fused layer regions and bf16 weight
copies made once per step, and a periodic checkpoint halfway through the run, written in the
background: its `stall_s`, GPU copy time and write time are printed). --cli-steps N then runs
`python -m trainer` on trainer/configs/gpu-8b-shape.yaml in a fresh process on the same
conversation lengths (synthetic words, one token each), N steps with a checkpoint halfway, and
prints its steady tokens/s beside the bench's `all`.

--variants compares target arrangements on each mode (#24): `whole` (the default: only the layers up to
the last tapped one run), `untruncated` (the previous default: the whole model with every hidden
state kept, the final norm included), `splitN` (the target in N layer stages over the --target
devices, cycled: all N on one GPU measures the stage hand-offs' cost). Each variant's key is
`<mode>:<variant>` (plain `<mode>` for whole).

--one-rank runs each mode a second time (key `<mode>/rank`) as the one rank of a host group
(trainer.distributed.multihost on a world-1 torch.distributed group: the cross-host all-reduce of
the gradient buffer, the per-step agreement, the host shard of the data), to show what being a
rank costs on one host.

--targets compares target shapes in one run (keys `<shape>/<mode>` when more than one): `8b` the
Qwen3-8B shape, `30b-a3b` the Qwen3-30B-A3B MoE shape (48 layers, 128 experts, 8 active; 61 GB in
bf16, one H200), each with its own drafter; MFU counts the active experts' FLOPs (trainer.pipeline.flops).

    PYTHONPATH=. python bench/pipeline.py --targets 8b 30b-a3b --modes packed --mix lognormal

--drafter-layouts compares drafter layouts on each mode (issue 41; keys `<mode>@<layout>`): `full`
(the 2025 layout), `swa4+1` (4 sliding-window causal layers then 1 full, --sliding-window tokens):
at long packed rows the sliding layers' flex block mask lists only the tiles of their window. A
`/dflash2` suffix makes it a DFlash2 drafter (issue 37: `full/dflash2`, `swa4+1/dflash2`).

    PYTHONPATH=. python bench/pipeline.py --modes all --pack-length 32768 --drafter-layouts full swa4+1 \
        --sliding-window 2048 --mix lognormal --min-len 64 --max-len 32768 --median 2000

By default a Qwen3-8B-shaped random bf16 target and a 5-layer drafter (512 anchors x 16 slots per 3072 tokens),
sequences of --min-len..--max-len tokens (--mix uniform) or log-normal around --median clipped to
that range (--mix lognormal, fixed seed). Every mode in --modes runs in this one process on the same
conversations and target: `bucketed` pads length buckets to warmed shapes (the previous default),
`packed` packs whole conversations into rows of --pack-length tokens (trainer.data.packing), one shape.
Prints one JSON line per measurement and a summary table; --out also writes them to a file.

Issue #51 item 3: --offload host (optim.offload: the drafter's fp32 weights and AdamW states in host
memory, the update on the host's CPU) lets --drafter-layers auto fit a 5-layer drafter beside the
70B-shaped FP8 target on one H200; each measurement reports the host's update per step and the
process's peak resident memory beside the plan's host entry:

    PYTHONPATH=. python bench/pipeline.py --targets 70b --precisions fp8 --offload host --modes packed+ct \
        --mix lognormal --min-len 64 --pack-length 8192 --micro 2 --steps 9 --log-every 3 --stage-micro 2
"""
from __future__ import annotations

import os

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402

from trainer.data.batches import Batch, PreloadedDataset  # noqa: E402
from trainer.data.packing import PackedDataset  # noqa: E402
from trainer.models.masks import resolve_backend  # noqa: E402
from trainer.models.objective import objective_of  # noqa: E402
from trainer.models.target import (  # noqa: E402
    LLAMA_3_3_70B_DIMS,
    QWEN3_30B_A3B_DIMS,
    FrozenHead,
    default_target_layer_ids,
    freeze,
    random_8b_shape_target,
    random_target,
    random_truncated_target,
    tiny_target,
)
from trainer.pipeline.compile_safety import compiled_frames  # noqa: E402
from trainer.pipeline.flops import micro_batch_flops, peak_tflops  # noqa: E402
from trainer.pipeline.threaded import ThreadedPipeline  # noqa: E402
from trainer.run.config import TinyTargetConfig, parse_config  # noqa: E402
from trainer.run.contract import read_events, read_status  # noqa: E402
from trainer.train.components import Components, build_drafter  # noqa: E402
from trainer.train.loop import ReferencePipeline, Trainer  # noqa: E402
from trainer.train.optim import build_optimizer, build_scheduler  # noqa: E402

CONFIG = """
model:
  target: {%(target)s}
  drafter_layers: %(layers)d
  block_size: 16
  num_target_layers: 5
  dtype: %(dtype)s
  mask_token_id: %(mask)d
  compile_target: %(ct)s
  fuse_drafter: %(fuse)s
  checkpoint_drafter: %(ckpt_drafter)s
  drafter: {%(drafter)s}
data:
  synthetic: {n_train: 1}
  max_length: %(max_len)d
  num_anchors: %(anchors)d
  token_budget: %(budget)d
  bucket_edges: [%(edges)s]
  pad_multiple: 64
  pack_length: %(pack_length)d
  pack_rows: %(pack_rows)d
optim: {lr: 0.0001, total_steps: %(steps)d, micro_batches: %(micro)d, warmup_ratio: 0.0, offload: %(offload)s}
devices: {target: [%(targets)s], drafter: [%(drafters)s], memory_gib: %(memory_gib)s}
run: {log_every: %(log_every)d, warmup_shapes: 4, heartbeat_s: 10, checkpoint_every: %(ckpt)d, keep_checkpoints: 1}
pipeline: {kind: threaded, pad_to_warm_shapes: always}
"""


MODES = ["bucketed", "packed", "packed+ct", "all"]
PRECISIONS = ["bf16", "fp8", "fp8fast"]


class SyncCounter:
    """Counts torch's 'called a synchronizing CUDA operation' warnings from every thread."""

    def __init__(self):
        self.count = 0
        self.where: dict[str, int] = {}
        self._lock = threading.Lock()

    def __enter__(self):
        self._old = warnings.showwarning
        self._filters = warnings.filters[:]
        warnings.simplefilter("always")

        def show(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" in str(message):
                with self._lock:
                    self.count += 1
                    key = f"{threading.current_thread().name}:{filename}:{lineno}"
                    self.where[key] = self.where.get(key, 0) + 1
            else:
                self._old(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = self._old
        warnings.filters[:] = self._filters


def sample_lengths(n, args, seed=0):
    """Conversation lengths: uniform in min..max, or log-normal (median, sigma) clipped to min..max."""
    rng = random.Random(seed)
    if args.mix == "uniform":
        return [rng.randint(args.min_len, args.max_len) for _ in range(n)]
    mu = math.log(args.median)
    return [int(min(args.max_len, max(args.min_len, rng.lognormvariate(mu, args.sigma)))) for _ in range(n)]


def random_samples(lengths, vocab, seed=0):
    """Random ids; the first quarter of each conversation is the prompt (no loss)."""
    rng = random.Random(seed + 1)
    return [([rng.randrange(10, vocab) for _ in range(n)], [0] * (n // 4) + [1] * (n - n // 4)) for n in lengths]


def one_rank_env():
    """The environment of a world-1 host group started here (no torchrun needed for one rank)."""
    import socket

    from trainer.distributed.group import GroupEnv

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", TORCHELASTIC_RUN_ID=f"bench-{port}")
    return GroupEnv.from_environ()


@contextlib.contextmanager
def untruncated():
    """Features the previous way: the whole base model with output_hidden_states, final norm included."""
    import trainer.pipeline.features as features
    import trainer.pipeline.workers as workers
    from trainer.models.frozen_target import as_target
    from trainer.models.target import base_model, packed_mask_mapping

    def full(target, x, lo, hi, taps, out, doc_start=None, mapping=None, pending=None, top=None):
        model = base_model(as_target(target).module)
        kwargs = {}
        if doc_start is not None:
            mapping = packed_mask_mapping(model, doc_start)
            kwargs["position_ids"] = torch.arange(doc_start.shape[1], device=doc_start.device) - doc_start
        mapping = mapping if mapping is not None else packed_mask_mapping(model, None)
        hidden = model(input_ids=x, attention_mask=mapping, output_hidden_states=True, use_cache=False,
                       **kwargs).hidden_states
        order = sorted((k, i) for i, ks in taps.items() for k in ks)
        return torch.cat([hidden[i + 1] for _, i in order], dim=-1, out=out)

    def full_features(target, input_ids, attention_mask, layer_ids, doc_start=None, out=None, top=None):
        from trainer.models.stages import tap_columns

        return full(target, input_ids, 0, 0, tap_columns(layer_ids), out, doc_start,
                    attention_mask if isinstance(attention_mask, dict) else None)

    saved = workers.stage_context_features, features.target_context_features
    workers.stage_context_features, features.target_context_features = full, full_features
    try:
        yield
    finally:
        workers.stage_context_features, features.target_context_features = saved


def variant_targets(args, variant):
    """devices.target for a variant: plain devices, or one replica of N stages over the --target devices."""
    if variant.startswith("split"):
        n = int(variant.removeprefix("split"))
        return "[" + ", ".join(args.target[i % len(args.target)] for i in range(n)) + "]"
    return ", ".join(args.target)


def drafter_layout(name, layers, window):
    """--drafter-layouts: `full` (every layer full attention, the 2025 layout: `layers` of them), `swa`
    (every layer sliding, causal), `swaN+M` (N sliding causal layers, then M full ones: z-lab's 2026
    drafts are swa4+1), each with a `/dflash2` suffix for a DFlash2 drafter (model.drafter.kind
    dflash2, its published sizes) and then a `/fp8` suffix for FP8 matmuls while training
    (model.drafter.precision fp8) -> (drafter layers, model.drafter as YAML flow)."""
    if name.endswith("/fp8"):
        layers, flow = drafter_layout(name.removesuffix("/fp8"), layers, window)
        return layers, ", ".join(part for part in (flow, "precision: fp8") if part)
    if name.endswith("/dflash2"):
        layers, flow = drafter_layout(name.removesuffix("/dflash2"), layers, window)
        return layers, ", ".join(part for part in (flow, "kind: dflash2") if part)
    if name == "full":
        return layers, ""
    if name == "swa":
        sliding, full = layers, 0
    else:
        try:
            sliding, full = (int(n) for n in name.removeprefix("swa").split("+"))
        except ValueError:
            raise SystemExit(f"--drafter-layouts: {name!r} is not full, swa or swaN+M") from None
    types = ["sliding_attention"] * sliding + ["full_attention"] * full
    return len(types), f"layer_types: [{', '.join(types)}], sliding_window: {window}"


CHECKPOINT_DRAFTER = {"auto": "auto", "on": "true", "off": "false"}  # --checkpoint-drafter -> model.checkpoint_drafter


def bench_config(args, mode, target, pack_length=0, variant="whole", precision="bf16", drafter_layers=None,
                 ckpt_drafter="auto"):
    """The trainer config of one measurement. precision: the config's model.target.precision (the memory
    plan counts FP8 weights at 1 byte; the target itself is quantized by main). On the CPU (--tiny) the
    config stays bf16: fp8 is refused there at config load, and the bench runs the quantized tiny target
    to test its own code. ckpt_drafter: --checkpoint-drafter's choice (model.checkpoint_drafter)."""
    drafter_layers = drafter_layers or (2 if args.tiny else 5)
    mode = mode.removesuffix("/rank")
    tiny = args.tiny
    edges = args.bucket_edges or [args.max_len]
    layers, drafter_yaml = drafter_layout(getattr(args, "layout", "full"), drafter_layers, args.sliding_window)
    if tiny and "kind: dflash2" in drafter_yaml:  # the tiny target's vocabulary is a few tokens
        drafter_yaml += ", selector_top_k: 4, selector_rank: 8"
    return parse_config(CONFIG % dict(
        target="tiny: {layers: 6, hidden: 64, heads: 4, kv_heads: 2, head_dim: 16, intermediate: 128}" if tiny
        else "random_8b_shape: true" + (", precision: fp8" if precision != "bf16" else ""),
        layers=layers, drafter=drafter_yaml, dtype="fp32" if tiny else "bf16", mask=mask_id(args, target.config),
        max_len=args.max_len, anchors=args.anchors, steps=args.steps, micro=args.micro,
        budget=max(args.token_budget or args.max_len, args.max_len), edges=", ".join(map(str, edges)),
        pack_length=pack_length if mode != "bucketed" else 0, pack_rows=args.pack_rows,
        ct="true" if mode in ("packed+ct", "all") else "false", fuse="true" if mode == "all" else "false",
        ckpt=max(args.steps // 2, 1) if mode == "all" and not args.no_save else 0,
        ckpt_drafter=CHECKPOINT_DRAFTER[ckpt_drafter], memory_gib="null" if args.memory_gib is None else args.memory_gib,
        targets=variant_targets(args, variant), drafters=", ".join(args.drafter), log_every=args.log_every,
        offload=args.offload))


def build(args, run_dir, mode, target, samples, pack_length=0, variant="whole", precision="bf16", drafter_layers=None,
          ckpt_drafter="auto"):
    rank = mode.endswith("/rank")
    mode = mode.removesuffix("/rank")
    edges = args.bucket_edges or [args.max_len]
    cfg = bench_config(args, mode, target, pack_length, variant, precision, drafter_layers, ckpt_drafter)
    ddev = args.drafter[0]
    drafter = build_drafter(cfg, target, cfg.model.mask_token_id, ddev)
    from trainer.models.target_loading import place, stage_plan
    from trainer.run.config import target_replicas

    placed = place(target, stage_plan(target, drafter.config.target_layer_ids, target_replicas(cfg.devices)[0]))
    opt = build_optimizer(drafter.parameters(), cfg.optim,
                          compute_dtype=torch.bfloat16 if cfg.model.dtype == "bf16" else torch.float32)
    data = PreloadedDataset(samples, edges, cfg.data.token_budget, pad_id=0, seed=0, pad_multiple=64)
    if mode != "bucketed":
        data = PackedDataset.from_dataset(data, pack_length, args.pack_rows)
    tr = Trainer(cfg, run_dir, ThreadedPipeline, one_rank_env() if rank else None)
    tr.hosts.join()
    c = Components(tokenizer=None, target=placed, head=FrozenHead.from_target(placed, ddev), drafter=drafter,
                   optimizer=opt, scheduler=build_scheduler(opt, cfg.optim), train_data=data,
                   eval_conversations=[], eval_data=data, gamma=7.0, objective=objective_of(cfg.model), target_device=args.target[0],
                   drafter_device=ddev,
                   backend=resolve_backend(cfg.model.attention, ddev, needs_grad=True))
    return ThreadedPipeline(tr, c)


TINY_DIMS = dict(hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=128, vocab_size=512)


def target_run_layers(config, layer_ids=None):
    """Layers training runs: up to the last of the default 5 taps (80 layers: 1, 20, 39, 58, 77 -> 78)."""
    return max(layer_ids or default_target_layer_ids(config.num_hidden_layers, 5)) + 1


def build_target(args, shape="8b", precision="bf16"):
    """The random target of a shape. 70b: Llama-3.3-70B's shape truncated at its last tap (layers 0..77 of
    80 built, the rest left on the meta device), made one layer at a time and quantized as it is made at
    precision fp8 (~62 GiB of FP8 weights beside the bf16 embedding and head, 2 GiB each); in bf16 it
    would hold 133 GB of weights, more than an H200."""
    tdev = args.target[0]
    if shape == "70b":
        from transformers import LlamaConfig

        dims = dict(LLAMA_3_3_70B_DIMS, **(TINY_DIMS if args.tiny else {}))
        config = LlamaConfig(**dims)
        if precision != "bf16" and not args.tiny:
            from trainer.models.fp8 import check_device

            check_device(tdev)
        torch.manual_seed(0)
        from trainer.models.fp8 import converter_for

        dtype = torch.float32 if args.tiny else torch.bfloat16
        return freeze(random_truncated_target(config, tdev, target_run_layers(config),
                                              converter_for(precision, out_dtype=dtype), dtype))
    if shape == "30b-a3b":
        from transformers import Qwen3MoeConfig

        dims = dict(QWEN3_30B_A3B_DIMS)
        if args.tiny:  # the same architecture, tiny: 6 layers of 8 experts (2 active)
            dims.update(TINY_DIMS, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
        torch.manual_seed(0)
        return freeze(random_target(Qwen3MoeConfig(**dims), tdev, torch.float32 if args.tiny else torch.bfloat16))
    if args.tiny:
        return freeze(tiny_target(TinyTargetConfig(layers=6, hidden=64, heads=4, kv_heads=2, head_dim=16,
                                                   intermediate=128), 512, tdev))
    return freeze(random_8b_shape_target(tdev, torch.bfloat16))


def sync_all(devices):
    for d in devices:
        if torch.device(d).type == "cuda":
            torch.cuda.synchronize(d)


def stage_alone(tr, which, n_micro, peak, around=None):
    """Run one stage on already-built micro-batches (the run's own data), in one thread, as fast as it goes;
    the target compiled as in the run (model.compile_target). around: a context manager entered for the
    timed part only (a profiler).

    Returns real tokens/s and the MFU of real and of padded FLOPs (trainer.pipeline.flops)."""
    from trainer.models.target import compile_decoder_layers, uncompile_decoder_layers

    if tr.compiled_target:
        compile_decoder_layers(tr.c.target.module)
    try:
        return _stage_alone(tr, which, n_micro, peak, around or contextlib.nullcontext())
    finally:
        uncompile_decoder_layers(tr.c.target.module)


def _stage_alone(tr, which, n_micro, peak, around):
    from trainer.distributed.grad_sync import ReplicaAllReduce
    from trainer.models.masks import prepare_blocks
    from trainer.pipeline.device_stats import BusyMeter
    from trainer.pipeline.features import allocate_slots, pack_context_features
    from trainer.pipeline.prefetch import BatchPrefetcher
    from trainer.pipeline.workers import DrafterSettings, DrafterWorker, Features, WorkerLinks
    from trainer.run.stopping import StopSignal

    c, cfg = tr.c, tr.cfg
    gen = torch.Generator().manual_seed(1)
    pre = BatchPrefetcher(c.train_data.next_batch,
                          lambda b: prepare_blocks(b.input_ids, b.loss_mask, tr.anchors, 16, c.gamma,
                                                   c.drafter.config.mask_token_id, gen, getattr(b, "doc_start", None)),
                          lambda: {}, [], StopSignal(), n_micro, 1, 0, tr.warm.shape_for if tr.pad else None,
                          pin=torch.cuda.is_available())
    mbs = [pre.build(i) for i in range(n_micro)]
    tdev, ddev = torch.device(tr.target_devices[0]), torch.device(tr.drafter_devices[0])
    layer_ids = c.drafter.config.target_layer_ids
    width = len(layer_ids) * c.target.config.hidden_size
    numel = max(max(b * s for b, s in tr.warm.shapes()), max(m.shape[0] * m.shape[1] for m in mbs)) * width
    slot = allocate_slots(1, numel, c.target.dtype, tdev)[0]
    tokens = sum(m.tokens for m in mbs)
    counts = [micro_batch_flops(c.target.config, c.drafter.config, m.attention_mask, m.doc_start, m.blocks) for m in mbs]

    def doc_start(mb, device):
        return None if mb.doc_start is None else mb.doc_start.to(device, non_blocking=True)

    def result(seconds, stage):
        real = sum(x[f"{stage}_real"] for x in counts) / seconds
        padded = sum(x[f"{stage}_padded"] for x in counts) / seconds
        return {"tokens_per_s": round(tokens / seconds, 1),
                "mfu_real": round(real / (peak * 1e12), 4) if peak else None,
                "mfu_padded": round(padded / (peak * 1e12), 4) if peak else None,
                "ms_per_micro": round(1000 * seconds / len(mbs), 2)}

    if which == "target":
        sync_all([tdev])
        began = time.perf_counter()
        with around, torch.inference_mode():
            for mb in mbs:
                ids = mb.input_ids.to(tdev, non_blocking=True)
                pack_context_features(c.target, ids, None, layer_ids, slot.view(*ids.shape, width), doc_start(mb, tdev))
            sync_all([tdev])
        return result(time.perf_counter() - began, "target")
    with torch.inference_mode():  # every micro-batch's own features (a batch's rows and lengths are its own)
        feats = []
        for mb in mbs:
            ids = mb.input_ids.to(tdev)
            out = torch.empty(*ids.shape, width, dtype=slot.buffer.dtype, device=tdev)
            feats.append(pack_context_features(c.target, ids, None, layer_ids, out, doc_start(mb, tdev)).to(ddev))
    feats = [f.clone() for f in feats]  # normal tensors, outside inference mode

    class Owner:
        class free:
            @staticmethod
            def put(_):
                pass

    stop = StopSignal()
    settings = DrafterSettings(rank=0, replicas=1, device=ddev, backend=c.backend, loss_chunk=cfg.model.loss_chunk,
                               autocast_dtype=tr.autocast_dtype[ddev], max_norm=cfg.optim.grad_clip, first_step=0,
                               total_steps=10**9, micro_batches=1, log_every=10**9)
    stream = stage_stream(ddev)
    w = DrafterWorker(settings, tr.replicas[0], ReplicaAllReduce([tr.replicas[0].flat], [stream], stop), [],
                      WorkerLinks(stop=stop, busy=BusyMeter(ddev), guard=tr.guard), None, None, stream)
    ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
    with ctx:  # one untimed step first: it fills this stream's pool of the caching allocator (stage_stream)
        w.micro_step(Features(mbs[0], feats[0], None, slot, Owner))
        w.optimizer_step()
    sync_all([ddev])
    began = time.perf_counter()
    with around, ctx:
        for mb, f in zip(mbs, feats):
            w.micro_step(Features(mb, f, None, slot, Owner))
            w.optimizer_step()
        sync_all([ddev])
    return result(time.perf_counter() - began, "drafter")


_STAGE_STREAMS: dict = {}


def stage_stream(device):
    """The side stream every drafter stage alone runs on, one per device for the whole bench. The caching
    allocator keeps its cached blocks per stream: a new stream per call found none, and its first micro-batch's
    allocations released the other pools' blocks, a device sync per segment (98 ms in one H100 profile, inside
    the timed part: 'drafter alone' read up to 6 % slow, and differed by that much between rows)."""
    if device.type != "cuda":
        return None
    if device not in _STAGE_STREAMS:
        _STAGE_STREAMS[device] = torch.cuda.Stream(device)
    return _STAGE_STREAMS[device]


def profile_stages(tr, out_dir, mode, n_micro=2):
    """torch.profiler over the target forward and the drafter step: the top CUDA kernels by time,
    the region's wall time beside its summed kernel time (a gap means the GPU waited on the host),
    and a gzipped Chrome trace per stage when out_dir is given."""
    import gzip

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        return None
    tables = {}
    name = mode.replace("/", "-").replace("+", "_")
    for which in ("target", "drafter"):
        stage_alone(tr, which, 1, None)  # under the profiler's own state a compiled frame may recompile once
        prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        wall = stage_alone(tr, which, n_micro, None, prof)["ms_per_micro"] * n_micro / 1e3
        events = prof.key_averages()
        kernels_ms = sum(e.self_device_time_total for e in events  # the kernels, not the ops that launched them
                         if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)) / 1e3
        table = (f"wall {wall * 1e3:.1f} ms for {n_micro} micro-batches, kernels {kernels_ms:.1f} ms\n"
                 + events.table(sort_by="self_cuda_time_total", row_limit=45, max_name_column_width=90))
        tables[which] = table
        if out_dir:
            with open(os.path.join(out_dir, f"profile_{name}_{which}.txt"), "w") as f:
                f.write(table)
            trace = os.path.join(out_dir, f"trace_{name}_{which}.json")
            prof.export_chrome_trace(trace)
            with open(trace, "rb") as src, gzip.open(trace + ".gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.remove(trace)
    return tables


def naive(tr, steps):
    """The reference loop's step: target forward, drafter step, .item() logging, one thread."""
    data = tr.c.train_data
    reference = ReferencePipeline(tr.trainer, tr.c)
    tokens, next_batch = [0], data.next_batch

    def counting():  # padded to the warm shapes, as in the pipeline, so nothing recompiles
        batch = next_batch()
        tokens[0] += batch.tokens
        if getattr(batch, "doc_start", None) is not None:
            return batch  # packed: always the one warm shape
        rows, length = tr.warm.shape_for(batch)
        pad = (0, length - batch.input_ids.shape[1], 0, rows - batch.input_ids.shape[0])
        return Batch(*(torch.nn.functional.pad(t, pad) for t in (batch.input_ids, batch.attention_mask,
                                                                  batch.loss_mask)))

    data.next_batch = counting
    reference.train_step()  # first call allocates; not timed
    sync_all(tr.devices())
    tokens[0] = 0
    began = time.perf_counter()
    for _ in range(steps):
        reference.train_step()  # converts loss/acc/grad-norm to floats: host syncs every step
    sync_all(tr.devices())
    data.next_batch = next_batch
    return tokens[0] / (time.perf_counter() - began)


def plan_against_peak(cfg, devices, model_config=None):
    """The memory plan's bytes per device (trainer.models.memory_plan, from the config alone) beside the
    peak the run allocated there (the pipeline, then each stage alone). model_config: the target's
    config as a dict (a shape other than the 8B the config names)."""
    from trainer.models.memory_plan import build_plan

    plan = build_plan(cfg, model_config)
    out = {}
    for d in plan.devices:
        entry = {"plan_gb": round(d.total / 2**30, 2), "items_gb": {k: round(v / 2**30, 3) for k, v in d.items.items()}}
        if d.device == "host":  # --offload host: beside the whole process's peak resident memory (Linux: KiB)
            import resource

            entry["process_peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
        elif torch.device(d.device.split(":target")[0].split(":drafter")[0]).type == "cuda":
            peak = torch.cuda.max_memory_allocated(d.device) / 2**30
            entry["peak_gb"] = round(peak, 2)
            entry["plan_over_peak"] = round(d.total / 2**30 / max(peak, 1e-9), 3)
        out[d.device] = entry
    return out


def run_mode(args, mode, target, samples, results, pack_length=0, variant="whole", precision="bf16",
             drafter_layers=None, ckpt_drafter="auto"):
    """One mode end to end: warm-up, the threaded pipeline, each stage alone; returns its figures."""
    with untruncated() if variant == "untruncated" else contextlib.nullcontext():
        return _run_mode(args, mode, target, samples, results, pack_length, variant, precision, drafter_layers,
                         ckpt_drafter)


def _run_mode(args, mode, target, samples, results, pack_length=0, variant="whole", precision="bf16",
              drafter_layers=None, ckpt_drafter="auto"):
    run_dir = tempfile.mkdtemp(prefix=f"bench-pipeline-{mode.replace('/', '-')}-")
    out = {"precision": precision, "drafter_layers": drafter_layers or (2 if args.tiny else 5), "offload": args.offload}
    experts = getattr(target.config, "_experts_implementation", None) if getattr(target.config, "num_experts", 0) else None
    if experts:
        out["experts"] = experts
    began = time.time()
    # the threaded pipeline, replicas built
    tr = build(args, run_dir, mode, target, samples, pack_length, variant, precision, drafter_layers, ckpt_drafter)
    out["build_s"] = round(time.time() - began, 1)
    out["checkpoint_drafter"] = int(tr.replicas[0].drafter.checkpoint_layers)  # layers checkpointed
    out["steps_planned"] = args.steps
    devices = tr.devices()
    for d in devices:
        if torch.device(d).type == "cuda":
            torch.cuda.reset_peak_memory_stats(d)
    frames_before = compiled_frames()
    began = time.time()
    tr.warmup()
    out["warmup_s"] = round(time.time() - began, 1)
    out["warm_shapes"] = tr.warm.shapes()
    out["compiled_frames_in_warmup"] = compiled_frames() - frames_before
    if not mode.startswith("bucketed"):
        out["pack_length"], out["anchors_per_row"] = pack_length, tr.anchors
    frames_after_warmup = compiled_frames()
    with SyncCounter() as syncs:
        tr.trainer.state.step = 0
        t0 = time.time()
        reason = tr.train_steps()
        sync_all(devices)
        wall = time.time() - t0
    tr.guard.freeze()  # train_steps unfreezes at the end; the stage runs below must not compile either
    optimizer = tr.replicas[0].optimizer
    if getattr(optimizer, "steps", 0):  # --offload host: the host's update, copies included, per step
        out["host_update_s_per_step"] = round(optimizer.step_s / optimizer.steps, 3)
    events = read_events(run_dir)
    windows = [w for w in events if w["event"] == "step"]
    if mode.startswith("all"):  # the periodic checkpoint written while the pipeline ran
        out["checkpoints"] = [{k: e.get(k) for k in ("step", "stall_s", "copy_s", "seconds")} for e in events
                              if e["event"] in ("checkpoint", "checkpoint_failed")]
        shutil.rmtree(os.path.join(run_dir, "checkpoints"), ignore_errors=True)  # gigabytes at 8B shape
    out["window_tokens_per_s"] = [[w["step"], round(w["tokens_per_s"], 1)] for w in windows]
    steady = windows[1:-1] or windows[1:] or windows  # as the trainer's tokens_per_s_steady: not filling, not draining
    steps = tr.trainer.state.step
    blocks = sum(tr.step_flops.get(s, {}).get("blocks_real", 0) for s in range(steps))
    out["pipeline"] = {
        "stop_reason": reason, "wall_s": round(wall, 2), "steps": steps,
        "tokens_per_s_steady": round(windows[-1].get("tokens_per_s_steady", steady[0]["tokens_per_s"]), 1),
        "blocks_per_s_all": round(blocks / wall, 1),
        "pad_share": round(sum(w["pad_share"] for w in steady) / len(steady), 4),
        "busy_steady": [[g["busy"] for g in w["gpus"]] for w in steady],
        "mfu_steady": [w.get("mfu") for w in steady],
        "peak_mem_gb": [g["mem_gb"] for g in windows[-1]["gpus"]],
        "recompiles_after_warmup": windows[-1]["recompiles"] + compiled_frames() - frames_after_warmup,
        "host_syncs_total": syncs.count, "host_syncs_per_step": round(syncs.count / max(steps, 1), 3),
        "sync_sites": syncs.where, "loss": [round(w["loss"], 4) for w in windows]}
    peak = peak_tflops(results.get("gpu"))
    out["target_alone"] = stage_alone(tr, "target", args.stage_micro, peak)
    out["drafter_alone"] = stage_alone(tr, "drafter", args.stage_micro, peak)
    out["recompiles_after_stages"] = compiled_frames() - frames_after_warmup
    tr.guard.unfreeze()
    if args.profile and mode != "bucketed":
        tables = profile_stages(tr, args.out_dir, mode)
        if tables:
            for which, table in tables.items():
                print(f"--- profile {which} ({mode})\n" + "\n".join(table.splitlines()[:50]), flush=True)
    if args.naive_steps:
        tr.c.drafter, tr.c.optimizer = tr.replicas[0].drafter, tr.replicas[0].optimizer
        out["naive_tokens_per_s"] = round(naive(tr, args.naive_steps), 1)
    t, d = out["target_alone"]["tokens_per_s"], out["drafter_alone"]["tokens_per_s"]
    shared = set(args.target) & set(args.drafter)
    bound = 1 / (1 / t + 1 / d) if shared else min(t, d)
    out["pipeline_over_bound"] = round(out["pipeline"]["tokens_per_s_steady"] / bound, 3)
    out["bound"] = "shared device: 1/(1/target+1/drafter)" if shared else "slowest stage"
    out["peak_mem_gb_all"] = [round(torch.cuda.max_memory_allocated(dv) / 2**30, 1) for dv in devices
                              if torch.device(dv).type == "cuda"]
    out["memory_plan"] = plan_against_peak(tr.cfg, devices, getattr(args, "model_config", None))
    tr.trainer.checkpointer.close()  # its pinned staging goes back before the next mode
    for dv in devices:  # free this mode's drafter, optimizer and features before the next mode
        if torch.device(dv).type == "cuda":
            torch.cuda.synchronize(dv)
    if mode.endswith("/rank"):
        import torch.distributed as dist

        out["pipeline"]["distributed"] = tr.trainer.hosts.group.describe()
        tr.trainer.hosts.group.close()
        dist.destroy_process_group()
    del tr
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def long_rows(summary):
    """#35's figure: each packed measurement's tokens/s over the shortest rows' of its mode and target
    (x_shortest; the shortest with the fewest drafter layers checkpointed), when the run measured
    several row lengths."""
    lengths = {v["pack_length"] for v in summary.values() if v.get("pack_length")}
    if len(lengths) < 2:
        return
    for key, v in summary.items():
        if not v.get("pack_length"):
            continue
        group = key.split("_")[0]
        peers = [(w["pack_length"], w["checkpoint_drafter"], w["tokens_per_s"]) for k, w in summary.items()
                 if k.split("_")[0] == group and w.get("pack_length")]
        shortest = min(peers)  # the shortest rows, with the fewest layers checkpointed
        v["shortest"], v["x_shortest"] = shortest[0], round(v["tokens_per_s"] / max(shortest[2], 1e-9), 3)


def per_length_args(args, pack_length):
    """--tokens-per-mode: the steps (and log interval: 3 windows at least, for a steady figure between
    the first and the last) of a measurement of rows of pack_length; else args as given."""
    if not args.tokens_per_mode or not pack_length:
        return args
    per_step = pack_length * args.pack_rows * args.micro
    steps = max(3, -(-args.tokens_per_mode // per_step))
    log_every = max(1, steps // 4)
    steps = max(steps, 3 * log_every)
    return argparse.Namespace(**{**vars(args), "steps": steps, "log_every": log_every})


def cli_config(args, train_path, run_steps):
    """trainer/configs/gpu-8b-shape.yaml on the bench's conversations (--tiny: a tiny CPU version)."""
    import yaml

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "trainer", "configs", "gpu-8b-shape.yaml")) as f:
        cfg = yaml.safe_load(f)
    data = cfg["data"]
    data.pop("synthetic")
    data.update(train_path=train_path, max_length=args.max_len, pack_length=args.pack_length[0],
                pack_rows=args.pack_rows, num_anchors=args.anchors)
    cfg["optim"].update(total_steps=run_steps, micro_batches=args.micro)
    cfg["run"].update(checkpoint_every=max(run_steps // 2, 1), keep_checkpoints=1, log_every=args.log_every)
    cfg["eval"] = {"samples": 1, "max_new_tokens": 8}
    cfg["devices"] = {"target": args.target, "drafter": args.drafter}
    if args.cli_precision != "bf16":
        cfg["model"]["target"]["precision"] = "fp8"
    if args.cli_precision == "fp8fast":
        cfg["model"]["target"]["fp8_fast_accum"] = True
    layers, flow = drafter_layout(args.cli_layout, cfg["model"]["drafter_layers"], args.sliding_window)
    cfg["model"]["drafter_layers"] = layers
    if flow:
        cfg["model"]["drafter"] = yaml.safe_load("{" + flow + "}")
    if args.tiny:
        cfg["model"].update(target={"tiny": {"layers": 6, "hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16,
                                             "intermediate": 128, "fit_steps": 0}},
                            drafter_layers=2, dtype="fp32")
    return cfg


def trainer_cli(args, lengths, results):
    """`python -m trainer` in a fresh process on conversations of the bench's lengths (the synthetic
    tokenizer's words: one token each): its steady tokens/s, warm-up and checkpoint stalls."""
    import subprocess
    import sys

    import yaml

    from trainer.data.synth import synthetic_conversation, write_jsonl

    work = tempfile.mkdtemp(prefix="bench-pipeline-cli-")
    rng = random.Random(0)
    conversations = [synthetic_conversation(rng, max(n - 16, 1), max(n - 16, 1)) for n in lengths]  # ~16 template tokens
    train_path = str(write_jsonl(conversations, os.path.join(work, "train.jsonl")))
    config = os.path.join(work, "config.yaml")
    with open(config, "w") as f:
        yaml.safe_dump(cli_config(args, train_path, args.cli_steps), f)
    run_dir = os.path.join(work, "run")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    began = time.time()
    done = subprocess.run([sys.executable, "-m", "trainer", "--config", config, "--run-dir", run_dir], env=env,
                          capture_output=True, text=True)
    wall = time.time() - began
    status = read_status(run_dir) or {}
    events = read_events(run_dir)
    warmup = next((e for e in events if e["event"] == "warmup"), {})
    out = {"exit": done.returncode, "state": status.get("state"), "wall_s": round(wall, 1),
           "steps": status.get("step"), "tokens_per_s_steady": round(status.get("tokens_per_s_steady") or 0, 1),
           "pad_share": status.get("pad_share"), "recompiles": status.get("recompiles"),
           "warmup_s": warmup.get("seconds"), "compile_target": warmup.get("compile_target"),
           "checkpoints": [{k: e.get(k) for k in ("step", "stall_s", "copy_s", "seconds")} for e in events
                           if e["event"] in ("checkpoint", "checkpoint_failed")],
           "peak_mem_gb": [g.get("mem_gb") for g in (events_last_step(events).get("gpus") or [])]}
    if done.returncode:
        out["log_tail"] = (done.stdout + done.stderr)[-3000:]
    shutil.rmtree(work, ignore_errors=True)
    bench_mode = bench_row_of_cli(args, results)
    if bench_mode:
        bench = results[bench_mode]["pipeline"]["tokens_per_s_steady"]
        out["bench_mode"], out["cli_over_bench"] = bench_mode, round(out["tokens_per_s_steady"] / max(bench, 1e-9), 3)
    return out


def bench_row_of_cli(args, results):
    """The bench's measurement the --cli-steps run compares with: the same mode (all, else the compiled or
    plain packed one), precision (fp8fast keys read @fp8fast, or @fp8) and drafter layout, or None."""
    precision = dict.fromkeys((args.cli_precision, args.cli_precision.removesuffix("fast")))
    keys = [prefix + k + suffix + layout for prefix in ("", "8b/") for k in ("all", "packed+ct", "packed")
            for suffix in (*(f"@{p}" for p in precision), "") for layout in (f"@{args.cli_layout}", "")]
    return next((k for k in keys if "pipeline" in results.get(k, {})), None)


def events_last_step(events):
    steps = [e for e in events if e["event"] == "step"]
    return steps[-1] if steps else {}


def quantize_target(args, target, precision, emit, prefix):
    """The target's layers that training runs, in FP8 (trainer.models.fp8), in place; once (fp8 and
    fp8fast share the quantized weights, fp8fast only turns on torch._scaled_mm's fast accumulation)."""
    from trainer.models import fp8

    fast = precision == "fp8fast"
    if not args.tiny:
        fp8.check_device(args.target[0])  # refuses with the reason where torch._scaled_mm cannot run
    converted = [m for m in target.modules() if isinstance(m, fp8.FP8Linear)]
    if converted:  # quantized already (an earlier precision, or built so): only the accumulation changes
        for m in converted:
            m.fast_accum = fast
        return
    began = time.time()
    from trainer.models.target import base_layers, base_model

    n = fp8.quantize_layers(base_layers(base_model(target))[:target_run_layers(target.config)],
                            torch.float32 if args.tiny else torch.bfloat16, fast)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    emit(f"{prefix}quantized", {"linears": n, "seconds": round(time.time() - began, 2), "summary": fp8.fp8_summary(target),
                                "mem_gb": round(torch.cuda.memory_allocated(args.target[0]) / 2**30, 1)
                                if torch.device(args.target[0]).type == "cuda" else None})


def drafter_layers_for(args, shape, precision, target, emit, prefix):
    """--drafter-layers: numbers, or auto: the most layers of 5..1 whose memory plan fits the device
    (trainer.models.memory_plan on the bench's config at this shape and precision); a list, each run."""
    wanted = args.drafter_layers or (["auto"] if shape == "70b" else [None])
    out = []
    for w in wanted:
        layers = None if w is None else _plan_layers(args, shape, precision, target, emit, prefix) if w == "auto" \
            else int(w)
        if layers not in out:
            out.append(layers)
    return out


def _plan_layers(args, shape, precision, target, emit, prefix):
    from trainer.models.memory_plan import build_plan

    tried = {}
    for layers in range(5, 0, -1):
        cfg = parse_config(CONFIG % plan_fields(args, layers, precision.removesuffix("fast"), target.config))
        plan = build_plan(cfg, None if shape == "8b" else target.config.to_dict())
        tried[layers] = {"fits": plan.fits, "refusal": plan.refusal(),
                         "gb": {d.device: round(d.total / 2**30, 1) for d in plan.devices}}
        if plan.fits:
            break
    emit(f"{prefix}drafter_plan@{precision}", {"chosen": layers, "tried": tried})
    return layers


def mask_id(args, config):
    """The drafter's mask token: Qwen3's 151669 where the vocabulary has it, else its last row (Llama-3's
    128 256-row vocabulary ends in reserved special tokens)."""
    if args.tiny:
        return 5
    return 151669 if config.vocab_size > 151669 else config.vocab_size - 1


def plan_fields(args, layers, precision, config):
    """The CONFIG fields of a packed run (the memory plan's view of it)."""
    tiny = args.tiny
    return dict(target="tiny: {layers: 6, hidden: 64, heads: 4, kv_heads: 2, head_dim: 16, intermediate: 128}" if tiny
                else "random_8b_shape: true" + (", precision: fp8" if precision != "bf16" else ""),
                layers=layers, drafter="", dtype="fp32" if tiny else "bf16", mask=mask_id(args, config), max_len=args.max_len,
                anchors=args.anchors, steps=args.steps, micro=args.micro,
                budget=max(args.token_budget or args.max_len, args.max_len), edges=str(args.max_len),
                pack_length=args.pack_length[0], pack_rows=args.pack_rows, ct="true", fuse="true", ckpt=0,
                ckpt_drafter="false",  # the layers that fit without checkpointing (#35's switch left as it was)
                memory_gib="null" if args.memory_gib is None else args.memory_gib,
                targets=", ".join(args.target), drafters=", ".join(args.drafter), log_every=args.log_every,
                offload=args.offload)


def experts_for(args, target):
    """The experts implementations to run a MoE target with (None: dense, or the installed default)."""
    if not args.experts or not getattr(target.config, "num_experts", 0):
        return [None]
    return args.experts


def shape_options(parser, args):
    """--modes-for, --steps-for and --precisions-for as {shape: modes}, {shape: steps}, {shape: precisions}."""
    modes_for, steps_for = {}, {}
    args.precisions_of = {}
    for item in args.precisions_for:
        shape, _, values = item.partition("=")
        bad = [q for q in values.split(",") if q not in PRECISIONS]
        if shape not in args.targets or not values or bad:
            parser.error(f"--precisions-for {item}: SHAPE (one of --targets) = precisions of {', '.join(PRECISIONS)}")
        args.precisions_of[shape] = sorted(dict.fromkeys(values.split(",")), key=PRECISIONS.index)
    for item in args.modes_for:
        shape, _, modes = item.partition("=")
        bad = [m for m in modes.split(",") if m not in MODES]
        if shape not in args.targets or not modes or bad:
            parser.error(f"--modes-for {item}: SHAPE (one of --targets) = modes of {', '.join(MODES)}")
        modes_for[shape] = modes.split(",")
    for item in args.steps_for:
        shape, _, steps = item.partition("=")
        if shape not in args.targets or not steps.isdigit() or int(steps) < 1:
            parser.error(f"--steps-for {item}: SHAPE (one of --targets) = a positive number of steps")
        steps_for[shape] = int(steps)
    return modes_for, steps_for


def precisions_of_shape(args, shape, precisions):
    """The precisions one shape runs at (--precisions-for, else --precisions) and why bf16 is dropped
    (None: it is not): the 70B in bf16 is more than one H200 holds."""
    chosen = args.precisions_of.get(shape, precisions)
    if shape == "70b" and not args.tiny and "bf16" in chosen:
        return ([q for q in chosen if q != "bf16"],
                "70b in bf16: 133 GB of weights for layers 0..77, more than one H200; run it at --precisions fp8")
    return chosen, None


def plan_skip(args, cfg, where, name, measured):
    """Why a measurement (--checkpoint-drafter's) is not run, else None (and it is noted in `measured`):
    the memory plan does not fit it (unless --force), or auto resolved to the drafter layers another
    choice measured already at the same mode, length and variant."""
    from trainer.models.memory_plan import build_plan

    plan = build_plan(cfg, getattr(args, "model_config", None))
    if not args.force and plan.refusal() is not None:
        return f"the memory plan does not fit: {plan.refusal()} (--force runs it)"
    same = (*where, plan.checkpoint_drafter)
    if same in measured:
        return f"the same as {measured[same]} ({plan.checkpoint_drafter} drafter layers checkpointed)"
    measured[same] = name
    return None


def mode_compiles(args, mode):
    """Whether the mode compiles the target (model.compile_target on CUDA for packed+ct and all)."""
    return mode.removesuffix("/rank") in ("packed+ct", "all") and torch.device(args.target[0]).type == "cuda"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--target", nargs="+", default=["cuda:0"])
    p.add_argument("--drafter", nargs="+", default=["cuda:0"])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--log-every", type=int, default=4)
    p.add_argument("--mix", choices=["uniform", "lognormal"], default="uniform")
    p.add_argument("--min-len", type=int, default=2112)
    p.add_argument("--max-len", type=int, default=3072)
    p.add_argument("--median", type=float, default=900.0)
    p.add_argument("--sigma", type=float, default=0.6)
    p.add_argument("--anchors", type=int, default=512, help="per --max-len tokens (per row when bucketed)")
    p.add_argument("--samples", type=int, default=400)
    p.add_argument("--bucket-edges", type=int, nargs="*", default=None, help="bucketed mode; default [max-len]")
    p.add_argument("--token-budget", type=int, default=None, help="bucketed mode; default max-len")
    p.add_argument("--modes", nargs="+", choices=MODES, default=["bucketed"],
                   help="packed: the drafter's previous per-op path, eager target; packed+ct: with "
                        "model.compile_target; all: everything of issue #29 (compiled target, fused drafter, "
                        "a background checkpoint halfway through the run: its stall is reported)")
    p.add_argument("--cli-steps", type=int, default=0,
                   help="then train that many steps with `python -m trainer` in a fresh process on the same "
                        "conversations (trainer/configs/gpu-8b-shape.yaml, a checkpoint halfway)")
    p.add_argument("--pack-length", type=int, nargs="+", default=[8192])
    p.add_argument("--pack-rows", type=int, default=1)
    p.add_argument("--stage-micro", type=int, default=12)
    p.add_argument("--naive-steps", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="profile both stages of the packed mode")
    p.add_argument("--one-rank", action="store_true", help="also run each mode as the one rank of a host group")
    p.add_argument("--variants", nargs="+", default=["whole"],
                   help="target arrangements per mode: whole, untruncated, splitN (N layer stages)")
    p.add_argument("--targets", nargs="+", choices=["8b", "30b-a3b", "70b"], default=["8b"],
                   help="target shapes, each through every mode (dense Qwen3-8B, Qwen3-30B-A3B MoE, Llama-3.3-70B "
                        "truncated at its last tap: fp8 only on one H200)")
    p.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=["bf16"],
                   help="model.target.precision per mode (keys <mode>@fp8): bf16 first, then the same target "
                        "quantized in place; fp8fast: fp8 with torch._scaled_mm's fast accumulation")
    p.add_argument("--experts", nargs="+", choices=["grouped_mm", "eager"], default=None,
                   help="a MoE target's experts implementations per mode (keys <mode>~eager); default: the "
                        "installed transformers' choice. eager (the per-expert loop) runs only with an eager target")
    p.add_argument("--drafter-layers", nargs="+", default=None,
                   help="drafter layers, each a run (keys <mode>#dN when several; default 5, --tiny 2); auto: the "
                        "most of 5..1 the memory plan fits (the default for 70b)")
    p.add_argument("--cli-precision", choices=["bf16", "fp8", "fp8fast"], default="bf16",
                   help="model.target.precision of the --cli-steps run (it runs after the 8b shape, else at the end)")
    p.add_argument("--cli-layout", default="full",
                   help="the --cli-steps run's drafter, as one of --drafter-layouts names it (full/fp8: FP8 matmuls)")
    p.add_argument("--modes-for", nargs="*", default=[], metavar="SHAPE=MODE,MODE",
                   help="modes of one shape instead of --modes, run in the order given (first what matters most "
                        "under --budget-s), e.g. 30b-a3b=packed+ct,packed 70b=packed+ct")
    p.add_argument("--steps-for", nargs="*", default=[], metavar="SHAPE=N", help="steps of one shape instead of --steps")
    p.add_argument("--precisions-for", nargs="*", default=[], metavar="SHAPE=P,P",
                   help="precisions of one shape instead of --precisions, e.g. 30b-a3b=bf16")
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="modes not started this many seconds after the start are skipped (0: none), so that one "
                        "device call ends with its summary; figures are written to --out as each mode ends")
    p.add_argument("--checkpoint-drafter", nargs="+", choices=list(CHECKPOINT_DRAFTER), default=["auto"],
                   help="model.checkpoint_drafter per measurement (#35): each row length runs once per choice "
                        "(keys <mode>_<length>:ckpt-<choice> when several); a choice the memory plan says does not "
                        "fit is skipped and reported, unless --force, and so is an auto that resolves to what "
                        "another choice measured")
    p.add_argument("--tokens-per-mode", type=int, default=0,
                   help="steps per measurement from its row length: about this many tokens each (at least 3 "
                        "logged windows; replaces --steps and --log-every), so long rows take no longer than short")
    p.add_argument("--no-save", action="store_true", help="mode all without its periodic checkpoint (long rows: "
                                                           "16 GB of drafter state written per measurement)")
    p.add_argument("--memory-gib", type=float, default=None, help="devices.memory_gib: the plan's budget per device")
    p.add_argument("--offload", choices=["none", "host"], default="none",
                   help="optim.offload (#51): host keeps the drafter's fp32 weights and AdamW states in host memory, "
                        "so --drafter-layers auto may fit more layers beside the 70B")
    p.add_argument("--force", action="store_true", help="run measurements the memory plan says do not fit")
    p.add_argument("--drafter-layouts", nargs="+", default=["full"],
                   help="drafter layouts, each through every mode (keys <mode>@<layout> when more than one): full, "
                        "swa (all sliding), swaN+M (N sliding causal layers then M full: swa4+1)")
    p.add_argument("--sliding-window", type=int, default=2048, help="window of the sliding drafter layers")
    p.add_argument("--out", default=None, help="also write every figure as JSON here")
    return p


def runs_of(args, shape, modes_for):
    """(mode, pack length) of each measurement of a shape: --modes-for in its order, else --modes; each
    pack length per packed mode; with --one-rank each also as the rank of a host group (`<mode>/rank`)."""
    modes = modes_for[shape] if shape in modes_for else sorted(args.modes, key=MODES.index)  # --modes-for: its order
    runs = [(m, L) for m in modes for L in (args.pack_length if m != "bucketed" else [0])]
    if args.one_rank:
        runs = [(m + suffix, L) for m, L in runs for suffix in ("", "/rank")]
    return runs


def measurement_key(args, mode, length, precision, precisions, experts, layers, layer_counts):
    """A measurement's key: the mode, `_<pack length>` when several, `@<precision>` when not all bf16,
    `~<experts>` when several implementations, `#d<layers>` when several drafter depths."""
    key = mode if mode.startswith("bucketed") or len(args.pack_length) == 1 else f"{mode}_{length}"
    if len(set(precisions) | {q for v in args.precisions_of.values() for q in v}) > 1 or precision != "bf16":
        key += f"@{precision}"
    if experts is not None and len(args.experts or []) > 1:
        key += f"~{experts}"
    if len(layer_counts) > 1:
        key += f"#d{layers}"
    return key


def free_device_memory():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def built_target(args, shape, shape_precisions, prefix, emit):
    """The shape's random target, its figures emitted (`<prefix>target`); None, the error emitted, when
    it cannot be built (one GPU run: the other shapes still run)."""
    try:
        began = time.time()
        target = build_target(args, shape, shape_precisions[0].removesuffix("fast") if shape == "70b" else "bf16")
        built_s = round(time.time() - began, 1)
    except Exception:  # noqa: BLE001 - one GPU run: a shape that cannot be built is reported, the others run
        import traceback

        emit(f"{prefix}target", {"error": traceback.format_exc()[-4000:]})
        return None
    args.model_config = None if shape == "8b" else target.config.to_dict()
    emit(f"{prefix}target", {"params": sum(p.numel() for p in target.parameters() if not p.is_meta),
                             "config": type(target.config).__name__, "build_s": built_s,
                             "layers_run": target_run_layers(target.config),
                             "mem_gb": round(torch.cuda.memory_allocated(args.target[0]) / 2**30, 1)
                             if torch.device(args.target[0]).type == "cuda" else None})
    return target


def measure(args, margs, name, run, emit):
    """One measurement reported under `name` (run: run_mode's arguments after args): its figures, or its
    error (the other measurements still run); an FP8 compiled mode that fails is measured eagerly too
    (`<name>:eager-fallback`): its figure still says what FP8 gives."""
    mode, target, samples, results, length, variant, precision, layers, ck, experts = run
    failed = False
    try:
        if experts is not None:
            from trainer.models.moe import set_experts

            set_experts(target, experts)
        emit(name, run_mode(margs, mode, target, samples, results, length, variant, precision, layers, ck))
    except Exception:  # noqa: BLE001 - one GPU run: a failing mode is reported, the others still measured
        import traceback

        emit(name, {"error": traceback.format_exc()[-4000:]})
        failed = True
    if failed:  # outside the except block: its traceback (holding the mode's tensors) is gone
        torch.compiler.set_stance("default")  # a guard left frozen would fail every later mode
        free_device_memory()
    if failed and precision != "bf16" and mode_compiles(args, mode) and not args.tiny:
        fallback = f"{name}:eager-fallback"
        try:
            emit(fallback, run_mode(args, "packed", target, samples, results, length, variant, precision, layers))
        except Exception:  # noqa: BLE001 - reported like any mode
            import traceback

            emit(fallback, {"error": traceback.format_exc()[-4000:]})
        free_device_memory()


def measure_shape(args, shape, precisions, runs, lengths, started, results, emit):
    """Every measurement of one target shape (built once, quantized in place for each FP8 precision);
    False when none ran (no precision for it, or its target could not be built)."""
    prefix = f"{shape}/" if len(args.targets) > 1 else ""
    shape_precisions, refusal = precisions_of_shape(args, shape, precisions)
    if refusal:
        emit(f"{prefix}bf16", {"error": refusal})
    target = built_target(args, shape, shape_precisions, prefix, emit) if shape_precisions else None
    if target is None:
        return False
    samples = random_samples(lengths, target.config.vocab_size)
    for precision in shape_precisions:
        if precision != "bf16":
            quantize_target(args, target, precision, emit, prefix)
        layer_counts = drafter_layers_for(args, shape, precision, target, emit, prefix)
        measured: dict[tuple, str] = {}  # (key, variant, drafter layers checkpointed) -> the measurement's name
        for experts, layers, (mode, length) in [(e, n, r) for e in experts_for(args, target) for n in layer_counts
                                                for r in runs]:
            key = measurement_key(args, mode, length, precision, precisions, experts, layers, layer_counts)
            if args.budget_s and time.time() - started > args.budget_s:
                emit(prefix + key, {"skipped": f"--budget-s {args.budget_s:g}: not started "
                                               f"{time.time() - started:.0f}s after the start"})
                continue
            if experts == "eager" and mode_compiles(args, mode):
                emit(prefix + key, {"skipped": "the per-expert loop is not compiled (data-dependent "
                                               "expert counts): run it with --modes packed"})
                continue
            for variant, layout, ck in [(v, lay, c) for v in args.variants for lay in args.drafter_layouts
                                        for c in args.checkpoint_drafter]:
                name = prefix + (key if variant == "whole" else f"{key}:{variant}")
                name += f"@{layout}" if len(args.drafter_layouts) > 1 else ""
                args.layout = layout
                if len(args.checkpoint_drafter) > 1:
                    name += f":ckpt-{ck}"
                margs = per_length_args(args, length)
                skip = plan_skip(margs, bench_config(margs, mode, target, length, variant,
                                                     precision.removesuffix("fast"), layers, ck),
                                 (key, variant, layout), name, measured)
                if skip is not None:
                    emit(name, {"skipped": skip, "pack_length": length, "checkpoint_drafter": ck})
                    continue
                measure(args, margs, name, (mode, target, samples, results, length, variant,
                                            precision.removesuffix("fast"), layers, ck, experts), emit)
    return True


def summarise(args, results):
    """Each pipeline measurement's figures in one row: tokens/s (and over the bucketed mode's), padding,
    warm-up, recompiles, host syncs, peaks, MFU, the memory plan over the peak; long rows' x_shortest."""
    summary = {}
    for key, v in results.items():
        if not (isinstance(v, dict) and "pipeline" in v):
            continue
        prefix = key.split("/")[0] + "/" if len(args.targets) > 1 else ""
        base = results.get(prefix + "bucketed", {}).get("pipeline", {}).get("tokens_per_s_steady")
        pipe = v["pipeline"]
        summary[key] = {
            "tokens_per_s": pipe["tokens_per_s_steady"], "x_bucketed": round(pipe["tokens_per_s_steady"] / base, 3)
            if base else None, "pad_share": pipe["pad_share"], "warmup_s": v["warmup_s"],
            "shapes": len(v["warm_shapes"]), "recompiles": pipe["recompiles_after_warmup"],
            "host_syncs_per_step": pipe["host_syncs_per_step"], "peak_mem_gb": v["peak_mem_gb_all"],
            "target_alone": v["target_alone"], "drafter_alone": v["drafter_alone"],
            "pipeline_over_bound": v["pipeline_over_bound"], "mfu": (pipe["mfu_steady"] or [None])[-1],
            "plan_over_peak": {d: e.get("plan_over_peak") for d, e in v.get("memory_plan", {}).items()},
            "precision": v.get("precision"), "drafter_layers": v.get("drafter_layers"), "experts": v.get("experts"),
            "pack_length": v.get("pack_length"), "checkpoint_drafter": v.get("checkpoint_drafter"),
            "offload": v.get("offload"), "host_update_s_per_step": v.get("host_update_s_per_step"),
            "host": v.get("memory_plan", {}).get("host")}
    long_rows(summary)
    return summary


def _mfu(s):
    return "-" if s["mfu_real"] is None else f"{s['mfu_real']:.2f}/{s['mfu_padded']:.2f}"


def _pipe_mfu(m):
    return "-" if not m else f"{m['target']:.2f}+{m['drafter']:.2f}"


def print_summary(summary, results):
    """The summary table, then the lines about FP8's MFU, long rows, skipped measurements, checkpoints
    written while `all` ran, and the trainer CLI's run."""
    print(f"{'mode':<36}{'tok/s':>9}{'x bkt':>7}{'pad':>7}{'warm s':>8}{'shapes':>7}{'recomp':>7}{'syncs/st':>9}"
          f"{'t MFU r/p':>12}{'d MFU r/p':>12}{'pipe MFU t+d':>14}{'mem GB':>8}")
    for key, v in summary.items():
        ta, da = v["target_alone"], v["drafter_alone"]
        print(f"{key:<36}{v['tokens_per_s']:>9.0f}{v['x_bucketed'] or 0:>7.2f}{v['pad_share']:>7.1%}"
              f"{v['warmup_s']:>8.1f}{v['shapes']:>7}{v['recompiles']:>7}{v['host_syncs_per_step']:>9.2f}"
              f"{_mfu(ta):>12}{_mfu(da):>12}{_pipe_mfu(v['mfu']):>14}{max(v['peak_mem_gb'] or [0]):>8.1f}", flush=True)
    if any((v.get("precision") or "bf16") != "bf16" for v in summary.values()):
        peak = peak_tflops(results.get("gpu"))
        print(f"MFU is against the bf16 dense peak everywhere ({f'{peak:g} TFLOP/s on this GPU' if peak else 'unknown here'}"
              "); FP8 tensor cores peak at twice that, so an fp8 target's 't MFU' halved is its share of the FP8 peak",
              flush=True)
    for key, v in summary.items():
        if v.get("x_shortest") is not None:
            print(f"{key}: rows of {v['pack_length']}, drafter layers checkpointed: {v['checkpoint_drafter']}: "
                  f"{v['tokens_per_s']:.0f} tok/s = {v['x_shortest']:.3f} x rows of {v['shortest']}, peak "
                  f"{max(v['peak_mem_gb'] or [0]):.1f} GiB, plan/peak {v['plan_over_peak']}, recompiles "
                  f"{v['recompiles']}", flush=True)
    for key, v in summary.items():
        if v.get("offload") == "host":
            host = v["host"] or {}
            print(f"{key}: optim.offload host, {v['drafter_layers']} drafter layers: {v['tokens_per_s']:.0f} tok/s, "
                  f"GPU peak {max(v['peak_mem_gb'] or [0]):.1f} GiB (plan/peak {v['plan_over_peak']}), the host's "
                  f"update {v['host_update_s_per_step']}s a step, host plan {host.get('plan_gb')} GiB, process peak "
                  f"RSS {host.get('process_peak_rss_gb')} GiB", flush=True)
    for key, v in results.items():
        if isinstance(v, dict) and "skipped" in v:
            print(f"{key}: skipped: {v['skipped']}", flush=True)
    for key in [k for k in summary if k.startswith("all")]:
        for c in results[key].get("checkpoints", []):
            print(f"{key}: checkpoint at step {c['step']}: training thread blocked {c['stall_s']}s, GPU copy "
                  f"{c['copy_s']}s (overlapping the next step), written in {c['seconds']}s in the background", flush=True)
    cli = results.get("cli")
    if cli:
        print(f"trainer CLI, fresh process: {cli['tokens_per_s_steady']} tok/s steady "
              f"({cli.get('cli_over_bench')} x the bench's {cli.get('bench_mode')}), warm-up {cli['warmup_s']}s "
              f"(target compiled: {cli['compile_target']}), recompiles {cli['recompiles']}, checkpoints "
              f"{[c['stall_s'] for c in cli['checkpoints']]} s blocked, state {cli['state']}", flush=True)


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
    args.out_dir = os.path.dirname(args.out) if args.out else None
    results = {"devices": {"target": args.target, "drafter": args.drafter}, "torch": torch.__version__,
               "mix": args.mix}
    if torch.cuda.is_available():
        results["gpu"] = torch.cuda.get_device_name(0)

    def emit(key, value):
        results[key] = value
        print(json.dumps({key: value}), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)

    lengths = sample_lengths(args.samples, args)
    emit("lengths", {"n": len(lengths), "median": sorted(lengths)[len(lengths) // 2],
                     "mean": round(sum(lengths) / len(lengths), 1), "min": min(lengths), "max": max(lengths)})
    started = time.time()
    modes_for, steps_for = shape_options(p, args)
    default_steps = args.steps
    cli_after = "8b" if "8b" in args.targets else args.targets[-1]
    precisions = sorted(dict.fromkeys(args.precisions), key=PRECISIONS.index)
    for shape in args.targets:
        args.steps = steps_for.get(shape, default_steps)
        if not measure_shape(args, shape, precisions, runs_of(args, shape, modes_for), lengths, started, results, emit):
            continue
        if len(args.targets) > 1:  # compiled graphs and their guards may hold the last shape's weights (70B: 66 GB)
            torch._dynamo.reset()
        free_device_memory()
        if args.cli_steps and shape == cli_after:
            if hasattr(torch._C, "_host_emptyCache"):
                torch._C._host_emptyCache()  # the modes' pinned staging, cached by torch: the CLI pins its own
            args.steps = default_steps
            emit("cli", trainer_cli(args, lengths, results))
    args.steps = default_steps
    for k, v in results.items():
        if isinstance(v, dict) and "error" in v:
            print(f"{k}: FAILED\n{v['error']}", flush=True)
    summary = summarise(args, results)
    emit("summary", summary)
    print_summary(summary, results)
    return results


if __name__ == "__main__":
    main()
