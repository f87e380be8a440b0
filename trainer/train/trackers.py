"""Experiment trackers beside metrics.jsonl: `run.trackers: [wandb, tensorboard, mlflow]`, any subset,
each an optional package (pyproject extras). They get the same scalars as metrics.jsonl's step and
eval records, flattened (`mfu/target`, `gpus/0/busy`, `acceptance/3`, `tau_by_length/<=2K/tau`).

A tracker named but not installed is refused before the run starts (missing_trackers, one line with
the pip command): a config that names W&B used to be silently not logged. A tracker that fails during
the run (a full disk, a tracking server gone) is recorded as a `tracker_error` event and dropped; the
run goes on.

TensorBoard event files are written with tensorboardX (a pure-Python writer, protobuf and numpy only;
the `tensorboard` package needs TensorFlow's stub and a server to write the same files) into
RUN_DIR/tensorboard/, which `dflash-ops pull` fetches with the run. MLflow (mlflow-skinny: the client
without server and UI) logs to run.mlflow_uri, default a file store in RUN_DIR/mlruns (MLflow 3.x keeps
that store in maintenance and refuses it unless MLFLOW_ALLOW_FILE_STORE is set: set here for the
default only; a database URI needs the full mlflow's SQLAlchemy).
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from trainer.run.config import TrainerConfig, dump_config

# tracker -> (the module it imports, the pip requirement that provides it)
PACKAGES = {"wandb": ("wandb", "wandb"), "tensorboard": ("tensorboardX", "tensorboardX"),
            "mlflow": ("mlflow", "mlflow-skinny")}


def trackers_of(cfg: TrainerConfig) -> list[str]:
    """The trackers a config names: run.trackers, plus wandb when the older run.wandb section is set."""
    names: list[str] = list(cfg.run.trackers)
    if cfg.run.wandb is not None and "wandb" not in names:
        names.append("wandb")
    return names


def missing_trackers(cfg: TrainerConfig) -> str | None:
    """One line naming the first tracker the config names that this python cannot import, with the
    pip command that installs it; None when every one is there."""
    for name in trackers_of(cfg):
        module, requirement = PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            return (f"run.trackers names {name}, which is not installed here: pip install {requirement} "
                    f"(or pip install 'dflash-ops[{name}]')")
    return None


def scalars(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Every finite number of a metrics record, nested dicts and lists flattened into `a/b/0` names."""
    out: dict[str, float] = {}
    items = record.items() if isinstance(record, dict) else enumerate(record)
    for key, value in items:
        if key in ("event", "time", "step") and not prefix:
            continue
        name = f"{prefix}{key}"
        if isinstance(value, bool):
            continue
        if isinstance(value, (int, float)) and math.isfinite(value):
            out[name] = float(value)
        elif isinstance(value, (dict, list)):
            if isinstance(value, list) and value and isinstance(value[0], dict) and "index" in value[0]:
                value = {str(v.get("index")): {k: x for k, x in v.items() if k != "index"} for v in value}
            out.update(scalars(value, name + "/"))
    return out


class Tracker(Protocol):
    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class _Wandb:
    def __init__(self, cfg: TrainerConfig, run_dir: Path) -> None:
        import wandb

        w = cfg.run.wandb
        self.run = wandb.init(project=w.project if w else "dflash", name=(w.name if w else None) or run_dir.name,
                              config=dump_config(cfg))

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class _TensorBoard:
    def __init__(self, cfg: TrainerConfig, run_dir: Path) -> None:
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(logdir=str(run_dir / "tensorboard"))

    def log(self, scalars: dict[str, float], step: int) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def mlflow_name(name: str) -> str:
    """A flattened key as MLflow takes a metric's name (alphanumerics, `_ - . : /` and spaces): the bucket
    signs spelled out (`<=2K` -> `le2K`), any other character as `_` (a data file's own form of prompt)."""
    readable = name.replace("<=", "le").replace(">=", "ge").replace("<", "lt").replace(">", "gt")
    return re.sub(r"[^A-Za-z0-9_\-. :/]", "_", readable)


class _Mlflow:
    def __init__(self, cfg: TrainerConfig, run_dir: Path) -> None:
        import mlflow

        self.mlflow = mlflow
        if cfg.run.mlflow_uri is None:  # MLflow 3.x refuses its file store unless asked (it wants a database,
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # which mlflow-skinny cannot open)
        mlflow.set_tracking_uri(cfg.run.mlflow_uri or (run_dir / "mlruns").resolve().as_uri())
        self.run = mlflow.start_run(run_name=run_dir.name)

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics({mlflow_name(k): v for k, v in scalars.items()}, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


OPENERS: dict[str, Callable[[TrainerConfig, Path], Tracker]] = {"wandb": _Wandb, "tensorboard": _TensorBoard,
                                                                 "mlflow": _Mlflow}


class Trackers:
    """The trackers of one run; `failed(name, stage, exc)` records a failure (an event and a log line)
    and the tracker is dropped."""

    def __init__(self, cfg: TrainerConfig, run_dir: Path, failed: Any) -> None:
        self.failed = failed
        self.open: dict[str, Tracker] = {}
        for name in trackers_of(cfg):
            try:
                self.open[name] = OPENERS[name](cfg, run_dir)
            except Exception as exc:  # noqa: BLE001 - a tracker never stops the run
                self.failed(name, "open", exc)

    def log(self, record: dict[str, Any], step: int) -> None:
        values = scalars(record)
        for name, tracker in list(self.open.items()):
            try:
                tracker.log(values, step)
            except Exception as exc:  # noqa: BLE001 - a tracker never stops the run
                del self.open[name]
                self.failed(name, "log", exc)

    def close(self) -> None:
        for name, tracker in list(self.open.items()):
            try:
                tracker.close()
            except Exception as exc:  # noqa: BLE001
                self.failed(name, "close", exc)
        self.open.clear()
