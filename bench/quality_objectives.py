"""The objectives ablation of the quality bench (issue #36, docs/objectives.md): `ce+decay` (today's
default), `ce+dpace`, `kl` and `ce+kl`, each over 3 seeds at equal wall clock, τ on the held-out
prompts and on a second, unseen prompt set, with the seed spread and the step-time cost of kl.

    PYTHONPATH=. python bench/quality_objectives.py --preset h200 --out $OUT/objectives   # one H200 call
    PYTHONPATH=. python bench/quality_objectives.py --preset cpu --out /tmp/objectives    # CPU, 10 min
    PYTHONPATH=. python bench/quality_objectives.py --preset tiny --out /tmp/objectives   # CPU (the test)
    ... --plan-only     # what fits the budget, and nothing run

The same machinery compares drafter generations (issue #37): `--preset dflash2-h200` (one H200 call)
and `--preset dflash2-cpu` (a 2-core CPU, tiny shapes) train DFlash1 and DFlash2
(`model.drafter.kind: dflash2`, its defaults) at equal wall clock over 3 seeds, with the same table.

Stages:

0. the plan, before anything runs (`plan_runs`): the runs (objectives x seeds, seed after seed) in
   waves of `parallel`, each wave costing a trainer's start-up, its training at the shared device's
   throughput and its end; what is left of the budget after the preparation's estimate gives every
   run its training budget (seconds of the device alone, counted from its first step: start-up
   and warm-up are not in it). Too little for `min_train_s`: seeds are dropped down to
   `min_seeds`; still too little: the bench refuses, naming what it needs.
1. bench/quality.py up to its regeneration (`--stop-after regen`): corpus, tokenizer, the code target
   saved as a model directory, its greedy answers (the same as `quality.py --preset h200` builds).
2. code prompts: a second prompt set written here, of another style than the training windows (which
   are windows of real files): short function signatures with typed arguments and a docstring, each
   asking for the body. None of them comes from the corpus.
3. step time: each objective's optimizer step timed alone on the device, with the run's own config
   and data (the reference loop: target features, the target's layers above when kl reads its logits,
   drafter forward and backward, the optimizer). Equal wall clock: objective o trains
   `train_s / t(o)` steps, so every run costs the same device time; the plan is made again with the
   measured step times and the time actually left.
4. the runs: `python -m trainer --config CFG --run-dir RUN` for every objective and seed (data order,
   anchors and initialisation all follow the seed), queued, `parallel` at a time (the first alone
   until it trains, so the others find its compiled kernels), sharing the target's model directory
   and one training file; each tokenises with its share of the CPUs. As each run ends: its τ on the
   code prompts (and on the held-out prompts if it stopped before its own final evaluation), and
   OUT/objectives.json and .md are written again, so a call killed later still leaves the table so far.
5. the table: per objective the mean τ over the seeds whose runs completed their planned steps, its
   spread (sample standard deviation and the range), per-position acceptance, steps, the solo step
   time and its cost over ce+decay; the verdict names an objective only where its mean gain over
   ce+decay exceeds both rows' seed ranges.

Everything lands in OUT/objectives.json and OUT/objectives.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import quality  # noqa: E402
from bench.common import apply_sets, named_twice, seeds_refused  # noqa: E402
from trainer.run.checkpoint import complete_checkpoints  # noqa: E402
from trainer.run.contract import read_events, read_log  # noqa: E402

OBJECTIVES = quality.OBJECTIVES  # name -> the model section's objective keys
# name -> the model section's drafter generation (issue #37, docs/dflash2.md): DFlash2 beside DFlash1,
# the same objective (the default), DFlash2 with the trainer's defaults for its five fields
GENERATIONS = {
    "dflash1": {},
    "dflash2": {"drafter": {"kind": "dflash2"}},
}
VARIANTS = {**OBJECTIVES, **GENERATIONS}


@dataclass
class Preset:
    title: str = "objectives ablation"
    baseline: str = "ce+decay"  # the row every other is timed and judged against (equal device time)
    quality: str = "h200"  # the bench/quality.py preset that builds target, answers and the trainer config
    quality_set: dict = field(default_factory=dict)  # its fields overridden (e.g. a shorter target fit)
    seeds: tuple[int, ...] = (0, 1, 2)
    objectives: tuple[str, ...] = ("ce+decay", "ce+dpace", "kl", "ce+kl")  # the rows: names of VARIANTS
    steps: int = 200  # without a budget (budget_s 0) and train_s 0: ce+decay's steps, the others as many as cost the same device time
    train_s: float = 0.0  # every run's training, in seconds of the device alone (t(o) x steps); 0 with a budget: the most that fits
    min_train_s: float = 4.0  # less than this a run: seeds are dropped (down to min_seeds), then the bench refuses
    max_steps: int = 4000  # the most optimizer steps any run is given
    min_seeds: int = 2  # a spread needs two
    parallel: int = 6  # trainer processes at once on the device (the rest queue): 12 at once never trained (issue #36)
    train_convs: int = 8192  # every run trains on the first this many regenerated answers
    code_prompts: int = 256  # the second prompt set
    code_new_tokens: int = 96  # tokens generated per code prompt
    timing_steps: int = 12  # timed optimizer steps per objective (after timing_warmup)
    timing_warmup: int = 3
    budget_s: float = 570.0  # whole-bench wall budget (0: none): trainer runs get SIGTERM eval_reserve_s before
    eval_reserve_s: float = 30.0  # after the deadline's SIGTERM: the stops, the last runs' τ, the table
    # the plan's estimates (seconds); after the step timing the plan is made again with what is measured
    prep_s: float = 190.0  # bench/quality.py up to regen (H200, issue #25 calls: corpus + tokenizer 10 s, target 80 s, regen ~100 s)
    timing_s: float = 35.0  # the four objectives' step timing
    startup_s: float = 40.0  # a trainer run's start before its first step: load, tokenise, warm-up (H200 main run: 34.7 s)
    startup_share: float = 5.0  # more per other run starting beside it (CPU: imports, tokenising workers, compiling)
    cold_start_s: float = 30.0  # more for the first wave: every objective compiles its own graphs (later seeds reuse them)
    end_s: float = 10.0  # a run's end: its own held-out τ (64 prompts, ~4 s), the final checkpoint, the exit
    eval_s: float = 3.0  # the bench's τ of a run's last checkpoint on the code prompts (256 x 96 tokens)
    share_gain: float = 1.5  # runs sharing the device train this many times faster together than one alone (issue #18: 8 runs 2.2x)


PRESETS = {
    # one regen batch of 16,384 answers (the runs train on 8,192): regen ends when it is done, ~100 s
    # 8,192 answers in one regen batch (what the runs train on), 6 runs at a time: 2 waves
    "h200": Preset(quality_set={"n_prompts": 8192, "regen_batch": 8192}),
    # this machine's CPU: the tiny target, the runs as subprocesses two at a time under a budget
    "cpu": Preset(quality="tiny", quality_set={"inprocess": False}, parallel=2,
                  train_convs=12, code_prompts=4, code_new_tokens=8, timing_steps=3, timing_warmup=1,
                  budget_s=600.0, eval_reserve_s=20.0, prep_s=90.0, timing_s=40.0, startup_s=40.0, startup_share=2.0,
                  cold_start_s=0.0, end_s=4.0, eval_s=3.0, share_gain=1.0, min_train_s=0.5, max_steps=60),
    "tiny": Preset(quality="tiny", steps=2, parallel=1, train_convs=12, code_prompts=4, code_new_tokens=8,
                   timing_steps=2, timing_warmup=1, budget_s=0.0),
    # issue #37: DFlash2 vs DFlash1 at equal device time, 3 seeds, one H200 call (6 runs: one wave)
    "dflash2-h200": Preset(title="DFlash2 vs DFlash1", baseline="dflash1", objectives=tuple(GENERATIONS),
                           quality_set={"n_prompts": 8192, "regen_batch": 8192}),
    # the same on this repository's 2-core CPU machines (105 s idle, ~15 min with the cores shared): the tiny
    # quality preset with a longer target fit and more answers, 6 runs one at a time (a CPU figure: tiny shapes)
    "dflash2-cpu": Preset(title="DFlash2 vs DFlash1 (CPU, tiny shapes)", baseline="dflash1",
                          objectives=tuple(GENERATIONS), quality="tiny",
                          quality_set={"n_prompts": 384, "answer_tokens": 32, "n_eval": 24,
                                       "eval_new_tokens": 32, "regen_batch": 64, "target_steps": 300},
                          steps=400, parallel=1, train_convs=384, code_prompts=24, code_new_tokens=32,
                          timing_steps=30, timing_warmup=5, budget_s=0.0),
}


class PlanError(SystemExit):
    """The budget cannot hold even min_seeds seeds at min_train_s: the message says what it needs."""


@dataclass
class Plan:
    seeds: tuple[int, ...]
    train_s: float  # each run's training, seconds of the device alone
    waves: list[int]  # runs per wave
    estimate_s: float  # the runs' wall time, start to the last τ
    steps: dict[str, int] = field(default_factory=dict)  # per objective, when step times are known
    notes: list[str] = field(default_factory=list)

    def text(self, objectives) -> str:
        steps = (", " + ", ".join(f"{o} {self.steps[o]} steps" for o in objectives)) if self.steps else ""
        return (f"{len(objectives)} objectives x {len(self.seeds)} seeds {list(self.seeds)} = "
                f"{len(objectives) * len(self.seeds)} runs in {len(self.waves)} waves {self.waves}, "
                f"{self.train_s:.1f}s of training each{steps}; estimated {self.estimate_s:.0f}s")


def runs_wall(p: Preset, runs: int, train_s: float) -> tuple[float, list[int]]:
    """Wall seconds of `runs` trainer runs queued `p.parallel` at a time, each training `train_s`
    seconds' worth alone: per wave its start-up, its training at the shared throughput (n runs of
    train_s in n * train_s / min(n, share_gain)), its end; then every run's τ on the code prompts."""
    waves = [min(p.parallel, runs - i) for i in range(0, runs, max(1, p.parallel))]
    wall = p.cold_start_s if runs else 0.0
    for n in waves:
        wall += p.startup_s + p.startup_share * (n - 1) + n * train_s / max(1.0, min(n, p.share_gain)) + p.end_s
    return wall + runs * p.eval_s, waves


