"""Text for people: one compact line per metrics event, and the fields of a run's status row."""

from __future__ import annotations

import json
import math
import time
from typing import Any

from dflash_ops.printable import printable
from dflash_ops.runs.info import RunInfo
from trainer.run.contract import duration_text, eta_seconds, phase_text, tau_by_length_text, tau_by_temperature_text

TABLE_LIMIT = 1e12  # beyond it a number is shown in 3 significant digits: 1e308 with .4f was 313 characters


def _num(value: Any, spec: str) -> str:
    """A number read back from status.json or metrics.jsonl as a table cell: '-' when it is none,
    nan / inf as such, a huge one short (the dashboard's model.plottable is the plots' twin)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "-"
    if not math.isfinite(value) or abs(value) >= TABLE_LIMIT:
        return format(value, ".3g")
    return format(value, spec)


def _rate(value: Any) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "-"
    if not math.isfinite(value) or abs(value) >= TABLE_LIMIT:
        return format(value, ".3g")
    return f"{value / 1000:.1f}k" if value >= 1000 else f"{value:.0f}"


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def acceptance_text(acceptance: Any, prefix: str = "") -> str:
    """Per-position acceptance (an eval's `acceptance`: the share of rounds accepting draft position
    k = 1, 2, ...) as `prefix` + `0.91 0.80 0.62 ...`; empty when absent or not a list of numbers."""
    if not isinstance(acceptance, list) or not acceptance or not all(
            isinstance(a, (int, float)) and not isinstance(a, bool) for a in acceptance):
        return ""
    return prefix + " ".join(f"{a:.2f}" for a in acceptance)


def metric_line(event: dict[str, Any], total_steps: int | None = None) -> str:
    """One metrics.jsonl event as a short line, e.g. `step 40/300 loss 2.3456 acc 0.412 ...`."""
    kind = event.get("event", "?")
    step = event.get("step")
    if kind == "step":
        of = f"/{total_steps}" if total_steps else ""
        text = (f"step {step}{of}  loss {_num(event.get('loss'), '.4f')}  acc {_num(event.get('acc'), '.3f')}"
                f"  lr {_num(event.get('lr'), '.2e')}  gnorm {_num(event.get('grad_norm'), '.3g')}"
                f"  {_rate(event.get('tokens_per_s'))} tok/s")
        if event.get("recompiles"):
            text += f"  recompiles {event['recompiles']}"
        return text
    if kind == "start":
        resumed = event.get("resumed_from")
        return f"start at step {step} of {event.get('total_steps')}" + (f" (resumed from {resumed})" if resumed else "")
    if kind == "eval":
        lookup = (f"  n-gram lookup {_num(event.get('tau_lookup'), '.3f')} ({_num(event.get('tau_ratio'), '.2f')}x)"
                  if event.get("tau_lookup") is not None else "")
        by_length = tau_by_length_text(event.get("tau_by_length"))
        return (f"eval at step {step}: acceptance length tau {_num(event.get('tau'), '.3f')}{lookup}"
                f"{acceptance_text(event.get('acceptance'), '  by position ')}"
                f"  acc {_num(event.get('acc'), '.3f')}  samples {event.get('samples', '-')}"
                + (f"  by prompt length: {by_length}" if by_length else "")
                + (f"  by temperature: {tau_by_temperature_text(event.get('temperatures'))}"
                   if tau_by_temperature_text(event.get("temperatures")) else ""))
    if kind == "checkpoint":
        request = f" (request {event['request']})" if event.get("request") else ""
        return f"checkpoint at step {step}: {event.get('path')} in {_num(event.get('seconds'), '.1f')}s{request}"
    if kind == "stop":
        return f"stop at step {step}: {event.get('reason')}"
    if kind == "error":
        return f"error at step {step} in {event.get('thread')}: {event.get('message')}"
    if kind == "restart":
        return f"restart {event.get('attempt')} at step {step}: {event.get('reason')}; from {event.get('from') or 'the start'}"
    if kind == "phase":
        return f"phase: {phase_text(event)}"
    if kind == "warmup":
        return f"warmup: {len(event.get('shapes') or [])} shapes in {_num(event.get('seconds'), '.1f')}s"
    extra = {k: v for k, v in event.items() if k not in ("event", "time", "step")}
    return f"{kind} at step {step}: {json.dumps(extra, sort_keys=True)}"


STATUS_COLUMNS = ("run", "state", "phase", "step", "loss", "tau", "tok/s", "eta", "heartbeat", "release")


def run_eta(info: RunInfo) -> float | None:
    """Seconds to a live run's end from its own recent throughput (trainer.run.contract.eta_seconds);
    None for a run that is not alive and training."""
    return eta_seconds({**info.status, "state": info.effective_state}) if info.alive else None


def _tokens(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return "-"
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


def progress_line(info: RunInfo) -> str | None:
    """`tokens: 1.2M done, 3.4M to go (26%), eta 12m at 4.1k tok/s (recent)` for a run that counts them."""
    done, total = info.tokens_done, info.tokens_total
    if done is None or total is None:
        return None
    share = f" ({done / total:.0%})" if total else ""
    eta = run_eta(info)
    rate = info.tokens_per_s_recent or info.tokens_per_s
    when = f", eta {duration_text(eta)} at {_rate(rate)} tok/s (recent)" if eta is not None else ""
    return f"tokens: {_tokens(done)} done, {_tokens(max(total - done, 0))} to go{share}{when}"


def status_row(info: RunInfo) -> tuple[str, ...]:
    step = "-" if info.step is None else (f"{info.step}/{info.total_steps}" if info.total_steps else str(info.step))
    state = f"queued #{info.position}" if info.effective_state == "queued" else info.effective_state
    row = (info.run_id, state, phase_text(info.phase) or "-", step, _num(info.loss, ".4f"), _num(info.tau, ".2f"),
           _rate(info.tokens_per_s), duration_text(run_eta(info)),
           _age(info.heartbeat_age) if not info.final else "-", info.release or "-")
    return tuple(printable(cell) for cell in row)  # a release file, a phase: read from the run directory


def restart_line(restart: dict[str, Any]) -> str:
    """`restart 1 at step 7: killed by SIGKILL; resumed from checkpoints/step_5` (run status, the dashboard)."""
    when = time.strftime("%H:%M:%S", time.localtime(restart["time"])) if isinstance(restart.get("time"), (int, float)) else "?"
    source = restart.get("from") or ("the newest checkpoint of the group (the ranks agree on it as they rejoin)"
                                     if restart.get("group") else "the start (no checkpoint yet)")
    return f"restart {restart.get('attempt')} at {when}, step {restart.get('step')}: {restart.get('reason')}; from {source}"


def notify_line(summary: Any) -> str | None:
    """`notifications: 3 dropped, 1 undelivered, 2 waiting; last: notify_dropped of started to
    https://host/…: ...` for a run some of whose events were not (yet) told; None when all were."""
    if not isinstance(summary, dict):
        return None
    names = (("dropped", "dropped (a destination's queue was full)"), ("gave_up", "given up"),
             ("undelivered", "left undelivered at a stop"), ("waiting", "waiting"))
    counts = [f"{summary[k]} {text}" for k, text in names if isinstance(summary.get(k), int) and summary[k] > 0]
    if not counts:
        return None
    last = summary.get("last") if isinstance(summary.get("last"), dict) else None
    tail = (f"; last: {last.get('event')} of {last.get('notify')} to {last.get('to')}: {last.get('error')}"
            if last else "")
    return "notifications: " + ", ".join(counts) + tail


def status_detail(info: RunInfo) -> list[str]:
    """The lines `run status TARGET RUN` prints below the row: why it failed, checkpoints, log tail."""
    lines = []
    if info.effective_state == "queued":
        lines.append(f"queued: position {info.position}, waits for {'; '.join(info.waits_for) or 'nothing (starting)'}")
    elif info.reason:
        lines.append(f"reason: {info.reason}")
    if phase_text(info.phase):
        lines.append(f"phase: {phase_text(info.phase)}" + ("" if info.alive else " (when it ended)"))
    if progress_line(info):
        lines.append(progress_line(info) or "")
    if info.error:
        lines.append(f"error ({info.error.get('thread', '?')}): {info.error.get('message')}")
    if tau_by_length_text(info.tau_by_length):
        lines.append(f"tau by prompt length: {tau_by_length_text(info.tau_by_length)}")
    if tau_by_temperature_text(info.tau_by_temperature):
        lines.append(f"tau by temperature: {tau_by_temperature_text(info.tau_by_temperature)}")
    if acceptance_text(info.acceptance):
        lines.append(f"accepted by draft position (last eval, tau {_num(info.tau, '.2f')}): "
                     f"{acceptance_text(info.acceptance)}")
    lines.append(f"checkpoints: {', '.join(f'step_{s}' for s in info.checkpoints) or 'none'}")
    if info.restart_policy:
        lines.append(f"restart: {info.restart_policy}, {len(info.restarts)} so far")
    if info.unsupervised and not (info.reason and info.unsupervised in info.reason):
        lines.append(info.unsupervised)
    lines += [f"  {restart_line(r)}" for r in info.restarts]
    if notify_line(info.notify):
        lines.append(notify_line(info.notify) or "")
    if info.gpus:
        lines.append(f"gpus: {','.join(map(str, info.gpus))}")
    if info.effective_state == "failed" and info.log_tail:
        lines.append("log tail:")
        lines += ["  " + line for line in info.log_tail.rstrip("\n").splitlines()]
    # a reason, an error, a log line: text from the run directory (a chat template's ESC sequences
    # reached the terminal raw and retitled it), shown escaped, one line each
    return [printable(line) for line in lines]
