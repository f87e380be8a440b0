"""The real user's inputs, built locally: a hub-format target directory and a prompts file.

    python -m trainer.testing.real_path --out DIR [--prompts N] [--fit-steps S]

writes DIR/models/tiny-qwen3 (trainer.testing.hub_model: config.json, sharded safetensors,
BPE tokenizer, Qwen3 chat template), briefly fitted on synthetic conversations so that its
answers follow a pattern a drafter can learn, and DIR/prompts.jsonl (user turns only, the
shape of a dataset awaiting regeneration). Used by playbooks/real-path.yaml; a rerun with
the same arguments reuses what is already there.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

MODEL_NAME = "tiny-qwen3"


def write_inputs(out: Path, prompts: int = 48, fit_steps: int = 120, seed: int = 0) -> tuple[Path, Path]:
    from trainer.synth import synthetic_conversations, write_jsonl
    from trainer.testing.hub_model import fit_hub_model, write_hub_model

    model = out / "models" / MODEL_NAME
    stamp = model / ".real-path.json"
    wanted = {"fit_steps": fit_steps, "seed": seed}
    if not (stamp.is_file() and json.loads(stamp.read_text()) == wanted):
        write_hub_model(model, "qwen3", seed=seed)
        if fit_steps:
            fit_hub_model(model, synthetic_conversations(256, seed, 8, 24), steps=fit_steps, seed=seed)
        stamp.write_text(json.dumps(wanted))
    rows = [{"id": f"prompt-{i:04d}", "messages": [c["messages"][0]]}
            for i, c in enumerate(synthetic_conversations(prompts, seed + 7, 8, 24))]
    return model, write_jsonl(rows, out / "prompts.jsonl")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.testing.real_path", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--prompts", type=int, default=48)
    p.add_argument("--fit-steps", type=int, default=120)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    model, prompts = write_inputs(Path(args.out), args.prompts, args.fit_steps, args.seed)
    print(f"model {model}")
    print(f"prompts {prompts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
