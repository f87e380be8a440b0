"""A download-free quality benchmark: a code model trained on the machine's own Python sources,
its greedy answers regenerated through the project's regen path, a DFlash drafter trained with
the project's trainer from the saved model directory, and τ on held-out prompts.

    PYTHONPATH=. python bench/quality.py --preset h200 --out /tmp/quality      # one H200, < 10 min
    PYTHONPATH=. python bench/quality.py --preset tiny --out /tmp/quality      # CPU, seconds (the test)
    PYTHONPATH=. python bench/quality.py --preset h200-long --out /tmp/quality-long   # one H200, long contexts (#35)
    PYTHONPATH=. python bench/quality.py --preset cpu-long --out /tmp/quality-long    # CPU, a few minutes

Long contexts (`long` presets, issue #35 item 4): the target trains on documents of one package's files
concatenated (8-16K tokens); regen prompts and held-out prompts are cut from such documents at token
lengths in given ranges, the held-out ones in every τ bucket (<=2K, 2-8K, 8-32K, >32K); a full-attention
drafter (the main run) and a sliding-window one train side by side at equal steps, and each one's last
checkpoint is evaluated by the bench on every held-out prompt: τ per bucket, side by side.

Stages (each prints its figures with what produced them; everything lands in OUT/quality.json
and a markdown summary in OUT/quality.md):

1. corpus: every .py file of the standard library and site-packages (no test files: no
   test/tests/testing directory, no test_*.py / *_test.py / conftest.py), deduplicated by
   content hash, split BY FILE into train and held-out (sha256 of the content decides).
2. tokenizer: a byte-level BPE trained on a sample of the train files, Qwen3 special tokens.
3. target: a Qwen3-architecture LM trained on train-file windows rendered as chat turns (user:
   a code prefix; assistant: its continuation), under one epoch, so it models code instead of
   memorising it; LM loss on rows it trained on vs rows of held-out files. Saved as a
   hub-shaped model directory (config.json, sharded safetensors, tokenizer, chat template).
4. prompts: code prefixes of train files (regeneration prompts, and the same prefixes with the
   original continuation for the "original answers" ablation); held-out prompts from held-out
   files for τ.
5. regen: `python -m trainer_tools.regen --engine hf --model-path MODEL ...` writes the target's greedy
   answers (the answers τ is measured against: evaluation decodes greedily).
6. drafter: `python -m trainer --config CFG --run-dir RUN` from the model directory; periodic
   checkpoints give the τ-vs-training-tokens curve; ablations (original answers, depth,
   block size, γ, target layers tapped) run beside it with fewer steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import random
import re
import site
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the trainer (its heavier parts imported where they are used)
    sys.path.insert(0, str(ROOT))

from bench.common import apply_sets, named_twice  # noqa: E402
from trainer.generate.sampling_params import DRAFT_SAMPLE_METHODS, DraftSampleMethod  # noqa: E402
from trainer.run.checkpoint import complete_checkpoints, load_weights, step_of  # noqa: E402
from trainer.run.contract import read_events, read_log, read_status, tau_by_length_text, tau_by_temperature_text  # noqa: E402

TEST_DIRS = {"test", "tests", "testing", "idle_test", "unittests"}
SPECIALS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
            "<tool_response>", "</tool_response>")


@dataclass
class Preset:
    device: str = "cuda:0"
    # corpus
    corpus: str = "machine"  # "machine": the stdlib and site-packages; "project": this repository's own files; "synthetic": generated modules (write_synthetic_corpus); or a directory
    corpus_mb: float = 400.0  # most source bytes read (train + held-out)
    max_file_kb: int = 512  # larger files (generated tables) are skipped
    heldout_permille: int = 30  # share of files held out (by content hash)
    tokenizer_vocab: int = 8192
    tokenizer_sample_mb: float = 12.0
    # target (Qwen3 architecture)
    hidden: int = 512
    layers: int = 8
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 64
    intermediate: int = 1536
    seq_len: int = 1024
    batch_rows: int = 64
    target_steps: int = 640
    target_lr: float = 3e-3
    target_warmup: int = 100
    window_chars: int = 4000  # characters per training window (prefix + continuation)
    heldout_rows: int = 256  # rows of held-out files for the LM loss
    compile_target: bool = False  # torch.compile the target for its own training
    target_budget_s: float = 0.0  # with a value: the target's steps are cut (at step RESIZE_AT) to what fits this long since its start
    target_prefix_chars: tuple[int, int] | None = None  # the target's windows' prompt part (default prefix_chars)
    # the target as it stands after these steps, each also written (out/model-stepN) with its held-out LM loss:
    # less trained, less sharp targets of the same run beside the final one (bench/headroom.py)
    target_snapshots: tuple = ()
    # long contexts (issue #35): the texts are documents of one package's files concatenated; prompts and
    # held-out prompts are cut from them at token lengths in these ranges (one range per bucket)
    long: bool = False
    doc_tokens: tuple[int, int] = (8192, 16384)  # a long document's length (estimated from chars/token)
    train_prompt_tokens: tuple = ((200, 2000), (2100, 8000), (8300, 16000))  # regen prompts, an equal share each
    eval_prompt_tokens: tuple = ((200, 2000), (2100, 8000), (8300, 30000), (33000, 38000))  # <=2K, 2-8K, 8-32K, >32K
    eval_per_bucket: tuple = (16, 16, 16, 16)  # held-out prompts per range
    trainer_eval: str = "eval.jsonl"  # the trainer's own held-out file (long: the <=2K prompts; the bench evaluates all)
    tau_from_checkpoints: bool = False  # every run's τ from the bench's evaluation of its last checkpoint
    # with tau_from_checkpoints: each trainer's own end-of-run evaluation cut to a check (T = 0, 64 new tokens),
    # since the bench measures the same checkpoint again; its time (~28 s of an H100 at 64 prompts x 256 tokens
    # x 2 temperatures) goes to training
    short_trainer_eval: bool = False
    synthetic_files: int = 40  # corpus "synthetic": modules written
    # prompts and regeneration
    prefix_chars: tuple[int, int] = (200, 1000)
    n_prompts: int = 65536  # 4 regen batches of 16384: ~110 s on an H200
    answer_tokens: int = 256
    regen_batch: int = 16384  # rows decoded at once: 3x the tokens/s of 4096 on an H200 (bench/decoder_speed.py)
    # the data docs/objectives.md makes the default (issue #50's recipe ablation): besides each prompt's greedy
    # answer, this many answers of it sampled at T = 1 (regen --samples-per-prompt), the runs train on both; the
    # sampled answers are decoded after the greedy ones, both stopped at regen_end_s (a regen batch finishes all
    # its rows at once, so a deadline of its own would lose the greedy batch whole on a slower card)
    sampled_answers: int = 0
    n_eval: int = 64
    eval_new_tokens: int = 256
    temperatures: tuple = (0.0,)  # the trainer's evaluation reports τ at each (issue #49; the first is the run's τ)
    # the engine's proposals at T > 0 in every evaluation (vLLM's draft_sample_method): the draft's argmax (its
    # default), or sampled from the draft and verified with its probabilities, which the ceiling does not bound
    draft_sample_method: DraftSampleMethod = "greedy"
    # the target drafting for itself beside lookup (trainer.generate.ceiling), once a prompt set, at each temperature:
    # off unless asked (--set ceiling=true), since no preset's plan keeps time for it: its first GPU call (an H100,
    # the h200 preset) was still decoding it past the call's 540 s where τ had ~35 s kept
    ceiling: bool = False
    # drafter (the trainer's config)
    pipeline: str = "threaded"
    dtype: str = "bf16"
    target_precision: str = "bf16"  # model.target.precision of the drafter's training runs (fp8: FP8 features); τ is measured against the bf16 target either way
    drafter_layers: int = 2
    block_size: int = 16
    num_target_layers: int = 3
    gamma: float | None = None
    drafter_steps: int = 6000  # the most; with a budget and drafter_rate, sized to the time left
    drafter_rate: float = 20.0  # optimizer steps/s the main run keeps (H200: 23 measured alone); 0: steps as given
    drafter_startup_s: float = 60.0  # a trainer run's start before its first step (H200: 78 s with one-process tokenisation, ~40 s of it tokenising 32768 conversations; now in worker processes, not re-measured)
    drafter_lr: float = 1.5e-3
    max_length: int = 768
    num_anchors: int = 192
    pack_length: int = 8192
    pack_rows: int = 2
    micro_batches: int = 1
    curve_points: int = 4  # checkpoints of the main run evaluated for the curve (plus the last one)
    # the main run's own overrides of the drafter config, an ablation's keys (e.g. {"objective": "kl+dpace"} or
    # {"drafter_kind": "dflash2"}): the one-call recipe with another objective or generation at its full length
    main_overrides: dict = field(default_factory=dict)
    # ablations: name -> overrides of the drafter config; they run with ablation_steps
    ablation_steps: int = 250
    ablations: dict = field(default_factory=dict)
    ablation_steps_as_main: bool = False  # the ablations train as many steps as the main run (sized to the budget)
    anchors_per_row: int | None = None  # packed rows: draft blocks a row (default: num_anchors per max_length)
    parallel: int = 8  # trainer processes at once on the device
    first_alone: bool = True  # the main run starts alone until it trains (the others then find its compiled kernels)
    ablation_convs: int = 16384  # ablations train on the first this many answers (less tokenization per run)
    inprocess: bool = False  # call the CLI entry points in this process (the CPU test: no interpreter start-up)
    budget_s: float = 560.0  # whole-bench wall budget (0: none); trainer runs get SIGTERM eval_reserve_s before its end
    eval_reserve_s: float = 35.0  # the checkpoints' τ (~5 s each on an H200) and the trainer's stop
    regen_end_s: float = 230.0  # regen gets SIGINT this many seconds after the start (0: none)
    seed: int = 0


GOAL = {"heldout": 2.0, "other": 1.6}  # issue #50's done-when: DFlash / lookup τ on each prompt set, at every T


# name -> the model section's objective keys (trainer/run/config.py ModelConfig); an ablation names one as
# {"objective": NAME} (the objectives ablation, the proposals bench and the recipe ablation train them too)
OBJECTIVES: dict[str, dict[str, Any]] = {
    "ce+decay": {"loss": "ce", "position_weight": "decay"},
    "ce+dpace": {"loss": "ce", "position_weight": "dpace"},
    "kl": {"loss": "kl", "position_weight": "decay"},
    "ce+kl": {"loss": {"ce": 1.0, "kl": 1.0}, "position_weight": "decay"},
    "kl+dpace": {"loss": "kl", "position_weight": "dpace"},  # the target's distribution, D-PACE's position weights
    # the total variation to the target's distribution: the share of sampled proposals rejected (DistillSpec's TVD)
    "ce+tv": {"loss": {"ce": 1.0, "tv": 1.0}, "position_weight": "dpace"},
}

ABLATIONS = {  # what the h200 preset runs; more can be named with --ablations
    "base": {},
    "original answers": {"train": "original"},
    "depth 1": {"drafter_layers": 1},
    "depth 5": {"drafter_layers": 5},
    "block 8": {"block_size": 8},
    "gamma 3": {"gamma": 3.0},
    "5 layers tapped": {"num_target_layers": 5},
}
MORE_ABLATIONS = {"gamma 20": {"gamma": 20.0}, "1 layer tapped": {"num_target_layers": 1},
                  "fp8 target": {"precision": "fp8"},
                  # drafter layouts (model.drafter, issue #41): every layer sliding (causal, vLLM's reading), or
                  # the last one full as z-lab's 2026 drafts (swa4+1)
                  "sliding 2048": {"sliding_window": 2048}, "sliding 2048 + full": {"sliding_window": 2048, "full_layers": 1}}

# one call's screen of four drafters side by side at equal steps on the default data (h200-proposals, h200-levers)
PROPOSALS = Preset(temperatures=(0.0, 1.0), draft_sample_method="probabilistic", drafter_rate=7.0,
                   drafter_startup_s=80.0, n_prompts=8192, sampled_answers=1, ablation_convs=16384,
                   regen_end_s=220.0, eval_reserve_s=110.0,
                   ablations={"base": {}, "kl+dpace": {"objective": "kl+dpace"},
                              "ce+tv": {"objective": "ce+tv"}, "dflash2": {"drafter_kind": "dflash2"}},
                   ablation_steps_as_main=True, parallel=4, curve_points=1, tau_from_checkpoints=True,
                   short_trainer_eval=True)

PRESETS = {
    # one H200, one call of < 10 min: the main run alone after target and regen
    "h200": Preset(temperatures=(0.0, 0.7, 1.0)),  # τ at the temperatures users serve at (issue #49)
    # one H200, one call (issue #42): the drafter trained on the bf16 target's features (the main run, "base")
    # and on the FP8 target's ("fp8 target": model.target.precision fp8) side by side, the same steps and data,
    # both evaluated against the bf16 target (as served): the τ FP8 features cost
    # and a second drafter seed of each (2026-12-04: FP8 cost 2.1-2.4 % on two target seeds, one drafter each, with
    # no measure of what the drafter's own initialisation moves τ by)
    "h200-fp8": Preset(drafter_rate=5.0, ablations={"base": {}, "fp8 target": {"precision": "fp8"},
                                                    "base, drafter seed 1": {"run_seed": 1},
                                                    "fp8 target, drafter seed 1": {"precision": "fp8", "run_seed": 1}},
                       ablation_steps_as_main=True, parallel=4, curve_points=2),
    # one H200, one call (issue #51): the drafter trained with FP8 matmuls ("fp8 drafter": model.drafter.precision
    # fp8) beside the bf16 one, two drafter seeds each, the same steps and data; each run's own τ is measured by its
    # trainer in bf16 (evaluation drafts as the export serves) against the bf16 target
    "h200-fp8-drafter": Preset(drafter_rate=5.0, ablations={"base": {}, "fp8 drafter": {"drafter_precision": "fp8"},
                                                            "base, drafter seed 1": {"run_seed": 1},
                                                            "fp8 drafter, drafter seed 1": {"drafter_precision": "fp8",
                                                                                            "run_seed": 1}},
                               ablation_steps_as_main=True, parallel=4, curve_points=2),
    # one H200, one call (issue #50): T = 1 with sampled proposals (vLLM's draft_sample_method probabilistic: a
    # position's draft accepted with probability 1 - TV(p, q)), where argmax proposals cannot reach the goal on
    # this target (the ceiling: 1.55x lookup, bench/RESULTS.md eleventh session); the default ce + dpace beside
    # the objectives that train the draft's distribution toward the target's, and DFlash2, whose sampled walk
    # draws each slot after the candidate drawn before (DFlash1 samples every position alone), the same steps and
    # the default data (8,192 prompts, each one's greedy answer and one sampled at T = 1: the recipe ablation's
    # gain at T = 1), one drafter seed (at T = 1 the seeds moved τ by ~1 %, docs/objectives.md). Sized from its
    # first call (an H100, twelfth session): each run's last checkpoint takes ~21 s to evaluate (T = 0 and 1, both
    # prompt sets), so eight runs' 170 s did not fit the 35 s kept and none but the main run's was measured; four
    # runs at once trained ~7 steps/s each after ~80 s of start-up (the fp8 presets); regen wrote 16,384 greedy
    # and 16,384 sampled answers in ~170 s after the target's 92 s: half of each here (~15M tokens, ~4 passes).
    # Its second call (thirteenth session, an H100): the four runs had ended 42 s before their deadline, each
    # after its own 64 x 256-token evaluation at two temperatures, now a short check: 7 steps/s
    "h200-proposals": PROPOSALS,
    # one call, the two levers of T = 0 crossed (2 x 2, equal steps, one seed): the drafter's generation (DFlash2:
    # +49 % τ at T = 0 held-out in the screen above) and the target layers it reads (`deep`: 1, 4, 7, the last of
    # the target's 8 among them, where the default 1, 3, 5 leaves 2 of 8 layers unread); each lever is read twice,
    # once with the other lever and once without
    "h200-levers": dataclasses.replace(PROPOSALS, ablations={
        "base": {}, "deep taps": {"target_layer_ids": [1, 4, 7]}, "dflash2": {"drafter_kind": "dflash2"},
        "dflash2 deep taps": {"drafter_kind": "dflash2", "target_layer_ids": [1, 4, 7]}}),
    # one H200, one call (issue #50's done-when): the default recipe (ce + dpace on each prompt's greedy answer and
    # one sampled at T = 1), the main run alone for as long as the call allows, τ at T = 0 and at T = 1 with sampled
    # proposals on both prompt sets; a seed a call. One regen batch of each kind: 16,384 greedy answers took 86 s
    # and 16,384 sampled 81 s on an H100 (twelfth session, the target 92 s before them), a batch the deadline cuts
    # is lost whole; its first call trained ~62M tokens in 169 s (20 steps/s, as sized). Resized from the thirteenth
    # session's two H100 calls (both regen halves by t = 256-268 s): the trainer started in ~40 s (tokenising 10 s,
    # compiling 26 s) and stepped at 30-32 steps/s, then spent 28 s on its own evaluation of the checkpoint the bench
    # measures again, and each call ended ~65 s inside its budget: now 27 steps/s after 45 s, the trainer's own
    # evaluation a short check. A main run that steps slower (main_overrides: DFlash2, kl) is sized at its own pace
    # (run_pace; the sixteenth session's DFlash2 runs, sized at DFlash's, were cut at 46 % and 82 % of their steps)
    "h200-recipe": Preset(temperatures=(0.0, 1.0), draft_sample_method="probabilistic", n_prompts=16384,
                          sampled_answers=1, regen_end_s=280.0, curve_points=2, eval_reserve_s=50.0,
                          drafter_rate=27.0, drafter_startup_s=45.0, tau_from_checkpoints=True, short_trainer_eval=True),
    # one H200, a second call: the same target and regen, then the ablations side by side at equal
    # steps (the main run, with the base settings, is the "base" row)
    "h200-ablations": Preset(drafter_steps=300, drafter_rate=0.0, ablation_steps=300, ablations=dict(ABLATIONS), parallel=7,
                             curve_points=2, n_eval=32),
    # one H200, one call (issue #35 item 4): the target trained on documents of one package's files (8-16K
    # tokens, rows of 16,384), regen prompts of <=2K, 2-8K and 8-16K tokens, held-out prompts in every
    # τ bucket up to 38K tokens; a full-attention drafter (the main run) and a sliding-window one (every
    # layer, window 2,048) side by side at equal steps on packed rows of 16,896, τ per bucket from each
    # one's last checkpoint
    # Sized from its first H200 call (bench/RESULTS.md, 2026-12-03): regen of 1,024 of the longest prompts at 256
    # tokens took ~170 s, τ per bucket of two checkpoints (48 prompts, 256 new tokens) over 133 s. Its second
    # (2026-12-04) ended 178 s inside the budget: τ per bucket took 52 s of the 150 s kept (now 90), and each drafter,
    # two side by side, trained at ~30 steps/s after ~77 s of start-up (897 steps of 16,896 tokens at 497k tok/s in a
    # 107 s run); sized at 20 steps/s after 80 s, a faster deadline stops them with a checkpoint as before
    "h200-long": Preset(long=True, seq_len=16384, batch_rows=4, target_steps=600, target_budget_s=150.0,
                        target_prefix_chars=(2000, 40000), window_chars=16000, n_prompts=768, regen_batch=256,
                        answer_tokens=128, eval_new_tokens=128,
                        regen_end_s=250.0, n_eval=32, eval_per_bucket=(8, 8, 8, 8), max_length=16896, pack_length=16896, pack_rows=1,
                        num_anchors=1024, drafter_rate=20.0, drafter_startup_s=80.0, curve_points=1,
                        ablations={"base": {}, "sliding 2048": {"sliding_window": 2048}}, ablation_steps_as_main=True,
                        parallel=2, first_alone=False, eval_reserve_s=90.0, trainer_eval="eval-short.jsonl",
                        tau_from_checkpoints=True),
    "tiny": Preset(temperatures=(0.0, 0.7, 1.0), device="cpu", corpus="synthetic", corpus_mb=0.4, max_file_kb=64, heldout_permille=200, tokenizer_vocab=400,
                   tokenizer_sample_mb=0.2, hidden=32, layers=4, heads=2, kv_heads=1, head_dim=16, intermediate=64,
                   seq_len=64, batch_rows=4, target_steps=60, target_lr=3e-3, target_warmup=2, window_chars=600,
                   heldout_rows=4, prefix_chars=(60, 200), n_prompts=24, answer_tokens=16, regen_batch=12,
                   n_eval=3, eval_new_tokens=12, pipeline="reference", dtype="fp32", drafter_steps=2,
                   drafter_lr=3e-3, max_length=128, num_anchors=8, pack_length=0, pack_rows=1, curve_points=2,
                   ablation_steps=1, ablations={"original answers": {"train": "original"}},
                   parallel=1, inprocess=True, ablation_convs=12, budget_s=0.0, regen_end_s=0.0),
}
# the long preset's plumbing on this machine's CPU in a few minutes: the tiny target, prompts in every bucket
# (one of 33K tokens), a full and a sliding-window (512) drafter, subprocesses under a budget
PRESETS["cpu-long"] = dataclasses.replace(
    PRESETS["tiny"], long=True, synthetic_files=420, corpus_mb=2.0, heldout_permille=300, seq_len=1024, batch_rows=2,
    target_steps=40, target_budget_s=60.0, target_prefix_chars=(200, 3000), window_chars=1500, n_prompts=12,
    doc_tokens=(2500, 4000), train_prompt_tokens=((100, 1500), (2100, 3000)),
    eval_prompt_tokens=((100, 1500), (2100, 3000), (8300, 9000), (32900, 33300)), eval_per_bucket=(2, 1, 1, 1),
    n_eval=5, eval_new_tokens=8, max_length=3328, drafter_steps=40, ablation_steps_as_main=True, curve_points=1,
    ablations={"base": {}, "sliding 512": {"sliding_window": 512}}, parallel=2, first_alone=False, inprocess=False,
    budget_s=900.0,
    eval_reserve_s=400.0, drafter_rate=0.0, trainer_eval="eval-short.jsonl", tau_from_checkpoints=True)


def say(line: str) -> None:
    print(line, flush=True)


# ---------------------------------------------------------------------------- 1. corpus


SYNTHETIC_VERBS = ("count", "scale", "merge", "parse", "render", "split", "check", "load", "store", "sort")
SYNTHETIC_NOUNS = ("values", "items", "rows", "names", "tokens", "lines", "blocks", "paths", "steps", "points")


def write_synthetic_corpus(root: Path, seed: int, files: int = 40) -> Path:
    """Small generated Python modules of one regular shape (and a test file, which is skipped): the
    tiny preset's corpus. The repository's own files change with every commit, and a target fitted
    for a few steps on them answered greedily with nothing but newlines on some of them (the chat
    template strips those: no answer to train on); on these it learns the shape and answers in code."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        parts = [f'"""Helpers for {rng.choice(SYNTHETIC_NOUNS)} ({i})."""\n\nimport math\n']
        for _ in range(rng.randint(4, 8)):
            verb, noun, k = rng.choice(SYNTHETIC_VERBS), rng.choice(SYNTHETIC_NOUNS), rng.randint(2, 9)
            parts.append(f'\n\ndef {verb}_{noun}({noun}, factor={k}):\n'
                         f'    """{verb.capitalize()} the {noun} by {k}."""\n'
                         f'    total = 0\n'
                         f'    for value in {noun}:\n'
                         f'        total += value * factor\n'
                         f'    return math.floor(total / {k})\n')
        (root / f"module_{i:02d}.py").write_text("".join(parts))
    (root / "test_modules.py").write_text("def test_nothing():\n    assert True\n")
    return root


def source_roots(corpus: str = "machine") -> list[Path]:
    """Where the corpus's .py files come from: the machine's Python installation, this repository
    ("project"), or any directory ("synthetic": write_synthetic_corpus's, under the output)."""
    if corpus == "project":
        return [ROOT]
    if corpus != "machine":
        if not Path(corpus).is_dir():
            raise SystemExit(f"quality: corpus {corpus!r}: expected 'machine', 'project' or a directory")
        return [Path(corpus).resolve()]
    paths = sysconfig.get_paths()
    roots = [paths["stdlib"], paths["purelib"], paths["platlib"]]
    try:
        roots += site.getsitepackages()
    except AttributeError:  # virtualenv's old site module
        pass
    out: list[Path] = []
    for r in roots:
        p = Path(r).resolve()
        if p.is_dir() and not any(p == o or o in p.parents for o in out):
            out = [o for o in out if p not in o.parents] + [p]
    return sorted(out)


def is_test_file(rel: Path) -> bool:
    name = rel.name
    if name.startswith("test_") or name.endswith("_test.py") or name == "conftest.py" or name == "tests.py":
        return True
    return any(part in TEST_DIRS or part.startswith("test_") for part in rel.parts[:-1])


def _read(path: Path, max_file_bytes: int):
    try:
        if path.stat().st_size > max_file_bytes:
            return path, None, "large"
        data = path.read_bytes()
    except OSError:
        return path, None, "unreadable"
    return path, data, hashlib.sha256(data).hexdigest()


def collect_sources(max_bytes: int, max_file_bytes: int, heldout_permille: int, seed: int,
                    corpus: str = "machine") -> dict:
    """{train: [text], heldout: [text], stats} from the Python sources under source_roots(corpus)."""
    from concurrent.futures import ThreadPoolExecutor

    roots = source_roots(corpus)
    files = []
    skipped = {"test": 0, "large": 0, "unreadable": 0, "not utf-8": 0, "duplicate": 0, "special tokens": 0,
               "empty": 0}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
            base = Path(dirpath)
            for name in sorted(filenames):
                if not name.endswith(".py"):
                    continue
                path = base / name
                if is_test_file(path.relative_to(root)):
                    skipped["test"] += 1
                else:
                    files.append(path)
    found = len(files) + skipped["test"]
    random.Random(seed).shuffle(files)  # a byte budget then samples every package, not the first few
    seen: set[str] = set()
    train: list[str] = []
    heldout: list[str] = []
    total = 0
    dirs: dict[str, list[str]] = {"train": [], "heldout": []}  # each text's directory: its package
    with ThreadPoolExecutor(max_workers=min(16, (os.cpu_count() or 2) * 2)) as pool:
        for path, data, digest in pool.map(lambda f: _read(f, max_file_bytes), files, chunksize=64):
            if total >= max_bytes:
                break
            if data is None:
                skipped[digest] += 1
                continue
            if digest in seen:
                skipped["duplicate"] += 1
                continue
            seen.add(digest)
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                skipped["not utf-8"] += 1
                continue
            if not text.strip():
                skipped["empty"] += 1
                continue
            if any(s in text for s in SPECIALS):
                skipped["special tokens"] += 1
                continue
            side = "heldout" if int(digest[:8], 16) % 1000 < heldout_permille else "train"
            (heldout if side == "heldout" else train).append(text)
            dirs[side].append(str(path.parent))
            total += len(data)
    stats = {"roots": [str(r) for r in roots], "files_found": found, "train_files": len(train),
             "heldout_files": len(heldout), "train_mb": round(sum(map(len, train)) / 1e6, 2),
             "heldout_mb": round(sum(map(len, heldout)) / 1e6, 2), "skipped": skipped}
    return {"train": train, "heldout": heldout, "stats": stats, "train_dirs": dirs["train"],
            "heldout_dirs": dirs["heldout"]}


# ---------------------------------------------------------------------------- windows and chat text


def windows(text: str, rng: random.Random, prefix_chars: tuple[int, int], answer_chars: int):
    """(prefix, continuation) pairs cut at line boundaries, one after the other through the file."""
    lines = text.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        want = rng.randint(*prefix_chars)
        j, n = i, 0
        while j < len(lines) and n < want:
            n += len(lines[j])
            j += 1
        k, m = j, 0
        while k < len(lines) and m < answer_chars:
            m += len(lines[k])
            k += 1
        prefix, answer = "".join(lines[i:j]), "".join(lines[j:k])
        if prefix.strip() and answer.strip() and m >= answer_chars // 4:
            yield prefix, answer
        i = k


def render(user: str, answer: str) -> str:
    """Qwen3's chat template for [user, assistant] (checked against apply_chat_template at run time)."""
    return (f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
            f"{answer.lstrip(chr(10))}<|im_end|>\n")


def check_render(tokenizer, pairs) -> None:
    for user, answer in pairs:
        expected = tokenizer.apply_chat_template([{"role": "user", "content": user},
                                                  {"role": "assistant", "content": answer}], tokenize=False)
        if expected != render(user, answer):
            raise SystemExit(f"quality: the fast chat rendering differs from the template:\n{expected!r}\n"
                             f"{render(user, answer)!r}")


# ---------------------------------------------------------------------------- 3. target


def target_dims(p: Preset) -> dict:
    return dict(hidden_size=p.hidden, num_hidden_layers=p.layers, num_attention_heads=p.heads,
                num_key_value_heads=p.kv_heads, head_dim=p.head_dim, intermediate_size=p.intermediate)


def token_rows(tok, texts: list[str], seq_len: int) -> torch.Tensor:
    """Texts tokenized (in parallel), concatenated and cut into rows of seq_len tokens."""
    ids = [np.asarray(e.ids, dtype=np.int32) for e in tok.encode_batch(texts, add_special_tokens=False)]
    flat = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int32)
    n = len(flat) // seq_len
    return torch.from_numpy(flat[: n * seq_len].astype(np.int64)).view(n, seq_len)


