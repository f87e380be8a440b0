"""The recipe ablation of issue #50 (docs/objectives.md): candidates (objective x training data) over
3 seeds at equal device time, τ at T = 0 and T = 1 on the held-out prompts and on prompts of another
style, beside n-gram lookup's τ there; at T = 1 with the engine's argmax proposals and again with sampled ones
(vLLM's draft_sample_method probabilistic; `proposals`); one run spans several device calls of one warm machine.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python bench/recipe_ablation.py --preset h200 --state /tmp/ablation --out $OUT/recipe
    ... the same command again, as each call ends by printing it, until it prints "done"
    PYTHONPATH=. python bench/recipe_ablation.py --preset cpu --state /tmp/ablation --out /tmp/recipe   # CPU (the test)
    ... --plan-only     # the plan from the preset's stated figures; nothing run

A candidate is `OBJECTIVE/DATA[/KIND][/TAPS]`: the objective one of bench/quality_objectives.py's OBJECTIVES
(ce+decay, ce+dpace, kl, ce+kl, kl+dpace), the drafter's generation (`model.drafter.kind`: dflash unless
`/dflash2`), the target layers it reads (the trainer's default, spaced from layer 1 to layers-3, unless `/deep`:
spaced from layer 1 to the last, `deep_layer_ids`), the data one of DATA_MIXES: `greedy` the target's greedy answer of each of
`mix_prompts` regen prompts, `sampled` `samples_per_prompt` seeded answers of each of the same prompts at
`sample_temperature` / `sample_top_p` (`regen --samples-per-prompt`), `both` the two together; `sampledK` and
`bothK` hold only each prompt's first K sampled answers (K at most `samples_per_prompt`: `both1` beside `sampled`
with 2 a prompt is the greedy answers traded for sampled ones at equal rows). The mix (prompts, rows, answer
characters, sampling) is recorded in the results beside the table.

**What the presets choose, and why (device time).** One warm machine holds a session's device time: about
25 minutes, 10 a command. The 12 candidates x 3 seeds = 36 runs at the ~70M tokens where today's τ curve
flattens would need ~2 hours of one H200 (36 x ~210 s of training alone, bench/RESULTS.md's ~330k
tokens/s), so the runs come in two stages:

* `h200` (the screen, three calls of 540 s, the data's ~630 s included: target and prompts ~120 s, 8,192
  greedy answers ~240 s, 16,384 sampled ~220 s, step times ~50 s, measured on an H100): 4 candidates x 3
  seeds = 12 runs, ~65 s of device time each (~1,800 ce+decay steps at an H100's 37 ms: 1.5x the 1,225 of the
  table of 2026-12-06, whose preparation was cut to half the planned data, and 14x the objectives ablation's).
  `ce+decay/greedy` (today's default, the baseline), `ce+dpace/greedy` (the earlier ablation's closest, to
  run longer before the default moves), `ce+decay/both` (the data alone), `kl/both` (the peers' objective
  on the data that carries the target's distribution). Each comparison with the baseline moves one
  factor, except kl/both, which is read against ce+decay/both.
* `h200-long` (a session of its own: the state of one machine does not outlive it, so the data is made
  again): the screen's best beside the baseline (`--candidates BEST,ce+decay/greedy`), 3 seeds, 6 runs in the
  same three calls: ~135 s of device time each, about twice the screen's (~50M tokens).

`sampled` alone and `ce+kl` stay out of the screen (both holds the greedy answers too; ce+kl cost as much as
kl and was no better at 125 steps); `--candidates` names any of the 12.

**Equal device time.** Every run trains `train_s` seconds of the device alone: a candidate of objective and
generation o trains `train_s / t(o)` optimizer steps, t(o) its step time timed alone on the device in the first
call (quality_objectives.time_objectives). train_s is fixed once (the preset's, or what `calls` calls hold at the
stated `rate`), recorded in the state, and never changed by a later call.

**Calls.** Everything lives under `--state` (default /tmp/ablation): the target, its tokenizer and the prompts
(bench/quality.py up to its prompts), the greedy answers, the sampled answers, the mixes, the step times, and
the runs under stages/STAGE/. Each call does what is left, in order, until its deadline (`call_s` after its
start, less `reserve_s` for the stops, the last τ and the table): the target and prompts once; the greedy
answers of every prompt, then the sampled answers (regen is given only the batches that end before the
deadline at the measured, else stated, seconds a batch, and gets SIGINT at the deadline if one runs over: it
cancels its batch in flight and keeps every finished row; the next call's rerun adds the missing ones; with
`regen_legs` the greedy regen answers at most 1/regen_legs of the prompts a call, the CPU test's cut); no run starts before the
data is whole, and the table says how many of the planned prompts it holds; the timing once; then the runs
(candidate after candidate, seed after seed; `parallel` at a time), each `python -m trainer --config C
--run-dir R --resume auto` (a mix is tokenized once, by the first of its runs to start: they share
`data.token_cache` STATE/tokenized): a run stopped by the deadline (SIGTERM: it checkpoints at its step boundary)
resumes from its last checkpoint in the next call; with `legs` a run trains at most 1/legs of its steps in one
call (the CPU test's deterministic stop). A run that has all its steps is evaluated once by the bench
(quality.CheckpointEvaluator: both prompt sets at every temperature), as soon as no run waits to start (while
the last ones train, before the deadline) or else at the call's end, and the table (OUT/recipe.md and .json,
also STATE/stages/STAGE/recipe.*) is written again, with each candidate's standing against #50's goal
(held-out 2.0x and other style 1.6x lookup's τ at every temperature; the cells short of it named). At its
end every call prints the command to run next and what is left (runs, their device time, the calls that
takes at the measured rate: device-time seconds trained per second of the runs' wall time, start-ups and
evaluations included).

**What the table cannot say.** Anything about another target than the bench's small code model, data sizes
beyond the bench's (~8K prompts), longer training than the stage ran (the screen stops well before the curve
flattens: a gain that appears late is not in it), prompts unlike the held-out and other-style sets, or
serving at other temperatures and top-p than those evaluated (T = 0 and 1, top-p 1). A gain smaller than the
seed range (3 seeds: max - min) is not a gain. The data axis holds the tokens trained equal, not the epochs:
`greedy` (one answer a prompt) is seen ~3x as often as `both` in the same steps, so a gain of `both` is more
distinct answers and fewer repeats together, not the sampling alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import re
import shlex
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import quality, quality_objectives  # noqa: E402
from bench.common import apply_sets, named_twice, seeds_refused  # noqa: E402
from trainer.generate.sampling_params import DRAFT_SAMPLE_METHODS  # noqa: E402
from trainer.models.drafter import DRAFTER_KINDS  # noqa: E402
from trainer.models.target import spaced_layer_ids  # noqa: E402
from trainer.run.checkpoint import complete_checkpoints, step_of  # noqa: E402
from trainer.run.contract import read_log, read_status  # noqa: E402

DATA_MIXES = ("greedy", "sampled", "both")
# a candidate's DATA: a mix, `sampled` and `both` with the sampled answers of each prompt they hold (K: its first K)
DATA_NAME = re.compile(r"greedy|(?P<mix>sampled|both)(?P<k>[1-9][0-9]*)?")
SETS = ("heldout", "other")


def deep_layer_ids(layers: int, count: int) -> list[int]:
    """`count` target layers spaced evenly from 1 to the last (8 layers, 3 -> 1, 4, 7): the trainer's default
    stops at layers-3 (DFlash's), which on the bench's 8-layer target leaves 2 of 8 layers unread."""
    return [layers - 1] if count == 1 else spaced_layer_ids(1, layers - 1, count)


# a candidate's taps (its TAPS part) -> its target layer ids on a target of (layers, count): None for the
# trainer's default, or the deep ones that read the target's last layer
TAPS: dict[str, Callable[[int, int], list[int] | None]] = {"default": lambda layers, count: None, "deep": deep_layer_ids}
SCREEN = ("ce+decay/greedy", "ce+dpace/greedy", "ce+decay/both", "kl/both")
# what the data of a state depends on: a preset asking for other values needs another --state
DATA_FIELDS = ("quality", "quality_set", "mix_prompts", "samples_per_prompt", "sample_temperature", "sample_top_p")
# what a stage's runs depend on: a later call with other values would not continue the same runs
PLANNED = ("candidates", "baseline", "seeds", *DATA_FIELDS, "temperatures", "train_s", "base_steps", "calls", "legs",
           "max_steps")


@dataclass
class Preset:
    quality: str = "h200"  # the bench/quality.py preset that builds target, greedy answers and the trainer config
    quality_set: dict = field(default_factory=dict)  # its fields overridden
    candidates: tuple[str, ...] = SCREEN  # OBJECTIVE/DATA[/KIND][/TAPS]
    baseline: str = "ce+decay/greedy"  # the row the verdict compares with
    seeds: tuple[int, ...] = (0, 1, 2)
    mix_prompts: int = 8192  # regen prompts whose answers the mixes hold
    samples_per_prompt: int = 2  # the sampled answers of each
    sample_temperature: float = 1.0
    sample_top_p: float = 1.0
    sample_batch: int = 2048  # rows regen samples at once (HF generate grows its cache: a smaller batch than greedy's)
    temperatures: tuple[float, ...] = (0.0, 1.0)  # τ of every prompt set at each
    # the engine's proposals each run is evaluated with at T > 0 (vLLM's draft_sample_method): the draft's argmax,
    # and sampled from it (columns "T=1 sampled"), which the ceiling does not bound (docs/objectives.md)
    proposals: tuple[str, ...] = ("greedy", "probabilistic")
    train_s: float = 0.0  # each run's training, seconds of the device alone (0: base_steps, else what `calls` hold)
    base_steps: int = 0  # with train_s 0: the baseline objective's steps (the others as many as cost the same)
    calls: int = 3  # the device calls the plan is sized for (train_s and base_steps 0), the data's included
    legs: int = 0  # a run trains at most 1/legs of its steps in one call (0: until done or the deadline)
    regen_legs: int = 0  # the greedy regen answers at most 1/regen_legs of the prompts in one call (the CPU test's cut)
    max_steps: int = 20000
    parallel: int = 6  # trainer processes at once on the device (quality_objectives: 12 at once never trained)
    call_s: float = 540.0  # one call's wall budget (the device tool: 600 s a command)
    reserve_s: float = 60.0  # kept at a call's end: the runs' stops (SIGTERM, checkpoint), the last τ, the table
    timing_steps: int = 12
    timing_warmup: int = 3
    # stated figures (seconds), for the plan before they are measured
    # measured on an H100 (2026-12-06, the first call's log): the target and prompts by t = 118 s; the greedy regen
    # 3,892 answers in ~110 s after its model load (~230 s for 8,192); the sampled answers 7,784 rows in 104 s
    # (~220 s for 2 x 8,192); the step times ~50 s
    prep_s: float = 120.0  # bench/quality.py up to its prompts (corpus, tokenizer, target)
    greedy_s: float = 240.0  # the greedy answers of every prompt (regen, model load included)
    sampled_s: float = 220.0  # the sampled answers (HF generate)
    timing_s: float = 50.0
    startup_s: float = 40.0  # a trainer run's start before its first step
    min_leg_s: float = 30.0  # a run is not started with less than startup_s + this left before the deadline
    eval_s: float = 22.0  # the bench's τ of one finished run (2 sets x 2 temperatures, 64 prompts x 256 tokens: ~15 s;
    # T = 1 again with sampled proposals: ~1.5x, estimated, not measured)
    rate: float = 1.0  # device-alone training seconds per second of the runs' wall (parallel runs; start-ups in)


# The data table (#50's lever for T = 1, docs/objectives.md): the data's sampled share. The default recipe's data
# (each prompt's greedy answer and its first sampled one: both1) beside two sampled answers a prompt and no greedy
# one (sampled): equal rows (32,768), equal device time, the default objective and generation; the data is
# made again (another --state). Its figures as measured on an H100 (eighteenth session): the target and
# prompts 123 s, the greedy answers 141 s (74 s the session before), two batches of sampled ones 105 s
# each, the timing ~50 s, 0.71 device-s per wall-s over the runs.
H200_DATA = Preset(quality_set={"n_prompts": 16384, "regen_batch": 16384},
                   candidates=("ce+dpace/both1", "ce+dpace/sampled"), baseline="ce+dpace/both1",
                   mix_prompts=16384, samples_per_prompt=2, sample_batch=16384, parallel=3, rate=0.7,
                   prep_s=125.0, greedy_s=140.0, sampled_s=210.0, timing_s=55.0, startup_s=60.0)

PRESETS = {
    "h200": Preset(quality_set={"n_prompts": 8192, "regen_batch": 8192}),
    # the screen's best (name it: --candidates BEST,ce+decay/greedy) beside the baseline, in a session of its own:
    # 6 runs in the three calls' time, ~2x the screen's device time each
    "h200-long": Preset(quality_set={"n_prompts": 8192, "regen_batch": 8192}, candidates=("kl/both", "ce+decay/greedy")),
    # issue #50's done-when on one session's machine: the default recipe (ce+dpace/both) over 3 seeds beside the
    # same recipe with a DFlash2 drafter, at equal device time, on the data the one-call recipe trains on (16,384
    # prompts, each one's greedy answer and one sampled at T = 1). DFlash2 is the one lever two screens at equal
    # steps agree on (the quality bench's h200-proposals and h200-levers, ~13-16M tokens, one seed each: +49 % and
    # +46 % τ at T = 0 held-out, +41 % and +30 % other style, level at T = 1); its step costs more, so whether the
    # lead holds at equal device time and at length is this table's question. (The fourteenth session's rival
    # was the peers' recipe, DFlash2 trained with kl+dpace: its step cost 1.53x the default's, and the table
    # could not have told the generation's gain from the objective's.) Stated figures: the thirteenth session's
    # H100 calls (the target and prompts by t = 119 s, 16,384 greedy answers in 71-74 s with the model load,
    # 16,384 sampled in 66-75 s, a trainer's start ~60 s); the fourteenth's (an H100): the data by t = 340 s, three
    # runs at once 0.92 of one alone over a whole call and 0.69 in the first call's last 117 s (start-ups): 0.8.
    # A session with too little device time for three calls: --set calls=2 (shorter runs, planned in the first)
    "h200-default": Preset(quality_set={"n_prompts": 16384, "regen_batch": 16384},
                           candidates=("ce+dpace/both", "ce+dpace/both/dflash2"), baseline="ce+dpace/both",
                           mix_prompts=16384, samples_per_prompt=1, sample_batch=16384, parallel=3, rate=0.8,
                           prep_s=120.0, greedy_s=80.0, sampled_s=80.0, startup_s=60.0),
    "h200-data": H200_DATA,
    # What the data table left open (eighteenth session: two sampled answers a prompt and no greedy one raise T = 1
    # by a quarter and cost T = 0 as much): a third of the rows greedy (each prompt's greedy answer and both sampled
    # ones) beside none, at T = 0, 1 and the 0.6 many users serve at; three calls give each run ~94 s of the device
    # alone (~37M tokens), so it also says whether the sampled data's T = 1 lead grows with length. Its data is
    # h200-data's (the same --state serves both on one machine).
    "h200-mix": dataclasses.replace(H200_DATA, candidates=("ce+dpace/sampled", "ce+dpace/both"),
                                    baseline="ce+dpace/sampled", temperatures=(0.0, 0.6, 1.0), eval_s=35.0),
    # the tiny target on CPU: in-process runs one at a time, each in two legs (two calls)
    "cpu": Preset(quality="tiny", quality_set={"target_steps": 8}, candidates=("ce+decay/greedy", "kl/both/dflash2"),
                  seeds=(0, 1), mix_prompts=12, samples_per_prompt=2, sample_batch=12, base_steps=10, legs=2, parallel=1,
                  call_s=900.0, reserve_s=10.0, timing_steps=2, timing_warmup=1, prep_s=60.0, greedy_s=5.0,
                  sampled_s=10.0, timing_s=20.0, startup_s=5.0, min_leg_s=1.0, eval_s=3.0, max_steps=40, calls=2),
}


def say(line: str) -> None:
    print(line, flush=True)


# ---------------------------------------------------------------------------- the state


def write_json(path: Path, doc: Any) -> None:
    """Whole or not at all: a call killed mid-write leaves the previous file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


class Candidate(NamedTuple):
    objective: str
    data: str
    kind: str  # the drafter's generation (model.drafter.kind)
    taps: str  # the target layers it reads: TAPS


def candidate_parts(name: str) -> Candidate:
    """`OBJECTIVE/DATA[/KIND][/TAPS]` -> its parts; ValueError naming the choices. The kind and the taps
    are named only when they are not the default (dflash, the trainer's taps), so each candidate has one
    name."""
    objective, data, *rest = name.split("/") + [""]
    kinds, taps = DRAFTER_KINDS[1:], tuple(TAPS)[1:]
    kind = rest.pop(0) if rest and rest[0] in kinds else DRAFTER_KINDS[0]
    tapped = rest.pop(0) if rest and rest[0] in taps else next(iter(TAPS))
    if objective not in quality_objectives.OBJECTIVES or not DATA_NAME.fullmatch(data) or rest != [""]:
        raise ValueError(f"candidate {name!r}: expected OBJECTIVE/DATA[/KIND][/TAPS], OBJECTIVE one of "
                         f"{', '.join(quality_objectives.OBJECTIVES)}, DATA one of {', '.join(DATA_MIXES)} "
                         "(sampled and both may end in K, each prompt's first K sampled answers: both1), "
                         f"KIND one of {', '.join(kinds)} (without it: {DRAFTER_KINDS[0]}), TAPS one of "
                         f"{', '.join(taps)} (without it: {next(iter(TAPS))})")
    return Candidate(objective, data, kind, tapped)


def data_parts(data: str) -> tuple[str, int | None]:
    """A candidate's DATA (checked by candidate_parts) -> (its mix, the count of each prompt's sampled answers
    it holds, None for all): `both1` -> ("both", 1), `sampled` -> ("sampled", None)."""
    match = DATA_NAME.fullmatch(data)
    if not match:
        raise ValueError(f"data {data!r}: expected greedy, sampled[K] or both[K]")
    return match["mix"] or "greedy", int(match["k"]) if match["k"] else None


def named_parts(c: Candidate) -> list[str]:
    """The parts a candidate names beside its objective and data (its kind and taps where not the default)."""
    return [part for part, default in ((c.kind, DRAFTER_KINDS[0]), (c.taps, next(iter(TAPS)))) if part != default]


def arm(candidate: str) -> str:
    """What a candidate's step time depends on (its objective, drafter kind and taps, not its data): the
    key of the step times and the steps."""
    c = candidate_parts(candidate)
    return "/".join([c.objective, *named_parts(c)])


def run_name(candidate: str, seed: int) -> str:
    c = candidate_parts(candidate)
    return " ".join([c.objective, c.data, *named_parts(c), f"seed {seed}"])


def planned_fields(p: Preset) -> dict:
    return json.loads(json.dumps({k: getattr(p, k) for k in PLANNED}))  # as read back from the state


def quality_preset(p: Preset) -> quality.Preset:
    qp = dataclasses.replace(quality.PRESETS[p.quality])
    for key, value in p.quality_set.items():
        setattr(qp, key, tuple(value) if isinstance(value, list) and key in quality.TUPLE_FIELDS else value)
    qp.parallel = p.parallel
    return qp


# ---------------------------------------------------------------------------- the data


def prepare_target(p: Preset, state: Path) -> dict:
    """bench/quality.py up to its prompts, into the state directory (corpus, tokenizer, the target as a
    model directory, the regen, held-out and other-style prompts)."""
    started = time.time()
    qset = [f"--set={k}={json.dumps(v)}" for k, v in p.quality_set.items()]
    prepared = quality.main(["--preset", p.quality, "--out", str(state), "--stop-after", "prompts", *qset])
    return {"seconds": round(time.time() - started, 1), "prompts": prepared["prompts"]}


def run_regen(qp: quality.Preset, argv: list[str], log: Path, out: Path, deadline: float | None) -> tuple[int, float, int]:
    """`python -m trainer_tools.regen ARGV` as a user runs it, SIGINT at the deadline (it cancels its batch
    in flight and keeps every finished row; a rerun adds the missing ones), though not before it has
    written a row this time; then OUT cut to whole lines. (exit, seconds, rows in OUT)"""
    size = out.stat().st_size if out.exists() else 0
    rc, seconds = quality.run_cli(qp, argv, log, deadline, module="trainer_tools.regen",
                                  started_work=lambda: out.exists() and out.stat().st_size > size)
    rows = quality.read_records(out) if out.exists() else []
    if out.exists():
        quality.write_jsonl(out, rows)  # whole lines only, for the trainer and the next rerun
    if rc == 2:  # regen's usage error: no rerun would do better
        raise SystemExit(f"recipe: regen refused its arguments (exit 2); see {log}")
    return rc, seconds, len(rows)


def prompts_that_fit(had: int, batch_rows: int, per_prompt: int, batch_s: float, deadline: float) -> int:
    """How many of the input's first prompts regen may be given so that each batch it starts ends before the
    deadline: `had` prompts are answered, a batch is `batch_rows` rows of `per_prompt` rows a prompt and takes
    ~batch_s. A batch the deadline cuts is lost whole (its rows are written at its end), and its device time
    with it; the call ends earlier instead and the next one makes it."""
    batches = max(0, math.floor((deadline - time.time()) / batch_s))
    return had + batches * max(1, batch_rows // per_prompt)


def limit_args(what: str, note: str, had: int, prompts: int, batch_rows: int, per_prompt: int, batch_s: float,
               deadline: float, cap: int | None = None) -> list[str] | None:
    """Regen's `--limit` for a part of `prompts` prompts of which `had` are answered: the batches that end before
    the deadline (`prompts_that_fit`), at most `cap` prompts; [] for all of them, None (and said) when not one
    batch fits."""
    limit = min(prompts if cap is None else cap, prompts_that_fit(had, batch_rows, per_prompt, batch_s, deadline))
    if limit <= had:
        say(f"{what}: a batch takes ~{batch_s:.0f}s{note}, {deadline - time.time():.0f}s are left: the next call makes them")
        return None
    return ["--limit", str(limit)] if limit < prompts else []


def sampled_batch_s(p: Preset, greedy: dict, planned_rows: int) -> float:
    """The seconds one batch of sampled answers takes: the greedy answers' measured seconds a row (the same
    model and answer length; model load included) over a sampled batch, or the stated figure if that is more."""
    stated = p.sampled_s / math.ceil(planned_rows / p.sample_batch)
    measured = greedy["seconds"] / greedy["rows"] * min(p.sample_batch, planned_rows) if greedy.get("rows") else 0.0
    return max(stated, measured)


def greedy_answers(p: Preset, qp: quality.Preset, state: Path, deadline: float, before: dict | None) -> dict | None:
    """The target's greedy answer to every regen prompt (data/regen.jsonl). Regen stops at the deadline
    with whole rows written and the next call's rerun adds the missing ones (with `regen_legs`, at most
    1/regen_legs of the prompts a call: the CPU test's cut). Done once every prompt has its answer."""
    data = state / "data"
    planned = len(quality.read_records(data / "prompts.jsonl"))
    out = data / "regen.jsonl"
    argv = quality.regen_argv(qp, state / "model", data)
    had = len(quality.read_records(out)) if out.exists() else 0
    leg = None if p.regen_legs <= 1 else min(planned, had + math.ceil(planned / p.regen_legs))
    limit = limit_args("greedy answers", " (stated)", had, planned, qp.regen_batch, 1,
                       p.greedy_s / math.ceil(planned / qp.regen_batch), deadline, leg)
    if limit is None:
        return None
    argv += limit
    rc, seconds, rows = run_regen(qp, argv, state / "regen.log", out, deadline)
    part = answers_part(argv, rc, seconds, rows, planned, before)
    say(f"greedy answers: exit {rc}; {rows} of {planned} prompts answered [{seconds:.0f}s]"
        + ("" if part["done"] else "; the next call resumes them"
           + ("" if rc in (0, 130, -2, -9) else f" (see {state / 'regen.log'})")))
    return part


def answers_part(argv: list[str], rc: int, seconds: float, rows: int, planned: int, before: dict | None) -> dict:
    """A part of the data as the state records it: whole once regen ran to its end with every planned row;
    its calls and seconds summed over the calls that made it."""
    return {"done": rc == 0 and rows >= planned, "rows": rows, "planned": planned, "exit": rc,
            "calls": (before or {}).get("calls", 0) + 1, "seconds": round((before or {}).get("seconds", 0.0) + seconds, 1),
            "command": "python -m trainer_tools.regen " + shlex.join(argv)}


def mix_prompt_ids(data: Path, n: int, seed: int) -> list[str]:
    """The regen prompts every mix draws on: n of those with a greedy answer, a seeded draw."""
    ids = sorted(str(r["id"]) for r in quality.read_records(data / "regen.jsonl"))
    random.Random(f"mix:{seed}").shuffle(ids)
    return ids[:n]


def sample_answers(p: Preset, qp: quality.Preset, state: Path, deadline: float, greedy: dict,
                   before: dict | None) -> dict | None:
    """The sampled answers of the mix's prompts (data/regen-sampled.jsonl, rows `<id>#<k>`): regen stops at
    the deadline with whole rows written, and the next call's rerun adds only the missing ones. Done when
    regen ran to its end."""
    data = state / "data"
    ids = set(mix_prompt_ids(data, p.mix_prompts, qp.seed))
    quality.write_jsonl(data / "prompts-sampled.jsonl",
                        (r for r in quality.read_records(data / "prompts.jsonl") if str(r.get("id")) in ids))
    argv = quality.regen_argv(dataclasses.replace(qp, regen_batch=p.sample_batch), state / "model", data, "prompts-sampled.jsonl", "regen-sampled.jsonl",
                              p.samples_per_prompt, p.sample_temperature, p.sample_top_p)
    out, planned = data / "regen-sampled.jsonl", len(ids) * p.samples_per_prompt
    had = (len(quality.read_records(out)) if out.exists() else 0) // p.samples_per_prompt
    limit = limit_args("sampled answers", "", had, len(ids), p.sample_batch, p.samples_per_prompt,
                       sampled_batch_s(p, greedy, planned), deadline)
    if limit is None:
        return None
    argv += limit
    rc, seconds, rows = run_regen(qp, argv, state / "regen-sampled.log", out, deadline)
    part = answers_part(argv, rc, seconds, rows, planned, before)
    say(f"sampled answers: exit {rc}; {rows} of {planned} rows ({p.samples_per_prompt} a prompt, "
        f"T = {p.sample_temperature:g}, top-p {p.sample_top_p:g}) [{seconds:.0f}s]"
        + ("" if part["done"] else "; the next call resumes them"))
    return part


def mix_names(p: Preset) -> list[str]:
    """The mixes a stage writes: greedy, sampled, both, and any other its candidates name (both1)."""
    return list(dict.fromkeys([*DATA_MIXES, *(candidate_parts(c).data for c in p.candidates)]))


def write_mixes(p: Preset, data: Path, seed: int) -> dict:
    """data/mix-NAME.jsonl for each of `mix_names` from the same prompts, and what each holds."""
    ids = set(mix_prompt_ids(data, p.mix_prompts, seed))
    greedy = [r for r in quality.read_records(data / "regen.jsonl") if str(r.get("id")) in ids]
    sampled_path = data / "regen-sampled.jsonl"
    sampled = quality.read_records(sampled_path) if sampled_path.exists() else []
    mixes = {}
    for name in mix_names(p):
        if name != "greedy" and not sampled:
            continue
        mix, k = data_parts(name)
        drawn = [] if mix == "greedy" else [r for r in sampled if k is None or int(r["sample"]) < k]
        greedy_part = [] if mix == "sampled" else greedy
        rows = greedy_part + drawn
        quality.write_jsonl(data / f"mix-{name}.jsonl", rows)
        chars = [len(r["messages"][-1]["content"]) for r in rows]
        mixes[name] = {"file": f"data/mix-{name}.jsonl", "rows": len(rows), "prompts": len(ids), "planned": p.mix_prompts,
                       "greedy_rows": len(greedy_part), "sampled_rows": len(drawn),
                       "answer_chars_mean": round(statistics.fmean(chars), 1)}
    mixes["sampling"] = {"samples_per_prompt": p.samples_per_prompt, "temperature": p.sample_temperature,
                         "top_p": p.sample_top_p}
    return mixes


# ---------------------------------------------------------------------------- the plan


def plan_train_s(p: Preset, runs: int, call: int, call_left_s: float, rate: float) -> float:
    """Each run's device-alone training seconds when the `calls` calls are to hold all `runs`: what is left
    of this call (number `call`, after its data and timing) plus every later planned call's time less the
    reserve, less the evaluations of the last runs (they end together, one after another, with nothing left
    to train beside them: without their time the plan's last call leaves one or two for a call of its own),
    at `rate` (device-alone seconds trained per wall second, start-ups and the evaluations before in),
    shared by the runs."""
    wall = max(0.0, call_left_s) + max(0, p.calls - call) * (p.call_s - p.reserve_s)
    wall -= min(p.parallel, runs) * p.eval_s
    return max(0.0, wall * rate / max(1, runs))


def uses_sampled(p: Preset) -> bool:
    return any(candidate_parts(c).data != "greedy" for c in p.candidates)


def data_s(p: Preset) -> float:
    """The stated seconds of the data and the timing, before any run: they may take more than one call."""
    return p.prep_s + p.greedy_s + (p.sampled_s if uses_sampled(p) else 0.0) + p.timing_s


def steps_of(train_s: float, step_s: dict[str, float], max_steps: int) -> tuple[float, dict[str, int]]:
    """Each objective's steps at equal device time; train_s lowered so the fastest stays within max_steps."""
    fastest = min(step_s.values())
    if train_s / fastest > max_steps:
        train_s = max_steps * fastest
    return train_s, {o: max(1, round(train_s / t)) for o, t in step_s.items()}


def leg_end(step: int, planned: int, legs: int) -> int:
    """The step a run stops at in this call: its planned steps, or with `legs` the next of the legs'
    boundaries (planned * k / legs, rounded up) past `step`."""
    if legs <= 1:
        return planned
    return min(b for b in (math.ceil(planned * k / legs) for k in range(1, legs + 1)) if b > step)


def calls_left(p: Preset, remaining_s: float, unevaluated: int, legs_left: int, rate: float) -> int:
    """The calls the rest takes: the device-alone training left at `rate` over each call's time, at least
    one per leg left, one to evaluate finished runs."""
    per_call = max(1.0, (p.call_s - p.reserve_s) * rate)
    need = math.ceil(remaining_s / per_call) if remaining_s > 0 else 0
    return max(need, legs_left, 1 if unevaluated else 0)


# ---------------------------------------------------------------------------- the runs


class LegStops:
    """Writes control/stop into a run directory once its status.json shows the step of its leg's end
    (the trainer serves it at its next step boundary with a checkpoint). A thread, because the runs may
    run in this process (the CPU preset), where nothing else gets a turn while they train."""

    def __init__(self, jobs: list[dict]):
        self.jobs = [j for j in jobs if j["stop_at"] < j["planned"]]
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.watch, name="leg-stops", daemon=True)

    def watch(self) -> None:
        pending = list(self.jobs)
        while pending and not self.done.is_set():
            for j in list(pending):
                status = read_status(j["run_dir"]) or {}
                if status.get("state") == "running" and (status.get("step") or 0) >= j["stop_at"]:
                    control = Path(j["run_dir"]) / "control"
                    control.mkdir(parents=True, exist_ok=True)
                    write_json(control / "stop", {"id": "recipe-leg"})
                    pending.remove(j)
            time.sleep(0.02)

    def __enter__(self) -> LegStops:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.done.set()
        self.thread.join()


def last_step(run_dir: Path) -> int:
    found = complete_checkpoints(run_dir)
    return step_of(found[-1]) if found else 0


def trainer_config(p: Preset, qp: quality.Preset, state: Path, candidate: str, seed: int, steps: int,
                   train_file: Path | None = None) -> dict:
    """A run's trainer config: the quality bench's, the candidate's objective and mix, the seed (the
    drafter's initialisation, the data's order and anchors); the trainer's own final evaluation kept
    short (the table's τ are the bench's evaluation of the last checkpoint)."""
    c = candidate_parts(candidate)
    train = train_file or state / "data" / f"mix-{c.data}.jsonl"
    taps = TAPS[c.taps](qp.layers, qp.num_target_layers)  # None: the trainer's default
    cfg = quality.trainer_config(qp, state / "model", train, state / "data", steps,
                                 {"drafter_kind": c.kind, **({"target_layer_ids": taps} if taps else {})},
                                 max(1, steps // 4))
    cfg["model"].update(quality_objectives.OBJECTIVES[c.objective])
    cfg["run"].update(seed=seed, keep_checkpoints=2)
    cfg["data"]["seed"] = seed
    # a mix's runs (its seeds, resumed legs) tokenize it once: the first to start, on every core (data.workers
    # auto), while the others starting beside it wait for its entry
    cfg["data"]["token_cache"] = str(state / "tokenized")
    cfg["data"]["workers"] = "auto"
    cfg["eval"].update(samples=min(qp.n_eval, 4), batch=min(qp.n_eval, 4), max_new_tokens=min(qp.eval_new_tokens, 16),
                       temperatures=[0.0])
    return cfg


def time_steps(p: Preset, qp: quality.Preset, state: Path, runs: Path) -> dict[str, float]:
    """Each arm's optimizer step timed alone on the device (quality_objectives.time_objectives)."""
    arms: dict[str, str] = {}  # each arm's first candidate: its config, trained on the timing file
    for c in p.candidates:
        arms.setdefault(arm(c), c)
    timing_file, _ = quality.subset(state / "data" / "mix-greedy.jsonl", state / "data" / "timing.jsonl", None, 512)
    qo = quality_objectives.Preset(objectives=tuple(arms), baseline=next(iter(arms)), timing_steps=p.timing_steps,
                                   timing_warmup=p.timing_warmup)

    def config(name: str, seed: int, steps: int, train: Path) -> dict:
        return trainer_config(p, qp, state, arms[name], seed, steps, train)

    return quality_objectives.time_objectives(qo, config, runs, timing_file, {})


def point_row(point: dict) -> dict:
    """A checkpoint's τ per prompt set and temperature label, each beside lookup's τ and the ratio."""
    out: dict = {}
    for name, s in (point.get("tau_by_set") or {}).items():
        by_t = s.get("tau_by_temperature") or {"0": {"tau": s["tau"], "tau_lookup": s.get("tau_lookup"),
                                                     "tau_ratio": s.get("tau_ratio")}}
        out[name] = {label: cells(t) for label, t in by_t.items()}
    return out


def cells(t: dict) -> dict:
    """A table cell's figures of one set's τ at one temperature."""
    return {k: t.get(k) for k in ("tau", "tau_expected", "tau_lookup", "tau_ratio")}


class Runs:
    """The stage's runs and what a call does with them: as each run ends, its progress (and its τ once
    it has all its steps) goes into the state, and the state and the table are written again."""

    def __init__(self, p: Preset, qp: quality.Preset, state: Path, stage_dir: Path, doc: dict, out: Path):
        self.p, self.qp, self.state, self.dir, self.doc, self.out = p, qp, state, stage_dir, doc, out
        self.evaluator: quality.CheckpointEvaluator | None = None
        self.trained_s = 0.0  # this call's device-alone seconds trained

    def jobs(self, call: int) -> list[dict]:
        """The runs this call trains, in order (seed after seed): not finished, not failed twice."""
        out = []
        for seed in self.p.seeds:
            for candidate in self.p.candidates:
                name = run_name(candidate, seed)
                r = self.doc["runs"].setdefault(name, {"candidate": candidate, "seed": seed, "legs": [], "failures": 0})
                planned = self.doc["steps"][arm(candidate)]
                r["planned"] = planned
                if r.get("step", 0) >= planned or r["failures"] >= 2:
                    continue
                cfg = trainer_config(self.p, self.qp, self.state, candidate, seed, planned)
                j = quality.job(name, cfg, self.dir / "runs")
                j["argv"] += ["--resume", "auto"]
                (Path(j["run_dir"]) / "control" / "stop").unlink(missing_ok=True)  # a leg's stop never served
                j.update(candidate=candidate, planned=planned, from_step=last_step(j["run_dir"]), call=call,
                         expect_s=self.p.startup_s + self.p.min_leg_s)
                j["stop_at"] = leg_end(j["from_step"], planned, self.p.legs)
                out.append(j)
        return out

    def ended(self, j: dict) -> None:
        """One run's leg ended: its progress, the state (a finished run is evaluated by `idle` while the last
        runs train, or at the call's end)."""
        r = self.doc["runs"][j["name"]]
        step = last_step(j["run_dir"])
        self.trained_s += max(0, step - j["from_step"]) * self.doc["step_s"][arm(j["candidate"])]
        r["step"] = step
        r["legs"].append({"call": j["call"], "from": j["from_step"], "to": step, "exit": j.get("rc"),
                          "seconds": round(j.get("seconds", 0.0), 1)})
        if j.get("rc") not in (0, None):
            r["failures"] += 1
            tail = read_log(j["run_dir"]).strip().splitlines()[-8:]
            say(f"{j['name']}: exit {j['rc']} (failure {r['failures']}):\n" + "\n".join(tail))
        say(f"{j['name']}: steps {j['from_step']} -> {step} of {j['planned']} [{j.get('seconds', 0.0):.0f}s]")
        save(self.doc, self.p, self.dir, self.out)

    def idle(self) -> None:
        """While the last runs train (none waits to start): every finished run's evaluation that ends before
        the deadline, so its τ is in the state at once, not after the deadline (a machine taken back in
        the reserve would lose it with the checkpoints)."""
        if self.evaluate_finished(self.doc["call_end"] - self.p.reserve_s):
            save(self.doc, self.p, self.dir, self.out)

    def evaluate_finished(self, end: float | None = None) -> int:
        """Every run with all its steps and no τ yet, while an evaluation fits before `end` (the call's end
        less 5 s unless given). The runs evaluated."""
        end = self.doc["call_end"] - 5 if end is None else end
        return sum(self.evaluate(name, time.time() + self.p.eval_s < end) for name in self.doc["runs"])

    def evaluate(self, name: str, time_left: bool) -> bool:
        r = self.doc["runs"][name]
        if r.get("step", 0) < r["planned"] or r.get("result") or not time_left:
            return False
        if self.evaluator is None:
            self.evaluator = quality.CheckpointEvaluator(self.qp, self.state / "model", self.state / "data")
        ck = complete_checkpoints(self.dir / "runs" / quality.run_slug(name))[-1]
        sampled = "probabilistic" in self.p.proposals and any(self.p.temperatures)
        point = self.evaluator(ck, tuple(self.p.temperatures), ("greedy", "probabilistic") if sampled else ("greedy",))
        by_set = point_row(point)
        if sampled:  # T = 0 is greedy whatever the proposals
            for prompt_set, by_t in point["tau_by_proposals"]["probabilistic"].items():
                by_set.setdefault(prompt_set, {}).update({f"{t} sampled": cells(v) for t, v in by_t.items()
                                                          if t != "0"})
        status = read_status(ck.parent.parent) or {}
        r["result"] = {"step": point["step"], "tokens": status.get("tokens_done"), "by_set": by_set,
                       "acceptance": point.get("acceptance"), "checkpoint": str(ck),
                       "by_repetition": {s: b.get("tau_by_repetition") for s, b in point["tau_by_set"].items()}}
        say(f"{name}: τ " + "; ".join(f"{s} T={t} {quality.fmt(v['tau'])} ({quality.fmt(v['tau_ratio'], 2)}x lookup)"
                                      for s, by_t in r["result"]["by_set"].items() for t, v in by_t.items()))
        return True

    def left(self) -> tuple[float, int, int]:
        """(device-alone seconds of training left, finished runs not evaluated, most legs any run has left)."""
        remaining, unevaluated, legs = 0.0, 0, 0
        for r in self.doc["runs"].values():
            if r["failures"] >= 2:
                continue
            rest = r["planned"] - r.get("step", 0)
            remaining += max(0, rest) * self.doc["step_s"][arm(r["candidate"])]
            unevaluated += int(rest <= 0 and not r.get("result"))
            if rest > 0 and self.p.legs > 1:
                legs = max(legs, sum(1 for k in range(1, self.p.legs + 1)
                                     if math.ceil(r["planned"] * k / self.p.legs) > r.get("step", 0)))
        return remaining, unevaluated, legs


# ---------------------------------------------------------------------------- the table


def summarise(p: Preset, runs: dict) -> dict:
    """Per candidate: its seeds evaluated, steps and tokens, and per prompt set and temperature the mean
    τ, its spread over the seeds and the ratio to lookup's τ."""
    table = {}
    for candidate in p.candidates:
        rows = [r for r in runs.values() if r["candidate"] == candidate]
        done = [r for r in rows if r.get("result")]
        entry: dict = {"runs": len(rows), "measured": len(done), "seeds": [r["seed"] for r in done],
                       "steps": [r["result"]["step"] for r in done],
                       "tokens": statistics.fmean(r["result"]["tokens"] or 0 for r in done) if done else None,
                       "failed": [r["seed"] for r in rows if r["failures"] >= 2]}
        for name in SETS:
            for label in labels(p.temperatures, p.proposals):
                points = [r["result"]["by_set"].get(name, {}).get(label) for r in done]
                points = [x for x in points if x and x.get("tau") is not None]
                if points:
                    ratios = [x["tau_ratio"] for x in points if x.get("tau_ratio") is not None]
                    entry[f"{name} T={label}"] = {"tau": quality_objectives.spread([x["tau"] for x in points]),
                                                  "ratio": quality_objectives.spread(ratios) if ratios else None,
                                                  "tau_lookup": points[0].get("tau_lookup")}
        table[candidate] = entry
    return table


def labels(temperatures: Any, proposals: Any) -> list[str]:
    """The table's temperature columns: each temperature ("0", "1") and, with probabilistic proposals, each
    temperature above 0 again with them ("1 sampled")."""
    out = [f"{t:g}" for t in temperatures]
    if "probabilistic" in proposals:
        out += [f"{t:g} sampled" for t in temperatures if t]
    return out


def verdict(table: dict, baseline: str) -> list[str]:
    """Per prompt set and temperature: the candidates whose mean τ beats the baseline's by more than the
    larger of the two rows' seed ranges (max - min)."""
    base = table.get(baseline, {})
    keys = [k for k in base if " T=" in k] or [f"{s} T=0" for s in SETS]
    lines = []
    for key in keys:
        if key not in base or base["measured"] < 2:
            lines.append(f"{key}: {baseline} has fewer than 2 seeds measured, no verdict")
            continue
        b, winners = base[key]["tau"], []
        for name, e in table.items():
            if name == baseline or key not in e or e["measured"] < 2:
                continue
            gain, bar = e[key]["tau"]["mean"] - b["mean"], max(e[key]["tau"]["max"] - e[key]["tau"]["min"], b["max"] - b["min"])
            if gain > bar:
                winners.append(f"{name} (+{gain:.3f}, spread {bar:.3f})")
        lines.append(f"{key}: " + ("; ".join(winners) + f" beat {baseline} beyond the seed spread" if winners
                                   else f"nothing beats {baseline} beyond the seed spread"))
    return lines


def goal_lines(table: dict) -> list[str]:
    """Per candidate with a ratio measured: the cells where its mean ratio to lookup is short of #50's goal
    (held-out 2.0x, other style 1.6x, at each temperature), each with its seeds' range; or that every cell
    meets it. At T > 0 the engine's argmax proposals and sampled ones are each a way to serve, so a
    temperature's best column counts."""
    lines = []
    for name, e in table.items():
        best: dict[tuple[str, str], dict] = {}  # (prompt set, temperature) -> its best column's ratio
        for key, v in e.items():
            if " T=" not in key or not isinstance(v, dict) or not v.get("ratio"):
                continue
            prompt_set, label = key.split(" T=")
            cell_key = (prompt_set, label.removesuffix(" sampled"))
            if cell_key not in best or v["ratio"]["mean"] > best[cell_key]["mean"]:
                best[cell_key] = v["ratio"]
        if not best:
            continue
        short = [f"{prompt_set} T={t} {r['mean']:.2f}x ({r['min']:.2f}-{r['max']:.2f}, goal {quality.GOAL[prompt_set]:g}x)"
                 for (prompt_set, t), r in best.items() if r["mean"] < quality.GOAL[prompt_set]]
        lines.append(f"{name} ({e.get('measured', 0)} seeds): " + ("meets #50's goal in every cell" if not short
                                                                   else "short of #50's goal at " + "; ".join(short)))
    return lines


def cell(e: dict | None) -> str:
    if not e:
        return "-"
    t, r = e["tau"], e.get("ratio")
    ratio = f"; {r['mean']:.2f}x" if r else ""
    return f"{t['mean']:.3f} ± {t['std']:.3f} ({t['min']:.3f}-{t['max']:.3f}){ratio}"


def markdown(doc: dict) -> str:
    p, table = doc["preset"], doc["table"]
    keys = [f"{s} T={label}" for s in SETS for label in labels(p["temperatures"], p.get("proposals", ("greedy",)))]
    mixes = doc.get("mixes", {})
    lines = [f"# Recipe ablation, stage {doc['stage']} ({doc['command']})", "",
             f"* target and prompts: bench/quality.py --preset {p['quality']} {p['quality_set']} (up to its prompts); "
             "the greedy and sampled answers by `python -m trainer_tools.regen`, resumed call after call until whole",
             "* data: " + ("; ".join(f"{k} {v['rows']} rows of {v['prompts']} prompts (of {v.get('planned', '?')} planned; "
                                    f"answers {v['answer_chars_mean']} chars)" for k, v in mixes.items() if k != "sampling")
                         + (f"; sampled at T = {mixes['sampling']['temperature']:g}, top-p {mixes['sampling']['top_p']:g}, "
                            f"{mixes['sampling']['samples_per_prompt']} a prompt" if "sampling" in mixes else "")
                         if mixes else "not whole yet, no run started: " + "; ".join(
                             f"{k} answers {v['rows']} of {v['planned']} {'prompts' if k == 'greedy' else 'rows'}"
                             for k, v in doc.get("data", {}).items())),
             f"* equal device time: {doc.get('train_s', 0):.1f}s of the device alone per run; steps "
             f"{doc.get('steps')}; step times alone {({k: round(v * 1000, 2) for k, v in doc.get('step_s', {}).items()})} ms",
             "* cells: τ mean ± std (range) over the seeds; then the mean ratio to n-gram lookup's τ on the same prompts",
             "", "| candidate | seeds | steps | tokens (M) | " + " | ".join(f"τ {k}" for k in keys) + " |",
             "|---|---|---|---:|" + "---|" * len(keys)]
    for name, e in table.items():
        tokens = f"{e['tokens'] / 1e6:.2f}" if e.get("tokens") else "-"
        lines.append(f"| {name} | {e['measured']}/{e['runs']} {e['seeds']} | {e['steps']} | {tokens} | "
                     + " | ".join(cell(e.get(k)) for k in keys) + " |")
    lines += ["", *[f"* {v}" for v in doc.get("verdict", [])], *[f"* goal: {v}" for v in doc.get("goal", [])], "",
              f"* left: {doc.get('left', '-')}",
              "* what the table cannot say: another target than the bench's code model, more data than the mixes, "
              "longer training than this stage's, prompts unlike both sets, other temperatures or top-p; "
              "a gain inside the seed range is no gain"]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- main


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="h200")
    ap.add_argument("--state", type=Path, default=Path("/tmp/ablation"), help="where the calls keep their work")
    ap.add_argument("--stage", default="screen", help="the runs' directory under STATE/stages (the data is shared)")
    ap.add_argument("--out", type=Path, required=True, help="this call's output: recipe.md and recipe.json")
    ap.add_argument("--candidates", default=None, help="comma-separated OBJECTIVE/DATA[/KIND][/TAPS] (the preset's)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a preset field")
    ap.add_argument("--call-s", type=float, default=None, help="this call's wall budget (the preset's call_s)")
    ap.add_argument("--plan-only", action="store_true", help="print the plan from the stated figures and stop")
    return ap


def preset_of(ap: argparse.ArgumentParser, args: argparse.Namespace) -> Preset:
    """The preset with --set, --candidates and --call-s applied; an unknown field or candidate, a candidate
    or seed named twice, a baseline not among the candidates, fewer than 2 seeds, or a stage that is no plain
    name is refused (ap.error)."""
    p = dataclasses.replace(PRESETS[args.preset])
    apply_sets(ap, p, args.set)
    if args.candidates:
        p.candidates = tuple(c.strip() for c in args.candidates.split(",") if c.strip())
    if args.call_s is not None:
        p.call_s = args.call_s
    try:
        [candidate_parts(c) for c in p.candidates]
    except ValueError as e:
        ap.error(str(e))
    for c in p.candidates:
        k = data_parts(candidate_parts(c).data)[1]
        if k and k > p.samples_per_prompt:
            ap.error(f"candidate {c!r}: {k} sampled answers of each prompt, the data holds {p.samples_per_prompt} "
                     "(--set samples_per_prompt=...)")
    for twice in (named_twice("candidates", p.candidates), seeds_refused(p.seeds)):
        if twice:
            ap.error(twice)
    if p.baseline not in p.candidates:
        ap.error(f"baseline {p.baseline!r} is not one of the candidates {list(p.candidates)} (--set baseline=...)")
    if len(p.seeds) < 2:
        ap.error(f"seeds {list(p.seeds)}: a spread needs at least 2")
    if "greedy" not in p.proposals or not set(p.proposals) <= set(DRAFT_SAMPLE_METHODS):
        ap.error(f"proposals {list(p.proposals)}: greedy (the engine's default), and probabilistic if asked")
    if not quality.RUN_NAME.fullmatch(args.stage) or " " in args.stage:  # it names a directory under STATE/stages
        ap.error(f"--stage {args.stage!r}: letters, digits and _ . + = , - only, starting with a letter or digit "
                 "(it names the stage's directory under STATE/stages)")
    return p


def stage_doc(p: Preset, stage_dir: Path, command: str) -> dict:
    """The stage's state: read back (refused when it was planned with other figures), or a new one."""
    doc = read_json(stage_dir / "state.json")
    if doc and doc["planned"] != planned_fields(p):
        was = doc["planned"]
        changed = sorted(k for k, v in planned_fields(p).items() if was.get(k) != v)
        raise SystemExit(f"recipe: {stage_dir} was planned with other {', '.join(changed)} "
                         f"({', '.join(f'{k}={was.get(k)}' for k in changed)}): run the same preset and "
                         f"--set, or another --stage or --state")
    return doc or {"planned": planned_fields(p), "command": command, "runs": {}, "calls": []}


def next_command(argv: list[str]) -> str:
    """This call's command line (an --out under $OUT written as $OUT/...)."""
    out_root = os.environ.get("OUT")
    shown = [("$OUT" + a[len(out_root):]) if out_root and a.startswith(out_root) else shlex.quote(a) for a in argv]
    return "PYTHONUNBUFFERED=1 PYTHONPATH=. python bench/recipe_ablation.py " + " ".join(shown)


def prepare_data(p: Preset, qp: quality.Preset, state: Path, deadline: float) -> tuple[dict, bool]:
    """The data, each part once and in order, a part the deadline cut resumed by the next call: the target
    and prompts (bench/quality.py up to its prompts), the greedy answers of every prompt, the sampled
    answers (when a candidate uses them), the mixes. (the state's prep.json, whether all of it is whole):
    no run starts on part of the data."""
    prep = read_json(state / "prep.json")
    wants = json.loads(json.dumps({f: getattr(p, f) for f in DATA_FIELDS}))
    if prep and prep["wants"] != wants:
        raise SystemExit(f"recipe: {state} holds data made with {prep['wants']}, this preset asks for {wants}: "
                         f"use another --state")
    if prep and "target" not in prep and "prompts" in prep:  # a state of the first version: its regen not checked
        prep["target"] = {"seconds": prep.get("seconds"), "prompts": prep["prompts"]}
    if not prep.get("target"):
        prep = {"wants": wants, "target": prepare_target(p, state)}
        write_json(state / "prep.json", prep)
    if not prep.get("greedy", {}).get("done"):
        greedy = greedy_answers(p, qp, state, deadline, prep.get("greedy"))
        if greedy is None:
            return prep, False
        prep["greedy"] = greedy
        for drawn in ("sampled", "mixes"):  # drawn from the prompts the greedy answers hold
            prep.pop(drawn, None)
        write_json(state / "prep.json", prep)
        if not greedy["done"]:
            return prep, False
    sampled = uses_sampled(p)
    if sampled and not prep.get("sampled", {}).get("done"):
        part = sample_answers(p, qp, state, deadline, prep["greedy"], prep.get("sampled"))
        if part is None:
            return prep, False
        prep["sampled"] = part
        write_json(state / "prep.json", prep)
        if not part["done"]:
            return prep, False
    if "mixes" not in prep or (sampled and not set(mix_names(p)) <= set(prep["mixes"])):
        prep["mixes"] = write_mixes(p, state / "data", qp.seed)
        write_json(state / "prep.json", prep)
    return prep, True


def data_left(prep: dict) -> str:
    """What a data not yet whole holds, and what is missing."""
    parts = []
    for name, unit in (("greedy", "prompts"), ("sampled", "rows")):
        part = prep.get(name)
        if part and not part.get("done"):
            parts.append(f"{name} answers: {part['rows']} of {part['planned']} {unit}")
    if not prep.get("greedy"):
        parts.append("no greedy answers yet")
    return "; ".join(parts) or "the sampled answers and the mixes"


def plan_stage(p: Preset, qp: quality.Preset, state: Path, stage_dir: Path, doc: dict, deadline: float) -> None:
    """The step times (timed once) and the runs' steps at equal device time, fixed in the state."""
    if "steps" in doc:
        return
    (stage_dir / "timing").mkdir(parents=True, exist_ok=True)
    doc["step_s"] = time_steps(p, qp, state, stage_dir / "timing")
    base = doc["step_s"][arm(p.baseline)]
    runs = len(p.candidates) * len(p.seeds)
    train_s = p.train_s or p.base_steps * base or plan_train_s(p, runs, len(doc["calls"]), deadline - time.time(), p.rate)
    doc["train_s"], doc["steps"] = steps_of(train_s, doc["step_s"], p.max_steps)
    say(f"plan: {runs} runs ({len(p.candidates)} candidates x {len(p.seeds)} seeds), {doc['train_s']:.1f}s of the "
        f"device alone each: steps {doc['steps']}")


def main(argv: list[str] | None = None) -> dict:
    ap = parser()
    args = ap.parse_args(argv)
    p = preset_of(ap, args)
    started = time.time()
    call_end, argv = started + p.call_s, list(argv if argv is not None else sys.argv[1:])
    if args.plan_only:
        return plan_only(p)
    state, out = args.state.resolve(), args.out.resolve()
    stage_dir = state / "stages" / args.stage
    for d in (state, stage_dir / "runs", out):
        d.mkdir(parents=True, exist_ok=True)
    doc = stage_doc(p, stage_dir, next_command(argv))
    doc.update(stage=args.stage, preset=dataclasses.asdict(p), call_end=call_end)
    call = len(doc["calls"]) + 1
    doc["calls"].append({"call": call, "started": started})
    qp, deadline = quality_preset(p), call_end - p.reserve_s
    runs = Runs(p, qp, state, stage_dir, doc, out)

    prep, ready = prepare_data(p, qp, state, deadline)
    doc["data"] = {k: {f: v.get(f) for f in ("rows", "planned", "done", "calls", "seconds")}
                   for k, v in prep.items() if k in ("greedy", "sampled")}
    if ready:
        doc["mixes"] = prep["mixes"]
        plan_stage(p, qp, state, stage_dir, doc, deadline)
        jobs = runs.jobs(call)
        say(f"call {call}: {len(jobs)} runs to train, {p.parallel} at a time; deadline in {deadline - time.time():.0f}s")
        began = time.time()
        with LegStops(jobs):
            quality.run_all(qp, jobs, deadline, on_done=runs.ended, first_alone=False, on_idle=runs.idle)
        runs.evaluate_finished()  # finished in an earlier call, or after the last start in this one (finish saves)
        wall = time.time() - began
        doc["calls"][-1].update(trained_s=round(runs.trained_s, 1), runs_wall_s=round(wall, 1))
        if runs.trained_s > 0 and wall > 0:
            doc["rate"] = runs.trained_s / wall
    finish(p, doc, runs, argv, stage_dir, out, prep if not ready else None)
    return doc


def plan_only(p: Preset) -> dict:
    """The plan from the preset's stated figures (nothing measured, nothing run)."""
    n = len(p.candidates) * len(p.seeds)
    train_s = p.train_s or plan_train_s(p, n, p.calls, p.calls * (p.call_s - p.reserve_s) - data_s(p), p.rate)
    say(f"plan (stated figures): the data and the step times first, ~{data_s(p):.0f}s (target and prompts {p.prep_s:.0f}s, "
        f"greedy answers {p.greedy_s:.0f}s" + (f", sampled answers {p.sampled_s:.0f}s" if uses_sampled(p) else "")
        + f", timing {p.timing_s:.0f}s), resumed call after call until whole")
    say(f"plan (stated figures): {n} runs ({len(p.candidates)} candidates x {len(p.seeds)} seeds) in {p.calls} calls "
        f"of {p.call_s:.0f}s, {p.parallel} at a time: "
        + (f"{p.base_steps} steps of the baseline each (equal device time)" if p.base_steps and not p.train_s
           else f"~{train_s:.1f}s of the device alone each (the step times, measured in the first call, give the steps)"))
    return {"runs": n, "train_s": train_s}


def save(doc: dict, p: Preset, stage_dir: Path, out: Path) -> None:
    """The state, and the table so far (OUT and the stage's directory)."""
    doc["table"] = summarise(p, doc["runs"])
    doc["verdict"] = verdict(doc["table"], p.baseline)
    doc["goal"] = goal_lines(doc["table"])
    write_json(stage_dir / "state.json", doc)
    for d in (stage_dir, out):
        write_json(d / "recipe.json", doc)
        (d / "recipe.md").write_text(markdown(doc))


def finish(p: Preset, doc: dict, runs: Runs, argv: list[str], stage_dir: Path, out: Path,
           unfinished: dict | None) -> None:
    """What is left, the command to run next (or done), the table. `unfinished`: the prep.json of a data
    not yet whole."""
    doc["calls"][-1]["seconds"] = round(time.time() - doc["calls"][-1]["started"], 1)
    if unfinished is not None or "steps" not in doc:
        doc["left"] = (f"the data ({data_left(unfinished)}; the next call resumes it, no run starts before it is "
                       f"whole); then the timing and every run" if unfinished is not None
                       else "the timing and every run")
        left_calls = max(1, p.calls - len(doc["calls"]) + 1)
    else:
        remaining, unevaluated, legs = runs.left()
        rate = doc.get("rate") or p.rate
        left_calls = calls_left(p, remaining, unevaluated, legs, rate)
        todo = sum(1 for r in doc["runs"].values() if not r.get("result") and r["failures"] < 2)
        doc["left"] = (f"{todo} runs not finished or not evaluated, {remaining:.0f}s of device-alone training; "
                       f"~{left_calls} calls of {p.call_s:.0f}s at {rate:.2f} device-s per wall-s "
                       f"({'measured' if doc.get('rate') else 'stated'})")
    save(doc, p, stage_dir, out)
    for line in doc["verdict"]:
        say(f"verdict: {line}")
    for line in doc["goal"]:
        say(f"goal: {line}")
    say(f"table: {out / 'recipe.md'}, {out / 'recipe.json'}")
    if left_calls:
        say(f"left: {doc['left']}")
        say(f"next: {next_command(argv)}")
    else:
        say("done: every run trained and evaluated; the table is final")


if __name__ == "__main__":
    main()