def plan_runs(p: Preset, available_s: float | None, step_s: dict[str, float] | None = None) -> Plan:
    """What fits `available_s` (None: no budget): the seeds, each run's training budget, the waves
    and, with measured step times, every objective's steps (equal device time). train_s 0 with a
    budget takes the most that fits; a given train_s too large is shrunk to fit; below min_train_s
    the last seeds are dropped (to min_seeds); below that the plan is refused (PlanError)."""
    objectives, seeds = tuple(p.objectives), tuple(p.seeds)
    notes: list[str] = []
    base = (step_s or {}).get(p.baseline, min((step_s or {}).values(), default=0.0))
    if available_s is None:
        train_s = p.train_s or p.steps * base
    else:
        while True:
            runs = len(objectives) * len(seeds)
            fixed, waves = runs_wall(p, runs, 0.0)
            per_train = runs_wall(p, runs, 1.0)[0] - fixed  # wall per second of each run's training
            fits = (available_s - fixed) / per_train if per_train else 0.0
            train_s = min(p.train_s, fits) if p.train_s else fits
            if p.train_s and fits < p.train_s and fits >= p.min_train_s:
                notes.append(f"train_s {p.train_s:g}s does not fit: {fits:.1f}s each")
            if train_s >= p.min_train_s:
                break
            if len(seeds) <= p.min_seeds:
                need = fixed + per_train * max(p.train_s or 0.0, p.min_train_s)
                raise PlanError(f"quality_objectives: the plan does not fit: {runs} runs ({len(objectives)} objectives x "
                                f"{len(seeds)} seeds, {len(waves)} waves of {p.parallel}) at {p.min_train_s:g}s of "
                                f"training each need {need:.0f}s, {available_s:.0f}s are left; raise budget_s, lower "
                                f"min_train_s or run fewer objectives (--set objectives=[...])")
            notes.append(f"seed {seeds[-1]} dropped: {len(seeds)} seeds leave {max(fits, 0.0):.1f}s of training a "
                         f"run, less than min_train_s {p.min_train_s:g}s")
            seeds = seeds[:-1]
    steps = {}
    if step_s:
        fastest = min(step_s[o] for o in objectives)
        if train_s / fastest > p.max_steps:  # less training for all, so that the device time stays equal
            notes.append(f"train_s {train_s:.1f}s lowered to {p.max_steps * fastest:.1f}s: the fastest objective "
                         f"would have passed max_steps {p.max_steps}")
            train_s = p.max_steps * fastest
        steps = {o: max(1, round(train_s / step_s[o])) for o in objectives}
    estimate, waves = runs_wall(p, len(objectives) * len(seeds), train_s)
    return Plan(seeds, train_s, waves, estimate, steps, notes)