class RowStream:
    """Training rows for the target, tokenized by a background thread while the GPU trains.

    Files in the corpus order, each cut into windows, rendered as chat turns, shuffled within a
    chunk of `chunk` windows, tokenized (the tokenizer runs on all cores and releases the GIL) and
    cut into rows. Deterministic for a seed. After the last file it starts over (a 2nd epoch)."""

    def __init__(self, tok, texts: list[str], p: Preset, seed: int, rows: int, chunk: int = 2048):
        import queue
        import threading

        self.tok, self.texts, self.p, self.chunk = tok, texts, p, chunk
        self.rng = random.Random(seed)
        self.queue: queue.Queue = queue.Queue(maxsize=16)
        self.windows = 0
        self.passes = 0
        self.rows_wanted, self.rows_made = rows, 0
        self.buffer = torch.zeros(0, p.seq_len, dtype=torch.long)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._produce, name="target-rows", daemon=True)
        self.thread.start()

    def _produce(self) -> None:
        pending: list[str] = []
        chunk = min(256, self.chunk)  # a small first chunk: training starts at once
        while True:
            for text in self.texts:
                for u, a in windows(text, self.rng, self.p.target_prefix_chars or self.p.prefix_chars,
                                    self.p.window_chars):
                    pending.append(render(u, a))
                if len(pending) >= chunk:
                    self._emit(pending)
                    pending, chunk = [], self.chunk
                if self.stop.is_set() or self.rows_made >= self.rows_wanted:
                    return
            self.passes += 1
            if pending:
                self._emit(pending)
                pending = []

    def _emit(self, texts: list[str]) -> None:
        import queue

        self.rng.shuffle(texts)
        self.windows += len(texts)
        rows = token_rows(self.tok, texts, self.p.seq_len)
        self.rows_made += len(rows)
        while not self.stop.is_set():
            try:
                self.queue.put(rows, timeout=0.5)
                return
            except queue.Full:
                continue

    def take(self, n: int) -> torch.Tensor:
        while len(self.buffer) < n:
            self.buffer = torch.cat([self.buffer, self.queue.get()])
        rows, self.buffer = self.buffer[:n], self.buffer[n:]
        return rows

    def close(self) -> None:
        self.stop.set()
        while not self.queue.empty():
            self.queue.get_nowait()


