"""The on-policy stage measured (issue #50): does a run on the drafter's own rollouts, its missed positions
weighed (trainer_tools.onpolicy), raise τ over a run of the same steps on the regen rows alone?

    PYTHONUNBUFFERED=1 PYTHONPATH=. python bench/onpolicy_stage.py --state /tmp/onpolicy --out $OUT/onpolicy
    ... the same command again (a second call on the same warm machine) until it prints "done"

Call 1 (no finished quality bench under STATE/quality): `bench/quality.py --preset PRESET --no-ablations`
there, under --quality-budget-s: the target, its greedy regen answers and the main drafter. Call 2: from the
main drafter's last checkpoint,

1. `python -m trainer_tools.onpolicy` on the first --prompts regen prompts (T = --temperature, one rollout a
   prompt, --miss-weight), printing the main drafter's on-policy τ;
2. two trainer runs side by side, warm-started from that checkpoint (model.drafter_init), the same --steps,
   seed and settings as the main run: `control` on the regen rows, `onpolicy` on the regen rows and the
   rollouts (mixed in one data set);
3. `python -m trainer eval` of the main drafter and of both runs on the held-out prompts (eval.jsonl) and
   the other-style prompts (other.jsonl) at T = 0 and T = 1, side by side, and at T = 1 again with sampled
   proposals (vLLM's draft_sample_method probabilistic; --no-sampled leaves it out); with --ceiling, the main
   drafter's also with `trainer eval --ceiling`: the target drafting for itself (its greedy chain as the
   block), what a drafter that always proposes the target's most likely continuation reaches.

It writes OUT/onpolicy.json and OUT/onpolicy.md. One seed: a difference inside the seed spread of the
recipe ablation (docs/objectives.md, ~0.1 τ at T = 0, ~0.01-0.02 at T = 1) is no difference.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SETS = {"held-out": "eval.jsonl", "other": "other.jsonl"}


def say(line: str) -> None:
    print(line, flush=True)


def run(argv: list[str], log: Path) -> subprocess.Popen:
    """A command of this repository (python -m ... or a bench script) in the background, its output in log."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as f:
        return subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env)


def wait(procs: dict[str, subprocess.Popen], logs: dict[str, Path]) -> None:
    """Every process ended with 0, else SystemExit with the failed one's output tail."""
    for name, proc in procs.items():
        if proc.wait() != 0:
            tail = "\n".join(logs[name].read_text().splitlines()[-15:])
            raise SystemExit(f"onpolicy stage: {name} failed (exit {proc.returncode}):\n{tail}")


def quality_done(q: Path) -> bool:
    try:
        return bool(json.loads((q / "quality.json").read_text()).get("main"))
    except (OSError, ValueError):
        return False