def say(line: str) -> None:
    print(line, flush=True)


# ---------------------------------------------------------------------------- 2. code prompts

VERBS = ("parse", "merge", "normalize", "count", "filter", "group", "render", "validate", "encode", "split",
         "flatten", "resolve", "format", "clip", "rank", "batch")
NOUNS = ("records", "tokens", "paths", "intervals", "scores", "headers", "rows", "edges", "words", "events",
         "prices", "labels", "chunks", "names", "matrix", "options")
TYPES = ("list[int]", "list[str]", "dict[str, int]", "str", "int", "float", "list[float]", "tuple[int, int]",
         "set[str]", "bytes")
PHRASES = ("in place and return how many changed", "into a new list, keeping the original order",
           "and drop the empty ones", "by the given key", "so that every value lies in [low, high]",
           "and return the first match, or None", "as one line per item", "and raise ValueError on bad input",
           "by their length, longest first", "without duplicates")


def code_prompts(n: int, seed: int) -> list[dict]:
    """n short code-completion conversations: a typed signature and its docstring, the body asked for.
    Another style than the bench's training windows (cuts of real files), and no text of the corpus."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        verb, noun = rng.choice(VERBS), rng.choice(NOUNS)
        args = [(noun, rng.choice(TYPES))] + [(rng.choice(("key", "limit", "low", "high", "sep", "strict")),
                                               rng.choice(("int", "str", "bool", "float"))) for _ in range(rng.randint(0, 2))]
        args = list(dict(args).items())
        signature = ", ".join(f"{a}: {t}" for a, t in args)
        doc = [f'    """{verb.capitalize()} the {noun} {rng.choice(PHRASES)}.', ""]
        doc += ["    Args:"] + [f"        {a}: the {a.replace('_', ' ')}." for a, _ in args]
        doc += ["", "    Returns:", f"        The {noun} after {verb}ing them.", '    """', ""]
        text = f"def {verb}_{noun}({signature}) -> {rng.choice(TYPES)}:\n" + "\n".join(doc)
        out.append({"id": f"code{i}", "messages": [{"role": "user", "content": text},
                                                   {"role": "assistant", "content": ""}]})
    return out


