"""The real user's inputs, built locally: a hub-format target directory and a prompts file.

    python -m trainer.testing.real_path --out DIR [--prompts N] [--fit-steps S]

writes DIR/models/tiny-qwen3 (trainer.testing.hub_model: config.json, sharded safetensors,
BPE tokenizer, Qwen3 chat template), briefly fitted on synthetic conversations so that its
answers follow a pattern a drafter can learn, and DIR/prompts.jsonl (user turns only, the
shape of a dataset awaiting regeneration). Used by playbooks/real-path.yaml; a rerun with
the same arguments reuses the model already there. The model is written beside its place and
renamed into it when complete; a directory there that this command did not write is refused.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

MODEL_NAME = "tiny-qwen3"
STAMP = ".real-path.json"
PROG = "python -m trainer.testing.real_path"


def _stamp(model: Path) -> dict | None:
    try:
        return json.loads((model / STAMP).read_text())
    except (OSError, ValueError):
        return None


def write_inputs(out: Path, prompts: int = 48, fit_steps: int = 120, seed: int = 0) -> tuple[Path, Path]:
    from trainer.synth import synthetic_conversations, write_jsonl
    from trainer.testing.hub_model import fit_hub_model, write_hub_model

    model = out / "models" / MODEL_NAME
    wanted = {"fit_steps": fit_steps, "seed": seed}
    written = _stamp(model)
    if model.exists() and written is None:
        raise SystemExit(f"{model} exists and was not written by {PROG}; choose another --out")
    if written != wanted:
        tmp = model.with_name(f".{model.name}.{os.getpid()}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        write_hub_model(tmp, "qwen3", seed=seed)
        if fit_steps:
            fit_hub_model(tmp, synthetic_conversations(256, seed, 8, 24), steps=fit_steps, seed=seed)
        (tmp / STAMP).write_text(json.dumps(wanted))
        if model.exists():
            shutil.rmtree(model)  # an earlier write of ours, with other arguments
        os.replace(tmp, model)
    rows = [{"id": f"prompt-{i:04d}", "messages": [c["messages"][0]]}
            for i, c in enumerate(synthetic_conversations(prompts, seed + 7, 8, 24))]
    return model, write_jsonl(rows, out / "prompts.jsonl")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--prompts", type=int, default=48)
    p.add_argument("--fit-steps", type=int, default=120)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per weight load is noise in a playbook's output
    model, prompts = write_inputs(Path(args.out), args.prompts, args.fit_steps, args.seed)
    print(f"model {model.resolve()}")
    print(f"prompts {prompts.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