def stage(args: argparse.Namespace, q: Path, out: Path) -> dict:
    data = q / "data"
    main_cfg = yaml.safe_load((q / "runs" / "main.yaml").read_text())
    target = main_cfg["model"]["target"]["path"]
    from trainer.run.checkpoint import complete_checkpoints

    start = str(complete_checkpoints(q / "runs" / "main")[-1])
    device = main_cfg["devices"]["drafter"][0]
    rows = out / "onpolicy.jsonl"
    began = time.time()
    say(f"onpolicy: rollouts of {start} on {args.prompts} prompts at T={args.temperature:g}")
    proc = run(["-m", "trainer_tools.onpolicy", "--target", target, "--drafter", start, "--in",
                str(data / "prompts.jsonl"), "--out", str(rows), "--limit", str(args.prompts),
                "--temperature", str(args.temperature), "--miss-weight", str(args.miss_weight),
                "--max-tokens", str(args.max_tokens), "--batch", str(args.batch), "--device", device,
                "--chat-template-kwargs", '{"enable_thinking": false}'], out / "onpolicy.log")
    wait({"onpolicy": proc}, {"onpolicy": out / "onpolicy.log"})
    summary = (out / "onpolicy.log").read_text().split("onpolicy: ")[-1].strip()
    say(f"onpolicy: {summary} ({time.time() - began:.0f}s)")
    regen = main_cfg["data"]["train_path"]
    procs, logs = {}, {}
    for name, paths in (("control", [regen]), ("onpolicy", [regen, str(rows)])):
        cfg = json.loads(json.dumps(main_cfg))
        cfg["model"]["drafter_init"] = start
        cfg["data"]["train_path"] = paths
        cfg["optim"]["total_steps"] = args.steps
        cfg["run"].update(checkpoint_every=args.steps, log_every=max(1, args.steps // 20))
        cfg["eval"].update(temperatures=[0.0], samples=8)  # the bench evaluates below, every drafter alike
        (out / f"{name}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        logs[name] = out / f"{name}.log"
        procs[name] = run(["-m", "trainer", "--config", str(out / f"{name}.yaml"), "--run-dir", str(out / name)],
                          logs[name])
    began = time.time()
    wait(procs, logs)
    say(f"trainer: control and onpolicy, {args.steps} steps each from {start}, in {time.time() - began:.0f}s")
    evaluation = json.loads(json.dumps(main_cfg))  # trains nothing: the held-out file as its data (no tokenising of regen)
    evaluation["data"]["train_path"] = str(data / "eval.jsonl")
    (out / "eval.yaml").write_text(yaml.safe_dump(evaluation, sort_keys=False))
    drafters = {"main (start)": start, "control": str(out / "control"), "onpolicy": str(out / "onpolicy")}
    procs, logs = {}, {}
    for name, draft in drafters.items():
        for label, file in SETS.items():
            key = f"{name} / {label}"
            logs[key] = out / f"eval-{name.split()[0]}-{label}.log"
            ceiling = ["--ceiling"] if args.ceiling and draft == start else []  # the target for itself: once a set
            procs[key] = run(["-m", "trainer", "eval", "--config", str(out / "eval.yaml"), "--checkpoint", draft,
                              "--data", str(data / file), "--temperature", "0", "1", *ceiling, "--json",
                              str(logs[key].with_suffix(".json"))], logs[key])
            if args.sampled:  # T = 1 again with sampled proposals (vLLM's draft_sample_method probabilistic)
                logs[f"{key} sampled"] = out / f"eval-{name.split()[0]}-{label}-sampled.log"
                procs[f"{key} sampled"] = run(
                    ["-m", "trainer", "eval", "--config", str(out / "eval.yaml"), "--checkpoint", draft, "--data",
                     str(data / file), "--temperature", "1", "--draft-sample-method", "probabilistic", "--json",
                     str(logs[f"{key} sampled"].with_suffix(".json"))], logs[f"{key} sampled"])
    wait(procs, logs)
    table: dict = {}
    for key, log in logs.items():
        report = json.loads(log.with_suffix(".json").read_text())
        by_t = {t: {k: r[k] for k in ("tau", "tau_lookup", "tau_ceiling") if k in r}
                for t, r in report["temperatures"].items()}
        if key.endswith(" sampled"):
            table[key.removesuffix(" sampled")]["1 sampled"] = by_t["1"]
        else:
            table[key] = by_t
    return {"start": start, "onpolicy": summary, "steps": args.steps, "prompts": args.prompts,
            "temperature": args.temperature, "miss_weight": args.miss_weight, "tau": table}


def markdown(result: dict) -> str:
    lines = [f"On-policy stage from `{result['start']}`: {result['prompts']} rollouts at T={result['temperature']:g}, "
             f"miss weight {result['miss_weight']:g}, then {result['steps']} steps each, one seed.", "",
             f"Rollouts: {result['onpolicy']}", "",
             "| drafter / prompts | τ T=0 (lookup) | τ T=1 (lookup) | τ T=1, sampled proposals | the target drafting "
             "for itself T=0 / T=1 |",
             "|---|---|---|---|---|"]
    for key, by_t in result["tau"].items():
        cells = [f"{by_t[t]['tau']:.3f} ({by_t[t]['tau_lookup']:.3f})" if t in by_t else ""
                 for t in ("0", "1", "1 sampled")]
        best = " / ".join(f"{by_t[t]['tau_ceiling']:.3f}" for t in ("0", "1")) if "tau_ceiling" in by_t["1"] else ""
        lines.append(f"| {key} | {' | '.join(cells)} | {best} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--state", type=Path, required=True, help="work directory kept between calls (/tmp on the machine)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", default="h200", help="bench/quality.py's preset for call 1")
    ap.add_argument("--quality-budget-s", type=float, default=480.0, help="call 1: quality.py's --budget-s")
    ap.add_argument("--prompts", type=int, default=2048, help="regen prompts rolled out")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--miss-weight", type=float, default=2.0)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=256, help="prompts decoded at once")
    ap.add_argument("--steps", type=int, default=1500, help="steps of each warm-started run")
    ap.add_argument("--ceiling", action="store_true", help="call 2: also the target drafting for itself, with the main "
                    "drafter's evaluation (trainer eval --ceiling; minutes on the GPU: its own call's time)")
    ap.add_argument("--no-sampled", dest="sampled", action="store_false", help="call 2: leave out T = 1 with sampled "
                    "proposals (the engine's draft_sample_method probabilistic) beside the argmax ones")
    args = ap.parse_args(argv)
    q, out = args.state / "quality", args.out
    out.mkdir(parents=True, exist_ok=True)
    if not quality_done(q):
        say(f"call 1: bench/quality.py --preset {args.preset} --no-ablations --out {q} --budget-s {args.quality_budget_s:g}")
        proc = run(["bench/quality.py", "--preset", args.preset, "--no-ablations", "--out", str(q),
                    "--budget-s", str(args.quality_budget_s)], out / "quality.log")
        wait({"quality": proc}, {"quality": out / "quality.log"})
        say("next: the same command again (the on-policy stage)")
        return 0
    result = stage(args, q, out)
    (out / "onpolicy.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "onpolicy.md").write_text(markdown(result))
    say(markdown(result))
    say("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
