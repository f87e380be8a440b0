"""The entry point that builds the trainer a config asks for and runs it.

Kept apart from the Trainer, as torchtitan keeps its entry point apart from its Trainer: it picks
the parts (the pipeline kind, the hosts) and the Trainer composes them; imports run one way,
entry -> pipeline.threaded -> train.loop, never back. Under torchrun (a run across hosts) every
rank runs the threaded pipeline, whatever pipeline.kind says: the reference loop is one process.
"""

from __future__ import annotations

from pathlib import Path

from trainer.distributed.group import GroupEnv
from trainer.pipeline.threaded import ThreadedPipeline
from trainer.run.config import TrainerConfig
from trainer.train.loop import PipelineKind, ReferencePipeline, Trainer


def train(cfg: TrainerConfig, run_dir: str | Path, resume: str | None = None) -> int:
    env = GroupEnv.from_environ()  # a rank of a run across hosts, started by torchrun (trainer.distributed.launch)
    threaded = env is not None or cfg.pipeline.kind == "threaded"
    pipeline: PipelineKind = ThreadedPipeline if threaded else ReferencePipeline
    return Trainer(cfg, run_dir, pipeline, env).run(resume)