# ---------------------------------------------------------------------------- 3. step time


def step_runner(cfg: dict, run_dir: Path, batches: int = 4):
    """One objective's optimizer step on the device, built from the run's own config and data: the
    reference loop's forward (target features, plus the target's last hidden states under kl),
    backward, optimizer. Returns step(i) (synchronised on CUDA)."""
    from trainer.run.config import parse_config
    from trainer.train.components import build_components
    from trainer.train.loop import forward, make_blocks

    config = parse_config(yaml.safe_dump(cfg))
    c = build_components(config, run_dir, lambda *_: None)
    device = torch.device(c.drafter_device)
    gen = torch.Generator().manual_seed(0)
    data = [c.train_data.next_batch() for _ in range(batches)]
    blocks = [make_blocks(config, c, b.input_ids, b.loss_mask, gen, getattr(b, "doc_start", None)) for b in data]

    def step(i: int) -> None:
        b = data[i % len(data)]
        loss, weight, _ = forward(config, c, b.input_ids, b.attention_mask, blocks[i % len(blocks)],
                                  getattr(b, "doc_start", None))
        (loss / weight.clamp(min=1.0)).backward()
        c.optimizer.step()
        c.optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return step


def step_seconds(steppers: dict, steps: int, warmup: int, rounds: int = 3) -> dict[str, float]:
    """Seconds per optimizer step of each objective alone on the device: every objective warmed up,
    then `rounds` rounds of `steps` timed steps taking the objectives in turn; the fastest round of
    each (a shared machine's noise, and one-time costs, only ever add time)."""
    for step in steppers.values():
        for i in range(warmup):
            step(i)
    best = {name: float("inf") for name in steppers}
    for _ in range(rounds):
        for name, step in steppers.items():
            began = time.perf_counter()
            for i in range(steps):
                step(i)
            best[name] = min(best[name], (time.perf_counter() - began) / steps)
    return best


# ---------------------------------------------------------------------------- 5. the table


def training_pace(run_dir: Path) -> dict:
    """A run's training wall seconds (its start to its last step) and its tokens/s as the mean of its logged
    intervals' (the last interval alone, quality.read_run's steady figure, is a few steps on a CPU)."""
    events = read_events(run_dir)
    start = next((e["time"] for e in events if e.get("event") == "start"), None)
    steps = [e for e in events if e.get("event") == "step"]
    rates = [e["tokens_per_s"] for e in steps[1:] if e.get("tokens_per_s")]  # the first includes the warm-up
    return {"train_s": round(steps[-1]["time"] - start, 1) if steps and start else None,
            "tokens_per_s_mean": statistics.fmean(rates) if rates else None}


def spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "n": len(values)}


