"""T = 1's levers side by side on one target (issue #50): the training data (the target's greedy answers, or
those and sampled ones), the objective, and the engine's proposals (the draft's argmax, or sampled from it:
vLLM's draft_sample_method), beside n-gram lookup and the ceiling (the target drafting for itself, the bound of
argmax proposals), over seeds at equal steps.

    PYTHONPATH=. python bench/quality.py --preset tiny --out /tmp/q --no-ablations [--set ...]   # target, prompts, answers
    PYTHONPATH=. python bench/proposals.py --quality /tmp/q --out /tmp/proposals --steps 600 --seeds 0,1,2

On top of a quality bench that ran at least to its regen (its target, prompts and greedy answers): the
sampled answers (`regen --samples-per-prompt`, T = 1) once, then each candidate (OBJECTIVE/DATA, the recipe
ablation's names) and seed trained from scratch for --steps, then each run's τ on the held-out prompts at each
temperature with argmax and with sampled proposals, beside lookup's and the ceiling's (the bench's
`quality.CheckpointEvaluator`: one target load, lookup and the ceiling decoded once). A rerun skips the runs
that have their last checkpoint. Writes OUT/proposals.json and OUT/proposals.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import quality, quality_objectives  # noqa: E402
from trainer.generate.sampling_params import DRAFT_SAMPLE_METHODS  # noqa: E402
from trainer.run.checkpoint import complete_checkpoints, step_of  # noqa: E402
from trainer.train.draft_eval import write_json  # noqa: E402

PROPOSALS = DRAFT_SAMPLE_METHODS  # the draft's argmax, then sampled from it


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quality", type=Path, required=True, help="a finished quality bench's --out")
    ap.add_argument("--out", type=Path, required=True, help="work directory (created; a rerun resumes in it)")
    ap.add_argument("--candidates", default="ce+dpace/greedy,kl/greedy,ce+dpace/both,kl/both",
                    help="OBJECTIVE/DATA, comma-separated (objectives: " + ", ".join(quality_objectives.OBJECTIVES)
                    + "; data: greedy, both)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--samples-per-prompt", type=int, default=4, help="sampled answers a prompt, T = 1")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7, 1.0])
    return ap


def candidates(text: str, ap: argparse.ArgumentParser) -> list[tuple[str, str]]:
    out = []
    for name in (c.strip() for c in text.split(",") if c.strip()):
        objective, _, data = name.partition("/")
        if objective not in quality_objectives.OBJECTIVES or data not in ("greedy", "both"):
            ap.error(f"--candidates: {name!r} is not OBJECTIVE/DATA (objectives: "
                     f"{', '.join(quality_objectives.OBJECTIVES)}; data: greedy, both)")
        out.append((objective, data))
    return out


def sampled_answers(qp: quality.Preset, q: Path, n: int) -> Path:
    """QUALITY/data/sampled.jsonl: n answers a prompt at T = 1 (regen resumes what an earlier call left), whole
    before any run trains on it."""
    out = q / "data" / "sampled.jsonl"
    argv = quality.regen_argv(qp, q / "model", q / "data", out="sampled.jsonl", samples=n)
    rc, seconds = quality.run_cli(qp, argv, q / "sampled.log", module="trainer_tools.regen")
    rows, prompts = len(out.read_text().splitlines()), len((q / "data" / "prompts.jsonl").read_text().splitlines())
    if rc != 0 or rows < n * prompts:
        raise SystemExit(f"proposals: the sampled answers are {rows} of {n * prompts} rows (regen exit {rc}); "
                         f"{q / 'sampled.log'}")
    quality.say(f"sampled answers: {rows} rows ({seconds:.0f}s; {out})")
    return out


def train(qp: quality.Preset, q: Path, runs: Path, objective: str, data: str, seed: int, steps: int) -> Path:
    """One candidate's run (skipped when its last checkpoint is there; one a call's end cut short resumes from its
    latest checkpoint, written every quarter of the steps): its run directory."""
    run = runs / f"{objective}-{data}-s{seed}"
    if any(step_of(c) == steps for c in complete_checkpoints(run)):
        return run
    files = [q / "data" / "regen.jsonl"] + ([q / "data" / "sampled.jsonl"] if data == "both" else [])
    cfg = quality.trainer_config(qp, q / "model", files[0], q / "data", steps, {}, max(1, steps // 4))
    cfg["model"].update(quality_objectives.OBJECTIVES[objective])
    cfg["data"].update(train_path=[str(f) for f in files], seed=seed)
    cfg["run"].update(seed=seed, log_every=max(1, steps // 10))
    cfg["eval"].update(temperatures=[0.0], samples=min(qp.n_eval, 4))
    config = runs / f"{run.name}.yaml"
    config.write_text(yaml.safe_dump(cfg))
    rc, seconds = quality.run_cli(qp, ["--config", str(config), "--run-dir", str(run), "--resume", "auto"],
                                  runs / f"{run.name}.log")
    if rc != 0:
        raise SystemExit(f"proposals: {run.name} failed (exit {rc}); {runs / f'{run.name}.log'}")
    quality.say(f"trained {run.name}: {steps} steps in {seconds:.0f}s")
    return run


def evaluate(evaluator: quality.CheckpointEvaluator, run: Path, temperatures: list[float]) -> dict:
    """{proposals: {T label: tau, tau_expected, tau_lookup}} of the run's last checkpoint on the held-out prompts
    (the bench's evaluator: one target load for every run, lookup's and the ceiling's τ decoded once)."""
    point = evaluator(complete_checkpoints(run)[-1], tuple(temperatures), PROPOSALS)
    return {method: {label: {k: t[k] for k in ("tau", "tau_expected", "tau_lookup")}
                     for label, t in by_set["heldout"].items()}
            for method, by_set in point["tau_by_proposals"].items()}


def spread(values: list[float]) -> str:
    """mean (min-max) of one row's seeds (quality_objectives.spread)."""
    s = quality_objectives.spread(values)
    return f"{s['mean']:.3f} ({s['min']:.3f}-{s['max']:.3f})"


def table(doc: dict) -> list[str]:
    """A row per candidate and proposals: mean τ (seed range) and the ratio of the mean to lookup's, per T;
    then lookup and the ceiling."""
    labels = list(doc["headroom"])
    out = ["| candidate | proposals | " + " | ".join(f"τ T={t}" for t in labels) + " |",
           "|---|---|" + "---:|" * len(labels)]
    for name, by_seed in doc["runs"].items():
        for method in PROPOSALS:
            cells = []
            for t in labels:
                taus = [r[method][t]["tau"] for r in by_seed.values()]
                cells.append(f"{spread(taus)}, {sum(taus) / len(taus) / doc['headroom'][t]['tau_lookup']:.2f}x")
            out.append(f"| {name} | {method} | " + " | ".join(cells) + " |")
    h = doc["headroom"]
    out.append("| n-gram lookup | argmax | " + " | ".join(f"{h[t]['tau_lookup']:.3f}" for t in labels) + " |")
    out.append("| the ceiling (bounds argmax) | argmax | " + " | ".join(
        f"{h[t]['tau_ceiling']:.3f}, {h[t]['tau_ceiling'] / h[t]['tau_lookup']:.2f}x" for t in labels) + " |")
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = parser()
    args = ap.parse_args(argv)
    chosen, seeds = candidates(args.candidates, ap), [int(s) for s in args.seeds.split(",") if s.strip()]
    if not any(args.temperatures):
        ap.error("--temperatures: name at least one above 0 (the proposals differ only there)")
    q, out = args.quality.resolve(), args.out.resolve()
    qp = quality.Preset(**json.loads((q / "quality.json").read_text())["preset"])
    runs = out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    if any(data == "both" for _, data in chosen):
        sampled_answers(qp, q, args.samples_per_prompt)
    trained = {(objective, data, seed): train(qp, q, runs, objective, data, seed, args.steps)
               for objective, data in chosen for seed in seeds}
    evaluator = quality.CheckpointEvaluator(dataclasses.replace(qp, ceiling=True), q / "model", q / "data", other=False)
    doc: dict = {"steps": args.steps, "seeds": seeds, "runs": {}}
    for (objective, data, seed), run in trained.items():
        doc["runs"].setdefault(f"{objective}/{data}", {})[str(seed)] = evaluate(evaluator, run, args.temperatures)
    doc["headroom"] = evaluator.set_lookups["heldout"]  # lookup's and the ceiling's τ at each temperature
    write_json(doc, out / "proposals.json")
    rows = table(doc)
    (out / "proposals.md").write_text("\n".join(rows) + "\n")
    for line in rows:
        quality.say(line)
    return doc


if __name__ == "__main__":
    main()