def lm_loss(model, rows: torch.Tensor, device: str, batch: int, autocast) -> float:
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad(), autocast():
        for i in range(0, len(rows), batch):
            x = rows[i:i + batch].to(device)
            out = model(input_ids=x, labels=x)
            total += float(out.loss) * x.numel()
            count += x.numel()
    model.train()
    return total / max(count, 1)


RESIZE_AT = 10  # target steps timed before target_budget_s resizes the schedule


def write_target(model: torch.nn.Module, p: Preset, tok: Any, where: Path) -> Path:
    """The target as a Hugging Face model directory (bf16 weights in two shards, the tokenizer beside them)."""
    from trainer_tools.fixtures.hub_model import write_hub_model

    state = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
    return write_hub_model(where, "qwen3", target_dims(p), seed=p.seed, dtype="bfloat16", shards=2, state_dict=state,
                           tokenizer=tok)


def train_target(p: Preset, tok, corpus: dict, out: Path, rng: random.Random,
                 chars_per_token: float) -> tuple[Path, dict]:
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer_tools.fixtures.hub_model import model_config

    started = time.time()
    p = dataclasses.replace(p)  # target_steps may be resized to target_budget_s below
    texts, held_texts = corpus.get("train_docs", corpus["train"]), corpus.get("heldout_docs", corpus["heldout"])
    stream = RowStream(tok, texts, p, p.seed, p.target_steps * p.batch_rows)
    held_pairs = []
    for text in held_texts:
        held_pairs += list(windows(text, rng, p.target_prefix_chars or p.prefix_chars, p.window_chars))
        if len(held_pairs) * p.window_chars > 2 * p.heldout_rows * p.seq_len * 4:
            break
    held_rows = token_rows(tok, [render(u, a) for u, a in held_pairs], p.seq_len)[: p.heldout_rows]
    data_seconds = time.time() - started
    config = model_config("qwen3", target_dims(p), tok, "bfloat16")
    cfg = AutoConfig.for_model(**{k: v for k, v in config.items()
                                  if k not in ("architectures", "torch_dtype", "transformers_version")})
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(p.seed)
    model = AutoModelForCausalLM.from_config(cfg).to(p.device)
    params = sum(t.numel() for t in model.parameters())
    cuda = p.device.startswith("cuda")

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)

    opt = torch.optim.AdamW(model.parameters(), lr=p.target_lr, betas=(0.9, 0.95), weight_decay=0.1,
                            **({"fused": True} if cuda else {}))

    def lr_at(step: int) -> float:
        if step < p.target_warmup:
            return p.target_lr * (step + 1) / p.target_warmup
        progress = (step - p.target_warmup) / max(1, p.target_steps - p.target_warmup)
        return p.target_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    forward = torch.compile(model) if p.compile_target else model
    model.train()
    losses = []
    snapshots: list[dict] = []
    seen_rows = None
    t0 = time.time()
    step = -1
    while step + 1 < p.target_steps:
        step += 1
        if step == 2:
            t2 = time.time()  # the first steps' start-up (allocations, kernels) left out of the rate
        if step == RESIZE_AT and p.target_budget_s:  # still warming up: the schedule is resized to fit
            rate = (RESIZE_AT - 2) / (time.time() - t2)
            fit = RESIZE_AT + int((p.target_budget_s - (time.time() - started)) * rate)
            if fit < p.target_steps:
                say(f"target: {max(fit, RESIZE_AT + 1)} steps of {p.target_steps} fit target_budget_s "
                    f"{p.target_budget_s:g}s ({rate:.2f} steps/s)")
                p.target_steps = max(fit, RESIZE_AT + 1)
        rows = stream.take(p.batch_rows)
        if seen_rows is None:
            seen_rows = rows[: p.heldout_rows].clone()
        x = rows.pin_memory().to(p.device, non_blocking=True) if cuda else rows
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        with autocast():
            loss = forward(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % max(1, p.target_steps // 10) == 0 or step == p.target_steps - 1:
            losses.append((step, round(loss.item(), 4)))
            say(f"target step {step}/{p.target_steps} loss {losses[-1][1]:.3f} "
                f"({(step + 1) * p.batch_rows * p.seq_len / (time.time() - t0):.0f} tok/s)")
        if step + 1 in p.target_snapshots and step + 1 < p.target_steps:
            held = round(lm_loss(model, held_rows, p.device, p.batch_rows, autocast), 4)
            snapshots.append({"step": step + 1, "lm_loss_heldout_rows": held,
                              "model_dir": str(write_target(model, p, tok, out / f"model-step{step + 1}"))})
            say(f"target snapshot at step {step + 1}: held-out LM loss {held:.3f} ({snapshots[-1]['model_dir']})")
    if cuda:
        torch.cuda.synchronize()
    train_seconds = time.time() - t0
    stream.close()
    if seen_rows is None:
        raise SystemExit(f"quality: target_steps {p.target_steps}: the target trained no step")
    rows_needed = p.target_steps * p.batch_rows
    chars = sum(map(len, texts))
    available = chars / chars_per_token  # estimated: the stream tokenizes only what training takes
    epochs = rows_needed * p.seq_len / available
    result = {
        "params": params, "dims": target_dims(p), "vocab_size": config["vocab_size"], "seq_len": p.seq_len,
        "steps": p.target_steps, "batch_tokens": p.batch_rows * p.seq_len,
        "tokens_trained": rows_needed * p.seq_len, "tokens_available_est": round(available),
        "epochs": round(epochs, 3), "train_windows_tokenized": stream.windows, "corpus_passes": stream.passes,
        "heldout_windows": len(held_pairs), "data_seconds": round(data_seconds, 1),
        "train_seconds": round(train_seconds, 1), "tokens_per_s": round(rows_needed * p.seq_len / train_seconds),
        "loss_curve": losses,
        "lm_loss_seen_train_rows": round(lm_loss(model, seen_rows, p.device, p.batch_rows, autocast), 4),
        "lm_loss_heldout_rows": round(lm_loss(model, held_rows, p.device, p.batch_rows, autocast), 4),
        "heldout_rows": len(held_rows), "snapshots": snapshots,
    }
    say(f"target: {params / 1e6:.1f}M params (Qwen3, {p.layers} layers, hidden {p.hidden}), {p.target_steps} steps x "
        f"{p.batch_rows * p.seq_len} tokens = {result['tokens_trained'] / 1e6:.1f}M tokens = {epochs:.2f} epochs of "
        f"~{available / 1e6:.0f}M (est. {chars_per_token:.2f} chars/token), {train_seconds:.0f}s ({result['tokens_per_s']:.0f} tok/s)")
    say(f"target LM loss: {result['lm_loss_seen_train_rows']:.3f} on {len(seen_rows)} rows it trained on, "
        f"{result['lm_loss_heldout_rows']:.3f} on {len(held_rows)} rows of held-out files "
        f"(nats/token, seq {p.seq_len})")
    model_dir = write_target(model, p, tok, out / "model")
    result["model_dir"] = str(model_dir)
    del model, forward, opt
    if cuda:
        torch.cuda.empty_cache()
    return model_dir, result


# ---------------------------------------------------------------------------- 4. prompts


def write_jsonl(path: Path, records) -> Path:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path


def cut_tokens(tok, texts: list[str], n: int) -> list[str]:
    return [tok.decode(e.ids[:n]) for e in tok.encode_batch(texts, add_special_tokens=False)]


MIN_EVAL_ANSWER = 8  # answer tokens a held-out conversation keeps within max_length (the trainer needs 2)


def prompt_tokens(tok, users: list[str]) -> list[int]:
    """Tokens of the prompt the evaluation and regen render for each user turn (render(user, "") up to
    the generation prompt; enable_thinking false), in one batch (the tokenizer's threads)."""
    end = len("<|im_end|>\n")
    return [len(e.ids) for e in tok.encode_batch([render(u, "")[:-end] for u in users], add_special_tokens=False)]


def fits(tok, p: Preset, user: str, answer: str) -> bool:
    """Whether a held-out (prompt, answer) keeps MIN_EVAL_ANSWER answer tokens after the trainer
    cuts the rendered conversation to max_length: a window that does not is useless for τ."""
    [n_prompt] = prompt_tokens(tok, [user])
    n_answer = len(tok.encode(answer, add_special_tokens=False).ids)
    return n_prompt + min(n_answer, MIN_EVAL_ANSWER) <= p.max_length and n_answer >= MIN_EVAL_ANSWER


# ---------------------------------------------------------------------------- long contexts (issue #35)


def long_documents(texts: list[str], dirs: list[str], chars: tuple[int, int], rng: random.Random) -> list[str]:
    """Files of one directory (a package) concatenated, in path order within it, into documents of
    `chars` characters (a random length in that range each); a package's remainder shorter than the
    lower end carries on into the next package's files. Deterministic for the rng's seed."""
    by_dir: dict[str, list[str]] = {}
    for text, d in zip(texts, dirs):
        by_dir.setdefault(d, []).append(text)
    docs, part, size, want = [], [], 0, rng.randint(*chars)
    for d in sorted(by_dir):
        for text in by_dir[d]:
            part.append(text if text.endswith("\n") else text + "\n")
            size += len(part[-1])
            if size >= want:
                docs.append("\n".join(part)[: chars[1]])
                part, size, want = [], 0, rng.randint(*chars)
    return docs


def long_pairs(tok, docs: list[str], ranges, counts, rng: random.Random, answer_chars: int) -> list[list]:
    """Per token range, up to counts[i] (prompt, continuation) pairs cut from `docs` at a line
    boundary, whose rendered prompt (prompt_tokens) lies inside the range: [[pairs of range 0], ...].
    Documents that reach the whole range are cut first; fewer documents than pairs: several cuts of
    each. Tokenised in batches (the tokenizer's threads): thousands of 16K-token prompts take seconds."""
    order = list(range(len(docs)))
    rng.shuffle(order)
    sample = [docs[i] for i in order[: max(8, 2 * sum(counts))]]
    encoded = list(zip(sample, tok.encode_batch(sample, add_special_tokens=False)))
    out: list[list] = []
    for (lo, hi), count in zip(ranges, counts):
        room = [(d, e) for d, e in encoded if len(e.ids) > lo + 64]
        room = room * (-(-2 * count // len(room)) if room else 0)
        rng.shuffle(room)
        room.sort(key=lambda de: len(de[1].ids) < hi)  # documents that can reach anywhere in the range first
        candidates = []
        for d, e in room[: 2 * count]:  # twice the pairs wanted: a cut can land outside the range
            n = rng.randint(lo, min(hi, len(e.ids) - 32))
            cut = d.rfind("\n", 0, e.offsets[n - 16][1]) + 1  # a line boundary just before token n - 16
            if d[:cut].strip() and d[cut:cut + answer_chars].strip():
                candidates.append((d[:cut], d[cut:cut + answer_chars]))
        sizes = prompt_tokens(tok, [u for u, _ in candidates])
        out.append([c for c, n in zip(candidates, sizes) if lo <= n <= hi][:count])
    return out


def write_long_prompts(p: Preset, tok, corpus: dict, data: Path, rng: random.Random) -> dict:
    """prompts.jsonl / original.jsonl from the train documents, an equal share of p.n_prompts in each
    of p.train_prompt_tokens; eval.jsonl: p.eval_per_bucket held-out prompts in each of
    p.eval_prompt_tokens (held-out documents), shortest first; p.trainer_eval: the first range's."""
    per = -(-p.n_prompts // len(p.train_prompt_tokens))
    train_docs = corpus["train_docs"]
    groups = long_pairs(tok, train_docs, p.train_prompt_tokens, [per] * len(p.train_prompt_tokens), rng,
                        p.answer_tokens * 5)
    pairs = [pair for g in groups for pair in g][: p.n_prompts]
    answers = cut_tokens(tok, [a for _, a in pairs], p.answer_tokens)
    # similar prompt lengths batch together, the longest first: regen's deadline cuts the short ones, the cheapest
    order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0]))
    write_jsonl(data / "prompts.jsonl", ({"id": f"p{i}", "messages": [{"role": "user", "content": pairs[i][0]}]}
                                         for i in order))
    write_jsonl(data / "original.jsonl", ({"id": f"p{i}", "messages": [{"role": "user", "content": pairs[i][0]},
                                                                       {"role": "assistant", "content": answers[i]}]}
                                          for i in order))
    held = long_pairs(tok, corpus["heldout_docs"], p.eval_prompt_tokens, p.eval_per_bucket, rng, p.answer_tokens * 5)
    missing = [f"{lo}-{hi}" for (lo, hi), g in zip(p.eval_prompt_tokens, held) if not g]
    if missing:
        raise SystemExit(f"quality: prompts: no held-out document is long enough for a prompt of {', '.join(missing)} "
                         f"tokens ({len(corpus['heldout_docs'])} held-out documents); raise corpus_mb or heldout_permille")
    conv = [{"messages": [{"role": "user", "content": u}, {"role": "assistant", "content": a}]} for g in held for u, a in g]
    write_jsonl(data / "eval.jsonl", conv)
    write_jsonl(data / p.trainer_eval, conv[: len(held[0])])
    by_range = {f"{lo}-{hi}": len(g) for (lo, hi), g in zip(p.eval_prompt_tokens, held)}
    stats = {"prompts": len(pairs), "eval_prompts": len(conv), "eval_by_tokens": by_range,
             "train_by_tokens": {f"{lo}-{hi}": len(g) for (lo, hi), g in zip(p.train_prompt_tokens, groups)},
             "prompt_chars_mean": round(sum(len(u) for u, _ in pairs) / max(len(pairs), 1)),
             "train_docs": len(train_docs), "heldout_docs": len(corpus["heldout_docs"])}
    say(f"prompts: {len(pairs)} prefixes of {len(train_docs)} train documents by prompt tokens "
        f"{stats['train_by_tokens']}; {len(conv)} held-out prompts of {len(corpus['heldout_docs'])} held-out "
        f"documents by prompt tokens {by_range}")
    return {"stats": stats, "check": pairs[:4] + [pair for g in held for pair in g[:1]],
            "ids": [f"p{i}" for i in order]}


def write_prompts(p: Preset, tok, corpus: dict, data: Path, rng: random.Random) -> dict:
    """prompts.jsonl (regen input), original.jsonl (same prompts, original answers), eval.jsonl."""
    pairs = []
    for text in corpus["train"]:  # at most 4 windows a file: prompts from many files
        pairs += [w for _, w in zip(range(4), windows(text, rng, p.prefix_chars, p.answer_tokens * 5))]
        if len(pairs) >= 2 * p.n_prompts:
            break
    rng.shuffle(pairs)
    # a window of one enormous line (minified data) is a prompt of thousands of tokens: one in a regen batch of
    # 16,384 widens every row's cache to it, and the trainer would cut its answer off at max_length anyway
    sizes = prompt_tokens(tok, [u for u, _ in pairs])
    kept = [i for i, n in enumerate(sizes) if n + MIN_EVAL_ANSWER <= p.max_length][: p.n_prompts]
    too_long = sum(n + MIN_EVAL_ANSWER > p.max_length for n in sizes)
    pairs, sizes = [pairs[i] for i in kept], [sizes[i] for i in kept]
    answers = cut_tokens(tok, [a for _, a in pairs], p.answer_tokens)
    order = sorted(range(len(pairs)), key=lambda i: sizes[i])  # similar prompt lengths batch together
    write_jsonl(data / "prompts.jsonl", ({"id": f"p{i}", "messages": [{"role": "user", "content": pairs[i][0]}]}
                                         for i in order))
    write_jsonl(data / "original.jsonl", ({"id": f"p{i}", "messages": [{"role": "user", "content": pairs[i][0]},
                                                                       {"role": "assistant", "content": answers[i]}]}
                                          for i in order))
    held = []
    for text in corpus["heldout"]:  # one window per held-out file: as many files as prompts
        w = next((w for w in windows(text, rng, p.prefix_chars, p.answer_tokens * 5) if fits(tok, p, *w)), None)
        if w is not None:
            held.append(w)
    if not held:
        raise SystemExit(f"quality: prompts: none of the {len(corpus['heldout'])} held-out files has a window whose "
                         f"prompt leaves {MIN_EVAL_ANSWER} answer tokens within max_length {p.max_length}")
    rng.shuffle(held)
    held = held[: p.n_eval]
    write_jsonl(data / "eval.jsonl", ({"messages": [{"role": "user", "content": u},
                                                    {"role": "assistant", "content": a}]} for u, a in held))
    check_render_pairs = pairs[:8] + held[:4]
    stats = {"prompts": len(pairs), "eval_prompts": len(held),
             "prompt_chars_mean": round(sum(len(u) for u, _ in pairs) / max(len(pairs), 1)),
             "prompt_tokens_max": max(sizes, default=0), "windows_too_long": too_long, "eval_files": len(held)}
    say(f"prompts: {len(pairs)} code prefixes of train files ({p.prefix_chars[0]}-{p.prefix_chars[1]} chars, mean "
        f"{stats['prompt_chars_mean']}, at most {stats['prompt_tokens_max']} tokens; {too_long} windows left out whose "
        f"prompt leaves no answer within max_length {p.max_length}); {len(held)} held-out prompts, one per held-out file")
    return {"stats": stats, "check": check_render_pairs, "ids": [f"p{i}" for i in order]}


OTHER_STYLES = ("signature", "question", "middle")  # other.jsonl's forms, in turn over the held-out files
QUOTES = ('"""', "'''")


def other_style(text: str, form: str, rng: random.Random, answer_chars: int) -> tuple[str, str] | None:
    """One held-out file's prompt of another form than every training prompt (a bare code prefix):
    `signature` a function's signature and docstring alone, asked to be implemented; `question` a prose
    question about a piece of the file; `middle` the lines around a gap, asked to fill it. The answer is
    the original text (τ is measured against the target's own answer; it only gives the row its shape)."""
    lines = text.splitlines(keepends=True)
    if len(lines) < 6:
        return None
    if form == "signature":
        for i, line in enumerate(lines[:-2]):
            quote = lines[i + 1].strip()[:3]
            if not (line.lstrip().startswith("def ") and quote in QUOTES):
                continue
            j = i + 1  # the docstring's last line: where its quotes close
            while j < len(lines) and "".join(lines[i + 1:j + 1]).count(quote) < 2:
                j += 1
            head, body = "".join(lines[i:j + 1]), "".join(lines[j + 1:j + 12])
            if body.strip():
                return f"Implement this function:\n\n{head}", body[:answer_chars]
        return None
    cut = rng.randint(1, len(lines) - 5)
    if form == "question":
        piece = "".join(lines[cut:cut + 3])  # short: the tiny preset's 128-token rows hold it with an answer
        return f"What does this code do, and what comes next?\n\n{piece}", "".join(lines[cut + 3:cut + 12])[:answer_chars] or piece
    before, gap, after = "".join(lines[max(0, cut - 6):cut]), "".join(lines[cut:cut + 3]), "".join(lines[cut + 3:cut + 9])
    return f"Fill in the lines missing at <GAP>:\n\n{before}<GAP>\n{after}", gap[:answer_chars]


def write_other_prompts(p: Preset, tok, corpus: dict, data: Path, rng: random.Random) -> dict:
    """other.jsonl: up to p.n_eval held-out prompts in the OTHER_STYLES forms, each held-out file's form in turn
    (else the next one that the file gives)."""
    rows, by_form = [], {form: 0 for form in OTHER_STYLES}
    for i, text in enumerate(corpus["heldout"]):
        for k in range(len(OTHER_STYLES)):
            form = OTHER_STYLES[(i + k) % len(OTHER_STYLES)]
            pair = other_style(text, form, rng, p.answer_tokens * 5)
            if pair is not None and fits(tok, p, *pair):
                rows.append({"form": form, "messages": [{"role": "user", "content": pair[0]},
                                                         {"role": "assistant", "content": pair[1]}]})
                by_form[form] += 1
                break
        if len(rows) >= p.n_eval:
            break
    write_jsonl(data / "other.jsonl", rows)
    say(f"prompts of another style: {len(rows)} held-out prompts in other.jsonl ({by_form})")
    return {"prompts": len(rows), "by_form": by_form}


# ---------------------------------------------------------------------------- 5. regen / 6. trainer


ENV = {"PYTHONUNBUFFERED": "1"}
MIN_WORK_S = 20.0  # a stage stopped at a deadline runs at least this long after its first output
KILL_AFTER_S = 60.0  # a trainer run that has not stopped this long after SIGTERM is killed
SIGINT_KILL_AFTER_S = 30.0  # the fallback: regen cancels its batch in flight and exits within seconds of SIGINT


def child_env() -> dict:
    return {**os.environ, **ENV, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def run_cli(p: Preset, argv: list[str], log: Path, deadline: float | None = None,
            started_work=None, module: str = "trainer") -> tuple[int, float]:
    """`python -m MODULE ARGV` (the trainer, or trainer_tools.regen) as a user runs it (in this process for the CPU test). At the
    deadline the process gets SIGINT (regen: cancels the batch it is decoding and exits 130 with
    whole lines written, within seconds; SIGKILL SIGINT_KILL_AFTER_S later if not, and the log says
    how long it took); a deadline that passes before `started_work()` holds (a cold machine still
    loading and compiling) moves to MIN_WORK_S after it, so the stage always produces something."""
    started = time.time()
    if p.inprocess:
        import contextlib
        import importlib

        main = importlib.import_module("trainer.__main__" if module == "trainer" else module).main

        with open(log, "w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
            rc = main(argv)
        return rc, time.time() - started
    import signal

    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", module, *argv], stdout=f, stderr=subprocess.STDOUT,
                                env=child_env(), cwd=str(ROOT), preexec_fn=default_signals)
        interrupted = sigint_at = None
        while proc.poll() is None:
            if deadline is not None and started_work is not None:
                if started_work():
                    deadline, started_work = max(deadline, time.time() + MIN_WORK_S), None
                else:
                    deadline = max(deadline, time.time() + 1.0)
            if deadline is not None and time.time() > deadline:
                say(f"deadline: SIGINT to `python -m {module}` (pid {proc.pid})")
                proc.send_signal(signal.SIGINT)
                deadline, interrupted = None, time.time()
                sigint_at = interrupted
            if interrupted is not None and time.time() - interrupted > SIGINT_KILL_AFTER_S:
                say(f"deadline: `python -m {module}` still running {SIGINT_KILL_AFTER_S:.0f}s after SIGINT: SIGKILL")
                proc.kill()
                interrupted = None
            time.sleep(0.2)
    if sigint_at is not None:
        say(f"deadline: `python -m {module}` ended (exit {proc.returncode}) {time.time() - sigint_at:.1f}s after SIGINT")
    return proc.returncode, time.time() - started


def default_signals() -> None:
    """In the child: SIGINT and SIGTERM as a terminal gives them (a background shell job inherits
    SIGINT ignored, and Python then never raises KeyboardInterrupt)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def regen_argv(p: Preset, model_dir: Path, data: Path, prompts: str = "prompts.jsonl", out: str = "regen.jsonl",
               samples: int = 0, temperature: float = 1.0, top_p: float = 1.0) -> list[str]:
    """The regen command line: the greedy answers of data/prompts.jsonl, or with `samples` that many
    seeded answers per prompt at `temperature` and `top_p` (regen --samples-per-prompt)."""
    sampling = (["--temperature", f"{temperature:g}", "--top-p", f"{top_p:g}", "--samples-per-prompt", str(samples),
                 "--seed", str(p.seed)] if samples else ["--temperature", "0"])
    return ["--engine", "hf", "--model-path", str(model_dir), "--in", str(data / prompts),
            "--out", str(data / out), "-n", str(p.regen_batch), "--max-tokens", str(p.answer_tokens),
            *sampling, "--device", p.device, "--dtype", "bf16" if p.dtype == "bf16" else "fp32",
            "--extra-body", json.dumps({"chat_template_kwargs": {"enable_thinking": False}})]


def regenerate(p: Preset, model_dir: Path, data: Path, out: Path, deadline: float | None, samples: int = 0) -> dict:
    """regen.jsonl, the greedy answers of the prompts; with `samples`, regen-sampled.jsonl: that many
    answers of each prompt sampled at T = 1. Stopped at the deadline with the rows written so far."""
    name = "regen-sampled" if samples else "regen"
    argv = regen_argv(p, model_dir, data, out=f"{name}.jsonl", samples=samples)
    path, log = data / f"{name}.jsonl", out / f"{name}.log"
    rc, seconds = run_cli(p, argv, log, deadline,
                          started_work=lambda: path.exists() and path.stat().st_size > 0, module="trainer_tools.regen")
    tail = log.read_text().strip().splitlines()
    summary = next((line for line in reversed(tail) if line.startswith("regen: ") and "regenerated" in line), "")
    records = len(read_records(path)) if path.exists() else 0
    if path.exists() and rc != 0:  # keep whole lines only, for the trainer
        write_jsonl(path, read_records(path))
    errors = [line for line in tail if line.startswith("regen: failed")][:3]
    result = {"command": "python -m trainer_tools.regen " + " ".join(argv), "exit": rc, "seconds": round(seconds, 1),
              "summary": summary, "conversations": records,
              "errors": errors}
    say(f"regen: exit {rc}; {summary}; {records} answers written [wall {seconds:.0f}s incl. model load; "
        f"`python -m trainer_tools.regen --engine hf`, batch {p.regen_batch}, "
        f"{f'{samples} sampled a prompt at T = 1' if samples else 'greedy'}, max {p.answer_tokens} tokens]")
    for e in errors:
        say(e)
    return result


def trainer_config(p: Preset, model_dir: Path, train_file: Path, data: Path, steps: int, overrides: dict,
                   checkpoint_every: int) -> dict:
    o = {"drafter_layers": p.drafter_layers, "block_size": p.block_size, "num_target_layers": p.num_target_layers,
         "gamma": p.gamma, "precision": p.target_precision, **{k: v for k, v in overrides.items() if k != "train"}}
    target = {"path": str(model_dir), **({"precision": o["precision"]} if o["precision"] != "bf16" else {})}
    model = {"target": target, "drafter_layers": o["drafter_layers"],
             "block_size": o["block_size"], "num_target_layers": o["num_target_layers"], "attention": "auto",
             "dtype": p.dtype, "loss_chunk": 4096}
    if o.get("target_layer_ids"):  # the target layers tapped, named (the default: spaced from 1 to layers-3)
        model.update(target_layer_ids=[int(i) for i in o["target_layer_ids"]], num_target_layers=len(o["target_layer_ids"]))
    if o["gamma"] is not None:  # gamma shapes the decay weights: an ablation of it trains under decay
        model["gamma"] = float(o["gamma"])
        model["position_weight"] = "decay"
    if o.get("sliding_window"):  # every layer sliding, or the last full_layers of them full
        full = int(o.get("full_layers", 0))
        model["drafter"] = {"layer_types": ["sliding_attention"] * (o["drafter_layers"] - full) + ["full_attention"] * full,
                            "sliding_window": int(o["sliding_window"])}
    if o.get("objective"):
        model.update(OBJECTIVES[o["objective"]])
    if o.get("drafter_precision", "bf16") != "bf16":  # the drafter's matmuls while training (model.drafter.precision)
        model.setdefault("drafter", {})["precision"] = o["drafter_precision"]
    if o.get("drafter_kind", "dflash") != "dflash":  # the drafter's generation (model.drafter.kind: dflash2)
        model.setdefault("drafter", {})["kind"] = o["drafter_kind"]
    cuda = p.device.startswith("cuda")
    data_cfg = {"train_path": str(train_file), "eval_path": str(data / p.trainer_eval),
                "max_length": p.max_length, "num_anchors": p.num_anchors, "token_budget": max(p.max_length, 1024),
                "bucket_edges": [p.max_length // 2, p.max_length], "pad_multiple": 16 if not cuda else 64,
                "seed": p.seed, "enable_thinking": False}  # as render() and regen_argv() render
    if p.pack_length:
        data_cfg.update(pack_length=p.pack_length, pack_rows=p.pack_rows)
        if p.anchors_per_row:
            data_cfg["anchors_per_row"] = p.anchors_per_row
    run_seed = int(o.get("run_seed", p.seed))  # the drafter's initialisation (the data and its order stay the seed's)
    return {
        "model": model,
        "data": data_cfg,
        "optim": {"lr": p.drafter_lr, "warmup_ratio": 0.04, "grad_clip": 1.0, "total_steps": steps,
                  "micro_batches": p.micro_batches},
        "devices": {"target": [p.device], "drafter": [p.device]},
        "pipeline": {"kind": p.pipeline},
        "run": {"log_every": max(1, steps // 50), "checkpoint_every": checkpoint_every, "keep_checkpoints": 100,
                "seed": run_seed, **({"threads": 1} if not cuda else {})},  # tiny CPU shapes: a thread pool only waits
        "eval": {"samples": p.n_eval, "batch": p.n_eval,  # as CheckpointEvaluator, or with short_trainer_eval a check
                 "max_new_tokens": min(64, p.eval_new_tokens) if p.short_trainer_eval else p.eval_new_tokens,
                 "temperatures": [0.0] if p.short_trainer_eval else list(p.temperatures),
                 "draft_sample_method": p.draft_sample_method},
    }


# What the main run's overrides add to a step and to the start-up, against the default drafter (DFlash, ce + dpace)
# that drafter_rate and drafter_startup_s state. Measured on an H100 (bench/RESULTS.md, sixteenth
# session): DFlash2 trained 17.2 steps/s from a cold compile cache and 20.4 from a warm one, against DFlash's ~27
# (one-call recipe, 2 x 8,192-token rows), and its cold start-up took ~90 s against ~45; kl's step costs +15 %
# (thirteenth session's screen). A start-up from a warm cache is shorter: the run then ends its schedule early.
DFLASH2_STEP_COST = 1.45
DFLASH2_EXTRA_STARTUP_S = 45.0
KL_STEP_COST = 1.15


def run_pace(p: Preset, overrides: dict) -> tuple[float, float]:
    """(steps/s, start-up seconds) of a run with these overrides of the drafter config."""
    rate, startup = p.drafter_rate, p.drafter_startup_s
    if overrides.get("drafter_kind", "dflash") == "dflash2":
        rate, startup = rate / DFLASH2_STEP_COST, startup + DFLASH2_EXTRA_STARTUP_S
    if "kl" in str(overrides.get("objective", "")).split("+"):
        rate /= KL_STEP_COST
    return rate, startup


def main_steps(p: Preset, deadline: float | None) -> int:
    """The main run's optimizer steps: p.drafter_steps, or with a deadline and p.drafter_rate, as
    many as fit before it at the pace of its overrides, so the learning-rate schedule ends (decays)
    inside the budget instead of being cut off halfway by the deadline's SIGTERM."""
    if deadline is None or not p.drafter_rate:
        return p.drafter_steps
    rate, startup = run_pace(p, p.main_overrides)
    fit = int((deadline - time.time() - startup) * rate)
    steps = max(p.curve_points + 1, min(p.drafter_steps, fit))
    say(f"drafter: {steps} steps for the main run ({deadline - time.time():.0f}s to its deadline, "
        f"{startup:.0f}s start-up, ~{rate:.3g} steps/s)")
    return steps


def read_run(run_dir: Path) -> dict:
    """A trainer run's figures from its metrics.jsonl: its last evaluation's τ, its last step's loss and
    throughput, its steps (from its stop event, else its last logged step)."""
    from trainer.run.contract import tau_by_temperature

    events = read_events(run_dir)
    evals = [e for e in events if e.get("event") == "eval"]
    steps = [e for e in events if e.get("event") == "step"]
    last = steps[-1] if steps else {}
    ev = evals[-1] if evals else {}
    stops = [e for e in events if e.get("event") == "stop"]
    return {"tau": ev.get("tau"), "tau_per_prompt": ev.get("tau_per_prompt"), "histogram": ev.get("histogram"),
            "acceptance": ev.get("acceptance"),
            "tau_lookup": ev.get("tau_lookup"), "tau_ratio": ev.get("tau_ratio"),
            "tau_by_length": ev.get("tau_by_length"),
            "tau_by_temperature": tau_by_temperature(ev.get("temperatures")) or None,  # sampled, expected, lookup's
            "eval_acc": ev.get("acc"), "eval_samples": ev.get("samples"), "train_loss": last.get("loss"),
            "train_acc": last.get("acc"), "steps": stops[-1]["step"] if stops else last.get("step"),  # steps log every log_every
            "stop": stops[-1].get("reason") if stops else None,
            "pad_share": (sum(e.get("pad_share", 0.0) for e in steps) / len(steps)) if steps else None,
            "tokens_per_s_steady": last.get("tokens_per_s_steady", last.get("tokens_per_s"))}


RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9 _.+=,-]*")  # a run's name, its directory's with - for each space


def run_slug(name: str) -> str:
    """The directory name of a run named `name` (spaces as -); ValueError for a name that is no plain label
    (a / or a leading dot would put the run's files outside the runs directory)."""
    if not RUN_NAME.fullmatch(name):
        raise ValueError(f"run name {name!r}: letters, digits, spaces and _ . + = , - only, starting with a letter "
                         "or digit (it names the run's directory)")
    return name.replace(" ", "-")


def job(name: str, cfg: dict, runs: Path) -> dict:
    slug = run_slug(name)
    cfg_path = runs / f"{slug}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return {"name": name, "argv": ["--config", str(cfg_path), "--run-dir", str(runs / slug)],
            "run_dir": runs / slug, "log": runs / f"{slug}.log", "cfg": cfg}


def started_training(j: dict) -> bool:
    status = read_status(j["run_dir"]) or {}
    return status.get("state") in ("running", "done", "stopped", "failed") and (status.get("step") or 0) > 0


def run_all(p: Preset, jobs: list[dict], deadline: float | None, on_done=None, first_alone: bool = True,
            on_idle=None) -> None:
    """The first job (the main run) starts alone; the others once it trains (they then find its
    compiled kernels in the on-disk cache and the CPU free of its tokenization), p.parallel at a
    time, in the order given (a queue). At the deadline every run still going gets SIGTERM: the
    trainer saves a checkpoint and stops; runs not started by then never start. In-process (the CPU
    test): one after the other. on_done(job), when given, is called as each run ends (its results
    can be written while the others train); first_alone False: the first `p.parallel` start together. A job
    with `expect_s` (its expected wall seconds) does not start when less than that is left to the deadline.
    on_idle(), when given, is called between polls once every run has started, while some still train and the
    deadline has not come: work that would otherwise hold a run back from starting (an evaluation of a
    finished run) is done there, not left to the end. A job runs `python -m trainer ARGV`, or its `module`."""
    def too_late(j: dict) -> bool:  # a run expected to take longer than is left would only be stopped half-trained
        if deadline is None or time.time() + j.get("expect_s", 0.0) <= deadline:
            return False
        j["rc"], j["seconds"] = None, 0.0
        say(f"deadline: trainer run {j['name']!r} not started: {deadline - time.time():.0f}s left, it needs "
            f"~{j.get('expect_s', 0.0):.0f}s")
        return True

    if p.inprocess:
        for j in jobs:
            if too_late(j):
                continue
            j["rc"], j["seconds"] = run_cli(p, j["argv"], j["log"])
            if on_done:
                on_done(j)
        return
    waiting, running = list(jobs), list[dict]()
    stopping = False
    while waiting or running:
        main_ready = (not first_alone or jobs[0] not in running or started_training(jobs[0])
                      or time.time() - jobs[0]["started"] > 90)
        while waiting and len(running) < p.parallel and not stopping and (not running or main_ready):
            j = waiting.pop(0)
            if too_late(j):
                continue
            j["started"] = time.time()
            j["proc"] = subprocess.Popen([sys.executable, "-m", j.get("module", "trainer"), *j["argv"]], stdout=open(j["log"], "w"),
                                         stderr=subprocess.STDOUT, env=child_env(), cwd=str(ROOT),
                                         preexec_fn=default_signals)
            running.append(j)
            if j is jobs[0] and first_alone:
                break
        time.sleep(0.5)
        if deadline is not None and time.time() > deadline and not stopping:
            stopping = True
            for j in running:
                say(f"deadline: SIGTERM to trainer run {j['name']!r} (it checkpoints and stops)")
                j["proc"].terminate()
                j["terminated"] = time.time()
            for j in waiting:
                j["rc"], j["seconds"] = None, 0.0
                say(f"deadline: trainer run {j['name']!r} never started")
            waiting = []
        for j in list(running):
            if j.get("terminated") and time.time() - j["terminated"] > KILL_AFTER_S and j["proc"].poll() is None:
                say(f"deadline: trainer run {j['name']!r} still running {KILL_AFTER_S:.0f}s after SIGTERM: SIGKILL")
                j["proc"].kill()
            if j["proc"].poll() is not None:
                j["rc"], j["seconds"] = j["proc"].returncode, time.time() - j["started"]
                running.remove(j)
                say(f"trainer run {j['name']!r}: exit {j['rc']} after {j['seconds']:.0f}s ({read_run(j['run_dir'])['steps']} steps)")
                if on_done:
                    on_done(j)
        if on_idle and running and not waiting and not stopping:
            on_idle()


# ---------------------------------------------------------------------------- evaluation of checkpoints


class CheckpointEvaluator:
    """τ of saved checkpoints with the trainer's own evaluation (one target load for all)."""

    def __init__(self, p: Preset, model_dir: Path, data: Path, other: bool = True):
        """other: also the prompts of another style (data/other.jsonl, when written)."""
        from transformers import AutoTokenizer

        from trainer.data.chat import read_conversations
        from trainer.models.target import FrozenHead, freeze, load_target

        self.p = p
        dtype = torch.bfloat16 if p.dtype == "bf16" else torch.float32
        self.target = freeze(load_target(str(model_dir), p.device, dtype))
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.head = FrozenHead.from_target(self.target, p.device)
        self.conversations = read_conversations(data / "eval.jsonl")[: p.n_eval]
        self.lookup: dict | None = None  # n-gram prompt lookup's τ: the same for every checkpoint, measured once
        self.lookup_by_length: dict = {}  # and per prompt-length bucket
        others = data / "other.jsonl"  # prompts of another style (write_other_prompts); its lookup τ measured once
        self.others = (read_conversations(others)[: p.n_eval] if other and others.exists() and others.stat().st_size
                       else [])
        self.other_lookup: float | None = None
        self.set_lookups: dict[str, dict] = {}  # per prompt set and temperature: lookup's τ, measured once
        # per split of a set's prompts (tau_by_form, tau_by_repetition), set and temperature: lookup's τ per part
        self.split_lookups: dict[tuple[str, str, str], dict] = {}
        from trainer.generate.sampling_params import Sampling

        self.proposals = Sampling(draft=p.draft_sample_method)  # at each temperature

    def __call__(self, ck: Path, temperatures: tuple = (0.0,),
                 proposals: tuple[DraftSampleMethod, ...] | None = None) -> dict:
        """τ of checkpoint `ck` at T = 0 (the held-out and other-style prompts), and with more than one of
        `temperatures` each set's τ at each (sampled and expected, lookup's beside: tau_by_set[set]
        ["tau_by_temperature"]; the held-out set's also as "tau_by_temperature"). proposals: the engine's at
        T > 0 (default the preset's draft_sample_method); the point is the first's, and with more than one,
        "tau_by_proposals" {method: {set: tau_by_temperature}} holds each's. T = 0 is decoded once: there every
        method proposes the draft's argmax."""
        from trainer.models.drafter import DFlashDrafter, DrafterConfig

        p = self.p
        methods = proposals or (self.proposals.draft,)
        weights = load_weights(ck)  # checked against its manifest
        with torch.device(p.device):
            drafter = DFlashDrafter(DrafterConfig.from_dict(weights["drafter_config"]))
        drafter.load_state_dict(weights["model"])
        drafter.float().eval()
        started = time.time()
        hot = [t for t in temperatures if t]
        r = self.reports(drafter, self.conversations, hot, methods, self.lookup is None)
        if self.lookup is None:
            self.lookup = {k: r[methods[0]][k] for k in ("tau_lookup", "tau_lookup_per_prompt", "lookup_histogram",
                                                          "lookup_same_output")}
            self.lookup_by_length = {name: b["tau_lookup"] for name, b in r[methods[0]]["tau_by_length"].items()}
        by_method = {m: {"heldout": self.beside_lookup("heldout", r[m]["temperatures"])} for m in methods}
        first = r[methods[0]]
        ratio = first["tau"] / self.lookup["tau_lookup"] if self.lookup["tau_lookup"] else None
        by_set = {"heldout": {"tau": first["tau"], "tau_per_prompt": first["tau_per_prompt"],
                              "samples": first["samples"], "tau_lookup": self.lookup["tau_lookup"], "tau_ratio": ratio,
                              "tau_by_temperature": by_method[methods[0]]["heldout"],
                              "tau_by_repetition": self.split_beside_lookup("tau_by_repetition", "heldout",
                                                                            first["temperatures"])}}
        if self.others:
            o = self.reports(drafter, self.others, hot, methods, self.other_lookup is None)
            if self.other_lookup is None:
                self.other_lookup = o[methods[0]]["tau_lookup"]
            for m in methods:
                by_method[m]["other"] = self.beside_lookup("other", o[m]["temperatures"])
            oo = o[methods[0]]
            by_set["other"] = {"tau": oo["tau"], "tau_per_prompt": oo["tau_per_prompt"], "samples": oo["samples"],
                               "tau_lookup": self.other_lookup,
                               "tau_ratio": oo["tau"] / self.other_lookup if self.other_lookup else None,
                               "tau_by_temperature": by_method[methods[0]]["other"],
                               "tau_by_form": self.split_beside_lookup("tau_by_form", "other", oo["temperatures"]),
                               "tau_by_repetition": self.split_beside_lookup("tau_by_repetition", "other",
                                                                             oo["temperatures"])}
        by_length = {name: {**b, "tau_lookup": self.lookup_by_length.get(name),
                            "tau_ratio": b["tau"] / self.lookup_by_length[name] if self.lookup_by_length.get(name)
                            else None} for name, b in first["tau_by_length"].items()}
        return {"step": step_of(ck), "tau": first["tau"], "tau_per_prompt": first["tau_per_prompt"],
                **self.lookup, "tau_ratio": ratio, "tau_by_length": by_length, "tau_by_set": by_set,
                "histogram": first["histogram"], "acceptance": first["acceptance"], "samples": first["samples"],
                "tau_by_temperature": by_set["heldout"]["tau_by_temperature"],
                **({"tau_by_proposals": by_method} if len(methods) > 1 else {}),
                "eval_seconds": round(time.time() - started, 1),
                "checkpoint": str(ck)}

    def reports(self, drafter: Any, conversations: list[dict], hot: list[float],
                methods: tuple[DraftSampleMethod, ...], first: bool) -> dict:
        """{method: temperature_reports at T = 0 and each of `hot`}: T = 0 decoded once, with the first method
        (lookup and, with the preset's ceiling, the target drafting for itself beside it when `first`: they are
        the same for every checkpoint); each later method decodes only `hot` and shares that T = 0 report."""
        from trainer.generate.evaluate import temperature_label, temperature_reports
        from trainer.train.loop import autocast_for

        out: dict[str, dict] = {}
        for i, m in enumerate(methods):
            temps = [0.0, *hot] if i == 0 else hot
            if not temps:
                out[m] = out[methods[0]]
                continue
            with autocast_for(self.p.device, self.p.dtype):
                r = temperature_reports(self.target, drafter, self.head, self.tokenizer, conversations,
                                        self.p.eval_new_tokens, temps, dataclasses.replace(self.proposals, draft=m),
                                        batch=len(conversations),  # rounds are launch-bound
                                        template_kwargs={"enable_thinking": False}, baseline=first and i == 0,
                                        ceiling=self.p.ceiling and first and i == 0)
            if i:
                greedy = out[methods[0]]
                r = {**greedy, "temperatures": {temperature_label(0.0): greedy["temperatures"][temperature_label(0.0)],
                                                **r["temperatures"]}}
            out[m] = r
        return out

    def split_beside_lookup(self, split: str, set_name: str, reports: dict) -> dict:
        """One set's τ per part of a split of its prompts (`split`: tau_by_form, the other-style set's forms;
        tau_by_repetition, at T = 0, how much of each answer repeats its text) at each temperature that has
        it, with lookup's τ there from the set's first evaluation (the only one that decodes lookup)."""
        out = {}
        for label, r in reports.items():
            parts = r.get(split) or {}
            lookups = self.split_lookups.setdefault((split, set_name, label),
                                                    {name: b.get("tau_lookup") for name, b in parts.items()})
            out[label] = {name: {**b, "tau_lookup": lookups.get(name),
                                 "tau_ratio": b["tau"] / lookups[name] if lookups.get(name) else None}
                          for name, b in parts.items()}
        return {label: by_part for label, by_part in out.items() if by_part}

    def beside_lookup(self, name: str, reports: dict) -> dict | None:
        """One set's τ at each temperature (more than one evaluated; else None) with lookup's τ there and the
        target's drafting for itself (tau_ceiling: the most any drafter reaches there), both from the first
        evaluation of the set (the only one that decodes them), and the ratio to lookup's."""
        from trainer.run.contract import tau_by_temperature

        if len(reports) < 2:
            return None
        by_t = tau_by_temperature(reports)
        kept = ("tau_lookup", "tau_lookup_expected", "tau_ceiling", "tau_ceiling_expected")
        lookups = self.set_lookups.setdefault(name, {str(label): {k: r.get(k) for k in kept}
                                                     for label, r in reports.items()})
        for label, t in by_t.items():
            t.update({k: v for k, v in lookups.get(label, {}).items() if t.get(k) is None})
            t["tau_ratio"] = t["tau"] / t["tau_lookup"] if t.get("tau") is not None and t.get("tau_lookup") else None
        return by_t


def fp8_run(j: dict) -> bool:
    return (j["cfg"]["model"]["target"].get("precision") or "bf16") != "bf16"


def precision_runs(main_job: dict, jobs: list[dict], ablations: dict) -> list[dict]:
    """The runs the τ cost of FP8 features compares: the main run and those that differ from it in the
    target's precision and the drafter's seed alone; none when no FP8 run is among them. Each one's last
    checkpoint is evaluated by the bench, whether or not its trainer measured τ itself, so that every
    figure of the comparison comes from one evaluator."""
    runs = [j for j in jobs if j is main_job or set(ablations.get(j["name"], {})) <= {"precision", "run_seed"}]
    return runs if any(fp8_run(j) for j in runs) else []


def bench_evaluates(j: dict, compared: list[dict], tau_from_checkpoints: bool) -> bool:
    """Whether the bench evaluates a run's last checkpoint itself (against the bf16 target): a run stopped
    before its own τ, a run on FP8 features (its own τ was measured against the FP8 target; served, the
    drafter meets the bf16 one), a run the FP8 cost compares, or every run with tau_from_checkpoints."""
    return (read_run(j["run_dir"])["tau"] is None or fp8_run(j) or j in compared or tau_from_checkpoints) \
        and bool(complete_checkpoints(j["run_dir"]))


def precision_cost(results: dict, main_job: dict, compared: list[dict], evaluated: dict, main_ckpts: list) -> dict | None:
    """τ of the drafters trained on FP8 features over τ of those trained on bf16 features (the means, where
    runs differ only in their `run_seed`: the drafter's initialisation), each the last checkpoint of equal
    runs evaluated by the same CheckpointEvaluator (the bf16 target). With two or more seeds of a
    precision, `seed_spread` is that precision's (max - min) / mean τ: the difference the drafter's own
    initialisation makes, beside the difference the features make. `tau_fp8_served`: the FP8 runs' own
    end-of-run τ, their trainer evaluating against its FP8 target (the drafter as an FP8 engine serves it)."""
    by_precision: dict[str, list[dict]] = {}
    unevaluated = []
    for j in compared:
        ckpts = main_ckpts if j is main_job and main_ckpts else complete_checkpoints(j["run_dir"])
        ck = ckpts[-1] if ckpts else None
        run = results.get("main", {}) if j is main_job else results["ablations"].get(j["name"], {})
        if ck not in evaluated:
            unevaluated.append(j["name"])
        else:
            by_precision.setdefault("fp8" if fp8_run(j) else "bf16", []).append(
                {"name": j["name"], **evaluated[ck], "served_by_fp8": run.get("tau_fp8_target")})
    if set(by_precision) != {"bf16", "fp8"}:
        return None
    taus = {name: [r["tau"] for r in runs] for name, runs in by_precision.items()}
    b, f = by_precision["bf16"], by_precision["fp8"]
    tau_b, tau_f = (sum(taus[name]) / len(taus[name]) for name in ("bf16", "fp8"))
    served = [r["served_by_fp8"] for r in f]
    tau_served = sum(served) / len(served) if all(x is not None for x in served) else None
    spread = {name: (max(t) - min(t)) / (sum(t) / len(t)) for name, t in taus.items() if len(t) > 1 and all(t)}
    return {"tau_bf16": tau_b, "tau_fp8": tau_f, "fp8_over_bf16": tau_f / tau_b if tau_b else None,
            "steps": [b[0]["step"], f[0]["step"]], "runs": [b[0]["name"], f[0]["name"]],
            "tau_per_prompt": [b[0]["tau_per_prompt"], f[0]["tau_per_prompt"]], "samples": b[0]["samples"],
            "seeds": {name: {r["name"]: r["tau"] for r in runs} for name, runs in by_precision.items()},
            "seed_spread": spread, "tau_fp8_served": tau_served, "unevaluated": unevaluated,
            "fp8_served_over_bf16": tau_served / tau_b if tau_served is not None and tau_b else None}


def precision_line(cost: dict) -> str:
    seeds = max(len(v) for v in cost["seeds"].values())
    spread = "" if seeds == 1 else f" (means of {seeds} drafter seeds; their own spread " + ", ".join(
        f"{name} {100 * v:.1f} %" for name, v in cost["seed_spread"].items()) + ")"
    served = "" if cost.get("tau_fp8_served") is None else (
        f"; the fp8 drafters served by the FP8 target {fmt(cost['tau_fp8_served'])} "
        f"({fmt(cost['fp8_served_over_bf16'], 4)} of bf16's)")
    left = "" if not cost.get("unevaluated") else (
        f"; left out, their last checkpoint not evaluated in time: {', '.join(cost['unevaluated'])}")
    return (f"τ cost of FP8 features (the drafters evaluated against the bf16 target, {cost['steps']} steps each): "
            f"bf16 {fmt(cost['tau_bf16'])}, fp8 {fmt(cost['tau_fp8'])}: fp8/bf16 {fmt(cost['fp8_over_bf16'], 4)} "
            f"(goal >= 0.98){spread}{served}{left}")


def spread(items: list, n: int) -> list:
    """At most n items, evenly spaced, the last one always kept."""
    if len(items) <= n:
        return items
    picks = {round(i * (len(items) - 1) / (n - 1)) for i in range(n)} if n > 1 else {len(items) - 1}
    return [items[i] for i in sorted(picks)]


# ---------------------------------------------------------------------------- report


def fmt(v: Any, digits: int = 3) -> str:
    """A figure as the tables print it: floats to `digits` places, None as '-'."""
    return f"{v:.{digits}f}" if isinstance(v, float) else ("-" if v is None else str(v))


def by_length_rows(by_length: dict | None) -> list[str]:
    """τ and the lookup baseline per prompt-length bucket (trainer.run.contract.PROMPT_LENGTH_BUCKETS) as a
    markdown table after a blank line; nothing when the evaluation had none."""
    if not by_length:
        return []
    rows = ["", "| prompt length | prompts | tau pooled | n-gram lookup tau | ratio |", "|---|---:|---:|---:|---:|"]
    rows += [f"| {name} | {b['prompts']} | {fmt(b['tau'])} | {fmt(b.get('tau_lookup'))} | {fmt(b.get('tau_ratio'), 2)} |"
             for name, b in by_length.items()]
    return rows


def by_length_side_by_side(runs: dict) -> list[str]:
    """τ per prompt-length bucket of several drafters side by side (a markdown table), the n-gram
    lookup baseline (the same for every drafter: the same target and prompts) as the last row."""
    from trainer.run.contract import PROMPT_LENGTH_BUCKETS

    buckets = [name for name, _ in PROMPT_LENGTH_BUCKETS if any(name in (r["tau_by_length"] or {}) for r in runs.values())]
    first = next(iter(runs.values()))["tau_by_length"]
    rows = ["| drafter | steps | tau pooled | " + " | ".join(f"{b} ({first.get(b, {}).get('prompts', 0)} prompts)"
                                                      for b in buckets) + " |",
            "|---|---:|---:|" + "---:|" * len(buckets)]
    for name, r in runs.items():
        rows.append(f"| {name} | {fmt(r['steps'])} | {fmt(r['tau'])} | "
                    + " | ".join(fmt(r["tau_by_length"].get(b, {}).get("tau")) for b in buckets) + " |")
    rows.append("| n-gram prompt lookup | - | - | " + " | ".join(fmt(first.get(b, {}).get("tau_lookup")) for b in buckets) + " |")
    return rows


def by_set_text(by_set: dict | None) -> str:
    """τ per prompt set (held-out prompts, prompts of another style), each beside lookup's on the same prompts."""
    return "; ".join(f"{name} tau {fmt(b['tau'])} ({fmt(b.get('tau_ratio'), 2)}x lookup's {fmt(b.get('tau_lookup'))}, "
                     f"{b['samples']} prompts)" for name, b in (by_set or {}).items()) or "-"


def temperature_rows(by_temperature: dict | None) -> list[str]:
    """The main drafter's τ at each temperature (its last checkpoint): sampled and expected,
    the drafter's and n-gram lookup's, and the target drafting for itself (the ceiling, trainer.generate.ceiling:
    the most a drafter reaches there, over lookup's: the most its ratio can be), as a markdown table."""
    if not by_temperature:
        return []
    rows = ["", "| T | tau (sampled) | tau (expected) | lookup tau (sampled) | lookup tau (expected) | ratio | "
            "ceiling tau (sampled) | ceiling / lookup |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, t in by_temperature.items():
        ratio = t["tau"] / t["tau_lookup"] if t.get("tau") and t.get("tau_lookup") else None
        most = t["tau_ceiling"] / t["tau_lookup"] if t.get("tau_ceiling") and t.get("tau_lookup") else None
        rows.append(f"| {label} | {fmt(t.get('tau'))} | {fmt(t.get('tau_expected'))} | {fmt(t.get('tau_lookup'))} | "
                    f"{fmt(t.get('tau_lookup_expected'))} | {fmt(ratio, 2)} | {fmt(t.get('tau_ceiling'))} | "
                    f"{fmt(most, 2)} |")
    return rows


def other_temperature_rows(by_set: dict | None) -> list[str]:
    """The other-style prompts' τ at each temperature (tau_by_set["other"]), as temperature_rows gives the
    held-out prompts', under a line naming the set; [] when that set was evaluated at T = 0 alone."""
    rows = temperature_rows(((by_set or {}).get("other") or {}).get("tau_by_temperature"))
    return ["", "other-style prompts (data/other.jsonl) by temperature:", *rows] if rows else []


def repetition_lines(tau_by_set: dict | None) -> list[str]:
    """Each prompt set's τ per bucket of how much of the answer repeats its own text, lookup's beside: where
    lookup's τ comes from, and where the drafter falls behind it."""
    return [f"main drafter on the {name} prompts at T={label} by how much of the answer repeats its text: "
            f"{tau_by_length_text(by_part)}"
            for name, b in (tau_by_set or {}).items() for label, by_part in (b.get("tau_by_repetition") or {}).items()]


def markdown(results: dict) -> str:
    t, r, m, c = results["target"], results["regen"], results["main"], results["corpus"]
    lines = [f"command: `{results['command']}`", "",
             f"* corpus: {c['train_files']} train files ({c['train_mb']} MB), {c['heldout_files']} held-out files "
             f"({c['heldout_mb']} MB); skipped {c['skipped']}",
             f"* tokenizer: {results['tokenizer']}",
             f"* target: {t['params'] / 1e6:.1f}M params {t['dims']}, {t['steps']} steps x {t['batch_tokens']} tokens = "
             f"{t['tokens_trained'] / 1e6:.1f}M tokens ({t['epochs']} epochs of ~{t['tokens_available_est'] / 1e6:.0f}M), "
             f"{t['train_seconds']} s, {t['tokens_per_s']} tok/s; LM loss {t['lm_loss_seen_train_rows']} on rows it "
             f"trained on, {t['lm_loss_heldout_rows']} on held-out files",
             f"* regen: {r['summary']} (exit {r['exit']}, {r['seconds']} s wall incl. model load)",
             *([f"* regen, sampled answers: {rs['summary']} (exit {rs['exit']}, {rs['seconds']} s wall)"]
               if (rs := results.get("regen_sampled")) else []),
             f"* main drafter ({m['train_file']}): {m['steps']} steps ({m['stop']}), tau {fmt(m['tau'])} pooled / "
             f"{fmt(m['tau_per_prompt'])} per-prompt mean over {m['eval_samples']} held-out prompts; n-gram prompt "
             f"lookup on the same prompts {fmt(m.get('tau_lookup'))}: ratio {fmt(m.get('tau_ratio'), 2)}x (goal {GOAL['heldout']:g}x); histogram "
             f"{m['histogram']}, train acc {fmt(m['train_acc'])}, held-out acc {fmt(m['eval_acc'])}, "
             f"{fmt(m['tokens_per_s_steady'], 0)} tok/s",
             f"* main drafter by prompt set: {by_set_text(m.get('tau_by_set'))}",
             *([f"* main drafter against #50's goal: {g}"] if (g := goal_text(m.get("tau_by_set"))) else []),
             *(f"* {line}" for line in repetition_lines(m.get("tau_by_set"))),
             *by_length_rows(m.get("tau_by_length")), *temperature_rows(m.get("tau_by_temperature")),
             *other_temperature_rows(m.get("tau_by_set")), ""]
    if results.get("curve"):
        lines += ["| step | training tokens (real) | tau pooled | tau per-prompt | n-gram lookup tau | ratio | "
                  "histogram (1..block) |", "|---:|---:|---:|---:|---:|---:|---|"]
        for x in results["curve"]:
            lines.append(f"| {x['step']} | {fmt(x.get('tokens'))} | {x['tau']:.3f} | {x['tau_per_prompt']:.3f} | "
                         f"{fmt(x.get('tau_lookup'))} | {fmt(x.get('tau_ratio'), 2)} | {x['histogram']} |")
        lines.append("")
    if results.get("by_length") and results["preset"].get("long"):
        lines += ["τ by prompt length (tokens), each drafter's last checkpoint:", "",
                  *by_length_side_by_side(results["by_length"]), ""]
    if results.get("ablations"):
        lines += ["| ablation | overrides | steps | tau pooled | ratio to lookup | tau per-prompt | train acc | "
                  "held-out acc | tok/s | tau by prompt set | tau by temperature (held-out) | tau by temperature (other) |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|"]
        for name, a in results["ablations"].items():
            lines.append(f"| {name} | {a['overrides']} | {a['steps']} | {fmt(a['tau'])} | {fmt(a.get('tau_ratio'), 2)} | "
                         f"{fmt(a['tau_per_prompt'])} | "
                         f"{fmt(a['train_acc'])} | {fmt(a['eval_acc'])} | {fmt(a['tokens_per_s_steady'], 0)} | "
                         f"{by_set_text(a.get('tau_by_set'))} | "
                         f"{tau_by_temperature_text(a.get('tau_by_temperature')) or '-'} | "
                         f"{tau_by_temperature_text(other_by_temperature(a)) or '-'} |")
    return "\n".join(lines) + "\n"


def read_records(path: Path) -> list[dict]:
    """Whole JSON lines only (a process killed mid-write leaves a torn last line)."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return rows


def subset(src: Path, dst: Path, ids: list[Any] | None, n: int) -> tuple[Path, list[Any]]:
    """The first n records of src (or those with the given ids, in that order) into dst."""
    rows = read_records(src)
    if ids is not None:
        by_id = {r.get("id"): r for r in rows}
        rows = [by_id[i] for i in ids if i in by_id]
    rows = rows[:n]
    write_jsonl(dst, rows)
    return dst, [r.get("id") for r in rows]


TUPLE_FIELDS = {"prefix_chars", "target_prefix_chars", "doc_tokens", "train_prompt_tokens", "eval_prompt_tokens",
                "eval_per_bucket", "temperatures", "target_snapshots"}


# ---------------------------------------------------------------------------- the stages main runs


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="h200")
    ap.add_argument("--out", type=Path, required=True, help="work directory (created)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a preset field, e.g. --set target_steps=800 (YAML value)")
    ap.add_argument("--no-ablations", action="store_true")
    ap.add_argument("--ablations", default=None, help="comma-separated names of the preset's ablations to run")
    ap.add_argument("--stop-after", choices=["target", "prompts", "regen"], default=None,
                    help="stop after this stage (prompts: the regen, held-out and other-style prompts written, "
                         "regen not run)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="whole-bench wall budget in seconds (the preset's budget_s; 0: none)")
    return ap


def preset_of(ap: argparse.ArgumentParser, args: argparse.Namespace) -> Preset:
    """The preset --preset names with --set, --budget-s and --ablations applied. An unknown field or
    ablation, or a budget that leaves the drafters no time, is refused (ap.error) before anything runs."""
    p = dataclasses.replace(PRESETS[args.preset])
    apply_sets(ap, p, args.set, TUPLE_FIELDS)
    if args.budget_s is not None:
        p.budget_s = args.budget_s
    if p.draft_sample_method not in DRAFT_SAMPLE_METHODS:
        ap.error(f"draft_sample_method {p.draft_sample_method!r}: one of {', '.join(DRAFT_SAMPLE_METHODS)}")
    wrong = [s for s in p.target_snapshots if not (isinstance(s, int) and 0 < s < p.target_steps)]
    if wrong:
        ap.error(f"target_snapshots {list(p.target_snapshots)}: each a step before the last, 1..{p.target_steps - 1} "
                 f"(target_steps {p.target_steps}); not {wrong}")
    if args.no_ablations:
        p.ablations = {}
    elif args.ablations:
        names = [n.strip() for n in args.ablations.split(",")]
        known = {**ABLATIONS, **MORE_ABLATIONS}
        unknown = [n for n in names if n not in known]
        if unknown:
            ap.error(f"--ablations: unknown {unknown}; known: {', '.join(known)}")
        p.ablations = {n: known[n] for n in names}
    if p.short_trainer_eval and not p.tau_from_checkpoints:
        ap.error("short_trainer_eval: only where the bench measures every last checkpoint (tau_from_checkpoints=true)")
    if not isinstance(p.main_overrides, dict):
        ap.error(f"main_overrides {p.main_overrides!r}: a mapping of the drafter config's overrides, e.g. "
                 "'main_overrides={objective: kl+dpace}'")
    try:  # each run's directory is its name's: a path, the main run's, or one directory for two is refused
        slugs = {name: run_slug(name) for name in p.ablations}
    except ValueError as e:
        ap.error(f"ablations: {e}")
    if clash := next((name for name, slug in slugs.items() if slug == run_slug("main")), None):
        ap.error(f"ablations: run name {clash!r} is the main run's")
    if twice := named_twice("ablations' directories", list(slugs.values())):
        ap.error(twice)
    overrides = {**p.ablations, "main_overrides": p.main_overrides}
    objectives = {name: o["objective"] for name, o in overrides.items() if o.get("objective", "ce+dpace") not in OBJECTIVES}
    if objectives:
        ap.error(f"unknown objective {objectives}: an objective is one of {', '.join(OBJECTIVES)}")
    if "train" in p.main_overrides:
        ap.error("main_overrides: the main run trains on the regenerated answers; an ablation names other data")
    for name, o in overrides.items():  # before the target and regen spend the device's time on a run that cannot start
        refused = override_refused(p, o)
        if refused:
            ap.error(f"{name} {o}: {refused}")
    if p.budget_s and p.regen_end_s and args.stop_after is None:  # up front: the drafters' share of the budget
        left = p.budget_s - p.eval_reserve_s - p.regen_end_s
        startup = run_pace(p, p.main_overrides)[1]
        if left < startup + MIN_WORK_S:
            ap.error(f"budget_s {p.budget_s:g}: after regen's end at {p.regen_end_s:g}s and {p.eval_reserve_s:g}s kept "
                     f"for τ, {left:.0f}s are left for the drafters, less than their start-up {startup:g}s "
                     f"+ {MIN_WORK_S:g}s; raise it or lower regen_end_s (--set regen_end_s=...)")
        say(f"budget {p.budget_s:g}s: regen ends by t={p.regen_end_s:g}s, the drafters by t={p.budget_s - p.eval_reserve_s:g}s "
            f"(~{left - startup:.0f}s of training after ~{startup:g}s of start-up), then τ")
    return p


def goal_text(tau_by_set: dict | None) -> str | None:
    """Where a run's ratios to lookup stand against #50's goal (held-out 2.0x, other style 1.6x at each
    temperature measured): the cells short of it, or that every cell meets it; None without a temperature table."""
    cells = {(name, label): t["tau_ratio"] for name, b in (tau_by_set or {}).items() if name in GOAL
             for label, t in (b.get("tau_by_temperature") or {}).items() if t.get("tau_ratio") is not None}
    if not cells:
        return None
    short = [f"{name} T={label} {r:.2f}x (goal {GOAL[name]:g}x)" for (name, label), r in cells.items() if r < GOAL[name]]
    return "meets it in every cell" if not short else "short at " + "; ".join(short)


OVERRIDE_KEYS = ("drafter_layers", "block_size", "num_target_layers", "target_layer_ids", "gamma", "precision",
                 "sliding_window", "full_layers", "objective", "drafter_precision", "drafter_kind", "run_seed", "train")


def override_refused(p: Preset, overrides: dict) -> str | None:
    """Why a run's overrides (an ablation's or main_overrides) cannot make a trainer config: a key
    trainer_config does not read (a typo would train the defaults under the run's name), a config the
    trainer refuses, or taps a layer the bench's target does not have; None when they can."""
    from trainer.models.target import tapped_layer_ids
    from trainer.run.config import ConfigError, parse_config

    unknown = sorted(set(overrides) - set(OVERRIDE_KEYS))
    if unknown:
        return f"unknown key(s) {unknown}; an override is one of {', '.join(OVERRIDE_KEYS)}"
    try:
        model = parse_config(yaml.safe_dump(trainer_config(p, Path("model"), Path("train.jsonl"), Path("data"), 10,
                                                           overrides, 5))).model
        tapped_layer_ids(model.target_layer_ids, model.num_target_layers, p.layers)  # the bench's target's layers
    except (ConfigError, ValueError) as exc:
        return f"the trainer refuses its config: {exc}"
    return None


def gather_corpus(p: Preset, out: Path) -> dict:
    """Stage 1: the train and held-out source files (SystemExit when either is empty)."""
    t0 = time.time()
    source = (str(write_synthetic_corpus(out / "corpus", p.seed, p.synthetic_files)) if p.corpus == "synthetic"
              else p.corpus)
    corpus = collect_sources(int(p.corpus_mb * 1e6), p.max_file_kb * 1024, p.heldout_permille, p.seed, source)
    s = corpus["stats"]
    say(f"corpus: {s['train_files']} train files ({s['train_mb']} MB) + {s['heldout_files']} held-out files "
        f"({s['heldout_mb']} MB) of {s['files_found']} .py files under {s['roots']}; skipped {s['skipped']} "
        f"[{time.time() - t0:.0f}s]")
    if not corpus["train"] or not corpus["heldout"]:
        raise SystemExit("quality: no Python sources found for train or held-out")
    return corpus


def fit_tokenizer(p: Preset, corpus: dict) -> tuple[Any, dict]:
    """Stage 2: a byte-level BPE trained on a sample of the train files, and its figures. Long presets:
    the corpus's long documents too (corpus["train_docs"], ["heldout_docs"]), their lengths in
    characters from the tokenizer's characters per token."""
    from trainer_tools.fixtures.hub_model import train_tokenizer

    t0 = time.time()
    sample, size = [], 0
    for text in corpus["train"]:
        if size >= p.tokenizer_sample_mb * 1e6:
            break
        sample.append(text)
        size += len(text)
    tok = train_tokenizer("qwen3", sample, p.tokenizer_vocab)
    probe = corpus["heldout"][: 200]
    n_tokens = sum(len(e.ids) for e in tok.encode_batch(probe, add_special_tokens=False))
    if p.long:  # documents of one package's files, of p.doc_tokens tokens (estimated from the chars per token)
        cpt = sum(map(len, probe)) / max(n_tokens, 1)
        chars = (int(p.doc_tokens[0] * cpt), int(p.doc_tokens[1] * cpt))
        longest = int((max(hi for _, hi in p.eval_prompt_tokens) + 2 * p.answer_tokens) * cpt)
        corpus["train_docs"] = long_documents(corpus["train"], corpus["train_dirs"], chars, random.Random(p.seed))
        random.Random(p.seed).shuffle(corpus["train_docs"])  # the target's rows from every package, not a-z
        corpus["heldout_docs"] = long_documents(corpus["heldout"], corpus["heldout_dirs"], (longest, longest),
                                                random.Random(p.seed + 1))
        say(f"long documents: {len(corpus['train_docs'])} train documents of {chars[0]}-{chars[1]} chars "
            f"(~{p.doc_tokens[0]}-{p.doc_tokens[1]} tokens), {len(corpus['heldout_docs'])} held-out of {longest} chars")
    stats = {"vocab": tok.get_vocab_size(), "sample_mb": round(size / 1e6, 2),
             "heldout_chars_per_token": round(sum(map(len, probe)) / max(n_tokens, 1), 2),
             "seconds": round(time.time() - t0, 1)}
    say(f"tokenizer: byte-level BPE, {tok.get_vocab_size()} tokens trained on {size / 1e6:.1f} MB of train files; "
        f"{stats['heldout_chars_per_token']} chars/token on held-out files [{time.time() - t0:.0f}s]")
    return tok, stats


def checked_prompts(p: Preset, tok: Any, corpus: dict, model_dir: Path, data: Path, rng: random.Random) -> dict:
    """Stage 4: the regen and held-out prompts, the fast chat rendering checked against the saved template."""
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    prompts = (write_long_prompts if p.long else write_prompts)(p, tok, corpus, data, rng)
    check_render(hf_tok, prompts["check"])
    if not p.long:  # its own rng: the other draws stay as they were
        prompts["stats"]["other"] = write_other_prompts(p, tok, corpus, data, random.Random(f"other:{p.seed}"))
    return prompts


def training_answers(regen: dict, prompts: dict, data: Path) -> Path:
    """What the main run trains on: the regenerated answers, or the original ones when regen wrote
    too few (a tenth of the prompts); beside the regenerated ones, the original answers of the same
    prompts (original-same.jsonl). With sampled answers (regen-sampled.jsonl), regen-both.jsonl: each
    greedy answer followed by the sampled ones of its prompt, so any first n rows hold the mix."""
    if regen["conversations"] < max(1, len(prompts["ids"]) // 10):
        say("regen wrote too few answers: the main run trains on the original answers instead")
        return data / "original.jsonl"
    main_file = data / "regen.jsonl"
    greedy = read_records(main_file)
    ids = [r.get("id") for r in greedy]
    subset(data / "original.jsonl", data / "original-same.jsonl", ids, len(ids))
    sampled_file = data / "regen-sampled.jsonl"
    if not sampled_file.exists():
        return main_file
    by_prompt: dict[Any, list[dict]] = {}
    for r in read_records(sampled_file):
        by_prompt.setdefault(str(r.get("prompt_id")), []).append(r)
    rows = [x for r in greedy for x in (r, *sorted(by_prompt.get(str(r.get("id")), ()), key=lambda x: x["sample"]))]
    say(f"training answers: {len(greedy)} greedy and {len(rows) - len(greedy)} sampled (regen-both.jsonl)")
    return write_jsonl(data / "regen-both.jsonl", rows)


def drafter_jobs(p: Preset, model_dir: Path, main_file: Path, data: Path, runs: Path,
                 steps: int) -> tuple[list[dict], bool]:
    """Stage 6's trainer runs: the main run first (checkpoints for the curve), then the ablations on a
    subset of the answers; and whether the main run is the ablations' "base" row (then it trains on
    their subset too)."""
    every = max(1, steps // max(p.curve_points, 1))
    base_is_main = "base" in p.ablations and p.ablation_steps == steps and not p.main_overrides
    if p.ablations:
        sub_regen, sub_ids = subset(main_file, data / "ablation-regen.jsonl", None, p.ablation_convs)
        sub_orig, _ = subset(data / "original.jsonl", data / "ablation-original.jsonl", sub_ids, p.ablation_convs)
        if base_is_main:  # the main run is the base row: same data as the other rows
            main_file = sub_regen
    jobs = [job("main", trainer_config(p, model_dir, main_file, data, steps, p.main_overrides, every), runs)]
    jobs[0]["train_file"] = main_file
    for name, over in p.ablations.items():
        if name == "base" and base_is_main:
            continue
        train = sub_orig if over.get("train") == "original" else sub_regen
        # an FP8-features run also checkpoints halfway: τ against the bf16 target is read from checkpoints
        halfway = max(1, p.ablation_steps // 2) if over.get("precision", "bf16") != "bf16" else 0
        jobs.append(job(name, trainer_config(p, model_dir, train, data, p.ablation_steps, over, halfway), runs))
    return jobs, base_is_main


def say_failed(jobs: list[dict]) -> None:
    """The tail of each failed trainer run's output and train.log."""
    for j in jobs:
        if j.get("rc") not in (0,):
            tail = j["log"].read_text().strip().splitlines()[-12:] if j["log"].exists() else []
            tail += read_log(j["run_dir"]).strip().splitlines()[-12:]
            say(f"trainer run {j['name']!r}: exit {j.get('rc')}:\n" + "\n".join(tail))


def main_run(main_job: dict, steps: int) -> dict:
    """The main run's figures as its trainer left them (SystemExit when it left neither a checkpoint nor a τ)."""
    figures = read_run(main_job["run_dir"])
    if not complete_checkpoints(main_job["run_dir"]) and not figures["tau"]:
        raise SystemExit(f"quality: drafter: the main run ended (exit {main_job.get('rc')}) without a checkpoint or "
                         f"a τ; its log: {main_job['run_dir'] / 'train.log'}")
    return {**figures, "train_file": main_job["train_file"].name,
            "command": "python -m trainer " + " ".join(main_job["argv"]), "config": main_job["cfg"],
            "exit": main_job.get("rc"), "seconds": round(main_job.get("seconds", 0.0), 1), "planned_steps": steps}


def evaluate_checkpoints(p: Preset, jobs: list[dict], compared: list[dict], model_dir: Path, data: Path,
                         budget_end: float | None) -> tuple[dict[Path, dict], list[Path]]:
    """Stage 7: τ of checkpoints by one CheckpointEvaluator, while the budget lasts: the main run's last
    one first, the last one of each run the bench evaluates itself (bench_evaluates) next, then the
    rest of the main run's curve. Returns {checkpoint: its evaluation} and the curve's checkpoints."""
    if not any(complete_checkpoints(j["run_dir"]) for j in jobs):
        return {}, []
    evaluator = CheckpointEvaluator(p, model_dir, data)

    def time_left() -> bool:
        return budget_end is None or time.time() < budget_end - 10

    main_ckpts = spread(complete_checkpoints(jobs[0]["run_dir"]), p.curve_points + 1)
    evaluated: dict[Path, dict] = {}
    if main_ckpts:
        evaluated[main_ckpts[-1]] = evaluator(main_ckpts[-1], p.temperatures)
    for j in jobs[1:]:  # at every temperature: each prompt set's τ at each, as the main run's
        if bench_evaluates(j, compared, p.tau_from_checkpoints) and time_left():
            last = complete_checkpoints(j["run_dir"])[-1]
            evaluated[last] = evaluator(last, p.temperatures)
    for ck in main_ckpts[:-1]:
        if time_left():
            evaluated[ck] = evaluator(ck)
    return evaluated, main_ckpts


def tau_curve(p: Preset, main_ckpts: list[Path], evaluated: dict[Path, dict], pad_share: float | None,
              out: Path) -> list[dict]:
    """The main run's evaluated checkpoints in step order, each with the real (not padding) training
    tokens it had seen when packed rows tell them."""
    per_step = None
    if pad_share is not None and p.pack_length:
        per_step = p.pack_length * p.pack_rows * p.micro_batches * (1 - pad_share)
    curve = []
    for ck in main_ckpts:
        if ck not in evaluated:
            continue
        point = evaluated[ck]
        point["tokens"] = round(point["step"] * per_step) if per_step else None
        curve.append(point)
        say(f"curve: step {point['step']} (~{fmt(point['tokens'])} real tokens): tau {point['tau']:.3f} pooled "
            f"({fmt(point['tau_ratio'], 2)}x n-gram lookup's {fmt(point['tau_lookup'])}), "
            f"{point['tau_per_prompt']:.3f} per-prompt mean ({point['samples']} held-out prompts, {p.eval_new_tokens} "
            f"new tokens; {ck.relative_to(out)}) [{point['eval_seconds']}s]")
    return curve


def checkpoint_figures(point: dict) -> dict:
    """The figures a run takes from the bench's evaluation of its last checkpoint."""
    return {"tau": point["tau"], "tau_per_prompt": point["tau_per_prompt"], "histogram": point["histogram"],
            "eval_samples": point["samples"], "tau_from": point["checkpoint"], "tau_lookup": point["tau_lookup"],
            "tau_ratio": point["tau_ratio"], "tau_by_length": point["tau_by_length"]}


def settle_tau(row: dict, j: dict, last: dict | None, compared: list[dict], tau_from_checkpoints: bool) -> bool:
    """A run's τ from the evaluation of its last checkpoint (`last`, None when not evaluated): with FP8
    features (its trainer's own τ, against the FP8 target, is kept as tau_fp8_target), stopped before
    its own τ, every run with tau_from_checkpoints, or a run of the FP8 comparison (one evaluator for
    all its figures). Whether it took them."""
    if last is None:
        return False
    if "tau_by_set" in last:  # the held-out and other-style sets: the bench's own evaluation
        row["tau_by_set"] = last["tau_by_set"]
    if last.get("tau_by_temperature"):  # the run's last checkpoint at each temperature: measured even when the
        row["tau_by_temperature"] = last["tau_by_temperature"]  # deadline's stop cut the trainer's own evaluation
    if fp8_run(j):
        row["tau_fp8_target"], row["tau"] = row["tau"], None
    if row["tau"] is None or tau_from_checkpoints or j in compared:
        row.update(checkpoint_figures(last))
        return True
    return False


def say_main(p: Preset, m: dict, steps: int) -> None:
    say(f"main drafter vs n-gram prompt lookup: tau {fmt(m['tau'])} vs {fmt(m.get('tau_lookup'))} pooled on the same "
        f"held-out prompts: ratio {fmt(m.get('tau_ratio'), 2)}x (goal >= {GOAL['heldout']:g}x)")

    if m.get("tau_by_length"):
        say(f"main drafter by prompt length: {tau_by_length_text(m['tau_by_length'])}")
    other = (m.get("tau_by_set") or {}).get("other") or {}
    if m.get("tau_by_set"):
        say(f"main drafter by prompt set: {by_set_text(m['tau_by_set'])}")
    if goal := goal_text(m.get("tau_by_set")):
        say(f"main drafter against #50's goal: {goal}")
    for label, by_form in (other.get("tau_by_form") or {}).items():
        say(f"main drafter on the other-style prompts by form at T={label}: {tau_by_length_text(by_form)}")
    for line in repetition_lines(m.get("tau_by_set")):
        say(line)
    if m.get("tau_by_temperature"):  # its last checkpoint at each temperature, lookup beside
        say(f"main drafter by temperature (its last checkpoint): "
            f"{tau_by_temperature_text(m['tau_by_temperature'])}")
        if other.get("tau_by_temperature"):
            say(f"main drafter by temperature on the other-style prompts: "
                f"{tau_by_temperature_text(other['tau_by_temperature'])}")
        for name, b in (m.get("tau_by_set") or {}).items():
            ceilings = [f"T={label} {fmt(t['tau_ceiling'])} ({fmt(t['tau_ceiling'] / t['tau_lookup'], 2)}x "
                        f"lookup's {fmt(t['tau_lookup'])})"
                        for label, t in (b.get("tau_by_temperature") or {}).items()
                        if t.get("tau_ceiling") and t.get("tau_lookup")]
            if ceilings:  # measured only with the preset's ceiling on
                say(f"the target drafting for itself (the most a drafter reaches) on the {name} prompts: "
                    + "; ".join(ceilings))
    say(f"main drafter: tau {fmt(m['tau'])} pooled, {fmt(m['tau_per_prompt'])} per-prompt mean over {m['eval_samples']} "
        f"held-out prompts ({p.eval_new_tokens} new tokens, block {p.block_size}, {p.drafter_layers} layers, "
        f"{m['steps']} steps of {steps}, {m['train_file']}"
        + (f", overrides {p.main_overrides}" if p.main_overrides else "") + f"); histogram {m['histogram']}; train acc "
        f"{fmt(m['train_acc'])}, held-out acc {fmt(m['eval_acc'])}; {fmt(m['tokens_per_s_steady'], 0)} tok/s")


def ablation_results(p: Preset, jobs: list[dict], evaluated: dict[Path, dict], compared: list[dict], m: dict,
                     base_is_main: bool) -> dict:
    """Each ablation's row: its trainer's figures, its τ from its last checkpoint where settle_tau says."""
    rows = {"base (the main run)": {**m, "overrides": {}}} if base_is_main else {}
    for j in jobs[1:]:
        a = {**read_run(j["run_dir"]), "overrides": p.ablations[j["name"]], "exit": j.get("rc")}
        ckpts = complete_checkpoints(j["run_dir"])
        last = evaluated.get(ckpts[-1]) if ckpts else None
        if settle_tau(a, j, last, compared, p.tau_from_checkpoints) and last is not None:
            a["steps"] = last["step"]
        rows[j["name"]] = a
        say(f"ablation {j['name']!r} ({a['overrides']}, {a['steps']} steps of {p.ablation_steps}, {a['stop']}): tau "
            f"{fmt(a['tau'])} pooled ({fmt(a.get('tau_ratio'), 2)}x lookup), {fmt(a['tau_per_prompt'])} per-prompt mean; "
            f"train acc {fmt(a['train_acc'])}, held-out acc {fmt(a['eval_acc'])}"
            + (f"; {tau_by_temperature_text(a['tau_by_temperature'])}" if a.get("tau_by_temperature") else "")
            + (f"; other style {tau_by_temperature_text(other_by_temperature(a))}" if other_by_temperature(a) else ""))
    return rows


def other_by_temperature(row: dict) -> dict | None:
    """A run's τ on the other-style prompts at each temperature (measured where the bench evaluated its last
    checkpoint at every temperature)."""
    return ((row.get("tau_by_set") or {}).get("other") or {}).get("tau_by_temperature")


def main(argv: list[str] | None = None) -> dict:
    ap = parser()
    args = ap.parse_args(argv)
    p = preset_of(ap, args)
    out = args.out.resolve()
    data, runs = out / "data", out / "runs"
    for d in (out, data, runs):
        d.mkdir(parents=True, exist_ok=True)
    command = "PYTHONPATH=. python bench/quality.py " + " ".join(argv if argv is not None else sys.argv[1:])
    started = time.time()
    budget_end = started + p.budget_s if p.budget_s else None
    results: dict = {"command": command, "preset": dataclasses.asdict(p), "torch": torch.__version__,
                     "device_name": torch.cuda.get_device_name(p.device) if p.device.startswith("cuda") else "cpu"}
    rng = random.Random(p.seed)
    random.seed(p.seed)
    torch.manual_seed(p.seed)

    def save() -> None:
        results["seconds"] = round(time.time() - started, 1)
        (out / "quality.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
        say(f"[t={results['seconds']:.0f}s]")

    corpus = gather_corpus(p, out)
    results["corpus"] = corpus["stats"]
    tok, results["tokenizer"] = fit_tokenizer(p, corpus)
    model_dir, results["target"] = train_target(p, tok, corpus, out, rng,
                                                results["tokenizer"]["heldout_chars_per_token"])
    save()
    if args.stop_after == "target":
        return results
    prompts = checked_prompts(p, tok, corpus, model_dir, data, rng)
    results["prompts"] = prompts["stats"]
    del corpus
    if args.stop_after == "prompts":
        save()
        return results
    # regen, stopped at its deadline with the answers written so far
    regen_end = started + p.regen_end_s if p.regen_end_s else None
    results["regen"] = regenerate(p, model_dir, data, out, regen_end)
    if p.sampled_answers:
        results["regen_sampled"] = regenerate(p, model_dir, data, out, regen_end, samples=p.sampled_answers)
    save()
    if args.stop_after == "regen":
        return results
    deadline = budget_end - p.eval_reserve_s if budget_end else None
    steps = main_steps(p, deadline)
    if p.ablation_steps_as_main:
        p.ablation_steps = steps
    jobs, base_is_main = drafter_jobs(p, model_dir, training_answers(results["regen"], prompts, data), data, runs, steps)
    say(f"drafter: {len(jobs)} trainer runs (`python -m trainer --config CFG --run-dir RUN`), main first, then "
        f"{p.parallel} at a time: " + ", ".join(j["name"] for j in jobs)
        + (f"; deadline in {deadline - time.time():.0f}s" if deadline else ""))
    run_all(p, jobs, deadline, first_alone=p.first_alone)
    say_failed(jobs)
    main_job = jobs[0]
    results["main"] = m = main_run(main_job, steps)
    save()
    compared = precision_runs(main_job, jobs, p.ablations)
    evaluated, main_ckpts = evaluate_checkpoints(p, jobs, compared, model_dir, data, budget_end)
    results["curve"] = curve = tau_curve(p, main_ckpts, evaluated, m["pad_share"], out)
    settle_tau(m, main_job, curve[-1] if curve else None, compared, p.tau_from_checkpoints)
    say_main(p, m, steps)
    results["ablations"] = ablation_results(p, jobs, evaluated, compared, m, base_is_main)
    results["by_length"] = {name: {"steps": a.get("steps"), "overrides": a.get("overrides"), "tau": a.get("tau"),
                                   "tau_by_length": a.get("tau_by_length")}
                            for name, a in results["ablations"].items() if a.get("tau_by_length")}
    if p.long and results["by_length"]:
        for line in by_length_side_by_side(results["by_length"]):
            say(line)
    precision = precision_cost(results, main_job, compared, evaluated, main_ckpts)
    if precision:
        results["precision"] = precision
        say(precision_line(precision))
    save()
    (out / "quality.md").write_text(markdown(results))
    say(f"quality: done in {time.time() - started:.0f}s; {out / 'quality.json'}, {out / 'quality.md'}")
    return results


if __name__ == "__main__":
    main()