def summarise(rows: dict[str, list[dict]], timing: dict[str, float], baseline: str = "ce+decay") -> dict:
    """Per objective: τ on both prompt sets over its seeds (mean, std, range), steps, step time and its
    cost over the baseline, the mean per-position acceptance, training tokens/s and seconds."""
    table = {}
    base_time = timing.get(baseline)
    for name, runs in rows.items():
        # a run stopped by the deadline before its planned steps trained less: not in the spread
        done = [r for r in runs if r.get("tau") is not None and r.get("tau_code") is not None
                and (r.get("planned_steps") is None or (r.get("steps") or 0) >= r["planned_steps"])]
        entry: dict = {"runs": len(runs), "measured": len(done), "steps": [r.get("steps") for r in runs],
                       "step_s": timing.get(name),
                       "step_cost": timing[name] / base_time - 1 if base_time and name in timing else None}
        if done:
            entry["tau"] = spread([r["tau"] for r in done])
            entry["tau_code"] = spread([r["tau_code"] for r in done])
            entry["tau_ratio"] = spread([r["tau_ratio"] for r in done if r.get("tau_ratio") is not None] or [0.0])
            acc = [r["acceptance"] for r in done if r.get("acceptance")]
            entry["acceptance"] = [statistics.fmean(col) for col in zip(*acc)] if acc else None
            entry["tokens_per_s"] = statistics.fmean(r.get("tokens_per_s_mean") or r["tokens_per_s_steady"] or 0.0
                                                     for r in done)
            walls = [r["train_s"] for r in done if r.get("train_s")]
            entry["train_s"] = statistics.fmean(walls) if walls else None
        table[name] = entry
    return table


def verdict(table: dict, baseline: str = "ce+decay") -> list[str]:
    """Which objective beats the baseline by more than the seed spread, on each prompt set: the difference
    of the means must exceed the larger of the two rows' ranges (max - min over the seeds)."""
    base = table.get(baseline, {})
    lines = []
    for key, label in (("tau", "held-out"), ("tau_code", "code prompts")):
        if key not in base:
            lines.append(f"{label}: {baseline} not measured, no verdict")
            continue
        b = base[key]
        winners = []
        for name, e in table.items():
            if name == baseline or key not in e:
                continue
            gain = e[key]["mean"] - b["mean"]
            bar = max(e[key]["max"] - e[key]["min"], b["max"] - b["min"])
            if gain > bar:
                winners.append(f"{name} (+{gain:.3f}, spread {bar:.3f})")
        lines.append(f"{label}: " + ("; ".join(winners) + f" beat {baseline} beyond the seed spread" if winners
                                     else f"no objective beats {baseline} beyond the seed spread: keep the default"))
    return lines


def _ms(e: dict | None, key: str) -> str:
    if not e or key not in e:
        return "-"
    s = e[key]
    return f"{s['mean']:.3f} ± {s['std']:.3f} ({s['min']:.3f}-{s['max']:.3f})"


def markdown(results: dict) -> str:
    t = results["table"]
    preset = results["preset"]
    baseline = preset.get("baseline", "ce+decay")
    lines = [f"# {preset.get('title', 'objectives ablation')} ({results['command']})", "",
             f"* target and answers: bench/quality.py --preset {results['preset']['quality']} (up to regen); "
             f"{results['train_convs']} answers per run; seeds {list(results['preset']['seeds'])}",
             f"* held-out: {results['heldout_prompts']} prompts of held-out files; code: {results['code_prompts']} "
             f"signature+docstring prompts written by the bench ({results['preset']['code_new_tokens']} new tokens)",
             "* equal wall clock: every run trains the plan's train_s of device time alone (its steps x its step time, timed "
             "alone in the reference loop), counted from its first step: start-up and warm-up are not in it",
             *([f"* plan: {results['plan']}"] if results.get("plan") else []),
             *[f"* {n}" for n in results.get("plan_notes", [])],
             "", "| objective | runs measured | steps (per seed) | τ held-out: mean ± std (range) | τ code prompts | "
             f"ratio to lookup (held-out) | step time | cost vs {baseline} | acceptance by position (mean) | "
             "training tokens/s | training s (mean) |", "|---|---:|---|---|---|---|---:|---:|---|---:|---:|"]
    for name, e in t.items():
        cost = "-" if e.get("step_cost") is None else f"{e['step_cost']:+.1%}"
        step = "-" if e.get("step_s") is None else f"{e['step_s'] * 1000:.1f} ms"
        acc = " ".join(f"{a:.2f}" for a in e["acceptance"]) if e.get("acceptance") else "-"
        tps = "-" if not e.get("tokens_per_s") else f"{e['tokens_per_s']:,.0f}"
        wall = "-" if not e.get("train_s") else f"{e['train_s']:.0f}"
        lines.append(f"| {name} | {e.get('measured', '-')}/{e.get('runs', '-')} | {e['steps']} | {_ms(e, 'tau')} | "
                     f"{_ms(e, 'tau_code')} | {_ms(e, 'tau_ratio')} | {step} | {cost} | {acc} | {tps} | {wall} |")
    lines += ["", *[f"* {v}" for v in results.get("verdict", [])]]
    if results.get("partial"):
        lines += [f"* partial: {results['partial']}"]
    if results.get("refused"):
        lines += [f"* refused after the step timing: {results['refused']}"]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- main


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="h200")
    ap.add_argument("--out", type=Path, required=True, help="work directory (created)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a field of this bench's preset (seeds=[0,1], parallel=3, train_s=20)")
    ap.add_argument("--budget-s", type=float, default=None, help="whole-bench wall budget (the preset's budget_s)")
    ap.add_argument("--quality-set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a field of the bench/quality.py preset (target_steps=400)")
    ap.add_argument("--plan-only", action="store_true", help="print what fits the budget and stop")
    return ap


