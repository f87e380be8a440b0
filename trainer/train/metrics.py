"""The one writer of a run's step and evaluation records: metrics.jsonl, status.json, train.log, wandb.

Both pipelines (the reference loop and the threaded one) hand their numbers here; what a record
holds and how its log line reads is decided in this file only.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Any

from trainer.run.config import TrainerConfig
from trainer.run.contract import tau_by_length_text, tau_by_temperature, tau_by_temperature_text
from trainer.run.rundir import RunDir
from trainer.train.trackers import Trackers

STATUS_FIELDS = ("loss", "acc", "tokens_per_s", "recompiles", "pad_share")  # copied from a step record to status.json
RECENT_WINDOWS = 5  # logged windows the recent throughput (and so the ETA) is measured over


class LossNotFinite(RuntimeError):
    """The training loss (or the drafter's weights) went NaN or inf: the run stops as `failed`
    instead of training on it and ending `done`."""


class Metrics:
    """Step and eval records of one run. `steady` accumulates tokens and seconds of the steps a
    pipeline counts as steady (every step after the first; the threaded pipeline's windows between
    the first and the last) for tokens_per_s_steady."""

    def __init__(self, cfg: TrainerConfig, rd: RunDir, run_name: str) -> None:
        self.rd = rd
        self.total_steps = cfg.optim.total_steps
        self.steady_tokens, self.steady_seconds = 0, 0.0
        self.first_step = 0  # the step this process started training from (start_at)
        self.counted_tokens = 0  # real tokens this process trained (step records' `tokens`)
        self.windows: deque[tuple[float, int]] = deque(maxlen=RECENT_WINDOWS + 1)  # (time, counted_tokens)
        self.trackers = Trackers(cfg, rd.root, self.tracker_failed)

    def start_at(self, step: int) -> None:
        """Training starts (or resumes) at `step`; status.json gets the run's planned token count."""
        self.first_step = step
        self.windows.clear()
        self.windows.append((time.time(), 0))

    def progress(self, step: int, tokens: int | None) -> dict[str, Any]:
        """status.json's tokens_done, tokens_total and tokens_per_s_recent after a step record whose
        window trained `tokens` real tokens: this process's tokens per step, times the steps done and
        the steps in all (a resumed run counts its earlier steps at this process's rate); the recent
        rate over the last RECENT_WINDOWS windows (the ETA reads it: trainer.run.contract.eta_seconds)."""
        if tokens is None:
            return {}
        self.counted_tokens += tokens
        self.windows.append((time.time(), self.counted_tokens))
        steps = step - self.first_step
        if steps <= 0:
            return {}
        per_step = self.counted_tokens / steps
        out: dict[str, Any] = {"tokens_done": round(per_step * step), "tokens_total": round(per_step * self.total_steps)}
        (t0, n0), (t1, n1) = self.windows[0], self.windows[-1]
        if t1 > t0 and n1 > n0:
            out["tokens_per_s_recent"] = (n1 - n0) / (t1 - t0)
        return out

    def add_steady(self, tokens: int, seconds: float) -> None:
        self.steady_tokens += tokens
        self.steady_seconds += seconds

    def steady_rate(self) -> float | None:
        """Tokens per second over the steady steps so far; None before the first."""
        return self.steady_tokens / self.steady_seconds if self.steady_seconds else None

    def step(self, step: int, m: dict[str, Any]) -> None:
        """A step record (metrics.jsonl `step`), status.json's step fields and the log line. m holds
        loss, acc, lr, grad_norm, tokens_per_s, pad_share, recompiles; the threaded pipeline adds
        gpus, queues and mfu (and its log line each GPU's busy share). A loss that is not finite
        raises LossNotFinite (no record: every step after it would train on NaN gradients)."""
        if not math.isfinite(m["loss"]):
            raise LossNotFinite(f"the loss is {m['loss']} at step {step} (lr {m['lr']:.2e}, grad_norm "
                                f"{m['grad_norm']}): the run stops instead of training on it; lower optim.lr "
                                "or check the data, then resume from a checkpoint before this step")
        self.rd.event("step", step, **m)
        steady = self.steady_rate()
        self.rd.update(step=step, **{k: m[k] for k in STATUS_FIELDS}, **self.progress(step, m.get("tokens")),
                       **({"tokens_per_s_steady": steady} if steady is not None else {}))
        line = (f"step {step}/{self.total_steps} loss {m['loss']:.4f} acc {m['acc']:.3f} "
                f"lr {m['lr']:.2e} grad_norm {m['grad_norm']:.3f} tok/s {m['tokens_per_s']:.0f}")
        if "gpus" in m:
            line += f" pad {m['pad_share']:.1%} busy {[g['busy'] for g in m['gpus']]}"
        self.rd.log(line)
        self.trackers.log(m, step)

    def eval(self, step: int, result: dict[str, Any]) -> None:
        """An evaluation record: trainer.generate.evaluate.acceptance_report's fields (tau None when
        not measured) and acc."""
        self.rd.event("eval", step, **result)
        self.trackers.log({"eval": result}, step)
        self.rd.update(tau=result["tau"], tau_per_prompt=result["tau_per_prompt"], tau_lookup=result.get("tau_lookup"),
                       tau_ratio=result.get("tau_ratio"), acceptance=result.get("acceptance"),
                       tau_by_length=result.get("tau_by_length"),
                       tau_by_temperature=tau_by_temperature(result["temperatures"]) if result.get("temperatures") else None)
        if result["tau"] is None:  # not measured: the target holds only the layers training runs
            self.rd.log(f"eval step {step}: tau not measured, acc {result['acc']:.3f}")
        else:
            lookup = (f"; n-gram prompt lookup {result['tau_lookup']:.2f}, ratio {result['tau_ratio']:.2f}x"
                      if result.get("tau_ratio") is not None else "")
            accepted = (f", accepted by position {' '.join(f'{a:.2f}' for a in result['acceptance'])}"
                        if result.get("acceptance") else "")
            self.rd.log(f"eval step {step}: tau {result['tau']:.2f} (mean acceptance length; per-prompt mean "
                        f"{result['tau_per_prompt']:.2f}{lookup}){accepted}, acc {result['acc']:.3f}, "
                        f"{result['samples']} conversations"
                        + (f" ({result['prompts']} assistant turns)" if result.get("prompts", result["samples"])
                           != result["samples"] else ""))
            if result.get("tau_by_length"):
                self.rd.log(f"eval step {step}: tau by prompt length: {tau_by_length_text(result['tau_by_length'])}")
            if result.get("tau_by_turn"):  # keys are turn numbers: the bucket text reads "turn 2 3.10 (...)"
                by_turn = {f"turn {k}": v for k, v in result["tau_by_turn"].items()}
                self.rd.log(f"eval step {step}: tau by assistant turn: {tau_by_length_text(by_turn)}")
            if result.get("temperatures"):
                self.rd.log(f"eval step {step}: tau by temperature: {tau_by_temperature_text(result['temperatures'])}")

    def tracker_failed(self, name: str, stage: str, exc: BaseException) -> None:
        """A tracker failed (opening, logging or closing): a `tracker_error` event and a log line; the
        tracker is dropped and the run goes on (trainer.train.trackers)."""
        message = f"{type(exc).__name__}: {exc}"
        self.rd.event("tracker_error", 0, tracker=name, stage=stage, message=message)
        self.rd.log(f"tracker {name} failed ({stage}): {message}; no longer logged to, the run goes on")

    def close(self) -> None:
        self.trackers.close()
