"""What a drafter can buy on the quality bench's target before one is trained (issue #50): n-gram lookup's τ
and the target drafting for itself (the ceiling, trainer.generate.ceiling) at each temperature, on the held-out
and the other-style prompts, for the bench's target and for snapshots of the same run less trained.

Every drafter the recipe ablation trained sat at 1.05-1.25x lookup at T = 1, whatever its data or steps, all of
them evaluated with argmax proposals (the engine's default). If the ceiling over lookup is under #50's goal there,
no recipe reaches it on this target with argmax proposals: the levers are then the target (the snapshots say how
the ratio moves as the target gets sharper, its held-out LM loss falling) and sampled proposals
(`draft_sample_method: probabilistic`, which the ceiling does not bound: `--set draft_sample_method=probabilistic`
in the quality bench, `--draft-sample-method` in `python -m trainer eval`).

    PYTHONUNBUFFERED=1 PYTHONPATH=. python bench/headroom.py --out /tmp/headroom --snapshots 160,320
    ... the same command again (a later call on the same warm machine) until it prints "done"

1. The quality bench's corpus, tokenizer, target and prompts (`bench/quality.py --stop-after prompts`, its
   --preset and --set), the target also written at each of --snapshots' steps, unless OUT holds them.
2. Each target's headroom (`trainer.generate.evaluate.headroom_reports`, as `python -m trainer eval --ceiling`
   without a draft reports it), a target and prompt set at a time (the bench's own target first), each written
   to OUT/headroom.json when done: a call that ends (its time limit) keeps what it measured, and the next
   measures the rest. The table lists the targets from the least trained.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import quality  # noqa: E402
from trainer.train.draft_eval import write_json  # noqa: E402

SETS = {"held-out": "eval.jsonl", "other": "other.jsonl"}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="work directory (created; a rerun resumes in it)")
    ap.add_argument("--preset", choices=sorted(quality.PRESETS), default="h200", help="the quality bench's preset")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a quality preset field")
    ap.add_argument("--snapshots", default="", help="comma-separated target steps also measured (each below the "
                    "preset's target_steps)")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7, 1.0])
    return ap


def targets(q: dict) -> list[dict]:
    """The final target, then the snapshots from the most trained down ({"step", "lm_loss_heldout_rows",
    "model_dir"}): the bench's own target is measured first, in case a call's time runs out."""
    t = q["target"]
    final = {"step": t["steps"], "lm_loss_heldout_rows": t["lm_loss_heldout_rows"], "model_dir": t["model_dir"]}
    return [final, *sorted(t["snapshots"], key=lambda s: -s["step"])]


def load(p: quality.Preset, model_dir: str) -> tuple:
    """(the target, frozen, in the preset's dtype on its device; its tokenizer)."""
    import torch
    from transformers import AutoTokenizer

    from trainer.models.target import freeze, load_target

    target = freeze(load_target(model_dir, p.device, torch.bfloat16 if p.dtype == "bf16" else torch.float32))
    return target, AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def measure(p: quality.Preset, model: tuple, data: Path, temperatures: list[float]) -> dict:
    """headroom_reports of one target (`load`'s) on one prompt set: {temperature label: the report's figures}."""
    from trainer.data.chat import read_conversations
    from trainer.generate.evaluate import headroom_reports
    from trainer.train.loop import autocast_for

    target, tokenizer = model
    conversations = read_conversations(data)[: p.n_eval]
    with autocast_for(p.device, p.dtype):
        r = headroom_reports(target, tokenizer, conversations, p.eval_new_tokens, p.block_size, temperatures,
                             batch=len(conversations), template_kwargs={"enable_thinking": False})
    kept = ("tau_lookup", "tau_lookup_expected", "tau_ceiling", "tau_ceiling_expected", "ceiling_over_lookup",
            "ceiling_acceptance_expected", "prompts")
    return {label: {k: t[k] for k in kept} for label, t in r["temperatures"].items()}


def rows(found: dict) -> list[str]:
    """The table: a row per target, prompt set and temperature."""
    out = ["| target steps | held-out LM loss | prompts | T | lookup τ | ceiling τ (expected) | ceiling / lookup |",
           "|---:|---:|---|---:|---:|---:|---:|"]
    for m in sorted(found.values(), key=lambda m: (m["step"], m["set"] != "held-out")):
        for label, t in m["by_temperature"].items():
            out.append(f"| {m['step']} | {m['lm_loss_heldout_rows']:.3f} | {m['set']} | {label} | {t['tau_lookup']:.3f} "
                       f"| {t['tau_ceiling']:.3f} ({t['tau_ceiling_expected']:.3f}) | {t['ceiling_over_lookup']:.2f}x |")
    return out


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    out = args.out.resolve()
    snapshots = [int(s) for s in args.snapshots.split(",") if s.strip()]
    q_path = out / "quality.json"
    if not (q_path.exists() and "prompts" in json.loads(q_path.read_text())):
        sets = [a for s in [*args.set, f"target_snapshots={snapshots}"] for a in ("--set", s)]
        quality.main(["--preset", args.preset, "--out", str(out), "--stop-after", "prompts", *sets])
    q = json.loads(q_path.read_text())
    p = quality.Preset(**q["preset"])  # as the bench ran
    done_path = out / "headroom.json"
    found: dict = json.loads(done_path.read_text()) if done_path.exists() else {}
    for t in targets(q):
        missing = {name: out / "data" / file for name, file in SETS.items()
                   if f"{t['step']}/{name}" not in found and (out / "data" / file).exists()}
        if not missing:
            continue
        model = load(p, t["model_dir"])  # once for both prompt sets
        for name, data in missing.items():
            key = f"{t['step']}/{name}"
            found[key] = {**t, "set": name, "by_temperature": measure(p, model, data, args.temperatures)}
            write_json(found, done_path)
            quality.say(f"headroom: target step {t['step']}, {name}: " + "; ".join(
                f"T={label} lookup {m['tau_lookup']:.3f}, ceiling {m['tau_ceiling']:.3f} ({m['ceiling_over_lookup']:.2f}x)"
                for label, m in found[key]["by_temperature"].items()))
    table = "\n".join(rows(found))
    (out / "headroom.md").write_text(table + "\n")
    quality.say(table)
    quality.say(f"headroom: done; {done_path}, {out / 'headroom.md'}")
    return found


if __name__ == "__main__":
    main()