def preset_of(ap: argparse.ArgumentParser, args: argparse.Namespace) -> Preset:
    """The preset --preset names with --set and --budget-s applied; an unknown field or objective, an
    objective or seed named twice, a baseline that is not a row, or parallel < 1 is refused (ap.error)."""
    p = dataclasses.replace(PRESETS[args.preset])
    apply_sets(ap, p, args.set)
    if args.budget_s is not None:
        p.budget_s = args.budget_s
    unknown = [o for o in p.objectives if o not in VARIANTS]
    if unknown:
        ap.error(f"objectives: unknown {unknown}; known: {', '.join(VARIANTS)}")
    for twice in (named_twice("objectives", p.objectives), seeds_refused(p.seeds)):
        if twice:
            ap.error(twice)
    if p.baseline not in p.objectives:
        ap.error(f"baseline {p.baseline!r} is not one of the rows {list(p.objectives)}")
    if p.parallel < 1:
        ap.error(f"parallel: {p.parallel}: must be at least 1")
    return p


def plan_ahead(p: Preset) -> Plan:
    """Stage 0: the plan from the preset's estimates, before anything runs."""
    ahead = plan_runs(p, p.budget_s - p.prep_s - p.timing_s - p.eval_reserve_s if p.budget_s else None)
    say(f"plan (estimated, before the preparation): {ahead.text(p.objectives)}"
        + (f" of {p.budget_s - p.prep_s - p.timing_s - p.eval_reserve_s:.0f}s left after ~{p.prep_s:.0f}s of "
           f"preparation and ~{p.timing_s:.0f}s of step timing" if p.budget_s else ""))
    for note in ahead.notes:
        say(f"plan: {note}")
    return ahead


def prepare(p: Preset, quality_set: list[str], out: Path, results: dict, started: float) -> tuple[quality.Preset, Path]:
    """Stage 1: bench/quality.py up to its regeneration; its preset (as it ran, `parallel` this bench's)
    and the file of answers every run trains on."""
    qset = [f"--set={k}={json.dumps(v)}" for k, v in p.quality_set.items()] + [f"--set={s}" for s in quality_set]
    prepared = quality.main(["--preset", p.quality, "--out", str(out), "--stop-after", "regen", *qset])
    qp = dataclasses.replace(quality.PRESETS[p.quality], **{k: v for k, v in prepared["preset"].items()
                                                            if k != "prefix_chars"})
    qp.parallel = p.parallel
    results["quality"] = {k: prepared[k] for k in ("corpus", "tokenizer", "target", "prompts", "regen") if k in prepared}
    results["prep_seconds"] = round(time.time() - started, 1)
    data = out / "data"
    source = data / ("regen.jsonl" if prepared["regen"]["conversations"] >= 1 else "original.jsonl")
    train_file, _ = quality.subset(source, data / "objectives-train.jsonl", None, p.train_convs)
    results["train_convs"] = len(quality.read_records(train_file))
    results["heldout_prompts"] = len(quality.read_records(data / "eval.jsonl"))
    say(f"objectives: {results['train_convs']} answers ({source.name}) per run; {len(p.objectives)} objectives x "
        f"{len(p.seeds)} seeds; preparation took {results['prep_seconds']:.0f}s (planned ~{p.prep_s:.0f}s)")
    return qp, train_file


