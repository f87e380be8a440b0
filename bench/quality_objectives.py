"""The objectives ablation of the quality bench (issue #36, docs/objectives.md): `ce+decay` (today's
default), `ce+dpace`, `kl` and `ce+kl`, each over 3 seeds at equal wall clock, τ on the held-out
prompts and on a second, unseen prompt set, with the seed spread and the step-time cost of kl.

    PYTHONPATH=. python bench/quality_objectives.py --preset h200 --out /tmp/objectives   # one H200, < 10 min
    PYTHONPATH=. python bench/quality_objectives.py --preset tiny --out /tmp/objectives   # CPU (the test)

The same machinery compares drafter generations (issue #37): `--preset dflash2-h200` (one H200, < 10 min)
and `--preset dflash2-cpu` (a 2-core CPU, ~10 min, tiny shapes) train DFlash1 and DFlash2
(`model.drafter.kind: dflash2`, its defaults) at equal wall clock over 3 seeds, with the same table.

Stages:

1. bench/quality.py up to its regeneration (`--stop-after regen`): corpus, tokenizer, the code target
   saved as a model directory, its greedy answers (the same as `quality.py --preset h200` builds).
2. code prompts: a second prompt set written here, of another style than the training windows (which
   are windows of real files): short function signatures with typed arguments and a docstring, each
   asking for the body. None of them comes from the corpus.
3. step time: each objective's optimizer step timed alone on the device, with the run's own config
   and data (the reference loop: target features, the target's layers above when kl reads its logits,
   drafter forward and backward, the optimizer). Equal wall clock: objective o trains
   `steps x t(ce+decay) / t(o)` steps, so every run costs the same device time.
4. the runs: `python -m trainer --config CFG --run-dir RUN` for every objective and seed (data order,
   anchors and initialisation all follow the seed), `parallel` at a time; the trainer's own final
   evaluation gives τ on the held-out prompts, the bench's evaluator τ on the code prompts.
5. the table: per objective the mean τ over the seeds, its spread (sample standard deviation and the
   range), per-position acceptance, steps, the solo step time and its cost over ce+decay; the verdict
   names an objective only where its mean gain over ce+decay exceeds both rows' seed ranges.

Everything lands in OUT/objectives.json and OUT/objectives.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import quality  # noqa: E402

# name -> the model section's objective keys (trainer/run/config.py ModelConfig)
OBJECTIVES = {
    "ce+decay": {"loss": "ce", "position_weight": "decay"},
    "ce+dpace": {"loss": "ce", "position_weight": "dpace"},
    "kl": {"loss": "kl"},
    "ce+kl": {"loss": {"ce": 1.0, "kl": 1.0}},
}
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
    baseline: str = "ce+decay"  # the row every other is timed against and judged against (equal wall clock)
    quality: str = "h200"  # the bench/quality.py preset that builds target, answers and the trainer config
    quality_set: dict = field(default_factory=dict)  # its fields overridden (e.g. a shorter target fit)
    seeds: tuple[int, ...] = (0, 1, 2)
    objectives: tuple[str, ...] = tuple(OBJECTIVES)  # the rows: names of VARIANTS
    steps: int = 200  # ce+decay's optimizer steps; the others get as many as fit the same device time
    parallel: int = 12  # trainer processes at once on the device
    train_convs: int = 8192  # every run trains on the first this many regenerated answers
    code_prompts: int = 256  # the second prompt set
    code_new_tokens: int = 96  # tokens generated per code prompt
    timing_steps: int = 12  # timed optimizer steps per objective (after timing_warmup)
    timing_warmup: int = 3
    budget_s: float = 570.0  # whole-bench wall budget (0: none): trainer runs get SIGTERM eval_reserve_s before
    eval_reserve_s: float = 60.0  # τ of 12 checkpoints on the code prompts (~3 s each on an H200), the stops


PRESETS = {
    # one regen batch of 16,384 answers (the runs train on 8,192): regen ends when it is done, ~100 s
    "h200": Preset(quality_set={"n_prompts": 16384}),
    "tiny": Preset(quality="tiny", steps=2, parallel=1, train_convs=12, code_prompts=4, code_new_tokens=8,
                   timing_steps=2, timing_warmup=1, budget_s=0.0),
    # issue #37: DFlash2 vs DFlash1 at equal wall clock, 3 seeds, on one H200 (< 10 min)
    "dflash2-h200": Preset(title="DFlash2 vs DFlash1", baseline="dflash1", objectives=tuple(GENERATIONS),
                           quality_set={"n_prompts": 16384}, steps=200, parallel=6),
    # the same on this repository's 2-core CPU machines (105 s idle, ~15 min with the cores shared): the tiny
    # quality preset with a longer target fit and more answers, 6 runs one at a time (a CPU figure: tiny shapes)
    "dflash2-cpu": Preset(title="DFlash2 vs DFlash1 (CPU, tiny shapes)", baseline="dflash1",
                          objectives=tuple(GENERATIONS), quality="tiny",
                          quality_set={"n_prompts": 384, "answer_tokens": 32, "n_eval": 24,
                                       "eval_new_tokens": 32, "regen_batch": 64, "target_steps": 300},
                          steps=400, parallel=1, train_convs=384, code_prompts=24, code_new_tokens=32,
                          timing_steps=30, timing_warmup=5, budget_s=0.0),
}


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


def step_seconds(cfg: dict, run_dir: Path, steps: int, warmup: int) -> float:
    """Seconds per optimizer step of one objective alone on the device: the reference loop's
    forward (target features, plus the target's last hidden states under kl), backward, optimizer."""
    from trainer.run.config import parse_config
    from trainer.train.components import build_components
    from trainer.train.loop import forward, make_blocks

    config = parse_config(yaml.safe_dump(cfg))
    c = build_components(config, run_dir, lambda *_: None)
    device = torch.device(c.drafter_device)
    gen = torch.Generator().manual_seed(0)
    batches = [c.train_data.next_batch() for _ in range(min(4, steps + warmup))]
    blocks = [make_blocks(config, c, b.input_ids, b.loss_mask, gen, getattr(b, "doc_start", None)) for b in batches]

    def step(i: int) -> None:
        b = batches[i % len(batches)]
        loss, weight, _ = forward(config, c, b.input_ids, b.attention_mask, blocks[i % len(blocks)],
                                  getattr(b, "doc_start", None))
        (loss / weight.clamp(min=1.0)).backward()
        c.optimizer.step()
        c.optimizer.zero_grad(set_to_none=True)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for i in range(warmup):
        step(i)
    sync()
    began = time.perf_counter()
    for i in range(steps):
        step(i)
    sync()
    return (time.perf_counter() - began) / steps


# ---------------------------------------------------------------------------- 5. the table


def training_pace(run_dir: Path) -> dict:
    """A run's training wall seconds (its start to its last step) and its tokens/s as the mean of its logged
    intervals' (the last interval alone, quality.read_run's steady figure, is a few steps on a CPU)."""
    path = run_dir / "metrics.jsonl"
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
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
    cost over the baseline, the mean per-position acceptance and training tokens/s."""
    table = {}
    base_time = timing.get(baseline)
    for name, runs in rows.items():
        done = [r for r in runs if r.get("tau") is not None and r.get("tau_code") is not None]
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
             f"* equal wall clock: {baseline}'s steps x its step time / each row's (timed alone, reference loop)",
             "", "| row | steps (per seed) | τ held-out: mean ± std (range) | τ code prompts | ratio to lookup "
             f"(held-out) | step time | cost vs {baseline} | acceptance by position (mean) | training tokens/s | "
             "training s (mean) |", "|---|---|---|---|---|---:|---:|---|---:|---:|"]
    for name, e in t.items():
        cost = "-" if e.get("step_cost") is None else f"{e['step_cost']:+.1%}"
        step = "-" if e.get("step_s") is None else f"{e['step_s'] * 1000:.1f} ms"
        acc = " ".join(f"{a:.2f}" for a in e["acceptance"]) if e.get("acceptance") else "-"
        tps = "-" if not e.get("tokens_per_s") else f"{e['tokens_per_s']:,.0f}"
        wall = "-" if not e.get("train_s") else f"{e['train_s']:.0f}"
        lines.append(f"| {name} | {e['steps']} | {_ms(e, 'tau')} | {_ms(e, 'tau_code')} | "
                     f"{_ms(e, 'tau_ratio')} | {step} | {cost} | {acc} | {tps} | {wall} |")
    lines += ["", *[f"* {v}" for v in results["verdict"]]]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="h200")
    ap.add_argument("--out", type=Path, required=True, help="work directory (created)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a field of this bench's preset (seeds=[0,1], steps=300)")
    ap.add_argument("--quality-set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a field of the bench/quality.py preset (target_steps=400)")
    args = ap.parse_args(argv)
    p = dataclasses.replace(PRESETS[args.preset])
    known = {f.name for f in dataclasses.fields(Preset)}
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in known:
            ap.error(f"--set {item}: no preset field {key!r} (known: {', '.join(sorted(known))})")
        v = yaml.safe_load(value)
        setattr(p, key, tuple(v) if isinstance(v, list) else v)
    unknown = [o for o in p.objectives if o not in VARIANTS]
    if unknown:
        ap.error(f"objectives: unknown {unknown}; known: {', '.join(VARIANTS)}")
    if p.baseline not in p.objectives:
        ap.error(f"baseline {p.baseline!r} is not one of the rows {list(p.objectives)}")
    out = args.out.resolve()
    started = time.time()
    budget_end = started + p.budget_s if p.budget_s else None
    command = "PYTHONPATH=. python bench/quality_objectives.py " + " ".join(argv if argv is not None else sys.argv[1:])
    results: dict = {"command": command, "preset": dataclasses.asdict(p), "torch": torch.__version__}

    def save() -> None:
        results["seconds"] = round(time.time() - started, 1)
        (out / "objectives.json").write_text(json.dumps(results, indent=2, default=str) + "\n")

    # 1. target and answers (bench/quality.py's own stages)
    qset = [f"--set={k}={json.dumps(v)}" for k, v in p.quality_set.items()] + [f"--set={s}" for s in args.quality_set]
    prepared = quality.main(["--preset", p.quality, "--out", str(out), "--stop-after", "regen", *qset])
    qp = dataclasses.replace(quality.PRESETS[p.quality], **{k: v for k, v in prepared["preset"].items()
                                                            if k != "prefix_chars"})
    qp.parallel = p.parallel
    results["quality"] = {k: prepared[k] for k in ("corpus", "tokenizer", "target", "prompts", "regen") if k in prepared}
    model_dir, data, runs = out / "model", out / "data", out / "runs-objectives"
    runs.mkdir(parents=True, exist_ok=True)
    regen_ok = prepared["regen"]["conversations"] >= 1
    source = data / ("regen.jsonl" if regen_ok else "original.jsonl")
    train_file, _ = quality.subset(source, data / "objectives-train.jsonl", None, p.train_convs)
    results["train_convs"] = len(quality.read_records(train_file))
    results["heldout_prompts"] = len(quality.read_records(data / "eval.jsonl"))
    say(f"objectives: {results['train_convs']} answers ({source.name}) per run; {len(p.objectives)} objectives x "
        f"{len(p.seeds)} seeds")

    # 2. the second prompt set
    code = code_prompts(p.code_prompts, 1000 + qp.seed)
    quality.write_jsonl(data / "code-prompts.jsonl", code)
    results["code_prompts"] = len(code)
    results["code_prompt_example"] = code[0]["messages"][0]["content"]

    timing_file, _ = quality.subset(train_file, data / "objectives-timing.jsonl", None, 512)  # quick to tokenise

    def config(name: str, seed: int, steps: int, train: Path = train_file) -> dict:
        cfg = quality.trainer_config(qp, model_dir, train, data, steps, {}, max(1, steps))
        cfg["model"].update(VARIANTS[name])
        cfg["run"]["seed"], cfg["data"]["seed"] = seed, seed
        return cfg

    # 3. step time of each objective alone: equal wall clock
    timing = {}
    for name in p.objectives:
        cfg = config(name, 0, p.timing_steps + p.timing_warmup, timing_file)
        cfg["pipeline"] = {"kind": "reference"}
        timing[name] = step_seconds(cfg, runs / f"timing-{name}", p.timing_steps, p.timing_warmup)
        say(f"step time alone: {name} {timing[name] * 1000:.1f} ms")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the components of the timing run are gone
    base = timing[p.baseline]
    plan = {name: max(1, round(p.steps * base / timing[name])) for name in p.objectives}
    results["timing"], results["planned_steps"] = timing, plan
    say("equal wall clock: " + ", ".join(f"{n} {s} steps" for n, s in plan.items()))
    save()

    # 4. the runs, then τ on the code prompts
    jobs = [quality.job(f"{name} seed {seed}", config(name, seed, plan[name]), runs)
            for seed in p.seeds for name in p.objectives]
    deadline = budget_end - p.eval_reserve_s if budget_end else None
    quality.run_all(qp, jobs, deadline)
    heldout = quality.CheckpointEvaluator(qp, model_dir, data)  # for a run stopped before its own final evaluation
    evaluator = quality.CheckpointEvaluator(qp, model_dir, data)
    evaluator.conversations = code
    evaluator.p = dataclasses.replace(qp, eval_new_tokens=p.code_new_tokens)
    rows: dict[str, list[dict]] = {name: [] for name in p.objectives}
    for j, (seed, name) in zip(jobs, [(s, n) for s in p.seeds for n in p.objectives]):
        r = {**quality.read_run(j["run_dir"]), **training_pace(j["run_dir"]), "seed": seed, "exit": j.get("rc")}
        last = quality.checkpoints(j["run_dir"])
        if last and (budget_end is None or time.time() < budget_end - 5):
            point = evaluator(last[-1])
            r.update(tau_code=point["tau"], tau_code_lookup=point["tau_lookup"], acceptance_code=point.get("acceptance"),
                     code_checkpoint=str(last[-1]))
            if r.get("tau") is None:  # stopped at the deadline: the trainer did not measure its held-out τ
                point = heldout(last[-1])
                r.update(tau=point["tau"], tau_ratio=point["tau_ratio"], acceptance=point["acceptance"],
                         tau_lookup=point["tau_lookup"], steps=point["step"], tau_from=str(last[-1]))
        rows[name].append(r)
        say(f"{j['name']}: exit {r['exit']}, {r['steps']} steps, tau held-out {quality._f(r.get('tau'))}, "
            f"code {quality._f(r.get('tau_code'))}, acceptance {r.get('acceptance')}")
    results["runs"] = rows
    results["table"] = summarise(rows, timing, p.baseline)
    results["verdict"] = verdict(results["table"], p.baseline)
    for line in results["verdict"]:
        say(f"verdict: {line}")
    save()
    (out / "objectives.md").write_text(markdown(results))
    say(f"objectives: done in {time.time() - started:.0f}s; {out / 'objectives.json'}, {out / 'objectives.md'}")
    return results


if __name__ == "__main__":
    main()
