"""python -m trainer --config CONFIG --run-dir DIR [--resume latest|STEP|auto]
python -m trainer synth --out FILE --n N [--seed S]
python -m trainer export --checkpoint DIR --out DIR
python -m trainer eval --config CONFIG (--checkpoint DIR | --export DIR) [--temperature T ...] [--json OUT]
python -m trainer data-report --config CONFIG
python -m trainer plan --config CONFIG [--gpus N --gpu-gib G] [--gpu h100|h200] [--calibrate N] [--data]
python -m trainer launch --nnodes N --rdzv-endpoint HOST:PORT --rdzv-id ID --config CONFIG --run-dir DIR
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Before torch initialises CUDA: fewer fragmentation OOMs with many batch shapes (issue #5).
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def _train(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer", description="Train a DFlash drafter.",
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="other commands (each takes --help):\n" + "\n".join(
                                    f"  python -m trainer {name:<12} {summary}" for name, summary in SUMMARIES.items()))
    p.add_argument("--config", required=True, help="trainer YAML config")
    p.add_argument("--run-dir", required=True, help="run directory (created if missing)")
    p.add_argument("--resume", default=None, help="'latest', a checkpoint step number, or 'auto' (the latest, "
                   "else a fresh start: a supervisor's restart before the first checkpoint)")
    args = p.parse_args(argv)
    from trainer.run.config import ConfigError, load_config

    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr, flush=True)
        return 2
    from trainer.train.trackers import missing_trackers

    missing = missing_trackers(cfg)  # where the run will log, not where the config was written
    if missing is not None:
        print(f"config error: {args.config}: {missing}", file=sys.stderr, flush=True)
        return 2
    from trainer.entry import train

    code = train(cfg, args.run_dir, args.resume)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # A rank of a run across hosts: a thread may still sit in a collective with a lost peer
        # (gloo/NCCL cannot be interrupted), and process-group teardown can hang on it.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _synth(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer synth", description="Write synthetic conversations (JSONL).")
    p.add_argument("--out", required=True)
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-len", type=int, default=12)
    p.add_argument("--max-len", type=int, default=40)
    args = p.parse_args(argv)
    from trainer.data.synth import synthetic_conversations, write_jsonl

    try:
        path = write_jsonl(synthetic_conversations(args.n, args.seed, args.min_len, args.max_len), args.out)
    except OSError as e:
        print(f"synth: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.n} conversations to {path}")
    return 0


def _export(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer export", description="Export a checkpoint as a DFlash (or DFlash2) draft.")
    p.add_argument("--checkpoint", required=True, help="checkpoints/step_N directory")
    p.add_argument("--out", required=True, help="output directory (config.json + model.safetensors); replaced only "
                   "when absent, empty or an earlier export")
    p.add_argument("--force", action="store_true", help="also replace an earlier output of another dflash-ops "
                   "command (a fetch, a push); never files no command wrote")
    args = p.parse_args(argv)
    from trainer.run import destination

    try:  # a destination it may not replace is refused before torch is imported (1.5 CPU-seconds)
        destination.refuse_replacing(os.path.normpath(Path(args.out).expanduser().absolute()), "export", args.force)
    except destination.Refused as e:
        print(f"export: {e}", file=sys.stderr)
        return 2
    from trainer.models.export import export_checkpoint
    from trainer.run.checkpoint import CheckpointError

    try:
        print(f"exported to {export_checkpoint(args.checkpoint, args.out, force=args.force)}")
    except (destination.Refused, CheckpointError, OSError) as e:
        print(f"export: {e}", file=sys.stderr)
        return 2
    return 0


def _launch(argv: list[str]) -> int:
    from trainer.distributed.launch import main as launch_main

    return launch_main(argv)


def _regen(argv: list[str]) -> int:
    print("python -m trainer regen: regeneration is not part of the trainer; run `python -m trainer_tools.regen` "
          "(deploy ships it with `extra_paths: [trainer_tools]`, as playbooks/regen.yaml does)", file=sys.stderr)
    return 2


def _data_report(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer data-report",
                                description="Count, measure and mask the configured chat data (loads the tokenizer only).")
    p.add_argument("--config", required=True, help="trainer YAML config")
    args = p.parse_args(argv)
    from trainer.data.chat import DataError
    from trainer.run.config import ConfigError, load_config

    try:
        cfg = load_config(args.config)
        if cfg.data.synthetic is not None:
            print("data-report: the config generates synthetic data (data.synthetic); nothing to report",
                  file=sys.stderr)
            return 2
        from trainer.data.report import build_report, format_report
        from trainer.data.tokenizer import build_tokenizer

        tokenizer = build_tokenizer(cfg)
        report = build_report(cfg, tokenizer)
    except (ConfigError, DataError, OSError, ValueError) as exc:
        print(f"data-report: {exc}", file=sys.stderr, flush=True)
        return 2
    print(format_report(report, cfg, cfg.model.target.path or "synthetic word-level"))
    if cfg.model.target.path is not None:
        from trainer.data.report import format_family
        from trainer.run.family import family_of_dir

        print(format_family(family_of_dir(cfg.model.target.path), cfg))
    return 0


def _entry_train() -> Callable[..., int]:
    """trainer.entry.train, imported only when a calibration runs (it imports torch and the pipelines)."""
    from trainer.entry import train

    return train


def _data_tokens(cfg: Any) -> tuple[int, int]:
    """(conversations, tokens after truncation) of the training data (trainer.data.report)."""
    if cfg.data.synthetic is not None:
        raise ValueError("--data: the config generates synthetic data (data.synthetic); nothing to count")
    from trainer.data.report import build_report
    from trainer.data.tokenizer import build_tokenizer

    train = next(r for r in build_report(cfg, build_tokenizer(cfg)) if r.name == "train")
    return train.conversations, train.kept_tokens


def _plan(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer plan",
                                description="Time, cost and memory of a config: tokens, tokens/s, wall time and "
                                            "GPU-hours (trainer.models.time_plan), then bytes per target stage, drafter "
                                            "replica and device, from the config, the model's config.json and its "
                                            "index (no weights read).")
    p.add_argument("--config", required=True, help="trainer YAML config")
    p.add_argument("--gpus", type=int, default=None, help="plan for a host with this many GPUs (default: this one's)")
    p.add_argument("--gpu-gib", type=float, default=None, help="with --gpus: each GPU's memory in GiB (H200: 139)")
    p.add_argument("--host-gib", type=float, default=None,
                   help="the host's RAM in GiB, which optim.offload host's state must fit (default: this machine's "
                        "when planning for it, unknown with --gpus)")
    p.add_argument("--gpu", choices=["h100", "h200"], default=None,
                   help="the GPU kind the time plan is for (default: this host's, else h200)")
    p.add_argument("--calibrate", type=int, default=None, metavar="N",
                   help="measure the rate with N training steps of this config on this host's devices")
    p.add_argument("--data", action="store_true",
                   help="also count the training data's tokens (loads the tokenizer, as data-report does) and "
                        "say how many epochs the run covers")
    args = p.parse_args(argv)
    from trainer.data.chat import DataError
    from trainer.run.config import ConfigError, load_config

    if (args.gpus is None) != (args.gpu_gib is None):
        print("plan: --gpus and --gpu-gib go together", file=sys.stderr)
        return 2
    if args.calibrate is not None and args.calibrate < 2:
        print("plan: --calibrate needs at least 2 steps (the first fills the pipeline)", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config)
        from trainer.models.time_plan import NoThroughput, build_time_plan, calibrate, format_time_plan

        try:
            measured = calibrate(cfg, args.calibrate, _entry_train()) if args.calibrate else None
            data = _data_tokens(cfg) if args.data else None
            print(format_time_plan(build_time_plan(cfg, args.gpu, measured, data)), flush=True)
        except NoThroughput as exc:
            print(f"time and cost: {exc}", flush=True)
        from trainer.models.memory_plan import build_plan, format_plan

        gpu_bytes = None if args.gpus is None else {i: int(args.gpu_gib * 2**30) for i in range(args.gpus)}
        host_bytes = None if args.host_gib is None else int(args.host_gib * 2**30)
        plan = build_plan(cfg, gpu_bytes=gpu_bytes, host_bytes=host_bytes)
    except (ConfigError, DataError, OSError, ValueError) as exc:
        print(f"plan: {exc}", file=sys.stderr, flush=True)
        return 2
    print(format_plan(plan))
    return 0 if plan.fits else 1


def _eval(argv: list[str]) -> int:
    from trainer.generate.sampling_params import DRAFT_SAMPLE_METHODS, sampling_problem

    p = argparse.ArgumentParser(prog="python -m trainer eval",
                                description="τ of a checkpoint or a draft (an export, a published draft) against the "
                                "config's target, at each temperature, sampled and expected, beside n-gram lookup; "
                                "no training. One table on stdout, the same as JSON with --json. With --ceiling and "
                                "no draft: before training one, lookup's τ and the most a drafter of the config's "
                                "model.block_size can reach there.")
    p.add_argument("--config", required=True, help="trainer YAML config: the target, the held-out data, eval settings")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--checkpoint", help="checkpoints/step_N directory (or a run directory: its latest)")
    which.add_argument("--export", help="a draft directory: this project's export or a published DFlash/DFlash2 draft")
    p.add_argument("--temperature", type=float, nargs="+", default=None, help="temperatures (default eval.temperatures)")
    p.add_argument("--top-p", type=float, default=None, help="the engine's top-p (default eval.top_p)")
    p.add_argument("--top-k", type=int, default=None, help="the engine's top-k, 0 off (default eval.top_k)")
    p.add_argument("--draft-sample-method", choices=DRAFT_SAMPLE_METHODS, default=None,
                   help="the engine's proposals at T > 0 (vLLM's speculative_config draft_sample_method): the draft's "
                   "argmax, or sampled from it and verified with its probabilities (default "
                   "eval.draft_sample_method)")
    p.add_argument("--samples", type=int, default=None, help="held-out conversations decoded (default eval.samples)")
    p.add_argument("--data", default=None, help="held-out conversations (JSONL) instead of the config's")
    p.add_argument("--json", default=None, help="also write the report as JSON here")
    p.add_argument("--ceiling", action="store_true",
                   help="also decode with the target drafting for itself (its greedy chain as the block): the τ a "
                   "drafter of this block size reaches at best at each temperature, and that over lookup's; "
                   "without --checkpoint or --export, only lookup and the ceiling")
    args = p.parse_args(argv)
    if not (args.checkpoint or args.export or args.ceiling):
        p.error("give the draft (--checkpoint or --export), or --ceiling alone: lookup's τ and the ceiling "
                "without a draft")
    import dataclasses

    from trainer.run.config import ConfigError, load_config

    try:
        cfg = load_config(args.config)
        e = dataclasses.replace(cfg.eval, top_p=cfg.eval.top_p if args.top_p is None else args.top_p,
                                top_k=cfg.eval.top_k if args.top_k is None else args.top_k,
                                draft_sample_method=args.draft_sample_method or cfg.eval.draft_sample_method)
        for t in args.temperature or e.temperatures:
            problem = sampling_problem(t, e.top_p, e.top_k, e.seed, e.draft_sample_method)
            if problem:
                raise ConfigError(problem)
        if args.samples is not None and args.samples < 1:
            raise ConfigError(f"--samples must be at least 1, not {args.samples}")
        if args.json and not Path(args.json).resolve().parent.is_dir():
            raise ConfigError(f"--json {args.json}: its directory does not exist")
        draft = args.checkpoint or args.export
        if draft and not Path(draft).is_dir():
            raise ConfigError(f"{draft}: not a draft model directory (no such directory)")
        if args.data is not None and not Path(args.data).is_file():
            raise ConfigError(f"--data {args.data}: no such file")
        from trainer.train.draft_eval import evaluate_draft, evaluate_headroom, table, write_json

        def log(line: str) -> None:
            print(line, file=sys.stderr, flush=True)

        cfg = dataclasses.replace(cfg, eval=e)
        report = (evaluate_draft(cfg, draft, args.temperature, args.samples, args.data, log=log, ceiling=args.ceiling)
                  if draft else evaluate_headroom(cfg, args.temperature, args.samples, args.data, log=log))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    print(table(report), flush=True)
    if args.json:
        write_json(report, args.json)
    return 0


SUMMARIES = {  # what `python -m trainer --help` lists beside training
    "eval": "τ of a checkpoint or draft at each temperature (sampled, expected, lookup's); --ceiling alone: what any "
            "drafter could reach; no training",
    "plan": "tokens, wall time and GPU-hours; bytes per target stage, drafter replica and GPU (no weights read)",
    "data-report": "count, measure and mask the configured chat data (loads the tokenizer only)",
    "export": "export a checkpoint as a DFlash (or DFlash2) draft an engine serves",
    "synth": "write synthetic conversations (JSONL)",
    "launch": "one rank of a run across hosts (torchrun; dflash-ops starts it)",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"launch": _launch, "synth": _synth, "export": _export, "regen": _regen, "data-report": _data_report,
                "plan": _plan, "eval": _eval}
    if argv and argv[0] in commands:
        return commands[argv[0]](argv[1:])
    return _train(argv)


if __name__ == "__main__":
    sys.exit(main())