def write_code_prompts(p: Preset, qp: quality.Preset, data: Path, results: dict) -> list[dict]:
    """Stage 2: the second prompt set (data/code-prompts.jsonl)."""
    code = code_prompts(p.code_prompts, 1000 + qp.seed)
    quality.write_jsonl(data / "code-prompts.jsonl", code)
    results["code_prompts"] = len(code)
    results["code_prompt_example"] = code[0]["messages"][0]["content"]
    return code


def time_objectives(p: Preset, config: Callable[..., dict], runs: Path, timing_file: Path, results: dict) -> dict[str, float]:
    """Stage 3: each objective's step time alone (the fastest of 3 rounds), on a small training file."""
    t0 = time.time()
    steppers = {}
    for name in p.objectives:
        cfg = config(name, 0, 3 * p.timing_steps + p.timing_warmup, timing_file)
        cfg["pipeline"] = {"kind": "reference"}
        steppers[name] = step_runner(cfg, runs / f"timing-{name}")
    timing = step_seconds(steppers, p.timing_steps, p.timing_warmup)
    del steppers
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the components of the timing runs are gone
    for name, t in timing.items():
        say(f"step time alone: {name} {t * 1000:.1f} ms (the fastest of 3 rounds of {p.timing_steps} steps)")
    results["timing"], results["timing_seconds"] = timing, round(time.time() - t0, 1)
    return timing


def measured_plan(p: Preset, timing: dict[str, float], left: float | None, ahead: Plan, results: dict,
                  save: Callable[[], None]) -> Plan:
    """The plan again from the measured step times and the time left; refused (PlanError), with the step
    times written as the table, when not even min_seeds seeds fit."""
    try:
        plan = plan_runs(p, left, timing)
    except PlanError as e:  # the preparation took longer than planned: the step times are still a figure
        results["refused"], results["table"] = str(e), summarise({name: [] for name in p.objectives}, timing, p.baseline)
        save()
        raise
    say(f"plan (measured step times{f', {left:.0f}s left' if left is not None else ''}): {plan.text(p.objectives)}")
    for note in plan.notes:
        say(f"plan: {note}")
    results["plan"], results["plan_notes"] = plan.text(p.objectives), ahead.notes + plan.notes
    results["planned_steps"], results["train_s"] = plan.steps, plan.train_s
    return plan


class RunsEnded:
    """Stage 4's on_done: as each run ends, its row (τ on the code prompts from its last checkpoint, and
    on the held-out prompts too when it stopped before its own final evaluation) joins the table, which
    is written again (a call killed later still leaves the table so far)."""

    def __init__(self, p: Preset, plan: Plan, timing: dict[str, float], evaluators: tuple, budget_end: float | None,
                 results: dict, save: Callable[[], None], total: int):
        self.p, self.plan, self.timing, self.budget_end, self.results, self.save = p, plan, timing, budget_end, results, save
        self.total = total  # runs queued
        self.evaluator, self.heldout = evaluators  # τ on the code prompts; τ on the held-out ones
        self.rows: dict[str, list[dict]] = {name: [] for name in p.objectives}
        results["runs"] = self.rows

    def __call__(self, j: dict) -> None:
        seed, name = j["seed"], j["objective"]
        r = {**quality.read_run(j["run_dir"]), **training_pace(j["run_dir"]), "seed": seed, "exit": j.get("rc"),
             "planned_steps": self.plan.steps[name], "seconds": round(j.get("seconds", 0.0), 1)}
        last = complete_checkpoints(j["run_dir"])
        if last and (self.budget_end is None or time.time() < self.budget_end - 5):
            point = self.evaluator(last[-1])
            r.update(tau_code=point["tau"], tau_code_lookup=point["tau_lookup"], acceptance_code=point.get("acceptance"),
                     code_checkpoint=str(last[-1]))
            if r.get("tau") is None:  # stopped at the deadline: the trainer did not measure its held-out τ
                point = self.heldout(last[-1])
                r.update(tau=point["tau"], tau_ratio=point["tau_ratio"], acceptance=point["acceptance"],
                         tau_lookup=point["tau_lookup"], steps=point["step"], tau_from=str(last[-1]))
        if j.get("rc") not in (0, None):
            text = read_log(j["run_dir"]) or (j["log"].read_text() if j["log"].exists() else "")
            tail = text.strip().splitlines()[-8:]
            say(f"{j['name']}: exit {j.get('rc')}:\n" + "\n".join(tail))
        self.rows[name].append(r)
        self.rows[name].sort(key=lambda x: x["seed"])
        say(f"{j['name']}: exit {r['exit']}, {r['steps']} of {self.plan.steps[name]} steps in {r['seconds']:.0f}s, tau "
            f"held-out {quality.fmt(r.get('tau'))}, code {quality.fmt(r.get('tau_code'))}, acceptance {r.get('acceptance')}")
        self.results["table"] = summarise(self.rows, self.timing, self.p.baseline)
        self.results["partial"] = f"{sum(map(len, self.rows.values()))} of {self.total} runs ended"
        self.save()


