"""Threaded pipeline vs each stage alone vs the naive sequential loop, on one run's data.

    PYTHONPATH=. python bench/pipeline.py --target cuda:0 --drafter cuda:0          # 1 GPU shared
    PYTHONPATH=. python bench/pipeline.py --target cuda:0 --drafter cuda:1          # 2 GPUs
    PYTHONPATH=. python bench/pipeline.py --tiny --target cpu --drafter cpu --steps 4   # CPU smoke

Qwen3-8B-shaped random bf16 target and a 5-layer drafter (512 anchors x 16 slots), sequences
of --min-len..--max-len tokens. Prints one JSON line per measurement and a summary with ratios.
"""
from __future__ import annotations

import os

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402

from trainer.components import Components, build_drafter  # noqa: E402
from trainer.config import TinyTargetConfig, parse_config  # noqa: E402
from trainer.data import Batch, PreloadedDataset  # noqa: E402
from trainer.masks import resolve_backend  # noqa: E402
from trainer.optim import build_optimizer, build_scheduler  # noqa: E402
from trainer.pipeline.compile_safety import compiled_frames  # noqa: E402
from trainer.pipeline.threaded import ThreadedTrainer  # noqa: E402
from trainer.target import FrozenHead, freeze, random_8b_shape_target, tiny_target  # noqa: E402

CONFIG = """
model:
  target: {%(target)s}
  drafter_layers: %(layers)d
  block_size: 16
  num_target_layers: 5
  dtype: %(dtype)s
  mask_token_id: %(mask)d
data:
  synthetic: {n_train: 1}
  max_length: %(max_len)d
  num_anchors: %(anchors)d
  token_budget: %(max_len)d
  bucket_edges: [%(max_len)d]
  pad_multiple: 64
optim: {lr: 0.0001, total_steps: %(steps)d, micro_batches: %(micro)d, warmup_ratio: 0.0}
devices: {target: [%(targets)s], drafter: [%(drafters)s]}
run: {log_every: %(log_every)d, warmup_shapes: 4, heartbeat_s: 10}
pipeline: {kind: threaded, pad_to_warm_shapes: always}
"""


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


