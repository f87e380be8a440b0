"""Runs in Prometheus's text exposition format (version 0.0.4): `dflash-ops metrics TARGET --format
prometheus` prints one target's, `dflash-ops exporter` serves every inventory target's.

What a scrape holds, per target: whether it answered (`dflash_target_up`, and why not as a label of
`dflash_target_error_info`), how long it took, its queue length, each GPU's busy share and memory
(the gpu_sample helper: NVML / nvidia-smi on the node), and per run its state and phase (labels of
`dflash_run_info`), step, loss, τ, tokens/s, tokens done and to go, ETA, heartbeat age and the GPUs
it holds. A run's numbers come from its status.json through RunInfo (trainer/run/contract.py), the
same fields `run status` and the dashboard show.

Label values are escaped as the format says (backslash, double quote, newline); text from a run
directory is data, so control characters are replaced too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dflash_ops.runs.info import RunInfo
from dflash_ops.runs.report import run_eta
from trainer.run.contract import phase_text

if TYPE_CHECKING:
    from dflash_ops.container import ContainerAPI

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class TargetScrape:
    """One target as a scrape found it: its runs and GPUs, or the error that kept them away."""

    target: str
    runs: list[RunInfo] = field(default_factory=list)
    gpus: list[dict[str, Any]] | None = None  # the gpu_sample helper's entries; None: none seen
    error: str | None = None  # not reached (or not in time): the runs and GPUs are unknown
    seconds: float = 0.0


def scrape_target(target: str, open_container: Callable[[], ContainerAPI], gpus: bool = True) -> TargetScrape:
    """Ask one target for its runs (one helper call) and, with gpus, its GPUs (one more)."""
    from dflash_ops.runs import list_runs

    began = time.monotonic()
    try:
        container = open_container()
        found = list_runs(container)
        samples = container.helper_json("gpu_sample", []).get("gpus") if gpus else None
    except Exception as exc:  # noqa: BLE001 - one target's failure is its `up 0`, never the scrape's
        return TargetScrape(target, error=f"{type(exc).__name__}: {exc}", seconds=time.monotonic() - began)
    return TargetScrape(target, runs=found, gpus=samples if isinstance(samples, list) else None,
                        seconds=time.monotonic() - began)


def label_value(value: object) -> str:
    """A label value as the exposition format writes it: \\ \" and newline escaped, other control
    characters (text from a run directory) replaced by U+FFFD."""
    text = str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return "".join("\ufffd" if ord(c) < 32 or ord(c) == 127 else c for c in text)


def _labels(labels: dict[str, object]) -> str:
    return "{" + ",".join(f'{k}="{label_value(v)}"' for k, v in labels.items()) + "}"


def _number(value: float) -> str:
    return repr(float(value)) if value == value and abs(value) != float("inf") else (
        "NaN" if value != value else ("+Inf" if value > 0 else "-Inf"))


class _Family:
    def __init__(self, name: str, kind: str, help_text: str) -> None:
        self.name, self.kind, self.help = name, kind, help_text
        self.samples: list[tuple[dict[str, object], float]] = []

    def add(self, labels: dict[str, object], value: object) -> None:
        if isinstance(value, bool):
            value = float(value)
        if isinstance(value, (int, float)):
            self.samples.append((labels, float(value)))

    def lines(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} {self.kind}"
        for labels, value in self.samples:
            yield f"{self.name}{_labels(labels)} {_number(value)}"


FAMILIES = (  # name, type, help; the order a scrape lists them in
    ("dflash_target_up", "gauge", "1 when the target answered this scrape in time, else 0"),
    ("dflash_target_error_info", "gauge", "why a target did not answer (its error as a label)"),
    ("dflash_target_scrape_seconds", "gauge", "seconds the target took to answer"),
    ("dflash_queue_length", "gauge", "runs queued in the target's container"),
    ("dflash_gpu_busy_ratio", "gauge", "a GPU's busy share (0..1), from the node"),
    ("dflash_gpu_memory_used_bytes", "gauge", "a GPU's memory in use, from the node"),
    ("dflash_gpu_memory_total_bytes", "gauge", "a GPU's memory, from the node"),
    ("dflash_run_info", "gauge", "1 per run, with its state, phase and release as labels"),
    ("dflash_run_alive", "gauge", "1 while the run's trainer process lives"),
    ("dflash_run_step", "gauge", "optimizer steps completed"),
    ("dflash_run_total_steps", "gauge", "steps the run will do in all"),
    ("dflash_run_loss", "gauge", "last logged training loss"),
    ("dflash_run_accuracy", "gauge", "last logged top-1 accuracy"),
    ("dflash_run_tau", "gauge", "mean acceptance length of the last evaluation"),
    ("dflash_run_tau_ratio", "gauge", "tau over n-gram prompt lookup's tau on the same prompts"),
    ("dflash_run_tokens_per_second", "gauge", "real tokens per second of the last logged window"),
    ("dflash_run_tokens_per_second_recent", "gauge", "real tokens per second over the last logged windows"),
    ("dflash_run_tokens_done", "gauge", "real tokens trained so far"),
    ("dflash_run_tokens_total", "gauge", "real tokens the run will train"),
    ("dflash_run_eta_seconds", "gauge", "seconds to the run's last step at its recent throughput"),
    ("dflash_run_phase_progress_ratio", "gauge", "done over total of the run's phase, where it has a count"),
    ("dflash_run_heartbeat_age_seconds", "gauge", "seconds since the trainer's last status.json heartbeat"),
    ("dflash_run_recompiles", "gauge", "recompiles after warm-up"),
    ("dflash_run_gpu", "gauge", "1 for each GPU a run holds"),
)


def exposition(scrapes: Iterable[TargetScrape]) -> str:
    """The text exposition of these targets' scrapes (every family's HELP and TYPE, then samples)."""
    f = {name: _Family(name, kind, help_text) for name, kind, help_text in FAMILIES}
    for s in scrapes:
        t: dict[str, object] = {"target": s.target}
        f["dflash_target_up"].add(t, s.error is None)
        f["dflash_target_scrape_seconds"].add(t, s.seconds)
        if s.error is not None:
            f["dflash_target_error_info"].add({**t, "error": s.error[:300]}, 1)
            continue
        f["dflash_queue_length"].add(t, sum(1 for r in s.runs if r.effective_state == "queued"))
        for g in s.gpus or ():
            gl = {**t, "gpu": g.get("index")}
            busy = g.get("busy")
            f["dflash_gpu_busy_ratio"].add(gl, busy / 100 if isinstance(busy, (int, float)) else None)
            for key, family in (("mem_gb", "dflash_gpu_memory_used_bytes"), ("mem_total_gb", "dflash_gpu_memory_total_bytes")):
                value = g.get(key)
                f[family].add(gl, value * 1e9 if isinstance(value, (int, float)) else None)
        for r in s.runs:
            _run(f, t, r)
    return "\n".join(line for family in f.values() for line in family.lines()) + "\n"


def _run(f: dict[str, _Family], t: dict[str, object], r: RunInfo) -> None:
    rl = {**t, "run": r.run_id}
    f["dflash_run_info"].add({**rl, "state": r.effective_state, "phase": phase_text(r.phase) or "",
                              "release": r.release or ""}, 1)
    f["dflash_run_alive"].add(rl, r.alive)
    for family, value in (("dflash_run_step", r.step), ("dflash_run_total_steps", r.total_steps),
                          ("dflash_run_loss", r.loss), ("dflash_run_accuracy", r.acc), ("dflash_run_tau", r.tau),
                          ("dflash_run_tau_ratio", r.tau_ratio), ("dflash_run_tokens_per_second", r.tokens_per_s),
                          ("dflash_run_tokens_per_second_recent", r.tokens_per_s_recent),
                          ("dflash_run_tokens_done", r.tokens_done), ("dflash_run_tokens_total", r.tokens_total),
                          ("dflash_run_eta_seconds", run_eta(r)), ("dflash_run_recompiles", r.recompiles)):
        f[family].add(rl, value)
    phase = r.phase or {}
    if isinstance(phase.get("done"), int) and isinstance(phase.get("total"), int) and phase["total"] > 0:
        f["dflash_run_phase_progress_ratio"].add(rl, phase["done"] / phase["total"])
    if r.alive:
        f["dflash_run_heartbeat_age_seconds"].add(rl, r.heartbeat_age)
        for gpu in r.gpus:
            f["dflash_run_gpu"].add({**rl, "gpu": gpu}, 1)
