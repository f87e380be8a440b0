"""The entry point that builds the trainer a config asks for and runs it.

Kept apart from the trainers, as torchtitan keeps its entry point apart from its Trainer: imports
run one way, entry -> pipeline.threaded (ThreadedTrainer) -> loop (Trainer), never back.
"""

from __future__ import annotations

from pathlib import Path

from trainer.config import TrainerConfig
from trainer.loop import Trainer
from trainer.pipeline.threaded import ThreadedTrainer


def train(cfg: TrainerConfig, run_dir: str | Path, resume: str | None = None) -> int:
    if cfg.pipeline.kind == "threaded":
        return ThreadedTrainer(cfg, run_dir).run(resume)
    return Trainer(cfg, run_dir).run(resume)
