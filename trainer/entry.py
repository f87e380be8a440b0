"""The entry point that builds the trainer a config asks for and runs it.

Kept apart from the trainers, as torchtitan keeps its entry point apart from its Trainer: imports
run one way, entry -> pipeline.multihost (MultiHostTrainer) -> pipeline.threaded (ThreadedTrainer)
-> loop (Trainer), never back. Under torchrun (a run across hosts) every rank runs the threaded
pipeline, whatever pipeline.kind says: the reference loop is one process.
"""

from __future__ import annotations

from pathlib import Path

from trainer.train.config import TrainerConfig
from trainer.distributed.group import GroupEnv
from trainer.train.loop import Trainer
from trainer.distributed.multihost import MultiHostTrainer
from trainer.pipeline.threaded import ThreadedTrainer


def train(cfg: TrainerConfig, run_dir: str | Path, resume: str | None = None) -> int:
    env = GroupEnv.from_environ()
    if env is not None:  # a rank of a run across hosts, started by torchrun (trainer.distributed.launch)
        return MultiHostTrainer(cfg, run_dir, env).run(resume)
    if cfg.pipeline.kind == "threaded":
        return ThreadedTrainer(cfg, run_dir).run(resume)
    return Trainer(cfg, run_dir).run(resume)