def random_dataset(n, min_len, max_len, vocab, budget, seed=0):
    rng = random.Random(seed)
    samples = []
    for _ in range(n):
        length = rng.randint(min_len, max_len)
        ids = [rng.randrange(10, vocab) for _ in range(length)]
        mask = [0] * (length // 4) + [1] * (length - length // 4)
        samples.append((ids, mask))
    return PreloadedDataset(samples, [max_len], budget, pad_id=0, seed=seed, pad_multiple=64)


def build(args, run_dir):
    tiny = args.tiny
    cfg = parse_config(CONFIG % dict(
        target="tiny: {layers: 6, hidden: 64, heads: 4, kv_heads: 2, head_dim: 16, intermediate: 128}" if tiny
        else "random_8b_shape: true",
        layers=2 if tiny else 5, dtype="fp32" if tiny else "bf16", mask=5 if tiny else 151669,
        max_len=args.max_len, anchors=args.anchors, steps=args.steps, micro=args.micro,
        targets=", ".join(args.target), drafters=", ".join(args.drafter), log_every=args.log_every))
    tdev, ddev = args.target[0], args.drafter[0]
    if tiny:
        target = freeze(tiny_target(TinyTargetConfig(layers=6, hidden=64, heads=4, kv_heads=2, head_dim=16,
                                                     intermediate=128), 512, tdev))
    else:
        target = freeze(random_8b_shape_target(tdev, torch.bfloat16))
    drafter = build_drafter(cfg, target, cfg.model.mask_token_id, ddev)
    opt = build_optimizer(drafter.parameters(), cfg.optim)
    data = random_dataset(args.samples, args.min_len, args.max_len, target.config.vocab_size, args.max_len)
    tr = ThreadedTrainer(cfg, run_dir)
    tr.c = Components(tokenizer=None, target=target, head=FrozenHead.from_target(target, ddev), drafter=drafter,
                      optimizer=opt, scheduler=build_scheduler(opt, cfg.optim), train_data=data,
                      eval_conversations=[], eval_data=data, gamma=7.0, target_device=tdev, drafter_device=ddev)
    tr.backend = resolve_backend(cfg.model.attention, ddev, needs_grad=True)
    return tr


def sync_all(devices):
    for d in devices:
        if torch.device(d).type == "cuda":
            torch.cuda.synchronize(d)


def stage_alone(tr, which, n_micro):
    """Run one stage on already-built micro-batches, in one thread, as fast as it goes."""
    from trainer.pipeline.features import allocate_slots, pack_context_features
    from trainer.pipeline.prefetch import BatchPrefetcher
    from trainer.pipeline.workers import DrafterSettings, DrafterWorker, Features
    from trainer.pipeline.grad_sync import ReplicaAllReduce
    from trainer.pipeline.stopping import StopSignal
    from trainer.pipeline.device_stats import BusyMeter
    from trainer.masks import prepare_blocks

    c, cfg = tr.c, tr.cfg
    gen = torch.Generator().manual_seed(1)
    pre = BatchPrefetcher(c.train_data.next_batch,
                          lambda b: prepare_blocks(b.input_ids, b.loss_mask, cfg.data.num_anchors, 16, c.gamma,
                                                   c.drafter.config.mask_token_id, gen),
                          lambda: {}, [], StopSignal(), n_micro, 1, 0, tr.warm.shape_for,
                          pin=torch.cuda.is_available())
    mbs = [pre.build(i) for i in range(n_micro)]
    tdev, ddev = torch.device(tr.target_devices[0]), torch.device(tr.drafter_devices[0])
    layer_ids = c.drafter.config.target_layer_ids
    width = len(layer_ids) * c.target.config.hidden_size
    numel = max(b * s for b, s in tr.warm.shapes()) * width
    slot = allocate_slots(1, numel, next(c.target.parameters()).dtype, tdev)[0]
    tokens = sum(m.tokens for m in mbs)
    if which == "target":
        sync_all([tdev])
        began = time.perf_counter()
        with torch.inference_mode():
            for mb in mbs:
                ids = mb.input_ids.to(tdev, non_blocking=True)
                pack_context_features(c.target, ids, None, layer_ids, slot.view(*ids.shape, width))
        sync_all([tdev])
        return tokens / (time.perf_counter() - began)
    with torch.inference_mode():
        feats = []
        for mb in mbs[:2]:
            ids = mb.input_ids.to(tdev)
            out = torch.empty(*ids.shape, width, dtype=slot.buffer.dtype, device=tdev)
            feats.append(pack_context_features(c.target, ids, None, layer_ids, out).to(ddev))
    feats = [f.clone() for f in feats]  # normal tensors, outside inference mode

    class Owner:
        class free:
            @staticmethod
            def put(_):
                pass

    stop = StopSignal()
    settings = DrafterSettings(tr.backend, cfg.model.loss_chunk, tr.autocast_dtype[ddev], cfg.optim.grad_clip, 0,
                               10**9, 1, 10**9)
    stream = torch.cuda.Stream(ddev) if ddev.type == "cuda" else None
    w = DrafterWorker(0, 1, ddev, tr.drafters[0], tr.heads[0], tr.optimizers[0], tr.schedulers[0], tr.flats[0],
                      ReplicaAllReduce(tr.flats[:1], [stream], stop), [], settings, stop, BusyMeter(ddev), tr.guard,
                      None, None, stream)
    ctx = torch.cuda.stream(stream) if stream is not None else torch.autograd.graph.saved_tensors_hooks(lambda x: x, lambda x: x)
    sync_all([ddev])
    began = time.perf_counter()
    with ctx:
        for i, mb in enumerate(mbs):
            w.micro_step(Features(mb, feats[i % 2][: mb.shape[0], : mb.shape[1]], None, slot, Owner))
            w.optimizer_step()
    sync_all([ddev])
    return tokens / (time.perf_counter() - began)


def naive(tr, steps):
    """The reference loop's step: target forward, drafter step, .item() logging, one thread."""
    data = tr.c.train_data
    tokens, next_batch = [0], data.next_batch

    def counting():  # padded to the warm shapes, as in the pipeline, so nothing recompiles
        batch = next_batch()
        tokens[0] += batch.tokens
        rows, length = tr.warm.shape_for(batch)
        pad = (0, length - batch.input_ids.shape[1], 0, rows - batch.input_ids.shape[0])
        return Batch(*(torch.nn.functional.pad(t, pad) for t in (batch.input_ids, batch.attention_mask,
                                                                  batch.loss_mask)))

    data.next_batch = counting
    tr.train_step()  # first call allocates; not timed
    sync_all(tr.busy_devices())
    tokens[0] = 0
    began = time.perf_counter()
    for _ in range(steps):
        tr.train_step()  # converts loss/acc/grad-norm to floats: host syncs every step
    sync_all(tr.busy_devices())
    data.next_batch = next_batch
    return tokens[0] / (time.perf_counter() - began)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--target", nargs="+", default=["cuda:0"])
    p.add_argument("--drafter", nargs="+", default=["cuda:0"])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--log-every", type=int, default=4)
    p.add_argument("--min-len", type=int, default=2112)
    p.add_argument("--max-len", type=int, default=3072)
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--samples", type=int, default=400)
    p.add_argument("--stage-micro", type=int, default=12)
    p.add_argument("--naive-steps", type=int, default=8)
    args = p.parse_args()
    run_dir = tempfile.mkdtemp(prefix="bench-pipeline-")
    results = {"devices": {"target": args.target, "drafter": args.drafter}, "torch": torch.__version__}
    if torch.cuda.is_available():
        results["gpu"] = torch.cuda.get_device_name(0)

    def emit(key, value):
        results[key] = value
        print(json.dumps({key: value}), flush=True)

    tr = build(args, run_dir)
    tr.build_replicas()
    began = time.time()
    tr.warmup()
    emit("warmup_s", round(time.time() - began, 1))
    emit("warm_shapes", tr.warm.shapes())
    frames_after_warmup = compiled_frames()
    tr.first_step = 0
    with SyncCounter() as syncs:
        tr.step = 0
        t0 = time.time()
        reason = tr.train_steps()
        sync_all(tr.busy_devices())
        wall = time.time() - t0
    tr.guard.freeze()  # train_steps unfreezes at the end; the stage runs below must not compile either
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        windows = [w for w in map(json.loads, f) if w["event"] == "step"]
    steady = windows[1:] or windows
    emit("pipeline", {
        "stop_reason": reason, "wall_s": round(wall, 2), "steps": tr.step,
        "tokens_per_s_steady": round(sum(w["tokens_per_s"] for w in steady) / len(steady), 1),
        "busy_steady": [[g["busy"] for g in w["gpus"]] for w in steady],
        "mfu_steady": [w.get("mfu") for w in steady],
        "peak_mem_gb": [g["mem_gb"] for g in windows[-1]["gpus"]],
        "recompiles_after_warmup": windows[-1]["recompiles"] + compiled_frames() - frames_after_warmup,
        "host_syncs_total": syncs.count, "host_syncs_per_step": round(syncs.count / max(tr.step, 1), 3),
        "sync_sites": syncs.where, "loss": [round(w["loss"], 4) for w in windows]})
    target_alone = stage_alone(tr, "target", args.stage_micro)
    drafter_alone = stage_alone(tr, "drafter", args.stage_micro)
    emit("target_alone_tokens_per_s", round(target_alone, 1))
    emit("drafter_alone_tokens_per_s", round(drafter_alone, 1))
    tr.guard.unfreeze()
    from trainer.loop import Trainer

    tr.c.drafter, tr.c.optimizer = tr.drafters[0], tr.optimizers[0]
    Trainer.warmup = lambda self: None
    emit("naive_tokens_per_s", round(naive(tr, args.naive_steps), 1))
    pipe = results["pipeline"]["tokens_per_s_steady"]
    slowest = min(target_alone, drafter_alone)
    shared = set(args.target) & set(args.drafter)
    bound = 1 / (1 / target_alone + 1 / drafter_alone) if shared else slowest
    emit("summary", {
        "pipeline_over_slowest_stage": round(pipe / slowest, 3),
        "pipeline_over_bound": round(pipe / bound, 3),
        "bound": "shared device: 1/(1/target+1/drafter)" if shared else "slowest stage",
        "speedup_over_naive": round(pipe / results["naive_tokens_per_s"], 3),
        "ideal_speedup_over_naive": round((1 / target_alone + 1 / drafter_alone) / (1 / slowest), 3),
        "drafter_mfu_alone": round(drafter_alone * 2.44e10 / 989e12, 3) if not args.tiny else None})


if __name__ == "__main__":
    main()