def main(argv: list[str] | None = None) -> dict:
    ap = parser()
    args = ap.parse_args(argv)
    p = preset_of(ap, args)
    started = time.time()
    budget_end = started + p.budget_s if p.budget_s else None
    margin = p.eval_reserve_s  # the deadline's stops and the last τ
    ahead = plan_ahead(p)
    if args.plan_only:
        return {"plan": dataclasses.asdict(ahead)}
    p.seeds = ahead.seeds
    out = args.out.resolve()
    command = "PYTHONPATH=. python bench/quality_objectives.py " + " ".join(argv if argv is not None else sys.argv[1:])
    results: dict = {"command": command, "preset": dataclasses.asdict(p), "torch": torch.__version__,
                     "plan_ahead": dataclasses.asdict(ahead)}

    def save() -> None:
        results["seconds"] = round(time.time() - started, 1)
        (out / "objectives.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
        if "table" in results:
            (out / "objectives.md").write_text(markdown(results))

    qp, train_file = prepare(p, args.quality_set, out, results, started)
    model_dir, data, runs = out / "model", out / "data", out / "runs-objectives"
    runs.mkdir(parents=True, exist_ok=True)
    code = write_code_prompts(p, qp, data, results)
    timing_file, _ = quality.subset(train_file, data / "objectives-timing.jsonl", None, 512)  # quick to tokenise
    workers = max(1, (os.cpu_count() or 2) // p.parallel)  # the runs tokenise at once: the CPUs shared

    def config(name: str, seed: int, steps: int, train: Path = train_file) -> dict:
        cfg = quality.trainer_config(qp, model_dir, train, data, steps, {}, max(1, steps))
        cfg["model"].update(VARIANTS[name])
        cfg["run"]["seed"], cfg["data"]["seed"] = seed, seed
        cfg["data"]["workers"] = workers
        return cfg

    timing = time_objectives(p, config, runs, timing_file, results)
    plan = measured_plan(p, timing, budget_end - time.time() - margin if budget_end else None, ahead, results, save)
    save()
    # the runs (seed after seed: a deadline leaves whole seeds), then τ on the code prompts as each ends
    order = [(seed, name) for seed in plan.seeds for name in p.objectives]
    jobs = [quality.job(f"{name} seed {seed}", config(name, seed, plan.steps[name]), runs) for seed, name in order]
    expect = p.startup_s + plan.train_s * p.parallel / max(1.0, min(p.parallel, p.share_gain)) + p.end_s
    for j, (seed, name) in zip(jobs, order):
        j["seed"], j["objective"], j["expect_s"] = seed, name, expect
    deadline = budget_end - margin if budget_end else None
    heldout = quality.CheckpointEvaluator(qp, model_dir, data)  # for a run stopped before its own final evaluation
    evaluator = quality.CheckpointEvaluator(qp, model_dir, data)
    evaluator.conversations = code
    evaluator.p = dataclasses.replace(qp, eval_new_tokens=p.code_new_tokens)
    ended = RunsEnded(p, plan, timing, (evaluator, heldout), budget_end, results, save, len(jobs))
    say(f"runs: {len(jobs)} queued, {p.parallel} at a time" + (f"; deadline in {deadline - time.time():.0f}s" if deadline else ""))
    quality.run_all(qp, jobs, deadline, on_done=ended, first_alone=False)  # each objective compiles its own graphs
    never = [j["name"] for j in jobs if j.get("rc") is None and j.get("seconds", 0.0) == 0.0 and "proc" not in j]
    results["table"] = summarise(ended.rows, timing, p.baseline)
    results["verdict"] = verdict(results["table"], p.baseline)
    results.pop("partial", None)
    if never:
        results["partial"] = f"never started before the deadline: {', '.join(never)}"
    for line in results["verdict"]:
        say(f"verdict: {line}")
    save()
    say(f"objectives: done in {time.time() - started:.0f}s; {out / 'objectives.json'}, {out / 'objectives.md'}")
    return results


if __name__ == "__main__":
    main()
