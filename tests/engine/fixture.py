"""The engine tier's inputs, built here with the project's own tools (no downloads): a tiny Qwen3
target that vLLM's CPU build can run, drafters trained by `trainer` and exported by it, and
held-out prompts.

vLLM-CPU's attention takes head_dim 32, 64, 80, ... 512 only (the trainer's tiny targets use 16),
so the target is 4 layers of hidden 64 = 2 heads x 32 (1 KV head). It is fitted briefly on
synthetic conversations so that its greedy answers follow a pattern a drafter can learn, and
written in fp32 so that vLLM and the project compute the same numbers.
"""

from __future__ import annotations

import json
from pathlib import Path

TARGET_DIMS = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                   head_dim=32, intermediate_size=128)
BLOCK_SIZE = 4


def build_target(out: Path) -> Path:
    from trainer.data.synth import synthetic_conversations
    from trainer_tools.fixtures.hub_model import fit_hub_model, write_hub_model

    model = write_hub_model(out, "qwen3", TARGET_DIMS, dtype="float32", shards=1)
    return fit_hub_model(model, synthetic_conversations(128, 0, 8, 24), steps=40, lr=5e-3)


def write_data(out: Path) -> tuple[Path, Path]:
    from trainer.data.synth import synthetic_conversations, write_jsonl

    train = write_jsonl(synthetic_conversations(64, 1, 8, 24), out / "train.jsonl")
    held_out = write_jsonl(synthetic_conversations(8, 2, 8, 24), out / "eval.jsonl")
    return train, held_out


def train_and_export(target: Path, train: Path, held_out: Path, run_dir: Path, layers: int, steps: int = 30,
                     drafter: dict | None = None) -> Path:
    """`trainer` on the fixture target, then `trainer export` of its last checkpoint in fp32;
    drafter: model.drafter (the draft's own layout and shape). Trained with position_weight decay, the
    weighting the tier's drafts were made with: under dpace (the default since 15f873d) the 2-layer
    draft's distinct k_norms and the sliding window no longer change what it drafts on these prompts,
    and the two tests that show vLLM-CPU's k_norm difference and the window's effect had nothing to show."""
    from trainer.entry import train as run_trainer
    from trainer.models.export import export_checkpoint
    from trainer.run.config import parse_config

    cfg = parse_config(json.dumps({
        "model": {"target": {"path": str(target)}, "drafter_layers": layers, "block_size": BLOCK_SIZE,
                  "num_target_layers": 2, "dtype": "fp32", "loss_chunk": 256, "drafter": drafter or {},
                  "position_weight": "decay"},
        "data": {"train_path": str(train), "eval_path": str(held_out), "max_length": 96, "num_anchors": 8,
                 "token_budget": 384, "bucket_edges": [96], "pad_multiple": 16},
        "optim": {"lr": 3e-3, "total_steps": steps},
        "run": {"threads": 1, "log_every": steps},
        "eval": {"samples": 2, "max_new_tokens": 8}}))
    if run_trainer(cfg, run_dir) != 0:
        raise RuntimeError(f"training the fixture drafter failed: {run_dir / 'train.log'}")
    last = sorted((run_dir / "checkpoints").glob("step_*"), key=lambda d: int(d.name.split("_")[1]))[-1]
    import torch

    return export_checkpoint(last, run_dir / "export", dtype=torch.float32)
